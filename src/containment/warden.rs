//! The warden: ends every call of a process that died without ending them.
//!
//! The issue this solves: a zygote, a worker or an agent SIGKILLed (the
//! pool kills the pid it spawned; an OOM; a person) runs nothing of its
//! own on the way out, and a node that ignores its parent-death signal, or
//! left its session, would live on. The warden is a small process of the
//! same binary (`fluksio-zygote warden DIR…`), exec'd so it holds none of
//! its owner's memory or fds, in a session of its own so a signal to its
//! owner's group spares it. It blocks reading a pipe whose only write end
//! its owner holds (close-on-exec, and closed in every child the owner
//! forks): end of file means the owner is gone, however it went. Then it
//! writes `cgroup.kill` of each subtree, waits for them to empty, removes
//! them, and exits.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use super::cgroup;
use crate::fds::Claimed;

/// The fd the warden reads its owner's pipe on.
const PIPE_FD: i32 = 3;

/// How long the warden waits for killed processes to leave their cgroups
/// (a process in uninterruptible sleep dies when it wakes).
const EMPTY_WAIT: Duration = Duration::from_secs(10);

/// Starts a warden over `dirs`; the returned write end must stay open, and
/// the caller's, for as long as the caller lives.
pub fn spawn(dirs: &[PathBuf]) -> io::Result<Claimed> {
    let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
    let read_fd = read.as_raw_fd();
    let mut command = Command::new(std::env::current_exe()?);
    command
        .arg("warden")
        .args(dirs)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .env_clear();
    // Nobody's child, so the owner's children are its calls alone, and in
    // a session of its own, so a signal to the owner's group spares it.
    crate::process::Start {
        fds: vec![(read_fd, 3)],
        detached: true,
        ..Default::default()
    }
    .on(&mut command);
    // Returns once the warden has exec'd (std waits for the exec through a
    // close-on-exec pipe, which the warden holds until then).
    let mut intermediate = command.spawn()?;
    let _ = intermediate.wait();
    drop(read);
    Ok(Claimed::new(write))
}

/// `fluksio-zygote warden DIR…`: waits for the owner to die, then ends and
/// removes every cgroup under `dirs`.
pub fn main(dirs: &[PathBuf]) -> ExitCode {
    // SAFETY: fd 3 was set up by `spawn` for this process alone.
    let pipe = unsafe { OwnedFd::from_raw_fd(PIPE_FD) };
    if !wait_for_end_of_file(&pipe) {
        // No owner to watch (started by hand?): kill nothing.
        std::mem::forget(pipe);
        eprintln!("fluksio-zygote warden: fd {PIPE_FD} is not its owner's pipe; exiting");
        return ExitCode::from(2);
    }
    for dir in dirs {
        let kill = dir.join("cgroup.kill");
        if kill.exists() {
            let _ = cgroup::write(&kill, "1");
        }
    }
    let deadline = Instant::now() + EMPTY_WAIT;
    for dir in dirs {
        while busy(dir) && Instant::now() < deadline {
            if !dir.join("cgroup.kill").exists() {
                // v1 has no cgroup.kill: kill what it lists, until it lists
                // nothing (a stopped fork bomb cannot outrun this).
                kill_listed(dir);
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        cgroup::remove_tree(dir);
    }
    ExitCode::SUCCESS
}

fn busy(dir: &Path) -> bool {
    if dir.join("cgroup.events").exists() {
        cgroup::populated(dir)
    } else {
        any_procs(dir)
    }
}

/// Whether a v1 cgroup or any cgroup below it has a process.
fn any_procs(dir: &Path) -> bool {
    cgroup::has_procs(dir)
        || std::fs::read_dir(dir).is_ok_and(|entries| {
            entries
                .flatten()
                .any(|e| e.file_type().is_ok_and(|t| t.is_dir()) && any_procs(&e.path()))
        })
}

/// SIGKILL to every process a v1 cgroup and its descendants list.
fn kill_listed(dir: &Path) {
    if let Ok(procs) = std::fs::read_to_string(dir.join("cgroup.procs")) {
        for pid in procs.lines().filter_map(|l| l.trim().parse::<i32>().ok()) {
            // SAFETY: kill(2) with a pid the kernel listed.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
    }
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                kill_listed(&entry.path());
            }
        }
    }
}

/// True at end of file (the owner is gone); false if `pipe` is no pipe.
fn wait_for_end_of_file(pipe: &OwnedFd) -> bool {
    let mut byte = 0u8;
    loop {
        // SAFETY: a one-byte read into a live local.
        let n = unsafe { libc::read(pipe.as_raw_fd(), (&mut byte as *mut u8).cast(), 1) };
        if n == 0 {
            return true;
        }
        if n < 0 {
            let error = io::Error::last_os_error();
            match error.kind() {
                io::ErrorKind::Interrupted => continue,
                // EBADF, EINVAL: nothing to watch.
                _ if matches!(error.raw_os_error(), Some(libc::EBADF | libc::EINVAL)) => {
                    return false;
                }
                _ => return true,
            }
        }
    }
}
