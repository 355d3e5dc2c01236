//! What goes back down a link: a call's lines and children as they come
//! (`LinkOutput`), nothing for a landed run whose lines the link's owner
//! read itself (`Discard`), and frames sent without waiting on an owner
//! that may be gone (`send`).

use std::os::fd::BorrowedFd;

use nix::unistd::Pid;

use crate::link::{self, Frame};
use crate::output::CallOutput;
use crate::process::ExitWatch;

/// A failed send means the link's owner is gone; the next read says so.
pub(super) fn send(socket: BorrowedFd<'_>, frame: Frame) {
    let _ = link::send(socket, &frame);
}

/// A call's lines and children, told to the agent as they come.
pub(super) struct LinkOutput<'a> {
    pub(super) socket: BorrowedFd<'a>,
    pub(super) ticket: u64,
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
pub(super) struct Discard;

impl CallOutput for Discard {
    fn event(&mut self, _line: &[u8]) {}
    fn reply(&mut self, _line: &[u8]) {}
}
