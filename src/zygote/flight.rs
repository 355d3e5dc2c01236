//! One call's child, from the parent's side: its pipe, its exit, its end.
//!
//! The parent reads the child's lines as they come (events, then one reply)
//! and watches for its exit beside the pipe, because a forked grandchild can
//! keep the pipe open after the child died. When the child has exited, what
//! it wrote is drained, its session is killed (anything the node left
//! running), and only then is it reaped, so its pid cannot have been reused
//! by the time the group is signalled.

use std::os::fd::{AsFd, AsRawFd, OwnedFd, RawFd};
use std::time::Instant;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::containment::Cell;
use crate::fds;
use crate::lines::{LineBuffer, Piece, TooLarge};
use crate::output::CallOutput;
use crate::process::{self, ChildEnd, ExitWatch, Reaped};
use crate::protocol;
use fluksio_embed::capture::LogBuffer;

/// A call's child that has been forked and not yet reaped.
pub struct Flight {
    pub pid: Pid,
    pipe: Option<OwnedFd>,
    exit: ExitWatch,
    /// What was read and is not yet a whole line (`crate::lines`).
    pending: LineBuffer,
    /// A line over `--max-reply-mb` ended the call: the child was killed,
    /// and the call's reply is the error this holds.
    too_large: Option<TooLarge>,
    replied: bool,
    logs: Option<LogBuffer>,
    cell: Option<Cell>,
    pub started: Instant,
}

/// A child killed with its cell and not yet reaped. Its cell goes back
/// once it is reaped (dropping it checks it is empty).
pub struct Landing {
    pub pid: Pid,
    pub exit: ExitWatch,
    pub logs: LogBuffer,
    pub cell: Cell,
}

/// A reaped call.
pub struct Landed {
    pub reaped: Reaped,
    /// Whether the child sent its reply before it ended.
    pub replied: bool,
    pub logs: LogBuffer,
    /// Given back when the landed call is dropped.
    pub cell: Cell,
}

impl Flight {
    pub fn new(pid: Pid, pipe: OwnedFd, logs: LogBuffer, cell: Cell, started: Instant) -> Flight {
        Flight {
            pid,
            pipe: Some(pipe),
            exit: ExitWatch::new(pid),
            pending: LineBuffer::new(),
            too_large: None,
            replied: false,
            logs: Some(logs),
            cell: Some(cell),
            started,
        }
    }

    /// Kills everything the call started: its session and its cell.
    fn kill_all(&self) {
        process::kill_group(self.pid, Signal::SIGKILL);
        if let Some(cell) = &self.cell {
            cell.kill();
        }
    }

    /// The call's lines read so far, held across a fork (`crate::scrub`).
    pub fn held(&self) -> crate::scrub::Held {
        self.pending.held()
    }

    /// Readies the flight of a resident child for its next call.
    pub fn rearm(&mut self) {
        self.replied = false;
        self.started = Instant::now();
    }

    /// Gives the pipe away: its lines are read elsewhere (by the agent).
    pub fn take_pipe(&mut self) -> Option<OwnedFd> {
        let pipe = self.pipe.take()?;
        fds::forget(pipe.as_raw_fd());
        Some(pipe)
    }

    /// What to poll for this flight's lines: its pipe, while open.
    pub fn pipe_poll(&self) -> Option<PollFd<'_>> {
        self.pipe
            .as_ref()
            .map(|pipe| PollFd::new(pipe.as_fd(), PollFlags::POLLIN))
    }

    /// What to poll for this flight's exit: its pidfd, where there is one.
    /// Without one, poll every [`FALLBACK_POLL_MS`] and ask [`Flight::has_exited`].
    pub fn exit_poll(&self) -> Option<PollFd<'_>> {
        self.exit.fd().map(|fd| PollFd::new(fd, PollFlags::POLLIN))
    }

    /// Whether the child has exited (it may not be reaped yet).
    pub fn has_exited(&self) -> bool {
        process::has_exited(self.pid)
    }

    /// Waits at most `limit` for the child to exit; whether it did.
    pub fn wait_exit(&self, limit: std::time::Duration) -> bool {
        let deadline = Instant::now() + limit;
        loop {
            if self.has_exited() {
                return true;
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return false;
            }
            let step = PollTimeout::from((left.as_millis().max(1) as u16).min(FALLBACK_POLL_MS));
            match self.exit_poll() {
                Some(exit) => {
                    let _ = poll(&mut [exit], step);
                }
                None => std::thread::sleep(std::time::Duration::from_millis(1)),
            }
        }
    }

    /// Reads what the child wrote so far and hands over every whole line.
    /// Blocks only if nothing is there yet; call after poll said readable.
    pub fn read(&mut self, out: &mut dyn CallOutput) {
        let Some(fd) = self.pipe.as_ref().map(|p| p.as_raw_fd()) else {
            return;
        };
        match read_into(fd, &mut self.pending) {
            Some(0) | None => self.close_pipe(),
            Some(_) => self.hand_over_lines(out),
        }
    }

    /// EOF (or a broken pipe): half a line is no line at all.
    fn close_pipe(&mut self) {
        if let Some(pipe) = self.pipe.take() {
            fds::forget(pipe.as_raw_fd());
        }
        self.pending.clear();
    }

    /// Hands over the whole lines read so far. Each byte is searched for
    /// its newline once (a reply of hundreds of MB comes in thousands of
    /// reads); a line over the limit kills the call (see [`Flight::too_large`]).
    fn hand_over_lines(&mut self, out: &mut dyn CallOutput) {
        while let Some(piece) = self.pending.next_piece() {
            let line = match piece {
                Piece::Line(line) => line,
                Piece::TooLarge(too_large) => {
                    if !self.replied {
                        tracing::warn!(
                            pid = self.pid.as_raw(),
                            bytes = too_large.bytes,
                            "a call's line is over --max-reply-mb; its process is killed"
                        );
                        self.too_large = Some(too_large);
                        self.kill_all();
                        self.close_pipe();
                    }
                    return;
                }
            };
            if self.replied {
                // Nothing after the reply belongs to the call.
                continue;
            }
            if protocol::is_event(line) {
                out.event(line);
            } else {
                self.replied = true;
                out.reply(line);
            }
        }
    }

    /// The line over `--max-reply-mb` that ended the call, if one did: the
    /// child was killed then, and the call has no reply yet (the one who
    /// lands it answers with [`TooLarge::reply`]).
    pub fn too_large(&self) -> Option<TooLarge> {
        self.too_large
    }

    /// Waits for the child's own exit (a trial's verdict is its exit code,
    /// so it must not be killed first), drains what it left in its pipe,
    /// kills its session, reaps it.
    pub fn land(mut self, out: &mut dyn CallOutput) -> std::io::Result<Landed> {
        process::wait_exited(self.pid)?;
        if let Some(fd) = self.pipe.as_ref().map(|p| p.as_raw_fd()) {
            // What is in the pipe now is all the child wrote; a grandchild
            // holding the write end must not keep us waiting for more.
            crate::fds::set_nonblocking(fd);
            while !self.replied {
                match read_into(fd, &mut self.pending) {
                    Some(n) if n > 0 => self.hand_over_lines(out),
                    _ => break,
                }
            }
            self.close_pipe();
        }
        self.kill_all();
        let mut reaped = process::reap(self.pid)?;
        let cell = self.cell.take().expect("a flight lands once");
        if reaped.end == ChildEnd::Signaled(Signal::SIGKILL)
            && let Some(limit) = cell.exceeded_memory_limit()
        {
            reaped.end = ChildEnd::OverMemoryLimit(limit);
        }
        tracing::debug!(
            pid = self.pid.as_raw(),
            user_ms = reaped.user_time.as_millis() as u64,
            system_ms = reaped.system_time.as_millis() as u64,
            max_rss_kib = reaped.max_rss_kib,
            "a call's process {}",
            reaped.end
        );
        Ok(Landed {
            reaped,
            replied: self.replied,
            logs: self.logs.take().expect("a flight lands once"),
            cell,
        })
    }

    /// Follows the call until its reply (true) or until its child exited
    /// without one (false); either way, it is then the caller's to land.
    pub fn follow_to_reply(&mut self, out: &mut dyn CallOutput) -> std::io::Result<bool> {
        self.follow_for(out, None)
            .map(|ended| ended.expect("no limit, so it ended"))
    }

    /// [`Flight::follow_to_reply`], for at most `limit`: `None` if the call
    /// is still running then.
    pub fn follow_for(
        &mut self,
        out: &mut dyn CallOutput,
        limit: Option<std::time::Duration>,
    ) -> std::io::Result<Option<bool>> {
        let deadline = limit.map(|limit| Instant::now() + limit);
        loop {
            if self.replied {
                return Ok(Some(true));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|left| left.is_zero()) {
                return Ok(None);
            }
            let (pipe_ready, exit_ready) = {
                let pipe = self.pipe_poll();
                let exit = self.exit_poll();
                let timeout = match (left, exit.is_some()) {
                    (Some(left), true) => PollTimeout::try_from(left.as_millis().max(1) as u64)
                        .unwrap_or(PollTimeout::MAX),
                    (Some(left), false) => {
                        PollTimeout::from((left.as_millis().max(1) as u16).min(FALLBACK_POLL_MS))
                    }
                    (None, true) => PollTimeout::NONE,
                    (None, false) => PollTimeout::from(FALLBACK_POLL_MS),
                };
                let watching_pipe = pipe.is_some();
                let mut fds: Vec<PollFd<'_>> = pipe.into_iter().chain(exit).collect();
                match poll(&mut fds, timeout) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(e) => return Err(e.into()),
                }
                let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
                let pipe_ready = watching_pipe && fds.first().is_some_and(ready);
                let exit_ready = self.exit.fd().is_some() && fds.last().is_some_and(ready);
                (pipe_ready, exit_ready)
            };
            if pipe_ready {
                self.read(out);
            }
            if !self.replied && (exit_ready || (self.exit.fd().is_none() && self.has_exited())) {
                return Ok(Some(false));
            }
        }
    }

    /// Gives up on a call that has replied: its session is killed now (the
    /// child, about to exit anyway, and whatever it started); the pid, not
    /// yet reaped, and the log buffer come back for a later reap.
    pub fn abandon(mut self) -> Landing {
        self.kill_all();
        self.close_pipe();
        Landing {
            pid: self.pid,
            exit: std::mem::replace(&mut self.exit, ExitWatch::none()),
            logs: self.logs.take().expect("a flight lands once"),
            cell: self.cell.take().expect("a flight lands once"),
        }
    }
}

/// How often a child's exit is asked about where the kernel has no pidfd.
pub const FALLBACK_POLL_MS: u16 = 50;

impl Drop for Flight {
    fn drop(&mut self) {
        if let Some(pipe) = &self.pipe {
            fds::forget(pipe.as_raw_fd());
        }
    }
}

/// One read appended to `lines`; `None` on an error other than EINTR
/// (EAGAIN included).
fn read_into(fd: RawFd, lines: &mut LineBuffer) -> Option<usize> {
    lines.read_fd(fd).ok()
}
