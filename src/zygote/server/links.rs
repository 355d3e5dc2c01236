//! A server's links: each greeted with `Ready`, its frames read as they
//! arrive, its calls served. A compile is served here whole; a run's child
//! is started, its pipe handed over the link (whose owner reads its lines),
//! and the run held here until its child exits: only a parent can kill its
//! cell, reap it and say how it ended. Requests for nodes that have zygotes
//! of their own go to the router instead.
//!
//! A link that closes takes its runs and its relayed calls with it, so a
//! pool slot SIGKILLed by its pool ends exactly its own call.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};

use nix::unistd::Pid;
use pyo3::prelude::*;

use super::link_output::{Discard, LinkOutput, send};
use super::{Contract, Link, Run, RunChild, Server};
use crate::end::End;
use crate::fds::Claimed;
use crate::link::{self, Frame, Received, Receiver};
use crate::output::CallOutput;
use crate::process::ChildEnd;
use crate::protocol;
use crate::zygote::{Detached, Zygote};

impl Server {
    /// Takes a new link: says `Ready` on it. False if it is gone already.
    pub(super) fn open(&mut self, socket: Claimed) -> bool {
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

    /// Accepts every slot waiting to connect.
    pub(super) fn accept(&mut self) {
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
    pub(super) fn read_link(&mut self, py: Python<'_>, zygote: &mut Zygote, id: u64) -> bool {
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
        if zygote.placement().own_zygote_first() {
            if parsed.op == protocol::Op::Run {
                // Each call's share of the CPUs, read where it is forked.
                let runs = self.routes.values().filter(|route| route.run).count();
                crate::zygote::threads::set_calls_in_flight(runs + 1);
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
            Ok(Some(Detached::Child(mut flight))) => {
                if let Some(pipe) = flight.take_pipe() {
                    send(socket, Frame::Pipe { ticket, pipe });
                }
                self.runs.push(Run {
                    link: id,
                    ticket,
                    child: RunChild::Fresh(flight),
                });
                // Now that the link's owner reads the call, fork the next standby.
                zygote.replenish(py);
            }
            Ok(Some(Detached::Resident { resident, pipe })) => {
                send(socket, Frame::Pipe { ticket, pipe });
                self.runs.push(Run {
                    link: id,
                    ticket,
                    child: RunChild::Resident {
                        resident,
                        silent: false,
                    },
                });
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

    /// The bytes of requests (and frames) read or queued and not yet
    /// passed on, held across a fork: a child never finds them. Dropped
    /// before any of those buffers changes.
    pub(super) fn pending_held(&self) -> Vec<crate::scrub::Held> {
        let links = self.links.iter().map(|link| link.receiver.pending());
        let relays = self
            .node_zygotes
            .iter()
            .flat_map(|relay| [relay.receiver.pending(), &relay.outbox[..]]);
        links.chain(relays).map(crate::scrub::Held::new).collect()
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
        crate::process::kill_group(run.flight().pid, nix::sys::signal::Signal::SIGKILL);
        if let Ok(landed) = run.into_flight().land(&mut Discard) {
            zygote.recycle(landed.logs);
        }
    }

    pub(super) fn socket_of(&self, id: u64) -> Option<BorrowedFd<'_>> {
        self.links
            .iter()
            .find(|l| l.id == id)
            .map(|l| l.socket.as_fd())
    }

    /// A run's child has exited: its cell killed, reaped, reported.
    pub(super) fn land(&mut self, zygote: &mut Zygote, run: Run) {
        let socket = self.socket_of(run.link);
        let ticket = run.ticket;
        let resident = match &run.child {
            RunChild::Resident { resident, .. } => Some(resident.tag()),
            RunChild::Fresh(_) => None,
        };
        match run.into_flight().land(&mut Discard) {
            Ok(landed) => {
                // Its call's lines went to the link's owner: a resident that
                // exits 0 retired itself once its call was over (a crash or
                // a kill is no put-back that failed).
                if let (Some(tag), ChildEnd::Exited(0)) = (resident, landed.reaped.end) {
                    zygote.resident_ended_after_its_call(&tag);
                }
                if let Some(socket) = socket {
                    send(
                        socket,
                        Frame::Ended {
                            ticket,
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
                    send(socket, Frame::Done { ticket });
                }
            }
        }
    }

    /// A resident's control socket is readable after a link's call: its
    /// word, that the call is over and it is put back (or why not, read
    /// when the node's next call takes it), or a hang-up as it ends.
    pub(super) fn heard(&mut self, zygote: &mut Zygote, index: usize) {
        let run = &mut self.runs[index];
        let RunChild::Resident { resident, silent } = &mut run.child else {
            return;
        };
        if !has_word(resident.control()) {
            // It is ending: its exit lands it and says how.
            *silent = true;
            return;
        }
        let run = self.runs.swap_remove(index);
        if let Some(socket) = self.socket_of(run.link) {
            send(socket, Frame::Done { ticket: run.ticket });
        }
        if let RunChild::Resident { resident, .. } = run.child {
            zygote.keep_resident(resident);
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
            crate::process::kill_group(run.flight().pid, nix::sys::signal::Signal::SIGKILL);
            if let Ok(landed) = run.into_flight().land(&mut Discard) {
                zygote.recycle(landed.logs);
            }
        }
    }
}

/// Whether `control` holds bytes to read (a word), not only a hang-up.
fn has_word(control: BorrowedFd<'_>) -> bool {
    let mut byte = [0u8; 1];
    matches!(
        nix::sys::socket::recv(
            control.as_raw_fd(),
            &mut byte,
            nix::sys::socket::MsgFlags::MSG_PEEK | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
        ),
        Ok(n) if n > 0
    )
}
