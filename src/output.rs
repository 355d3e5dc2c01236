//! A call's lines: how they are read off its child's pipe, and where they
//! go. The sink is the one thing a front end gives the call pipeline: the
//! worker writes them to its stdout, a pool slot's zygote sends them as link
//! frames, the agent sends them to the engine, `run` and `sweep` write a
//! results stream. Events come in the order the child wrote them, then
//! exactly one reply.

use std::os::fd::RawFd;

use nix::unistd::Pid;

use crate::lines::{LineBuffer, Piece, TooLarge};

/// Where a call's lines go as they are read.
pub trait CallOutput {
    /// An event line (`yield`, `emit`), in the order the child wrote it.
    fn event(&mut self, line: &[u8]);
    /// The reply: the last line of the call.
    fn reply(&mut self, line: &[u8]);
    /// A child was forked for the call (a trial, then the run, say).
    fn started(&mut self, _pid: Pid) {}
    /// The call ended without a reply of its node's, as `end` says (the
    /// reply for it comes next).
    fn ended_without_reply(&mut self, _end: &crate::end::End) {}
}

/// A call's pipe split into its lines: events until the reply, and nothing
/// after it (whatever threads the node left print then). Every reader of a
/// call's pipe goes through this: the zygote that forked the child, and
/// whoever it handed the pipe to ([`crate::link::follow`]).
#[derive(Default)]
pub struct CallLines {
    /// What was read and is not yet a whole line (`crate::lines`).
    pending: LineBuffer,
    replied: bool,
}

impl CallLines {
    pub fn new() -> CallLines {
        CallLines::default()
    }

    /// Whether the call's reply has been handed over.
    pub fn replied(&self) -> bool {
        self.replied
    }

    /// Whether bytes were read that are not a whole line yet.
    pub fn holds_part(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Readies it for a resident child's next call, on the same pipe.
    pub fn rearm(&mut self) {
        self.replied = false;
    }

    /// One read of `fd` appended (`LineBuffer::read_fd`).
    pub fn read_fd(&mut self, fd: RawFd) -> std::io::Result<usize> {
        self.pending.read_fd(fd)
    }

    /// Drops half a line: at the pipe's end, it is no line at all.
    pub fn clear(&mut self) {
        self.pending.clear();
    }

    /// What was read and not yet handed over, held across a fork (`crate::scrub`).
    pub fn held(&self) -> crate::scrub::Held {
        self.pending.held()
    }

    /// Hands every whole line read so far to `out`. A line over
    /// `--max-reply-mb` before the reply ends the call there: it comes back,
    /// for the caller to end the child and answer with its reply.
    pub fn hand_over(&mut self, out: &mut dyn CallOutput) -> Option<TooLarge> {
        let mut too_large = None;
        while let Some(piece) = self.pending.next_piece() {
            if self.replied {
                // Nothing after the reply belongs to the call.
                continue;
            }
            match piece {
                Piece::Line(line) if crate::protocol::is_event(line) => out.event(line),
                Piece::Line(line) => {
                    self.replied = true;
                    out.reply(line);
                }
                Piece::TooLarge(found) => {
                    too_large = Some(found);
                    break;
                }
            }
        }
        // Zeroed now, not at the next read: a resident's pipe may not be
        // read again for a long time, and children are forked meanwhile.
        self.pending.forget_handed_over();
        too_large
    }

    /// Reads and hands over what is in the pipe of a child that has exited,
    /// without waiting for more: a grandchild may still hold its write end.
    /// Sets `fd` nonblocking.
    pub fn drain(&mut self, fd: RawFd, out: &mut dyn CallOutput) -> Option<TooLarge> {
        crate::fds::set_nonblocking(fd);
        loop {
            if let Some(too_large) = self.hand_over(out) {
                return Some(too_large);
            }
            if self.replied || !matches!(self.pending.read_fd(fd), Ok(n) if n > 0) {
                return None;
            }
        }
    }
}
