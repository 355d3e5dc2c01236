//! The runtime's own file descriptors, claimed: no call's child keeps one
//! (every fd the runtime opens is claimed, and closed in a child at fork).
//!
//! The request and reply streams of `worker` mode, the pipes, pidfds and
//! wake-up calls of other calls, the cgroup files of other cells, the log
//! buffers of other calls: a child that held one could read another call's
//! request, write into another call's reply, kill another call through its
//! pidfd, or read and forge what another call printed. They are
//! close-on-exec already, which covers a node's `subprocess`; this covers
//! the fork itself. Fds the zygote's Python code opened (a compiled node's
//! module-level `open`, say) are the node's, and are left alone.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};
use std::sync::Mutex;

static OURS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());

/// Marks `fd` as the zygote's own.
pub fn claim(fd: RawFd) {
    OURS.lock().unwrap_or_else(|e| e.into_inner()).push(fd);
}

/// `fd` is being closed: forget it before its number can be reused.
pub fn forget(fd: RawFd) {
    OURS.lock()
        .unwrap_or_else(|e| e.into_inner())
        .retain(|&f| f != fd);
}

/// Claims every fd this process was started with beyond stdio (a build
/// tool's jobserver pipe, whatever its parent leaked): they are its
/// parent's business, never a node's. Call first, before anything opens.
pub fn claim_inherited() {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        return;
    };
    let open: Vec<RawFd> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    for fd in open {
        // The directory being read is one of them; it is closed by now.
        // SAFETY: F_GETFD only asks whether the fd is open.
        if fd > 2 && unsafe { libc::fcntl(fd, libc::F_GETFD) } >= 0 {
            claim(fd);
        }
    }
}

/// Whether `fd` is claimed now.
pub fn is_claimed(fd: RawFd) -> bool {
    OURS.lock().unwrap_or_else(|e| e.into_inner()).contains(&fd)
}

/// In a freshly forked child: closes every fd the zygote claimed.
pub fn close_in_child() {
    let ours = OURS.lock().unwrap_or_else(|e| e.into_inner());
    for &fd in ours.iter() {
        // SAFETY: in the child these are copies nobody else uses.
        unsafe { libc::close(fd) };
    }
}

/// In a node's own zygote, after [`close_in_child`]: those numbers are
/// free again, and what it opens next under them is not claimed.
pub fn closed_all() {
    OURS.lock().unwrap_or_else(|e| e.into_inner()).clear();
}

/// An fd that is the zygote's own for as long as it is open: claimed when
/// made, forgotten just before it is closed.
#[derive(Debug)]
pub struct Claimed(OwnedFd);

impl Claimed {
    pub fn new(fd: OwnedFd) -> Claimed {
        claim(fd.as_raw_fd());
        Claimed(fd)
    }

    /// Back to a plain fd, no longer claimed (it is being handed over).
    pub fn release(self) -> OwnedFd {
        let this = std::mem::ManuallyDrop::new(self);
        forget(this.0.as_raw_fd());
        // SAFETY: `this` is never dropped, so the fd is moved out once.
        unsafe { std::ptr::read(&this.0) }
    }
}

impl AsFd for Claimed {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.0.as_fd()
    }
}

impl AsRawFd for Claimed {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_raw_fd()
    }
}

impl Drop for Claimed {
    fn drop(&mut self) {
        forget(self.0.as_raw_fd());
    }
}

/// Puts `fd` in non-blocking mode: a read takes what is there and returns.
pub fn set_nonblocking(fd: RawFd) {
    // SAFETY: fcntl's flag calls touch no memory; a stale fd gives EBADF.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK);
        }
    }
}

/// Where [`out_of_the_way`] moves an fd: above the low numbers.
const OUT_OF_THE_WAY: RawFd = 100;

/// `fd` moved to 100 or above, close-on-exec, where the fd limit allows
/// (else left where it is; a failed open's `-1` stays one): an fd a
/// resident child keeps for itself beside node code, off the low numbers
/// that node code's own `open` gets first in a fresh child (CPython's
/// `test_closerange` needs two consecutive free fds there).
pub fn out_of_the_way(fd: RawFd) -> RawFd {
    if !(0..OUT_OF_THE_WAY).contains(&fd) {
        return fd;
    }
    // SAFETY: F_DUPFD_CLOEXEC makes a new fd; no existing one changes.
    let moved = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, OUT_OF_THE_WAY) };
    if moved < 0 {
        return fd;
    }
    // SAFETY: the original, which the caller hands over with it.
    unsafe { libc::close(fd) };
    moved
}

/// A private copy of standard stream `fd` (close-on-exec, at 3 or above),
/// for this process's own reading or writing of it once
/// [`shield_standard_streams`] has pointed the stream elsewhere.
pub fn keep_stream(fd: RawFd) -> std::io::Result<OwnedFd> {
    // SAFETY: F_DUPFD_CLOEXEC makes a new fd; no existing one changes.
    let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
    if new < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned, owned here alone.
    Ok(unsafe { std::os::fd::FromRawFd::from_raw_fd(new) })
}

/// Points fd 1 at stderr and, with `stdin`, fd 0 at /dev/null: what a node
/// or its subprocess writes to fd 1 (or reads from fd 0) never touches this
/// process's own streams, which it keeps with [`keep_stream`] first.
pub fn shield_standard_streams(stdin: bool) -> std::io::Result<()> {
    // SAFETY: dup2 onto this process's own standard fds.
    if unsafe { libc::dup2(2, 1) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    if stdin {
        let null = std::fs::File::open("/dev/null")?;
        // SAFETY: as above.
        if unsafe { libc::dup2(null.as_raw_fd(), 0) } < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok(())
}
