//! Restarting a zygote that can no longer fork safely, without losing
//! anything the peer sent.
//!
//! The issue this solves: a thread that does not stop at fork (one a node's
//! module-level code started, CUDA initialised by a library) cannot be
//! removed from a process. Forking beside it risks children that hang on a
//! lock it held; refusing to fork is refusing every call. The one clean way
//! out is a new process image: the zygote re-executes itself with the same
//! arguments and file descriptors, preloads again, and carries on from a
//! [`Resume`] record: the nodes it had compiled (the one that brought the
//! thread in now loaded in each call's child instead), the request it was
//! serving, and what it had read of the stream but not yet served. Its pid
//! does not change, so the engine's pool never notices.

use std::io::{Read, Seek, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;

use serde::{Deserialize, Serialize};

/// The variable that names the fd holding a [`Resume`] record.
const RESUME_ENV: &str = "FLUKSIO_ZYGOTE_RESUME";

/// A node the previous incarnation had compiled.
#[derive(Debug, Serialize, Deserialize)]
pub struct ResumeNode {
    pub flow: String,
    pub node: String,
    pub source: String,
    /// Whether it was loaded in the zygote (it is loaded again, and checked)
    /// or in each call's child (it stays there).
    pub in_zygote: bool,
}

/// Everything a re-executed zygote needs to carry on.
#[derive(Debug, Default, Serialize, Deserialize)]
pub struct Resume {
    pub nodes: Vec<ResumeNode>,
    /// The request being served when forking became unsafe, if any.
    pub pending: Option<String>,
    /// Bytes read from the request stream and not yet served.
    pub unread: Vec<u8>,
    /// The request and reply streams, by the numbers they had.
    pub request_fd: RawFd,
    pub reply_fd: RawFd,
}

/// Re-executes this binary with the same arguments, handing `resume` over.
/// Returns only if that failed.
pub fn reexec(resume: &Resume) -> std::io::Error {
    match write_record(resume) {
        Ok(record) => {
            for fd in [record.as_raw_fd(), resume.request_fd, resume.reply_fd] {
                inherit(fd);
            }
            let mut args = std::env::args_os();
            let arg0 = args.next().unwrap_or_else(|| "fluksio-zygote".into());
            let mut command = std::process::Command::new("/proc/self/exe");
            command
                .arg0(arg0)
                .args(args)
                .env(RESUME_ENV, record.as_raw_fd().to_string());
            crate::artifacts::reinstate_token_for(&mut command);
            command.exec()
        }
        Err(error) => error,
    }
}

fn write_record(resume: &Resume) -> std::io::Result<OwnedFd> {
    let name = c"fluksio-zygote-resume";
    // SAFETY: memfd_create takes a C string and flags; -1 on failure.
    let fd = unsafe { libc::memfd_create(name.as_ptr(), 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just gave us.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    file.write_all(&serde_json::to_vec(resume)?)?;
    file.rewind()?;
    Ok(file.into())
}

/// Clears close-on-exec, so `fd` survives the exec.
fn inherit(fd: RawFd) {
    if fd >= 0 {
        // SAFETY: fcntl flag change on an fd this process owns.
        unsafe { libc::fcntl(fd, libc::F_SETFD, 0) };
    }
}

/// The record a previous incarnation left, if this process is one resumed.
/// Removes it from the environment, so node code never sees it.
pub fn take() -> Option<Resume> {
    let fd: RawFd = std::env::var(RESUME_ENV).ok()?.parse().ok()?;
    // SAFETY: single-threaded at start-up (the zygote has no other thread,
    // and this runs before the interpreter starts).
    unsafe { std::env::remove_var(RESUME_ENV) };
    // SAFETY: the previous incarnation left this fd open for us alone.
    let mut file = unsafe { std::fs::File::from_raw_fd(fd) };
    let mut text = Vec::new();
    file.read_to_end(&mut text).ok()?;
    let resume: Resume = serde_json::from_slice(&text).ok()?;
    for fd in [resume.request_fd, resume.reply_fd] {
        crate::process::set_cloexec(
            // SAFETY: borrowed only for the fcntl call; the fd stays open.
            unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) },
        );
    }
    Some(resume)
}
