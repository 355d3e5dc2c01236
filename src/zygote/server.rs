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

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::process::ExitCode;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::Pid;
use pyo3::prelude::*;

use super::flight::{CallOutput, FALLBACK_POLL_MS, Flight};
use super::plumbing::Claimed;
use super::{Zygote, ZygoteOptions};
use crate::link::{self, Frame, Received, Receiver};
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
        let mut server = Server {
            listener,
            links: Vec::new(),
            runs: Vec::new(),
            next_link: 0,
            contract,
        };
        if let Some(socket) = first
            && !server.open(socket)
        {
            return ExitCode::SUCCESS;
        }
        if let Some(listener) = &server.listener {
            set_nonblocking(listener.as_raw_fd());
        }
        ready(None);
        let code = server.serve(py, &mut zygote);
        zygote.shutdown();
        code
    })
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
}

impl Server {
    /// Takes a new link: says `Ready` on it. False if it is gone already.
    fn open(&mut self, socket: Claimed) -> bool {
        set_nonblocking(socket.as_raw_fd());
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

    fn serve(&mut self, py: Python<'_>, zygote: &mut Zygote) -> ExitCode {
        // Set once forking became unsafe: no new call is taken, the runs in
        // flight (each forked safely) land and are reported, then the zygote
        // exits for a new one to be started.
        let mut restarting = false;
        loop {
            if restarting && self.runs.is_empty() {
                return ExitCode::from(MUST_RESTART);
            }
            let linger = if self.links.is_empty() {
                match (&self.listener, self.next_link) {
                    // The agent's link closed.
                    (None, _) => return ExitCode::SUCCESS,
                    // A shared zygote's last slot left: the pool respawns a
                    // killed slot at once, and it should find the zygote warm.
                    (Some(_), n) if n > 0 => Some(shared_linger()),
                    _ => None,
                }
            } else {
                None
            };
            let ready = match self.wait(!restarting, linger) {
                Ok(ready) => ready,
                Err(error) => {
                    tracing::error!("the zygote lost track of its links: {error}");
                    return ExitCode::FAILURE;
                }
            };
            if linger.is_some() && self.links.is_empty() && !ready.accept && self.runs.is_empty() {
                return ExitCode::SUCCESS;
            }
            for index in ready.exited.into_iter().rev() {
                let run = self.runs.swap_remove(index);
                self.land(zygote, run);
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

    /// Waits for a frame, a slot, or a run's exit.
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
        let first_run = fds.len();
        let mut owners = Vec::new();
        let mut watched_all = true;
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
        let accept = taking_calls && self.listener.is_some() && is_ready(&fds[0]);
        // A closed link reads as POLLHUP even when calls are not taken.
        let links = self
            .links
            .iter()
            .zip(&fds[first_link..first_run])
            .filter(|(_, fd)| is_ready(fd))
            .map(|(link, _)| link.id)
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
        let Some(socket) = self.socket_of(id) else {
            return false;
        };
        let mut out = LinkOutput { socket, ticket };
        let parsed = match self.contract {
            Contract::Agent => protocol::parse_request(request),
            Contract::Worker => protocol::parse_worker_request(request),
        };
        let request = match parsed {
            Ok(request) => request,
            Err(refusal) => {
                out.reply(&refusal.reply());
                send(socket, Frame::Done { ticket });
                return false;
            }
        };
        match zygote.serve_detached(py, &request, &mut out) {
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
                    out.reply(&protocol::failure_reply(
                        &request.id,
                        &request.call_id,
                        "RemoteError",
                        "the zygote can no longer fork safely and is restarting; send the call again",
                        "",
                    ));
                }
                send(socket, Frame::Done { ticket });
                return true;
            }
        }
        zygote.needs_recovery()
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

fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl flag changes on an fd this process owns.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
    }
}
