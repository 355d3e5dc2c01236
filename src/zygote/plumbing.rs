//! The zygote's own file descriptors, which no call's child may keep.
//!
//! The request and reply streams of `worker` mode, the pipes of other calls
//! in flight: a child that held one could read another call's request, write
//! into another call's reply, or keep a pipe open after its reader expects
//! EOF. They are close-on-exec already, which covers a node's `subprocess`;
//! this covers the fork itself. Fds the zygote's Python code opened (a
//! preloaded module's file, say) are not ours and are left alone.

use std::os::fd::RawFd;
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

/// In a freshly forked child: closes every fd the zygote claimed.
pub fn close_in_child() {
    let ours = OURS.lock().unwrap_or_else(|e| e.into_inner());
    for &fd in ours.iter() {
        // SAFETY: in the child these are copies nobody else uses.
        unsafe { libc::close(fd) };
    }
}
