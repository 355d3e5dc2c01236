//! Following one call that another process serves: the one follower of
//! the link's frames, driven by whoever owns the call. A pool slot and a
//! zygote relaying to a node's own zygote drive it from a thread that may
//! block (`super::client`); the agent drives it from its async tasks.
//!
//! The call's lines come two ways: as `Line` frames (a compile, a refusal),
//! or on the run's own pipe, handed over in a `Pipe` frame and read here.
//! `Ended` says the run's child was reaped: what it wrote is read to the
//! end, and if it wrote no reply, one is written for it that says how it
//! ended (`crate::end`). `Done` and `Lost` say nothing more comes. Lines
//! reach the call's output with their newline, as a call's lines do
//! everywhere else.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Duration;

use serde_json::value::RawValue;

use super::Frame;
use crate::end::End;
use crate::lines::TooLarge;
use crate::output::{CallLines, CallOutput};
use crate::protocol;

/// How an owner holds a run's pipe: as it came, for a thread that polls
/// it, or registered with the agent's event loop.
pub trait CallPipe: AsRawFd + Sized {
    fn hold(pipe: OwnedFd) -> std::io::Result<Self>;
}

impl CallPipe for OwnedFd {
    fn hold(pipe: OwnedFd) -> std::io::Result<OwnedFd> {
        Ok(pipe)
    }
}

/// How the owner ended a call, for a reply it gets without its node's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ending {
    /// It did not: the call's process ended on its own.
    Ended,
    Cancelled,
    TimedOut(Duration),
}

/// One call followed over a link, from its `Call` frame to its reply.
pub struct Follower<P: CallPipe = OwnedFd> {
    ticket: u64,
    /// The request's, for a reply written here.
    id: Box<RawValue>,
    call_id: String,
    /// The run's line pipe, once the serving zygote handed it over.
    pipe: Option<P>,
    lines: CallLines,
    /// A pidfd of the call's child: a line over the limit kills it here.
    child: Option<OwnedFd>,
    /// How an end without a reply is told.
    ending: Ending,
    over: bool,
}

impl<P: CallPipe> Follower<P> {
    pub fn new(ticket: u64, id: &RawValue, call_id: &str) -> Follower<P> {
        Follower {
            ticket,
            id: id.to_owned(),
            call_id: call_id.to_string(),
            pipe: None,
            lines: CallLines::new(),
            child: None,
            ending: Ending::Ended,
            over: false,
        }
    }

    /// Whether the call is over, its reply written.
    pub fn is_over(&self) -> bool {
        self.over
    }

    /// The run's pipe, while there is one to read: wait for it to be
    /// readable, then [`Follower::read_pipe`].
    pub fn pipe(&self) -> Option<&P> {
        self.pipe.as_ref()
    }

    /// The owner cancelled the call: if its process ends without a reply,
    /// the reply says it was cancelled.
    pub fn cancel(&mut self) {
        self.ending = Ending::Cancelled;
    }

    /// The owner ends the call past its time limit: its child is killed now
    /// (the zygote that forked it ends what it started), and the reply says
    /// it ran past `limit`.
    pub fn time_out(&mut self, limit: Duration) {
        self.ending = Ending::TimedOut(limit);
        self.kill();
    }

    /// Kills the call's child, once it has one, until the call is over
    /// (a resident then serves other calls).
    pub fn kill(&self) {
        if self.over {
            return;
        }
        if let Some(child) = &self.child {
            crate::process::pidfd_kill(child.as_fd());
        }
    }

    /// Takes one frame of the link; another call's frames are left alone.
    pub fn frame(&mut self, frame: Frame, out: &mut dyn CallOutput) {
        if self.over || frame.ticket() != Some(self.ticket) {
            // Another call's late news: that call is over.
            return;
        }
        match frame {
            Frame::Line { mut line, .. } => {
                // Lines cross the link without their newline.
                line.push(b'\n');
                if protocol::is_event(&line) {
                    out.event(&line);
                } else {
                    // The zygote answered for a child it saw die: if that
                    // was a cancel, the reply says so.
                    let cancelled =
                        (self.ending == Ending::Cancelled).then(|| crate::end::as_cancelled(&line));
                    match cancelled.flatten() {
                        Some(mut reply) => {
                            reply.push(b'\n');
                            out.reply(&reply);
                        }
                        None => out.reply(&line),
                    }
                    self.over = true;
                }
            }
            Frame::Pipe { pipe, .. } => {
                crate::fds::set_nonblocking(pipe.as_raw_fd());
                match P::hold(pipe) {
                    Ok(pipe) => self.pipe = Some(pipe),
                    // Its lines are lost; how the run ends still comes.
                    Err(error) => tracing::warn!("could not watch a call's pipe: {error}"),
                }
            }
            Frame::Started { pid, pidfd, .. } => {
                self.child = Some(pidfd);
                out.started(nix::unistd::Pid::from_raw(pid));
            }
            Frame::Ended { end, logs, .. } => {
                let end = match self.ending {
                    Ending::Ended => End::Process(end),
                    Ending::Cancelled => End::Cancelled(end),
                    Ending::TimedOut(limit) => End::TimedOut(limit),
                };
                self.end(end, &logs, out);
            }
            // Nothing more comes (the process that served it is gone, or
            // never started it).
            Frame::Lost { message, .. } => self.end(End::Lost(message), "", out),
            Frame::Done { .. } => {
                let why = "the zygote ended the call without a reply".to_string();
                self.end(End::Lost(why), "", out);
            }
            other => tracing::warn!("unexpected on a call's link: {other:?}"),
        }
    }

    /// Reads the run's pipe once (it is nonblocking) and hands over its
    /// whole lines. False if there was nothing to read yet.
    pub fn read_pipe(&mut self, out: &mut dyn CallOutput) -> bool {
        let Some(fd) = self.pipe.as_ref().map(|pipe| pipe.as_raw_fd()) else {
            return true;
        };
        match self.lines.read_fd(fd) {
            Ok(0) => self.close_pipe(),
            Ok(_) => {
                let too_large = self.lines.hand_over(out);
                self.after_lines(too_large, out);
            }
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => return false,
            Err(_) => self.close_pipe(),
        }
        true
    }

    /// The link closed before the call was over: what the child wrote,
    /// then a reply that says `why`, if it wrote none.
    pub fn lost(&mut self, why: String, out: &mut dyn CallOutput) {
        if !self.over {
            self.end(End::Lost(why), "", out);
        }
    }

    /// The call's process is gone: the rest of its pipe, then `end`'s reply
    /// if the call has none.
    fn end(&mut self, end: End, logs: &str, out: &mut dyn CallOutput) {
        if let Some(fd) = self.pipe.as_ref().map(|pipe| pipe.as_raw_fd()) {
            let too_large = self.lines.drain(fd, out);
            self.close_pipe();
            self.after_lines(too_large, out);
        }
        if !self.over {
            out.ended_without_reply(&end);
            out.reply(&end.reply(&self.id, &self.call_id, logs));
            self.over = true;
        }
    }

    /// The call is over once its reply came; a line over the limit before
    /// it ends the call: its child is killed, and the reply says why.
    fn after_lines(&mut self, too_large: Option<TooLarge>, out: &mut dyn CallOutput) {
        if let Some(too_large) = too_large {
            tracing::warn!(
                call = %self.call_id,
                bytes = too_large.bytes,
                "a call's line is over --max-reply-mb; its process is killed"
            );
            self.kill();
            self.close_pipe();
            out.reply(&too_large.reply(&self.id, &self.call_id));
        }
        self.over |= too_large.is_some() || self.lines.replied();
    }

    fn close_pipe(&mut self) {
        self.pipe = None;
        self.lines.clear();
    }
}
