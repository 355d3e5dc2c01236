//! Following one call that another process serves, from a thread that may
//! block: a pool slot following the shared zygote, a worker following a
//! node's own zygote.
//!
//! The call's lines come two ways: as `Line` frames (a compile, a refusal),
//! or on the run's own pipe, handed over in a `Pipe` frame and read here.
//! `Ended` says the run's child was reaped: what it wrote is read to the
//! end, and if it wrote no reply, one is written for it that says how it
//! ended. `Done` and `Lost` say nothing more comes. Lines reach `out`
//! with their newline, as a call's lines do everywhere else.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use serde_json::value::RawValue;

use super::{Frame, Received, Receiver};
use crate::end::End;
use crate::lines::{LineBuffer, Piece};
use crate::output::CallOutput;
use crate::protocol;

/// How following a call ended.
pub enum Followed {
    /// The call is over, its reply written.
    Done,
    /// The link closed (the serving process died) before the call was over.
    LinkLost { replied: bool },
}

/// Follows call `ticket` on `link` until it is over, its lines to `out`.
/// `id` and `call_id` are the request's, for a reply written here.
pub fn follow(
    link: BorrowedFd<'_>,
    ticket: u64,
    id: &RawValue,
    call_id: &str,
    out: &mut dyn CallOutput,
) -> Followed {
    let mut receiver = Receiver::default();
    let mut pipe: Option<OwnedFd> = None;
    let mut lines = LineBuffer::new();
    let mut replied = false;
    'call: loop {
        if replied {
            return Followed::Done;
        }
        let (link_ready, pipe_ready) = {
            let mut fds = vec![PollFd::new(link, PollFlags::POLLIN)];
            if let Some(pipe) = &pipe {
                fds.push(PollFd::new(pipe.as_fd(), PollFlags::POLLIN));
            }
            match poll(&mut fds, PollTimeout::NONE) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(_) => return Followed::LinkLost { replied },
            }
            let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
            (ready(&fds[0]), fds.get(1).is_some_and(ready))
        };
        if pipe_ready && let Some(fd) = pipe.as_ref().map(|p| p.as_raw_fd()) {
            match lines.read_fd(fd) {
                Ok(0) | Err(_) => pipe = None,
                Ok(_) => replied |= relay(&mut lines, id, call_id, out),
            }
            continue;
        }
        if !link_ready {
            continue;
        }
        match receiver.receive(link) {
            Ok(Received::Data) | Ok(Received::WouldBlock) => {}
            Ok(Received::Closed) | Err(_) => return Followed::LinkLost { replied },
        }
        while let Ok(Some(frame)) = receiver.next_frame() {
            if frame.ticket() != Some(ticket) {
                // Another call's late news: that call is over.
                continue;
            }
            match frame {
                Frame::Line { mut line, .. } => {
                    // Lines cross the link without their newline.
                    line.push(b'\n');
                    if protocol::is_event(&line) {
                        out.event(&line);
                    } else {
                        out.reply(&line);
                        replied = true;
                    }
                }
                Frame::Pipe { pipe: fd, .. } => pipe = Some(fd),
                Frame::Started { pid, .. } => out.started(nix::unistd::Pid::from_raw(pid)),
                Frame::Ended { end, logs, .. } => {
                    // What it wrote before it ended comes first.
                    if let Some(fd) = pipe.take() {
                        drain(fd.as_raw_fd(), &mut lines);
                        replied |= relay(&mut lines, id, call_id, out);
                    }
                    if !replied {
                        out.reply(&End::Process(end).reply(id, call_id, &logs));
                    }
                    break 'call Followed::Done;
                }
                // Nothing more comes (the process that served it is gone,
                // or never started it): its lines so far, then a reply if
                // it wrote none.
                Frame::Done { .. } | Frame::Lost { .. } => {
                    if let Some(fd) = pipe.take() {
                        drain(fd.as_raw_fd(), &mut lines);
                        replied |= relay(&mut lines, id, call_id, out);
                    }
                    if !replied {
                        let message = match frame {
                            Frame::Lost { message, .. } => message,
                            _ => "the zygote ended the call without a reply".to_string(),
                        };
                        out.reply(&End::Lost(message).reply(id, call_id, ""));
                    }
                    break 'call Followed::Done;
                }
                _ => {}
            }
        }
    }
}

/// Writes every whole line in `lines`; true once the reply went out.
fn relay(lines: &mut LineBuffer, id: &RawValue, call_id: &str, out: &mut dyn CallOutput) -> bool {
    let mut replied = false;
    while let Some(piece) = lines.next_piece() {
        if replied {
            // Nothing after the reply belongs to the call.
            continue;
        }
        match piece {
            Piece::Line(line) => {
                if protocol::is_event(line) {
                    out.event(line);
                } else {
                    out.reply(line);
                    replied = true;
                }
            }
            Piece::TooLarge(too_large) => {
                out.reply(&too_large.reply(id, call_id));
                replied = true;
            }
        }
    }
    replied
}

/// Reads what is left in a pipe whose writer has exited, without waiting
/// for a grandchild that may still hold it.
fn drain(fd: RawFd, lines: &mut LineBuffer) {
    crate::fds::set_nonblocking(fd);
    while matches!(lines.read_fd(fd), Ok(n) if n > 0) {}
}

/// Blocks for a fresh link's first frame: `Ready`, or why not.
pub fn wait_ready(link: BorrowedFd<'_>, receiver: &mut Receiver) -> Result<(), super::NotReady> {
    loop {
        if let Some(ready) = receiver.ready() {
            return ready;
        }
        match receiver.receive(link) {
            Ok(Received::Data) => {}
            Ok(Received::WouldBlock) => {
                let mut fds = [PollFd::new(link, PollFlags::POLLIN)];
                let _ = poll(&mut fds, PollTimeout::NONE);
            }
            Ok(Received::Closed) | Err(_) => return Err(super::NotReady::Closed),
        }
    }
}
