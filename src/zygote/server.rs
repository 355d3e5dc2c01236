//! The zygote serving over links (`crate::link`): the agent's, or the pool
//! slots' of a shared zygote.
//!
//! Started by the agent as `fluksio-zygote zygote --link-fd N`, or by the
//! first pool slot as `fluksio-zygote zygote --listen PATH` (see
//! `crate::slot`). Requests come as `Call` frames; a compile is served here
//! whole (its lines go back as `Line` frames); a run's child is started and
//! its pipe handed over the link, whose owner reads its lines. The zygote
//! keeps what only a parent can do: watch each child's exit, kill its cell,
//! reap it, and say how it ended. Several runs are in flight at once; the
//! zygote itself stays one thread, blocked in `poll` between frames.
//!
//! A link that closes takes its runs with it: a pool slot SIGKILLed by its
//! pool ends exactly its own call. The agent's zygote ends with its one
//! link; a shared zygote ends with its last.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::ExitCode;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::Pid;
use pyo3::prelude::*;

use super::app::{self, NodeZygote};
use super::flight::{FALLBACK_POLL_MS, Flight};
use super::node::NodeKey;
use super::{Zygote, ZygoteOptions};
use crate::end::End;
use crate::fds::Claimed;
use crate::link::{self, Frame, Received, Receiver};
use crate::output::CallOutput;
use crate::process::ExitWatch;
use crate::protocol;

/// Exit code when forking became unsafe: the agent starts a new zygote.
pub const MUST_RESTART: u8 = 3;

/// Which contract the requests on a link follow.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Contract {
    /// The agent's: a request's `env` is applied in its child.
    Agent,
    /// The worker contract's, for pool slots: `env` ignored, as
    /// `worker_main.py` ignores it.
    Worker,
}

/// Serves the agent on `link` until it closes the link.
pub fn run(options: &ZygoteOptions, link: RawFd) -> ExitCode {
    // SAFETY: the agent passed this fd for the zygote alone.
    let socket = unsafe { OwnedFd::from_raw_fd(link) };
    crate::process::set_cloexec(socket.as_fd());
    serve_links(options, Some(socket), None, Contract::Agent, |_| {})
}

/// Serves pool slots on a Unix socket at `path` until the last one has
/// gone; `ready` hears the start-up's outcome (`None`: ready).
pub fn listen(options: &ZygoteOptions, path: &Path, ready: impl FnOnce(Option<&str>)) -> ExitCode {
    let _ = std::fs::remove_file(path);
    let listener = match UnixListener::bind(path) {
        Ok(listener) => listener,
        Err(error) => {
            let message = format!("could not listen on {}: {error}", path.display());
            ready(Some(&message));
            return ExitCode::from(2);
        }
    };
    let code = serve_links(options, None, Some(listener), Contract::Worker, ready);
    let _ = std::fs::remove_file(path);
    code
}

fn serve_links(
    options: &ZygoteOptions,
    first: Option<OwnedFd>,
    listener: Option<UnixListener>,
    contract: Contract,
    ready: impl FnOnce(Option<&str>),
) -> ExitCode {
    let first = first.map(Claimed::new);
    let listener = listener.map(|l| Claimed::new(OwnedFd::from(l)));
    // A node's stray writes to fd 1 go to the log, and stdin is nobody's.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto this process's own standard fds.
        unsafe {
            libc::dup2(null.as_raw_fd(), 0);
            libc::dup2(2, 1);
        }
    }
    let failed = |first: &Option<Claimed>, message: String| {
        if let Some(socket) = first {
            let _ = link::send(socket.as_fd(), &Frame::Failed { message });
        }
        ExitCode::from(2)
    };
    if let Err(error) = super::boot(options) {
        ready(Some(&error.to_string()));
        return failed(&first, error.to_string());
    }
    Python::attach(|py| {
        let mut zygote = match Zygote::new(py, options) {
            Ok(zygote) => zygote,
            Err(error) => {
                ready(Some(&error.to_string()));
                return failed(&first, error.to_string());
            }
        };
        let mut server = Server::new(listener, contract, Placement::NodeZygotes);
        server.lanes_per_node = options.node_lanes.unwrap_or_else(|| {
            app::default_lanes(std::thread::available_parallelism().map_or(1, |n| n.get()))
        });
        if let Some(socket) = first
            && !server.open(socket)
        {
            return ExitCode::SUCCESS;
        }
        if let Some(listener) = &server.listener {
            crate::fds::set_nonblocking(listener.as_raw_fd());
        }
        ready(None);
        let code = server.serve(py, &mut zygote);
        server.end_node_zygotes();
        zygote.shutdown();
        ExitCode::from(code)
    })
}

/// Forks a zygote of its own for node `key`. It loads `preload` first (if
/// given), then serves the link under `contract` until the link closes.
/// Returns in the parent only.
pub(super) fn spawn_node_zygote(
    py: Python<'_>,
    zygote: &mut Zygote,
    key: &NodeKey,
    contract: Contract,
    preload: Option<app::Preload<'_>>,
) -> std::io::Result<NodeZygote> {
    app::fork_own(py, zygote, key, |py, zygote, link| {
        if let Some(preload) = preload {
            zygote.load_into_zygote(py, key, preload.source, preload.digest, preload.warm);
        }
        serve_link(py, zygote, link, contract, key)
    })
}

/// A node's own zygote (or a lane of one) serving the link to the zygote
/// that forked it, until it closes; the exit code.
pub(super) fn serve_link(
    py: Python<'_>,
    zygote: &mut Zygote,
    link: Claimed,
    contract: Contract,
    key: &NodeKey,
) -> i32 {
    let mut server = Server::new(None, contract, Placement::Here);
    server.node = Some(key.clone());
    if !server.open(link) {
        return 0;
    }
    server.serve(py, zygote) as i32
}

/// Where the nodes a server is asked for are loaded and forked from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Placement {
    /// Each in a zygote of its own (`super::app`), forked on its first
    /// request: this process runs no node code, so no compile holds up
    /// another node's calls, and its forks stay as cheap as its preloads.
    NodeZygotes,
    /// Here: this process is a node's own zygote.
    Here,
}

/// One link: its socket and what has arrived on it.
struct Link {
    id: u64,
    socket: Claimed,
    receiver: Receiver,
}

/// A run whose lines a link's owner reads; the zygote waits for its exit.
struct Run {
    link: u64,
    ticket: u64,
    flight: Flight,
}

struct Server {
    /// Where pool slots connect (a shared zygote).
    listener: Option<Claimed>,
    links: Vec<Link>,
    runs: Vec<Run>,
    next_link: u64,
    contract: Contract,
    placement: Placement,
    /// The nodes' own zygotes, and the calls relayed to them by their
    /// tickets there.
    node_zygotes: Vec<Relay>,
    routes: HashMap<u64, Route>,
    next_route: u64,
    /// The most fork loops (a node zygote and its lanes) one node gets.
    lanes_per_node: usize,
    /// In a node's own zygote: its node, and the lanes it forked (its
    /// children, reaped here).
    node: Option<NodeKey>,
    lanes: Vec<(Pid, ExitWatch)>,
}

/// The most node zygotes kept: past it, the least recently used one with
/// no call in flight is ended (a flow of many nodes, each process holding
/// its node's module-level objects and its standby children).
const MAX_NODE_ZYGOTES: usize = 16;

/// A node's zygote asks for a lane once each of its node's fork loops has
/// this many calls in flight: one loop keeps about this many cores busy
/// with trivial calls ([`app::CORES_PER_LANE`]).
const LANE_AT_IN_FLIGHT: usize = app::CORES_PER_LANE;

/// A node's own zygote, or a lane of it, as the zygote relays to it.
struct Relay {
    node_zygote: NodeZygote,
    /// A lane: forked by the node's zygote, not by this process.
    lane: bool,
    /// A lane was asked of it and has not come yet.
    lane_asked: bool,
    /// When its node was last asked for (a count of relayed requests).
    last_used: u64,
    receiver: Receiver,
    /// Frames not yet taken by its socket: it reads nothing while it loads
    /// a node, and the zygote must not wait for it.
    outbox: Vec<u8>,
}

/// A call relayed to a node's zygote: whose it is, to answer for it if
/// that zygote dies.
struct Route {
    link: u64,
    ticket: u64,
    node_zygote: Pid,
    /// A run (not a compile): it counts among the calls in flight.
    run: bool,
}

impl Server {
    fn new(listener: Option<Claimed>, contract: Contract, placement: Placement) -> Server {
        Server {
            listener,
            links: Vec::new(),
            runs: Vec::new(),
            next_link: 0,
            contract,
            placement,
            node_zygotes: Vec::new(),
            routes: HashMap::new(),
            next_route: 0,
            lanes_per_node: 1,
            node: None,
            lanes: Vec::new(),
        }
    }

    /// Takes a new link: says `Ready` on it. False if it is gone already.
    fn open(&mut self, socket: Claimed) -> bool {
        crate::fds::set_nonblocking(socket.as_raw_fd());
        if link::send(socket.as_fd(), &Frame::Ready).is_err() {
            return false;
        }
        self.next_link += 1;
        self.links.push(Link {
            id: self.next_link,
            socket,
            receiver: Receiver::default(),
        });
        true
    }

    fn serve(&mut self, py: Python<'_>, zygote: &mut Zygote) -> u8 {
        // Set once forking became unsafe: no new call is taken, the runs in
        // flight (each forked safely) land and are reported, then the zygote
        // exits for a new one to be started.
        let mut restarting = false;
        // Since when no link is open (a shared zygote lingers then).
        let mut alone_since: Option<std::time::Instant> = None;
        loop {
            if restarting && self.runs.is_empty() && self.routes.is_empty() {
                return MUST_RESTART;
            }
            let linger = if self.links.is_empty() {
                match (&self.listener, self.next_link) {
                    // The agent's link closed.
                    (None, _) => return 0,
                    // A shared zygote's last slot left: the pool respawns a
                    // killed slot at once, and it should find the zygote warm.
                    (Some(_), n) if n > 0 => {
                        let since = *alone_since.get_or_insert_with(std::time::Instant::now);
                        Some(shared_linger().saturating_sub(since.elapsed()))
                    }
                    _ => None,
                }
            } else {
                alone_since = None;
                None
            };
            let ready = match self.wait(!restarting, linger) {
                Ok(ready) => ready,
                Err(error) => {
                    tracing::error!("the zygote lost track of its links: {error}");
                    return 1;
                }
            };
            // Its time alone is up, with nothing in flight (a node zygote's
            // news may wake it before then).
            let lingered = alone_since.is_some_and(|since| since.elapsed() >= shared_linger());
            if lingered
                && self.links.is_empty()
                && !ready.accept
                && self.runs.is_empty()
                && self.routes.is_empty()
            {
                return 0;
            }
            for index in ready.exited.into_iter().rev() {
                let run = self.runs.swap_remove(index);
                self.land(zygote, run);
            }
            for pid in ready.writable {
                self.flush_to(pid);
            }
            for pid in ready.relayed {
                self.read_node_zygote(pid);
            }
            for pid in ready.ended {
                self.node_zygote_ended(pid);
            }
            for pid in ready.lanes_ended {
                self.lane_ended(pid);
            }
            if ready.accept {
                self.accept();
            }
            for id in ready.links {
                if self.read_link(py, zygote, id) {
                    restarting = true;
                }
            }
        }
    }

    /// Accepts every slot waiting to connect.
    fn accept(&mut self) {
        loop {
            let Some(listener) = &self.listener else {
                return;
            };
            // SAFETY: accept4 on a listening socket this process owns.
            let fd = unsafe {
                libc::accept4(
                    listener.as_raw_fd(),
                    std::ptr::null_mut(),
                    std::ptr::null_mut(),
                    libc::SOCK_CLOEXEC,
                )
            };
            if fd < 0 {
                return;
            }
            // SAFETY: the kernel just returned this fd to us.
            let socket = Claimed::new(unsafe { OwnedFd::from_raw_fd(fd) });
            self.open(socket);
        }
    }

    /// Reads what link `id` sent and serves its calls; true when the zygote
    /// must restart.
    fn read_link(&mut self, py: Python<'_>, zygote: &mut Zygote, id: u64) -> bool {
        let Some(index) = self.links.iter().position(|l| l.id == id) else {
            return false;
        };
        loop {
            let link = &mut self.links[index];
            match link.receiver.receive(link.socket.as_fd()) {
                Ok(Received::Data) => {}
                Ok(Received::WouldBlock) => break,
                Ok(Received::Closed) | Err(_) => {
                    self.close(zygote, id);
                    return false;
                }
            }
        }
        loop {
            let Some(link) = self.links.iter_mut().find(|l| l.id == id) else {
                return false;
            };
            match link.receiver.next_frame() {
                Ok(Some(Frame::Call { ticket, request })) => {
                    if self.call(py, zygote, id, ticket, &request) {
                        return true;
                    }
                }
                Ok(Some(Frame::Abandon { ticket })) => self.abandon(zygote, id, ticket),
                Ok(Some(Frame::ForkLane)) => {
                    if self.fork_lane(py, zygote, id) {
                        return true;
                    }
                }
                Ok(Some(other)) => {
                    tracing::warn!("the zygote ignores an unexpected frame: {other:?}")
                }
                Ok(None) => return false,
                Err(error) => {
                    tracing::error!("a link sent a frame the zygote cannot read: {error}");
                    self.close(zygote, id);
                    return false;
                }
            }
        }
    }

    /// Waits for a frame, a slot, a run's exit, or news of a node's zygote.
    fn wait(
        &self,
        taking_calls: bool,
        linger: Option<std::time::Duration>,
    ) -> std::io::Result<Ready> {
        let interest = if taking_calls {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        let mut fds = Vec::new();
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(listener.as_fd(), interest));
        }
        let first_link = fds.len();
        for link in &self.links {
            fds.push(PollFd::new(link.socket.as_fd(), interest));
        }
        // Each node zygote: its socket, then its exit.
        let first_relay = fds.len();
        for relay in &self.node_zygotes {
            let mut flags = PollFlags::POLLIN;
            if !relay.outbox.is_empty() {
                flags |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(relay.node_zygote.link.as_fd(), flags));
            match relay.node_zygote.exit.fd() {
                Some(fd) => fds.push(PollFd::new(fd, PollFlags::POLLIN)),
                // Without pidfds its socket closing says it ended.
                None => fds.push(PollFd::new(
                    relay.node_zygote.link.as_fd(),
                    PollFlags::empty(),
                )),
            }
        }
        let first_lane = fds.len();
        let mut watched_all = true;
        for (_, exit) in &self.lanes {
            match exit.fd() {
                Some(fd) => fds.push(PollFd::new(fd, PollFlags::POLLIN)),
                None => watched_all = false,
            }
        }
        let first_run = fds.len();
        let mut owners = Vec::new();
        for (index, run) in self.runs.iter().enumerate() {
            match run.flight.exit_poll() {
                Some(fd) => {
                    fds.push(fd);
                    owners.push(index);
                }
                None => watched_all = false,
            }
        }
        let timeout = match (watched_all, linger) {
            (true, None) => PollTimeout::NONE,
            (true, Some(linger)) => {
                PollTimeout::try_from(linger.as_millis() as u64).unwrap_or(PollTimeout::MAX)
            }
            (false, _) => PollTimeout::from(FALLBACK_POLL_MS),
        };
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(error.into()),
        }
        let is_ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let has =
            |fd: &PollFd<'_>, flag: PollFlags| fd.revents().is_some_and(|r| r.intersects(flag));
        let accept = taking_calls && self.listener.is_some() && is_ready(&fds[0]);
        // A closed link reads as POLLHUP even when calls are not taken.
        let links = self
            .links
            .iter()
            .zip(&fds[first_link..first_relay])
            .filter(|(_, fd)| is_ready(fd))
            .map(|(link, _)| link.id)
            .collect();
        let mut relayed = Vec::new();
        let mut writable = Vec::new();
        let mut ended = Vec::new();
        for (relay, pair) in self
            .node_zygotes
            .iter()
            .zip(fds[first_relay..first_lane].chunks(2))
        {
            let pid = relay.node_zygote.pid;
            if has(
                &pair[0],
                PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR,
            ) {
                relayed.push(pid);
            }
            if has(&pair[0], PollFlags::POLLOUT) {
                writable.push(pid);
            }
            if relay.node_zygote.exit.fd().is_some() && is_ready(&pair[1]) {
                ended.push(pid);
            }
        }
        let mut watched = fds[first_lane..first_run].iter();
        let lanes_ended = self
            .lanes
            .iter()
            .filter(|(pid, exit)| match exit.fd() {
                Some(_) => watched.next().is_some_and(is_ready),
                None => crate::process::has_exited(*pid),
            })
            .map(|(pid, _)| *pid)
            .collect();
        let mut exited: Vec<usize> = owners
            .iter()
            .zip(&fds[first_run..])
            .filter(|(_, fd)| is_ready(fd))
            .map(|(&i, _)| i)
            .collect();
        if !watched_all {
            exited.extend((0..self.runs.len()).filter(|&i| {
                self.runs[i].flight.exit_poll().is_none() && self.runs[i].flight.has_exited()
            }));
            exited.sort_unstable();
            exited.dedup();
        }
        Ok(Ready {
            accept,
            links,
            exited,
            relayed,
            writable,
            ended,
            lanes_ended,
        })
    }

    /// Serves one request of link `id`; true when the zygote must restart.
    fn call(
        &mut self,
        py: Python<'_>,
        zygote: &mut Zygote,
        id: u64,
        ticket: u64,
        request: &[u8],
    ) -> bool {
        // No child forked while this call is served may find it.
        let _line = crate::scrub::Held::new(request);
        let parsed = match self.contract {
            Contract::Agent => protocol::parse_request(request),
            Contract::Worker => protocol::parse_worker_request(request),
        };
        let parsed = match parsed {
            Ok(parsed) => parsed,
            Err(refusal) => {
                if let Some(socket) = self.socket_of(id) {
                    LinkOutput { socket, ticket }.reply(&refusal.reply());
                    send(socket, Frame::Done { ticket });
                }
                return false;
            }
        };
        let _secrets = parsed.held();
        if self.placement == Placement::NodeZygotes {
            if parsed.op == protocol::Op::Run {
                // Each call's share of the CPUs, read where it is forked.
                let runs = self.routes.values().filter(|route| route.run).count();
                super::threads::set_calls_in_flight(runs + 1);
            }
            self.relay(py, zygote, id, ticket, &parsed, request);
            return zygote.needs_recovery();
        }
        // Nor the requests behind it, not yet taken (forks follow).
        let _pending = self.pending_held();
        let Some(socket) = self.socket_of(id) else {
            return false;
        };
        let mut out = LinkOutput { socket, ticket };
        match zygote.serve_detached(py, &parsed, &mut out) {
            Ok(Some(mut flight)) => {
                if let Some(pipe) = flight.take_pipe() {
                    send(socket, Frame::Pipe { ticket, pipe });
                }
                self.runs.push(Run {
                    link: id,
                    ticket,
                    flight,
                });
                // Now that the link's owner reads the call, fork the next standby.
                zygote.replenish(py);
            }
            Ok(None) => send(socket, Frame::Done { ticket }),
            Err(must) => {
                if !must.answered {
                    out.reply(&End::Lost("the zygote can no longer fork safely and is restarting; send the call again".to_string()).reply(&parsed.id, &parsed.call_id, ""));
                }
                send(socket, Frame::Done { ticket });
                return true;
            }
        }
        zygote.needs_recovery()
    }

    /// Hands a request to its node's own zygote, forking one if the node
    /// has none yet; its frames come back through [`Server::read_node_zygote`].
    fn relay(
        &mut self,
        py: Python<'_>,
        zygote: &mut Zygote,
        link: u64,
        ticket: u64,
        parsed: &protocol::Request,
        request: &[u8],
    ) {
        let key = NodeKey {
            flow: parsed.flow.clone(),
            node: parsed.node.clone(),
        };
        self.next_route += 1;
        let relayed = self.next_route;
        let pid = match self.node_zygote_for(py, zygote, &key, relayed) {
            Ok(pid) => pid,
            Err(error) => {
                if let Some(socket) = self.socket_of(link) {
                    let message = format!("could not start the node's zygote: {error}");
                    LinkOutput { socket, ticket }.reply(&End::Lost(message).reply(
                        &parsed.id,
                        &parsed.call_id,
                        "",
                    ));
                    send(socket, Frame::Done { ticket });
                }
                return;
            }
        };
        self.routes.insert(
            relayed,
            Route {
                link,
                ticket,
                node_zygote: pid,
                run: parsed.op == protocol::Op::Run,
            },
        );
        self.post(
            pid,
            &Frame::Call {
                ticket: relayed,
                request: request.to_vec(),
            },
        );
    }

    /// The fork loop of `key` with the fewest calls in flight: its node
    /// zygote, forked now if it has none, or one of its lanes. `used` marks
    /// it as the most recently used. Where every loop of the node is busy
    /// and it may have more, its node zygote is asked for a lane.
    fn node_zygote_for(
        &mut self,
        py: Python<'_>,
        zygote: &mut Zygote,
        key: &NodeKey,
        used: u64,
    ) -> std::io::Result<Pid> {
        let mut loops = 0;
        let mut least: Option<(usize, usize)> = None;
        for (index, relay) in self.node_zygotes.iter().enumerate() {
            if relay.node_zygote.key != *key {
                continue;
            }
            loops += 1;
            let in_flight = self.in_flight(relay.node_zygote.pid);
            if least.is_none_or(|(_, fewest)| in_flight < fewest) {
                least = Some((index, in_flight));
            }
        }
        if let Some((index, in_flight)) = least {
            self.node_zygotes[index].last_used = used;
            let pid = self.node_zygotes[index].node_zygote.pid;
            if in_flight >= LANE_AT_IN_FLIGHT && loops < self.lanes_per_node {
                self.ask_for_lane(key);
            }
            return Ok(pid);
        }
        self.retire_one();
        let pending = self.pending_held();
        let node_zygote = spawn_node_zygote(py, zygote, key, self.contract, None)?;
        drop(pending);
        crate::fds::set_nonblocking(node_zygote.raw_link());
        let pid = node_zygote.pid;
        tracing::debug!(node = %key, pid = pid.as_raw(), "forked the node's own zygote");
        self.node_zygotes.push(Relay {
            node_zygote,
            lane: false,
            lane_asked: false,
            last_used: used,
            receiver: Receiver::claiming(),
            outbox: Vec::new(),
        });
        Ok(pid)
    }

    /// The bytes of requests (and frames) read or queued and not yet
    /// passed on, held across a fork: a child never finds them. Dropped
    /// before any of those buffers changes.
    fn pending_held(&self) -> Vec<crate::scrub::Held> {
        let links = self.links.iter().map(|link| link.receiver.pending());
        let relays = self
            .node_zygotes
            .iter()
            .flat_map(|relay| [relay.receiver.pending(), &relay.outbox[..]]);
        links.chain(relays).map(crate::scrub::Held::new).collect()
    }

    /// Calls relayed to node zygote (or lane) `pid` and not yet ended.
    fn in_flight(&self, pid: Pid) -> usize {
        self.routes
            .values()
            .filter(|route| route.node_zygote == pid)
            .count()
    }

    /// Asks `key`'s node zygote for a lane, unless one is on its way: a
    /// fork of itself, the node loaded as there, forking its own share of
    /// the node's calls on another core.
    fn ask_for_lane(&mut self, key: &NodeKey) {
        let Some(relay) = self
            .node_zygotes
            .iter_mut()
            .find(|r| r.node_zygote.key == *key && !r.lane)
        else {
            return;
        };
        if relay.lane_asked {
            return;
        }
        relay.lane_asked = true;
        let pid = relay.node_zygote.pid;
        tracing::debug!(node = %key, "asked the node's zygote for a lane");
        self.post(pid, &Frame::ForkLane);
    }

    /// The lane node zygote `index` forked: relayed to like it from now on.
    fn add_lane(&mut self, index: usize, pid: i32, link: OwnedFd, pidfd: OwnedFd) {
        let parent = &mut self.node_zygotes[index];
        parent.lane_asked = false;
        let key = parent.node_zygote.key.clone();
        let last_used = parent.last_used;
        let pid = Pid::from_raw(pid);
        let link = Claimed::new(link);
        crate::fds::set_nonblocking(link.as_raw_fd());
        tracing::debug!(node = %key, pid = pid.as_raw(), "the node has a new lane");
        self.node_zygotes.push(Relay {
            node_zygote: NodeZygote {
                key,
                pid,
                link,
                // Its parent reaps it; a lane that ended is seen here by
                // this pidfd, which its parent opened while it was its
                // child (so it cannot name a reused pid).
                exit: ExitWatch::from_pidfd(pidfd),
            },
            lane: true,
            lane_asked: false,
            last_used,
            receiver: Receiver::claiming(),
            outbox: Vec::new(),
        });
    }

    /// In a node zygote: forks a lane of itself and hands the zygote on
    /// link `id` its end of the lane's link. True when the zygote must
    /// restart (forking was not safe).
    fn fork_lane(&mut self, py: Python<'_>, zygote: &mut Zygote, id: u64) -> bool {
        let Some(key) = self.node.clone() else {
            return false;
        };
        let contract = self.contract;
        let pending = self.pending_held();
        let forked = app::fork_own(py, zygote, &key, |py, zygote, link| {
            serve_link(py, zygote, link, contract, &key)
        });
        drop(pending);
        let Some(socket) = self.socket_of(id) else {
            if let Ok(lane) = forked {
                lane.end();
            }
            return zygote.needs_recovery();
        };
        match forked {
            Ok(lane) => {
                let pidfd = lane.exit.fd().and_then(|fd| fd.try_clone_to_owned().ok());
                let Some(pidfd) = pidfd else {
                    // No pidfds here (Linux before 5.3): the zygote could
                    // not watch it safely, so there is no lane.
                    lane.end();
                    return zygote.needs_recovery();
                };
                let NodeZygote {
                    pid, link, exit, ..
                } = lane;
                send(
                    socket,
                    Frame::Lane {
                        pid: pid.as_raw(),
                        link: link.release(),
                        pidfd,
                    },
                );
                self.lanes.push((pid, exit));
            }
            Err(error) => {
                tracing::warn!(node = %key, "could not fork a lane: {error}");
                send(
                    socket,
                    Frame::Failed {
                        message: format!("could not fork a lane of node {key}: {error}"),
                    },
                );
            }
        }
        zygote.needs_recovery()
    }

    /// In a node zygote: a lane it forked has ended; it is reaped, and what
    /// its calls left is ended.
    fn lane_ended(&mut self, pid: Pid) {
        self.lanes.retain(|(lane, _)| *lane != pid);
        let _ = crate::process::reap(pid);
        crate::containment::end_node_zygote(pid.as_raw());
    }

    /// Makes room for one more node zygote: past [`MAX_NODE_ZYGOTES`], ends
    /// the least recently used node's zygote and lanes, none of them with
    /// a call in flight.
    fn retire_one(&mut self) {
        let nodes = self.node_zygotes.iter().filter(|r| !r.lane).count();
        if nodes < MAX_NODE_ZYGOTES {
            return;
        }
        let busy: std::collections::HashSet<&NodeKey> = self
            .node_zygotes
            .iter()
            .filter(|relay| self.in_flight(relay.node_zygote.pid) > 0)
            .map(|relay| &relay.node_zygote.key)
            .collect();
        let mut last_used: HashMap<&NodeKey, u64> = HashMap::new();
        for relay in &self.node_zygotes {
            let used = last_used.entry(&relay.node_zygote.key).or_default();
            *used = (*used).max(relay.last_used);
        }
        let Some(key) = last_used
            .into_iter()
            .filter(|(key, _)| !busy.contains(key))
            .min_by_key(|(_, used)| *used)
            .map(|(key, _)| key.clone())
        else {
            return;
        };
        tracing::debug!(node = %key, "ended the least recently used node zygote");
        let (retired, kept) = std::mem::take(&mut self.node_zygotes)
            .into_iter()
            .partition(|relay| relay.node_zygote.key == key);
        self.node_zygotes = kept;
        end_all(retired);
    }

    /// Where node zygote `pid` is in `node_zygotes`.
    fn relay_index(&self, pid: Pid) -> Option<usize> {
        self.node_zygotes
            .iter()
            .position(|relay| relay.node_zygote.pid == pid)
    }

    /// Queues a frame for a node zygote and sends what its socket takes.
    fn post(&mut self, pid: Pid, frame: &Frame) {
        if let Some(index) = self.relay_index(pid) {
            self.node_zygotes[index]
                .outbox
                .extend_from_slice(&frame.bytes());
        }
        self.flush_to(pid);
    }

    /// Sends what a node zygote's socket takes of its outbox, without
    /// waiting.
    fn flush_to(&mut self, pid: Pid) {
        let Some(relay) = self.relay_index(pid).map(|i| &mut self.node_zygotes[i]) else {
            return;
        };
        while !relay.outbox.is_empty() {
            match nix::sys::socket::send(
                relay.node_zygote.raw_link(),
                &relay.outbox,
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            ) {
                // A call's request must not stay behind in this memory.
                Ok(sent) => crate::scrub::drain_front(&mut relay.outbox, sent),
                Err(nix::errno::Errno::EINTR) => {}
                // Full, or gone (its end is read next).
                Err(_) => return,
            }
        }
    }

    /// Reads a node zygote's frames and passes each to the call it belongs
    /// to, under that call's own ticket.
    fn read_node_zygote(&mut self, pid: Pid) {
        let Some(index) = self.relay_index(pid) else {
            return;
        };
        loop {
            let relay = &mut self.node_zygotes[index];
            match relay.receiver.receive(relay.node_zygote.link.as_fd()) {
                Ok(Received::Data) => {}
                Ok(Received::WouldBlock) => break,
                Ok(Received::Closed) | Err(_) => {
                    self.forward_frames(index);
                    self.node_zygote_ended(pid);
                    return;
                }
            }
        }
        self.forward_frames(index);
    }

    fn forward_frames(&mut self, index: usize) {
        loop {
            let frame = match self.node_zygotes[index].receiver.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(error) => {
                    tracing::error!("a node's zygote sent a frame the zygote cannot read: {error}");
                    return;
                }
            };
            let Some(relayed) = frame.ticket() else {
                match frame {
                    Frame::Lane { pid, link, pidfd } => self.add_lane(index, pid, link, pidfd),
                    Frame::Failed { message } => {
                        // (A lane it could not fork: it may be asked again.)
                        self.node_zygotes[index].lane_asked = false;
                        tracing::error!("a node's zygote failed: {message}")
                    }
                    _ => {}
                }
                continue;
            };
            let Some(route) = self.routes.get(&relayed) else {
                // Its caller is gone (the run was abandoned).
                continue;
            };
            let (link, ticket) = (route.link, route.ticket);
            if frame.is_last() {
                self.routes.remove(&relayed);
            }
            if let Some(socket) = self.socket_of(link) {
                send(socket, frame.with_ticket(ticket));
            }
        }
    }

    /// A node's zygote has ended: each call it had is told so, with how it
    /// ended; what its calls left is ended too. Its node's next request
    /// forks a new one.
    fn node_zygote_ended(&mut self, pid: Pid) {
        let Some(index) = self.relay_index(pid) else {
            return;
        };
        let relay = self.node_zygotes.swap_remove(index);
        let key = relay.node_zygote.key.clone();
        if relay.lane {
            // Its parent, the node's zygote, reaps it and ends what its
            // calls left.
            drop(relay);
            self.fail_routes(pid, &key, "ended");
            return;
        }
        let how = match crate::process::reap(pid) {
            Ok(reaped) => reaped.end.to_string(),
            Err(_) => "ended".to_string(),
        };
        drop(relay);
        crate::containment::end_node_zygote(pid.as_raw());
        // Its lanes die with it (a parent-death SIGKILL) and come to this
        // process (a subreaper) to be reaped; none is given another call.
        let (lanes, kept): (Vec<Relay>, Vec<Relay>) = std::mem::take(&mut self.node_zygotes)
            .into_iter()
            .partition(|r| r.lane && r.node_zygote.key == key);
        self.node_zygotes = kept;
        for lane in lanes {
            let lane_pid = lane.node_zygote.pid;
            lane.node_zygote.end_orphaned_lane();
            self.fail_routes(lane_pid, &key, "ended with the node's zygote");
        }
        self.fail_routes(pid, &key, &how);
    }

    /// Answers every call relayed to node zygote (or lane) `pid`, which
    /// ended (`how`), with a failure saying so.
    fn fail_routes(&mut self, pid: Pid, key: &NodeKey, how: &str) {
        let orphaned: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, route)| route.node_zygote == pid)
            .map(|(&relayed, _)| relayed)
            .collect();
        if !orphaned.is_empty() {
            tracing::warn!(node = %key, pid = pid.as_raw(), "the node's own zygote {how} with calls in flight");
        }
        for relayed in orphaned {
            let Some(route) = self.routes.remove(&relayed) else {
                continue;
            };
            if let Some(socket) = self.socket_of(route.link) {
                let message = format!("the zygote of node {key} (pid {pid}) {how}");
                send(
                    socket,
                    Frame::Lost {
                        ticket: route.ticket,
                        message,
                    },
                );
            }
        }
    }

    /// Ends every node zygote, and what their calls left.
    fn end_node_zygotes(&mut self) {
        end_all(std::mem::take(&mut self.node_zygotes));
    }

    /// In a node zygote: the caller of `ticket` on link `id` is gone; its
    /// run (if it has one in flight) ends with its cell.
    fn abandon(&mut self, zygote: &mut Zygote, id: u64, ticket: u64) {
        let Some(index) = self
            .runs
            .iter()
            .position(|r| r.link == id && r.ticket == ticket)
        else {
            return;
        };
        let run = self.runs.swap_remove(index);
        crate::process::kill_group(run.flight.pid, nix::sys::signal::Signal::SIGKILL);
        if let Ok(landed) = run.flight.land(&mut Discard) {
            zygote.recycle(landed.logs);
        }
    }

    fn socket_of(&self, id: u64) -> Option<BorrowedFd<'_>> {
        self.links
            .iter()
            .find(|l| l.id == id)
            .map(|l| l.socket.as_fd())
    }

    /// A run's child has exited: its cell killed, reaped, reported.
    fn land(&mut self, zygote: &mut Zygote, run: Run) {
        let socket = self.socket_of(run.link);
        match run.flight.land(&mut Discard) {
            Ok(landed) => {
                if let Some(socket) = socket {
                    send(
                        socket,
                        Frame::Ended {
                            ticket: run.ticket,
                            end: landed.reaped.end,
                            logs: landed.logs.text_lossy(),
                        },
                    );
                }
                zygote.recycle(landed.logs);
            }
            Err(error) => {
                // The link's owner still hears the call is over.
                tracing::error!("could not reap a call's process: {error}");
                if let Some(socket) = socket {
                    send(socket, Frame::Done { ticket: run.ticket });
                }
            }
        }
    }

    /// Link `id` is gone: every run it started ends with its cell.
    fn close(&mut self, zygote: &mut Zygote, id: u64) {
        self.links.retain(|l| l.id != id);
        let abandoned: Vec<(u64, Pid)> = self
            .routes
            .iter()
            .filter(|(_, route)| route.link == id)
            .map(|(&relayed, route)| (relayed, route.node_zygote))
            .collect();
        for (relayed, pid) in abandoned {
            self.routes.remove(&relayed);
            self.post(pid, &Frame::Abandon { ticket: relayed });
        }
        let (theirs, others): (Vec<Run>, Vec<Run>) = std::mem::take(&mut self.runs)
            .into_iter()
            .partition(|r| r.link == id);
        self.runs = others;
        for run in theirs {
            crate::process::kill_group(run.flight.pid, nix::sys::signal::Signal::SIGKILL);
            if let Ok(landed) = run.flight.land(&mut Discard) {
                zygote.recycle(landed.logs);
            }
        }
    }
}

/// How long a shared zygote outlives its last slot, waiting for a new one
/// (`FLUKSIO_SHARED_ZYGOTE_LINGER_S`, default 10 s).
fn shared_linger() -> std::time::Duration {
    std::env::var("FLUKSIO_SHARED_ZYGOTE_LINGER_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 0.0)
        .map_or(
            std::time::Duration::from_secs(10),
            std::time::Duration::from_secs_f64,
        )
}

/// What a wait found ready.
struct Ready {
    accept: bool,
    links: Vec<u64>,
    /// Indices of runs whose child has exited, ascending.
    exited: Vec<usize>,
    /// Node zygotes with frames to read (or a closed socket).
    relayed: Vec<Pid>,
    /// Node zygotes whose socket takes more of their outbox.
    writable: Vec<Pid>,
    /// Node zygotes that exited.
    ended: Vec<Pid>,
    /// In a node zygote: lanes it forked that exited.
    lanes_ended: Vec<Pid>,
}

/// Ends node zygotes, what their calls left, and their lanes (which die
/// with them and come here to be reaped).
fn end_all(relays: Vec<Relay>) {
    let (lanes, node_zygotes): (Vec<Relay>, Vec<Relay>) =
        relays.into_iter().partition(|relay| relay.lane);
    for relay in node_zygotes {
        relay.node_zygote.end();
    }
    for relay in lanes {
        relay.node_zygote.end_orphaned_lane();
    }
}

/// A failed send means the link's owner is gone; the next read says so.
fn send(socket: BorrowedFd<'_>, frame: Frame) {
    let _ = link::send(socket, &frame);
}

/// A call's lines and children, told to the agent as they come.
struct LinkOutput<'a> {
    socket: BorrowedFd<'a>,
    ticket: u64,
}

impl CallOutput for LinkOutput<'_> {
    fn event(&mut self, line: &[u8]) {
        self.send_line(line);
    }

    fn reply(&mut self, line: &[u8]) {
        self.send_line(line);
    }

    fn started(&mut self, pid: Pid) {
        let watch = ExitWatch::new(pid);
        if let Some(pidfd) = watch.fd().and_then(|fd| fd.try_clone_to_owned().ok()) {
            let _ = link::send(
                self.socket,
                &Frame::Started {
                    ticket: self.ticket,
                    pid: pid.as_raw(),
                    pidfd,
                },
            );
        }
    }
}

impl LinkOutput<'_> {
    fn send_line(&mut self, line: &[u8]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line).to_vec();
        let _ = link::send(
            self.socket,
            &Frame::Line {
                ticket: self.ticket,
                line,
            },
        );
    }
}

/// Where the lines of a landed run go: nowhere (the agent read them).
struct Discard;

impl CallOutput for Discard {
    fn event(&mut self, _line: &[u8]) {}
    fn reply(&mut self, _line: &[u8]) {}
}
