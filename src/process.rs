//! Process control: how a child ended, its process group, waiting on it.
//!
//! The issues this solves:
//! 1. A reply has to say how a call's process ended without a reply
//!    (`exited with code 3`, `killed by SIGSEGV`). That is [`ChildEnd`], one
//!    enum that every such message is rendered from, never a string assembled
//!    on the way.
//! 2. A node may leave processes behind (a subprocess, a `multiprocessing`
//!    pool). Every call's child leads its own session, so ending the call is
//!    one `killpg`; [`kill_group`] does it while the leader is still a zombie,
//!    before its pid can be reused.
//! 3. Waiting on a pipe alone is not enough: a forked grandchild can hold the
//!    write end open after the child died. [`ExitWatch`] is a pidfd, readable
//!    when the child exits, polled beside the pipe.

use std::fmt;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::time::Duration;

use nix::sys::signal::Signal;
use nix::unistd::Pid;

use crate::fds::Claimed;

/// How a child process ended, as its parent saw it when reaping it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildEnd {
    /// `_exit(code)`, `sys.exit(code)`, or returning normally (code 0).
    Exited(i32),
    /// Ended by a signal: a crash (SIGSEGV, SIGABRT) or a kill.
    Signaled(Signal),
    /// Killed by the kernel's OOM killer for going over the call's memory
    /// limit (`--call-memory-limit`, MiB).
    OverMemoryLimit(u64),
}

impl ChildEnd {
    fn from_wait_status(status: libc::c_int) -> ChildEnd {
        if libc::WIFSIGNALED(status) {
            let signal = Signal::try_from(libc::WTERMSIG(status)).unwrap_or(Signal::SIGKILL);
            ChildEnd::Signaled(signal)
        } else {
            ChildEnd::Exited(libc::WEXITSTATUS(status))
        }
    }
}

impl fmt::Display for ChildEnd {
    /// Reads after "the node process": `exited with code 3`,
    /// `was killed by SIGSEGV (segmentation fault)`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ChildEnd::Exited(code) => write!(f, "exited with code {code}"),
            ChildEnd::Signaled(signal) => {
                write!(f, "was killed by {}", signal.as_str())?;
                match signal_meaning(*signal) {
                    Some(meaning) => write!(f, " ({meaning})"),
                    None => Ok(()),
                }
            }
            ChildEnd::OverMemoryLimit(mib) => write!(
                f,
                "exceeded the call's memory limit of {mib} MiB and was killed"
            ),
        }
    }
}

/// What a node author reads a signal as; the name alone means little to most.
fn signal_meaning(signal: Signal) -> Option<&'static str> {
    Some(match signal {
        Signal::SIGSEGV => "segmentation fault",
        Signal::SIGABRT => "aborted",
        Signal::SIGBUS => "bus error",
        Signal::SIGFPE => "arithmetic error",
        Signal::SIGILL => "illegal instruction",
        Signal::SIGKILL => "killed",
        Signal::SIGTERM => "terminated",
        _ => return None,
    })
}

/// A reaped child: how it ended and what it used.
#[derive(Debug, Clone, Copy)]
pub struct Reaped {
    pub end: ChildEnd,
    pub user_time: Duration,
    pub system_time: Duration,
    /// Peak resident set size, in KiB.
    pub max_rss_kib: i64,
}

/// Reaps `pid`, blocking until it has exited. Retries on EINTR.
pub fn reap(pid: Pid) -> io::Result<Reaped> {
    let mut status: libc::c_int = 0;
    // SAFETY: rusage is plain data the kernel fills in; zeroed is a valid value.
    let mut usage: libc::rusage = unsafe { std::mem::zeroed() };
    loop {
        // SAFETY: pointers to live locals; wait4 writes only through them.
        let done = unsafe { libc::wait4(pid.as_raw(), &mut status, 0, &mut usage) };
        if done == pid.as_raw() {
            crate::containment::strays::forget(done);
            break;
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
    let time = |t: libc::timeval| {
        Duration::from_secs(t.tv_sec as u64) + Duration::from_micros(t.tv_usec as u64)
    };
    Ok(Reaped {
        end: ChildEnd::from_wait_status(status),
        user_time: time(usage.ru_utime),
        system_time: time(usage.ru_stime),
        max_rss_kib: usage.ru_maxrss,
    })
}

/// `waitid` for `pid`'s exit, leaving it unreaped (`WNOWAIT`): the zombie
/// keeps its pid, so its process group can still be signalled safely.
/// Whether it has exited (always true without `WNOHANG` in `flags`).
fn wait_unreaped(pid: Pid, flags: libc::c_int) -> io::Result<bool> {
    waitid(
        libc::P_PID,
        pid.as_raw() as libc::id_t,
        libc::WEXITED | libc::WNOWAIT | flags,
    )
}

/// `waitid(2)`, retried when interrupted: whether a child's exit was
/// reported (never, under `WNOHANG`, while it still runs).
fn waitid(idtype: libc::idtype_t, id: libc::id_t, flags: libc::c_int) -> io::Result<bool> {
    loop {
        // SAFETY: siginfo_t is plain data; zeroed is valid and waitid fills it in.
        let mut info: libc::siginfo_t = unsafe { std::mem::zeroed() };
        // SAFETY: a pointer to a live local.
        let done = unsafe { libc::waitid(idtype, id, &mut info, flags) };
        if done == 0 {
            // SAFETY: waitid succeeded, so si_pid is set (0 when nothing changed).
            return Ok(unsafe { info.si_pid() } != 0);
        }
        let error = io::Error::last_os_error();
        if error.kind() != io::ErrorKind::Interrupted {
            return Err(error);
        }
    }
}

/// Whether `pid` has exited, without reaping it.
pub fn has_exited(pid: Pid) -> bool {
    wait_unreaped(pid, libc::WNOHANG).unwrap_or(false)
}

/// Blocks until `pid` has exited, without reaping it.
pub fn wait_exited(pid: Pid) -> io::Result<()> {
    wait_unreaped(pid, 0).map(|_| ())
}

/// Signals every process in the group `leader` leads, and `leader` itself:
/// a child forked a moment ago may not have called `setsid` yet, and its
/// group does not exist until it has. Gone already is fine.
pub fn kill_group(leader: Pid, signal: Signal) {
    let _ = nix::sys::signal::killpg(leader, signal);
    let _ = nix::sys::signal::kill(leader, signal);
}

/// SIGKILL through a pidfd: it names exactly its process, never one that
/// took a reused pid. Gone already is fine.
pub fn pidfd_kill(pidfd: BorrowedFd<'_>) {
    // SAFETY: pidfd_send_signal on a live fd; no pointers but a null siginfo.
    unsafe {
        libc::syscall(
            libc::SYS_pidfd_send_signal,
            pidfd.as_raw_fd(),
            libc::SIGKILL,
            std::ptr::null::<libc::siginfo_t>(),
            0,
        );
    }
}

/// Reaps the process of `pidfd` if it is this process's child (an orphan
/// that came to this subreaper), waiting at most 2 s for it to exit; not
/// one: nothing to do.
pub fn reap_orphan(pidfd: BorrowedFd<'_>) {
    let deadline = std::time::Instant::now() + Duration::from_secs(2);
    // P_PIDFD names the process by the fd, never by a pid; not a child of
    // this process: ECHILD.
    let id = pidfd.as_raw_fd() as libc::id_t;
    while let Ok(false) = waitid(libc::P_PIDFD, id, libc::WEXITED | libc::WNOHANG) {
        if std::time::Instant::now() >= deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Readable once a child has exited: a pidfd, where the kernel has them.
pub struct ExitWatch {
    /// Claimed: a call's child must never hold another call's pidfd, which
    /// would let it signal that call's process.
    fd: Option<Claimed>,
}

impl ExitWatch {
    /// Kernels before 5.3 have no pidfd; the watch is then empty and callers
    /// fall back to asking [`has_exited`] on a short poll timeout.
    pub fn new(pid: Pid) -> ExitWatch {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid.as_raw(), 0) };
        let fd = (fd >= 0).then(|| {
            // SAFETY: the kernel just returned this fd to us; nobody else owns it.
            let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
            set_cloexec(fd.as_fd());
            Claimed::new(fd)
        });
        ExitWatch { fd }
    }

    /// A watch by a pidfd opened elsewhere (by the process's parent).
    pub fn from_pidfd(pidfd: OwnedFd) -> ExitWatch {
        set_cloexec(pidfd.as_fd());
        ExitWatch {
            fd: Some(Claimed::new(pidfd)),
        }
    }

    /// A watch with nothing to watch: ask [`has_exited`] instead.
    pub fn none() -> ExitWatch {
        ExitWatch { fd: None }
    }

    /// The pidfd itself, for a caller that waits on it its own way.
    pub fn into_fd(self) -> Option<OwnedFd> {
        self.fd.map(Claimed::release)
    }

    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        self.fd.as_ref().map(|fd| fd.as_fd())
    }
}

/// What a helper process the runtime starts (its zygote, a warden, a
/// service, the metrics server) has done to it between its fork and its
/// exec. One place, so every such call there is async-signal-safe.
#[derive(Debug, Default)]
pub struct Start {
    /// `(fd, at)`: `fd` of this process becomes the child's `at`, open
    /// across its exec. In order: an `at` must not be a later `fd`.
    pub fds: Vec<(std::os::fd::RawFd, std::os::fd::RawFd)>,
    /// A cell's `cgroup.procs`: the child joins the cell before its exec.
    pub join_cell: Option<std::os::fd::RawFd>,
    /// A session of its own.
    pub own_session: bool,
    /// SIGKILLed when this process dies (and not started if it already has).
    pub dies_with_parent: bool,
    /// Nobody's child here: forked once more, the middle process exiting,
    /// so it outlives its starter. `spawn` returns once it has exec'd; the
    /// child to wait for is the middle process.
    pub detached: bool,
}

impl Start {
    /// Sets this up to run in `command`'s child before its exec.
    pub fn on(self, command: &mut std::process::Command) {
        use std::os::unix::process::CommandExt;
        // SAFETY: getpid has no preconditions.
        let parent = unsafe { libc::getpid() };
        // SAFETY: between fork and exec only dup2, fcntl, write, fork,
        // _exit, setsid, prctl and getppid, all async-signal-safe; nothing
        // allocates (the fds were moved in before the fork).
        unsafe {
            command.pre_exec(move || {
                for &(fd, at) in &self.fds {
                    // dup2 onto itself would keep close-on-exec set.
                    let moved = if fd == at {
                        libc::fcntl(at, libc::F_SETFD, 0)
                    } else {
                        libc::dup2(fd, at)
                    };
                    if moved < 0 {
                        return Err(io::Error::last_os_error());
                    }
                }
                if let Some(procs) = self.join_cell {
                    libc::write(procs, b"0".as_ptr().cast(), 1);
                }
                if self.detached {
                    match libc::fork() {
                        -1 => return Err(io::Error::last_os_error()),
                        0 => {}
                        _ => libc::_exit(0),
                    }
                }
                if self.own_session || self.detached {
                    libc::setsid();
                }
                if self.dies_with_parent {
                    libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                }
                Ok(())
            });
        }
    }
}

/// Marks an fd close-on-exec, so a node's `subprocess` never inherits it.
pub fn set_cloexec(fd: BorrowedFd<'_>) {
    // SAFETY: fcntl on a valid fd; F_SETFD only changes its flags.
    unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
}

/// Ends this process at once: no atexit handler, no destructor, no flush
/// of buffers it inherited (what a call's child must not write twice).
pub fn exit_now(code: i32) -> ! {
    // SAFETY: _exit ends the process at once; nothing of ours needs to run.
    unsafe { libc::_exit(code) }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_and_signal_read_as_a_node_author_would() {
        assert_eq!(ChildEnd::Exited(3).to_string(), "exited with code 3");
        assert_eq!(
            ChildEnd::Signaled(Signal::SIGSEGV).to_string(),
            "was killed by SIGSEGV (segmentation fault)"
        );
        assert_eq!(
            ChildEnd::Signaled(Signal::SIGUSR1).to_string(),
            "was killed by SIGUSR1"
        );
    }
}
