//! One call's child, from the parent's side: its pipe, its exit, its end.
//!
//! The parent reads the child's lines as they come (events, then one reply)
//! and watches for its exit beside the pipe, because a forked grandchild can
//! keep the pipe open after the child died. When the child has exited, what
//! it wrote is drained, its session is killed (anything the node left
//! running), and only then is it reaped, so its pid cannot have been reused
//! by the time the group is signalled.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::time::Instant;

use nix::poll::PollFlags;
use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::containment::Cell;
use crate::fds;
use crate::lines::TooLarge;
use crate::output::{CallLines, CallOutput};
use crate::poll_set::{Key, PollSet};
use crate::process::{self, ChildEnd, ExitWatch, Reaped};
use fluksio_embed::capture::LogBuffer;

/// A call's child that has been forked and not yet reaped.
pub struct Flight {
    pub pid: Pid,
    pipe: Option<OwnedFd>,
    exit: ExitWatch,
    lines: CallLines,
    /// A line over `--max-reply-mb` ended the call: the child was killed,
    /// and the call's reply is the error this holds.
    too_large: Option<TooLarge>,
    logs: Option<LogBuffer>,
    cell: Option<Cell>,
    pub started: Instant,
}

/// What a flight waits for, in a [`PollSet`].
pub struct Watched {
    /// Its pipe, while open.
    pub pipe: Option<Key>,
    pub exit: Key,
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
            lines: CallLines::new(),
            too_large: None,
            logs: Some(logs),
            cell: Some(cell),
            started,
        }
    }

    /// What the child has reported so far in its log buffer, taken out
    /// (a resident's, after each call: `super::learn`).
    pub fn take_report(&self) -> Vec<u8> {
        self.logs
            .as_ref()
            .map(LogBuffer::take_report)
            .unwrap_or_default()
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
        self.lines.held()
    }

    /// Readies the flight of a resident child for its next call.
    pub fn rearm(&mut self) {
        self.lines.rearm();
        self.started = Instant::now();
    }

    /// Whether anything its child wrote waits unread: in its pipe, or read
    /// and not a whole line yet.
    pub fn has_unread(&self) -> bool {
        let Some(pipe) = &self.pipe else {
            return self.lines.holds_part();
        };
        let mut unread: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int, here a local, for an open pipe.
        let done = unsafe { libc::ioctl(pipe.as_raw_fd(), libc::FIONREAD, &mut unread) };
        done != 0 || unread > 0 || self.lines.holds_part()
    }

    /// Gives the pipe away: its lines are read elsewhere (by the agent).
    pub fn take_pipe(&mut self) -> Option<OwnedFd> {
        let pipe = self.pipe.take()?;
        fds::forget(pipe.as_raw_fd());
        Some(pipe)
    }

    /// Adds what to wait for to `set`: this flight's pipe, while open,
    /// and its exit.
    pub fn watch<'a>(&'a self, set: &mut PollSet<'a>) -> Watched {
        Watched {
            pipe: self
                .pipe
                .as_ref()
                .map(|pipe| set.fd(pipe.as_fd(), PollFlags::POLLIN)),
            exit: set.exit(self.pid, &self.exit),
        }
    }

    /// Adds its exit (alone) to what `set` waits for.
    pub fn watch_exit<'a>(&'a self, set: &mut PollSet<'a>) -> Key {
        set.exit(self.pid, &self.exit)
    }

    /// Waits at most `limit` for the child to exit; whether it did.
    pub fn wait_exit(&self, limit: std::time::Duration) -> bool {
        crate::poll_set::wait_exit(self.pid, &self.exit, limit)
    }

    /// Reads what the child wrote so far and hands over every whole line.
    /// Blocks only if nothing is there yet; call after poll said readable.
    pub fn read(&mut self, out: &mut dyn CallOutput) {
        let Some(fd) = self.pipe.as_ref().map(|p| p.as_raw_fd()) else {
            return;
        };
        match self.lines.read_fd(fd) {
            Ok(0) | Err(_) => self.close_pipe(),
            Ok(_) => {
                let too_large = self.lines.hand_over(out);
                self.end_if_too_large(too_large);
            }
        }
    }

    /// EOF (or a broken pipe): half a line is no line at all.
    fn close_pipe(&mut self) {
        if let Some(pipe) = self.pipe.take() {
            fds::forget(pipe.as_raw_fd());
        }
        self.lines.clear();
    }

    /// A line over `--max-reply-mb` ends the call: its child is killed,
    /// and its reply is the error kept here (see [`Flight::too_large`]).
    fn end_if_too_large(&mut self, too_large: Option<TooLarge>) {
        if let Some(too_large) = too_large {
            tracing::warn!(
                pid = self.pid.as_raw(),
                bytes = too_large.bytes,
                "a call's line is over --max-reply-mb; its process is killed"
            );
            self.too_large = Some(too_large);
            self.kill_all();
            self.close_pipe();
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
            // What is in the pipe now is all the child wrote.
            let too_large = self.lines.drain(fd, out);
            self.end_if_too_large(too_large);
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
            replied: self.lines.replied(),
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
            if self.lines.replied() {
                return Ok(Some(true));
            }
            let left = deadline.map(|d| d.saturating_duration_since(Instant::now()));
            if left.is_some_and(|left| left.is_zero()) {
                return Ok(None);
            }
            let (pipe_ready, exit_ready) = {
                let mut set = PollSet::new();
                let watched = self.watch(&mut set);
                set.wait(left)?;
                (
                    watched.pipe.is_some_and(|pipe| set.ready(pipe)),
                    set.ready(watched.exit),
                )
            };
            if pipe_ready {
                self.read(out);
            }
            if !self.lines.replied() && exit_ready {
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

impl Drop for Flight {
    fn drop(&mut self) {
        if let Some(pipe) = &self.pipe {
            fds::forget(pipe.as_raw_fd());
        }
    }
}
