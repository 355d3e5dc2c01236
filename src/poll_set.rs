//! One wait over fds and over processes' exits. An exit is watched by its
//! pidfd where the kernel has them (5.3 on); without one, the wait is cut
//! to [`FALLBACK_POLL_MS`] and the process is asked whether it has exited
//! (`waitid`, not reaping it). Every loop of the runtime that waits for a
//! child's lines and its end waits here, so none forgets the fallback.

use std::os::fd::BorrowedFd;
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, ppoll};
use nix::sys::time::TimeSpec;
use nix::unistd::Pid;

use crate::process::ExitWatch;

/// How often a child's exit is asked about where the kernel has no pidfd.
pub const FALLBACK_POLL_MS: u16 = 50;

/// The longest one wait lasts (a longer limit is cut to it).
const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// What to wait for, then what is ready.
#[derive(Default)]
pub struct PollSet<'a> {
    fds: Vec<PollFd<'a>>,
    entries: Vec<Entry>,
    /// An exit is watched without a pidfd: waits are cut short.
    fallback: bool,
}

/// One thing waited for: its place in the poll, if it has one.
enum Entry {
    Fd(usize),
    Exit { at: Option<usize>, pid: Pid },
}

/// Names what was added, to ask whether it is ready.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Key(usize);

impl<'a> PollSet<'a> {
    pub fn new() -> PollSet<'a> {
        PollSet::default()
    }

    /// Waits for `flags` on `fd` (no flags: only its hang-up and errors).
    pub fn fd(&mut self, fd: BorrowedFd<'a>, flags: PollFlags) -> Key {
        self.fds.push(PollFd::new(fd, flags));
        self.push(Entry::Fd(self.fds.len() - 1))
    }

    /// Waits for `pid`, a child of this process or one `watch` names, to exit.
    pub fn exit(&mut self, pid: Pid, watch: &'a ExitWatch) -> Key {
        let at = watch.fd().map(|fd| {
            self.fds.push(PollFd::new(fd, PollFlags::POLLIN));
            self.fds.len() - 1
        });
        self.fallback |= at.is_none();
        self.push(Entry::Exit { at, pid })
    }

    fn push(&mut self, entry: Entry) -> Key {
        self.entries.push(entry);
        Key(self.entries.len() - 1)
    }

    /// Blocks until something is ready, or for at most `limit` (`None`: no
    /// limit), or [`FALLBACK_POLL_MS`] where an exit has no pidfd. A signal
    /// ends the wait early.
    pub fn wait(&mut self, limit: Option<Duration>) -> std::io::Result<()> {
        let mut limit = limit;
        if self.fallback {
            let fallback = Duration::from_millis(FALLBACK_POLL_MS.into());
            limit = Some(limit.map_or(fallback, |limit| limit.min(fallback)));
        }
        // To the microsecond (a reset resident is looked at again after
        // tens of them), where `poll` would round up to a millisecond.
        let timeout = limit.map(|limit| TimeSpec::from_duration(limit.min(MAX_WAIT)));
        match ppoll(&mut self.fds, timeout, None) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
            Err(error) => Err(error.into()),
        }
    }

    /// After a wait, whether `key` is ready: its fd has any of its flags
    /// (or a hang-up or an error), or its process has exited.
    pub fn ready(&self, key: Key) -> bool {
        match self.entries[key.0] {
            Entry::Fd(at) | Entry::Exit { at: Some(at), .. } => {
                self.fds[at].revents().is_some_and(|r| !r.is_empty())
            }
            Entry::Exit { at: None, pid } => crate::process::has_exited(pid),
        }
    }

    /// Whether `key`'s fd has any of `flags`.
    pub fn has(&self, key: Key, flags: PollFlags) -> bool {
        match self.entries[key.0] {
            Entry::Fd(at) | Entry::Exit { at: Some(at), .. } => {
                self.fds[at].revents().is_some_and(|r| r.intersects(flags))
            }
            Entry::Exit { at: None, .. } => false,
        }
    }
}

/// Waits at most `limit` for `pid` (see [`PollSet::exit`]) to exit;
/// whether it has. It is not reaped.
pub fn wait_exit(pid: Pid, watch: &ExitWatch, limit: Duration) -> bool {
    let deadline = std::time::Instant::now() + limit;
    loop {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let mut set = PollSet::new();
        let exit = set.exit(pid, watch);
        let _ = set.wait(Some(left));
        if set.ready(exit) {
            return true;
        }
        if left.is_zero() {
            return false;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A child's exit is seen with its pidfd and, as on a kernel without
    /// pidfds, with none; it is not reaped by being seen.
    #[test]
    fn an_exit_is_seen_with_or_without_a_pidfd() {
        for with_pidfd in [true, false] {
            let mut child = std::process::Command::new("sleep")
                .arg("30")
                .spawn()
                .expect("sleep runs");
            let pid = Pid::from_raw(child.id() as i32);
            let watch = if with_pidfd {
                ExitWatch::new(pid)
            } else {
                ExitWatch::none()
            };
            assert_eq!(watch.fd().is_some(), with_pidfd);
            assert!(!wait_exit(pid, &watch, Duration::from_millis(120)));
            let (reader, _writer) = nix::unistd::pipe().unwrap();
            let mut set = PollSet::new();
            let pipe = set.fd(std::os::fd::AsFd::as_fd(&reader), PollFlags::POLLIN);
            let exit = set.exit(pid, &watch);
            child.kill().unwrap();
            // A wait with no limit still wakes for the exit.
            while !set.ready(exit) {
                set.wait(None).unwrap();
            }
            assert!(!set.ready(pipe));
            assert!(wait_exit(pid, &watch, Duration::ZERO));
            let status = child.wait().unwrap();
            assert!(!status.success(), "reaped here, not by the wait");
        }
    }
}
