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
//!
//! One `Server` holds a process's links, its runs in flight, the node
//! zygotes it relays to and the lanes it forked. It is defined here with
//! the entry points; the files below add its methods by concept and name
//! this one, never the other way, so the dependencies point one way:
//! `event_loop` (the one thread's wait, lingering, restarting), `links`
//! (frames read, calls served, runs landed), `router` (requests relayed
//! to nodes' own zygotes), `lanes` (more fork loops for a busy node),
//! `link_output` (what goes back down a link).

mod event_loop;
mod lanes;
mod link_output;
mod links;
mod router;

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::ExitCode;

use nix::unistd::Pid;
use pyo3::prelude::*;

use super::app::{self, NodeZygote};
use super::flight::Flight;
use super::node::NodeKey;
use super::placement::NodeZygotes;
use super::resident::Resident;
use super::{Zygote, ZygoteOptions};
use crate::fds::Claimed;
use crate::link::{self, Frame, Receiver};
use crate::process::ExitWatch;

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
    let _ = crate::fds::shield_standard_streams(true);
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
        zygote.set_node_zygotes(NodeZygotes::Every);
        let mut server = Server::new(listener, contract);
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
/// given), then serves the link under `contract` until the link closes;
/// with `gpu`, its children see that GPU alone (a sweep's GPU slot).
/// Returns in the parent only.
pub(crate) fn spawn_node_zygote(
    py: Python<'_>,
    zygote: &mut Zygote,
    key: &NodeKey,
    contract: Contract,
    preload: Option<app::Preload<'_>>,
    gpu: Option<&super::device::Gpu>,
) -> std::io::Result<NodeZygote> {
    app::fork_own(py, zygote, key, |py, zygote, link| {
        if let Some(gpu) = gpu
            && let Err(error) = super::device::take(py, gpu)
        {
            tracing::error!("could not give a lane GPU {}: {error}", gpu.id);
            return 1;
        }
        if let Some(preload) = preload {
            zygote.load_into_zygote(py, key, preload.source, preload.digest, preload.warm);
        }
        serve_link(py, zygote, link, contract, key)
    })
}

/// A node's own zygote (or a lane of one) serving the link to the zygote
/// that forked it, until it closes; the exit code.
fn serve_link(
    py: Python<'_>,
    zygote: &mut Zygote,
    link: Claimed,
    contract: Contract,
    key: &NodeKey,
) -> i32 {
    let mut server = Server::new(None, contract);
    server.node = Some(key.clone());
    if !server.open(link) {
        return 0;
    }
    server.serve(py, zygote) as i32
}

/// One link: its socket and what has arrived on it.
struct Link {
    id: u64,
    socket: Claimed,
    receiver: Receiver,
}

/// A run whose lines a link's owner reads; the zygote waits for its exit,
/// or a resident's word that the call is over and it is put back.
struct Run {
    link: u64,
    ticket: u64,
    child: RunChild,
}

enum RunChild {
    Fresh(Flight),
    Resident {
        resident: Resident,
        /// Its control socket hung up without a word: it is ending, and
        /// its exit says how.
        silent: bool,
    },
}

impl Run {
    fn flight(&self) -> &Flight {
        match &self.child {
            RunChild::Fresh(flight) => flight,
            RunChild::Resident { resident, .. } => resident.flight(),
        }
    }

    fn into_flight(self) -> Flight {
        match self.child {
            RunChild::Fresh(flight) => flight,
            RunChild::Resident { resident, .. } => resident.into_flight(),
        }
    }
}

struct Server {
    /// Where pool slots connect (a shared zygote).
    listener: Option<Claimed>,
    links: Vec<Link>,
    runs: Vec<Run>,
    next_link: u64,
    contract: Contract,
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
    fn new(listener: Option<Claimed>, contract: Contract) -> Server {
        Server {
            listener,
            links: Vec::new(),
            runs: Vec::new(),
            next_link: 0,
            contract,
            node_zygotes: Vec::new(),
            routes: HashMap::new(),
            next_route: 0,
            lanes_per_node: 1,
            node: None,
            lanes: Vec::new(),
        }
    }
}
