//! The zygote serving an agent over the link (`crate::link`).
//!
//! Started by the agent as `fluksio-zygote zygote --link-fd N`. Requests
//! come as `Call` frames; a compile is served here whole (its lines go back
//! as `Line` frames); a run's child is started and its pipe handed to the
//! agent, which reads its lines. The zygote keeps what only a parent can do:
//! watch each child's exit, kill its session, reap it, and say how it ended.
//! Several runs are in flight at once; the zygote itself stays one thread,
//! blocked in `poll` between frames.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::process::ExitCode;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::Pid;
use pyo3::prelude::*;

use super::flight::{CallOutput, FALLBACK_POLL_MS, Flight};
use super::{Zygote, ZygoteOptions, plumbing};
use crate::link::{self, Frame, Received, Receiver};
use crate::process::ExitWatch;
use crate::protocol;

/// Exit code when forking became unsafe: the agent starts a new zygote.
pub const MUST_RESTART: u8 = 3;

/// Serves the agent on `link` until it closes the link.
pub fn run(options: &ZygoteOptions, link: RawFd) -> ExitCode {
    // SAFETY: the agent passed this fd for the zygote alone.
    let socket = unsafe { OwnedFd::from_raw_fd(link) };
    crate::process::set_cloexec(socket.as_fd());
    plumbing::claim(socket.as_raw_fd());
    // A node's stray writes to fd 1 go to the log, and stdin is nobody's.
    if let Ok(null) = std::fs::File::open("/dev/null") {
        // SAFETY: dup2 onto this process's own standard fds.
        unsafe {
            libc::dup2(null.as_raw_fd(), 0);
            libc::dup2(2, 1);
        }
    }
    if let Err(error) = super::boot(options) {
        let _ = link::send(
            socket.as_fd(),
            &Frame::Failed {
                message: error.to_string(),
            },
        );
        return ExitCode::from(2);
    }
    Python::attach(|py| {
        let mut zygote = match Zygote::new(py, options) {
            Ok(zygote) => zygote,
            Err(error) => {
                let _ = link::send(
                    socket.as_fd(),
                    &Frame::Failed {
                        message: error.to_string(),
                    },
                );
                return ExitCode::from(2);
            }
        };
        if link::send(socket.as_fd(), &Frame::Ready).is_err() {
            return ExitCode::SUCCESS;
        }
        let code = Server {
            socket: socket.as_fd(),
            receiver: Receiver::default(),
            runs: Vec::new(),
        }
        .serve(py, &mut zygote);
        zygote.shutdown();
        code
    })
}

struct Server<'a> {
    socket: BorrowedFd<'a>,
    receiver: Receiver,
    /// Runs whose lines the agent reads; the zygote waits for their exit.
    runs: Vec<(u64, Flight)>,
}

impl Server<'_> {
    fn serve(&mut self, py: Python<'_>, zygote: &mut Zygote) -> ExitCode {
        set_nonblocking(self.socket.as_raw_fd());
        // Set once forking became unsafe: no new call is taken, the runs in
        // flight (each forked safely) land and are reported, then the zygote
        // exits for the agent to start a new one.
        let mut restarting = false;
        loop {
            if restarting && self.runs.is_empty() {
                return ExitCode::from(MUST_RESTART);
            }
            let (link_ready, exited) = match self.wait(!restarting) {
                Ok(ready) => ready,
                Err(error) => {
                    tracing::error!("the zygote lost track of its link: {error}");
                    return ExitCode::FAILURE;
                }
            };
            for index in exited.into_iter().rev() {
                let (ticket, flight) = self.runs.swap_remove(index);
                self.land(zygote, ticket, flight);
            }
            if !link_ready {
                continue;
            }
            loop {
                match self.receiver.receive(self.socket) {
                    Ok(Received::Data) => {}
                    Ok(Received::WouldBlock) => break,
                    Ok(Received::Closed) | Err(_) => return self.close(zygote),
                }
            }
            loop {
                match self.receiver.next_frame() {
                    Ok(Some(Frame::Call { ticket, request })) => {
                        if self.call(py, zygote, ticket, &request) {
                            restarting = true;
                            break;
                        }
                    }
                    Ok(Some(other)) => {
                        tracing::warn!("the zygote ignores an unexpected frame: {other:?}")
                    }
                    Ok(None) => break,
                    Err(error) => {
                        tracing::error!("the agent sent a frame the zygote cannot read: {error}");
                        return self.close(zygote);
                    }
                }
            }
        }
    }

    /// Waits for a frame or a run's exit: whether the link is readable, and
    /// the indices of runs whose child has exited, ascending.
    fn wait(&self, link: bool) -> std::io::Result<(bool, Vec<usize>)> {
        let interest = if link {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        let mut fds = vec![PollFd::new(self.socket, interest)];
        let mut owners = Vec::new();
        let mut watched_all = true;
        for (index, (_, flight)) in self.runs.iter().enumerate() {
            match flight.exit_poll() {
                Some(fd) => {
                    fds.push(fd);
                    owners.push(index);
                }
                None => watched_all = false,
            }
        }
        let timeout = if watched_all {
            PollTimeout::NONE
        } else {
            PollTimeout::from(FALLBACK_POLL_MS)
        };
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(error.into()),
        }
        let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let mut exited: Vec<usize> = owners
            .iter()
            .zip(&fds[1..])
            .filter(|(_, fd)| ready(fd))
            .map(|(&i, _)| i)
            .collect();
        if !watched_all {
            exited.extend(
                (0..self.runs.len()).filter(|&i| {
                    self.runs[i].1.exit_poll().is_none() && self.runs[i].1.has_exited()
                }),
            );
            exited.sort_unstable();
            exited.dedup();
        }
        Ok((link && ready(&fds[0]), exited))
    }

    /// Serves one request; `Some` exit code when the zygote must stop.
    fn call(&mut self, py: Python<'_>, zygote: &mut Zygote, ticket: u64, request: &[u8]) -> bool {
        let mut out = LinkOutput {
            socket: self.socket,
            ticket,
        };
        let request = match protocol::parse_request(request) {
            Ok(request) => request,
            Err(refusal) => {
                out.reply(&refusal.reply());
                self.send(Frame::Done { ticket });
                return false;
            }
        };
        match zygote.serve_detached(py, &request, &mut out) {
            Ok(Some(mut flight)) => {
                if let Some(pipe) = flight.take_pipe() {
                    self.send(Frame::Pipe { ticket, pipe });
                }
                self.runs.push((ticket, flight));
                // Now that the agent reads the call, fork the next standby.
                zygote.replenish(py);
            }
            Ok(None) => self.send(Frame::Done { ticket }),
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
                self.send(Frame::Done { ticket });
                return true;
            }
        }
        zygote.needs_recovery()
    }

    /// A run's child has exited: its session killed, reaped, reported.
    fn land(&mut self, zygote: &mut Zygote, ticket: u64, flight: Flight) {
        match flight.land(&mut Discard) {
            Ok(landed) => {
                let logs = landed.logs.text_lossy();
                self.send(Frame::Ended {
                    ticket,
                    end: landed.reaped.end,
                    logs,
                });
                zygote.recycle(landed.logs);
            }
            Err(error) => {
                // The agent still hears the call is over.
                tracing::error!("could not reap a call's process: {error}");
                self.send(Frame::Done { ticket });
            }
        }
    }

    /// The agent is gone: every run ends with its session.
    fn close(&mut self, zygote: &mut Zygote) -> ExitCode {
        for (_, flight) in self.runs.drain(..) {
            crate::process::kill_group(flight.pid, nix::sys::signal::Signal::SIGKILL);
            if let Ok(landed) = flight.land(&mut Discard) {
                zygote.recycle(landed.logs);
            }
        }
        ExitCode::SUCCESS
    }

    fn send(&self, frame: Frame) {
        // A failed send means the agent is gone; the next read says so.
        let _ = link::send(self.socket, &frame);
    }
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
