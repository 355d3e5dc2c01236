//! Files a resident keeps open across its calls, each checked to be the
//! file it was opened on before it is used.
//!
//! A call shares the process's fd table: `os.dup2` puts a file of its own
//! at any number. In place of `/proc/self`, a directory it made would
//! answer every check of the state with what the state was before the
//! call, and the call's fd, working directory and umask would pass to the
//! next call unseen (`tests/reset.rs`:
//! `a_call_that_puts_its_own_files_at_the_runtimes_kept_fds_is_retired`).
//! `fstat` names the file an fd holds now: its device and inode are no
//! other file's, and no call can make them.
//!
//! The `/proc/self` files read after every call are opened once, here
//! ([`ProcSelf`]): opening and closing one costs more than reading it.

use std::ffi::CStr;
use std::os::fd::RawFd;

/// `fcntl`'s: the signal an fd's `SIGIO` is sent as (Linux; not in libc).
pub const F_GETSIG: libc::c_int = 11;

/// An fd kept open across calls, and what it was when opened.
#[derive(Debug)]
pub struct Pinned {
    fd: RawFd,
    /// What it was opened on, for a reader.
    name: &'static str,
    opened: Identity,
    /// Whether its inode's change time is part of what it is: a `/proc`
    /// file's never changes; a memfd's moves as its pages are read in.
    fixed_time: bool,
}

/// What an fd holds and how: the file (device, inode, and the inode's
/// change time: `/proc` numbers its inodes from a counter that wraps), its
/// offset (the runtime reads with `pread`, and rewinds a directory it
/// lists, so it stays where it was opened), its status flags, whether it
/// closes on exec, and who gets its `SIGIO`, as which signal. A call can
/// set each of these on the runtime's fd, and the next call read it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Identity {
    dev: u64,
    ino: u64,
    changed: (i64, i64),
    offset: i64,
    status_flags: i32,
    fd_flags: i32,
    owner: i32,
    signal: i32,
}

impl Identity {
    /// `fd`'s, or `None` if it is not open; its change time only where
    /// `with_time`.
    fn of(fd: RawFd, with_time: bool) -> Option<Identity> {
        // SAFETY: fstat into a zeroed struct; lseek's and fcntl's reads
        // touch no memory.
        unsafe {
            let mut stat: libc::stat = std::mem::zeroed();
            if libc::fstat(fd, &mut stat) != 0 {
                return None;
            }
            Some(Identity {
                dev: stat.st_dev,
                ino: stat.st_ino,
                changed: if with_time {
                    (stat.st_ctime, stat.st_ctime_nsec)
                } else {
                    (0, 0)
                },
                // -1 where it has none (an `O_PATH` fd).
                offset: libc::lseek(fd, 0, libc::SEEK_CUR),
                status_flags: libc::fcntl(fd, libc::F_GETFL),
                fd_flags: libc::fcntl(fd, libc::F_GETFD),
                owner: libc::fcntl(fd, libc::F_GETOWN),
                signal: libc::fcntl(fd, F_GETSIG),
            })
        }
    }
}

/// A pinned fd that no longer holds what it was opened on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Replaced {
    pub fd: RawFd,
    pub name: &'static str,
}

impl std::fmt::Display for Replaced {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "fd {}, where the runtime keeps {}, was changed (another file put there, \
             or its offset, flags or signal owner)",
            self.fd, self.name
        )
    }
}

impl Pinned {
    /// Opens `path` (below `dir`'s directory, or absolute) with `flags`,
    /// close-on-exec, above the fds node code opens at.
    pub fn open(
        dir: Option<&Pinned>,
        path: &'static CStr,
        flags: libc::c_int,
    ) -> std::io::Result<Pinned> {
        let at = dir.map_or(libc::AT_FDCWD, |dir| dir.fd);
        // SAFETY: openat with a NUL-terminated path.
        let fd = unsafe { libc::openat(at, path.as_ptr(), flags | libc::O_CLOEXEC) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Pinned::pin(fd, path.to_str().unwrap_or("a file"), true)
    }

    /// Pins `fd`, just opened and handed over: a file outside `/proc`,
    /// whose change time is not part of what it is.
    pub fn adopt(fd: RawFd, name: &'static str) -> std::io::Result<Pinned> {
        Pinned::pin(fd, name, false)
    }

    fn pin(fd: RawFd, name: &'static str, fixed_time: bool) -> std::io::Result<Pinned> {
        let fd = crate::fds::out_of_the_way(fd);
        let Some(opened) = Identity::of(fd, fixed_time) else {
            return Err(std::io::Error::last_os_error());
        };
        Ok(Pinned {
            fd,
            name,
            opened,
            fixed_time,
        })
    }

    /// Takes what it holds now as what it was opened on: after the
    /// runtime's own change to the file (the snapshot's memfd, sized and
    /// sealed once it is taken).
    pub fn settle(&mut self) -> std::io::Result<()> {
        self.opened =
            Identity::of(self.fd, self.fixed_time).ok_or_else(std::io::Error::last_os_error)?;
        Ok(())
    }

    /// Its number, unchecked: for telling it apart in a listing of fds.
    pub fn number(&self) -> RawFd {
        self.fd
    }

    /// What it was opened on.
    pub fn name(&self) -> &'static str {
        self.name
    }

    /// The device and inode of the file it was opened on.
    pub fn inode(&self) -> (u64, u64) {
        (self.opened.dev, self.opened.ino)
    }

    /// Reads the whole file from its start into `into` (a file below
    /// `/proc` is made anew by a read from offset 0).
    pub fn read_all(&self, into: &mut Vec<u8>) -> std::io::Result<()> {
        let fd = self
            .fd()
            .map_err(|replaced| std::io::Error::other(replaced.to_string()))?;
        read_whole(fd, into)
    }

    /// The fd, where it still holds what it was opened on, as it was then.
    /// No allocation: the put-back checks its fds while the heap is the
    /// call's.
    pub fn fd(&self) -> Result<RawFd, Replaced> {
        if Identity::of(self.fd, self.fixed_time) == Some(self.opened) {
            Ok(self.fd)
        } else {
            Err(Replaced {
                fd: self.fd,
                name: self.name,
            })
        }
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        // Only where it is still ours: a number a call reused is not.
        if self.fd().is_ok() {
            // SAFETY: the fd this pins, checked to be the one it opened.
            unsafe { libc::close(self.fd) };
        }
    }
}

/// The files below `/proc/self` the state is read from after every call,
/// open.
#[derive(Debug)]
pub struct ProcSelf {
    /// `/proc/self` itself (`O_PATH`): links and fdinfo are read below it.
    pub dir: Pinned,
    /// `fd`, listed after every call.
    pub fds: Pinned,
    /// `ns`, listed after every call.
    pub namespaces: Pinned,
    /// `task`: its threads.
    pub tasks: Pinned,
    pub status: Pinned,
    pub environ: Pinned,
    pub cmdline: Pinned,
    pub comm: Pinned,
    pub timers: Pinned,
    pub cgroup: Pinned,
    pub oom_score_adj: Pinned,
    /// `task/PID/children`, this thread's children (the only thread).
    pub children: Pinned,
    /// `/proc/locks`: every file lock on the machine.
    pub locks: Pinned,
}

impl ProcSelf {
    /// Opens them all.
    pub fn open() -> std::io::Result<ProcSelf> {
        let dir = Pinned::open(None, c"/proc/self", libc::O_PATH | libc::O_DIRECTORY)?;
        let listed = |path| Pinned::open(Some(&dir), path, libc::O_RDONLY | libc::O_DIRECTORY);
        let read = |path| Pinned::open(Some(&dir), path, libc::O_RDONLY);
        let children = {
            // SAFETY: gettid has no failure.
            let tid = unsafe { libc::gettid() };
            let path = format!("task/{tid}/children\0");
            // SAFETY: openat with the NUL-terminated path just made.
            let fd = unsafe {
                libc::openat(
                    dir.fd,
                    path.as_ptr().cast(),
                    libc::O_RDONLY | libc::O_CLOEXEC,
                )
            };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Pinned::pin(fd, "/proc/self/task/*/children", true)?
        };
        Ok(ProcSelf {
            fds: listed(c"fd")?,
            namespaces: listed(c"ns")?,
            tasks: listed(c"task")?,
            status: read(c"status")?,
            environ: read(c"environ")?,
            cmdline: read(c"cmdline")?,
            comm: read(c"comm")?,
            timers: read(c"timers")?,
            cgroup: read(c"cgroup")?,
            oom_score_adj: read(c"oom_score_adj")?,
            children,
            locks: Pinned::open(None, c"/proc/locks", libc::O_RDONLY)?,
            dir,
        })
    }

    /// Every fd it holds.
    pub fn all(&self) -> [&Pinned; 13] {
        [
            &self.dir,
            &self.fds,
            &self.namespaces,
            &self.tasks,
            &self.status,
            &self.environ,
            &self.cmdline,
            &self.comm,
            &self.timers,
            &self.cgroup,
            &self.oom_score_adj,
            &self.children,
            &self.locks,
        ]
    }
}

/// The names in the directory `dir` holds, `.` and `..` left out, each
/// NUL-terminated, read from its start; the directory rewound after.
pub fn list(dir: &Pinned, names: &mut Vec<u8>) -> std::io::Result<()> {
    let fd = dir
        .fd()
        .map_err(|replaced| std::io::Error::other(replaced.to_string()))?;
    list_fd(fd, names)
}

/// [`list`], of a directory fd already checked.
pub fn list_fd(fd: RawFd, names: &mut Vec<u8>) -> std::io::Result<()> {
    names.clear();
    let rewind = || {
        // SAFETY: rewinds our own directory fd.
        unsafe { libc::lseek(fd, 0, libc::SEEK_SET) }
    };
    rewind();
    let mut buffer = [0u8; 4096];
    loop {
        // SAFETY: getdents64 writes at most the buffer's length into it.
        let n =
            unsafe { libc::syscall(libc::SYS_getdents64, fd, buffer.as_mut_ptr(), buffer.len()) };
        if n <= 0 {
            let error = std::io::Error::last_os_error();
            rewind();
            return if n < 0 { Err(error) } else { Ok(()) };
        }
        let mut at = 0;
        while at < n as usize {
            // struct linux_dirent64: ino (8), off (8), reclen (2), type (1),
            // then the name, NUL-terminated.
            let reclen = u16::from_ne_bytes([buffer[at + 16], buffer[at + 17]]) as usize;
            let name = &buffer[at + 19..at + reclen];
            let name = &name[..name.iter().position(|&b| b == 0).unwrap_or(name.len())];
            if name != b"." && name != b".." {
                names.extend_from_slice(name);
                names.push(0);
            }
            at += reclen;
        }
    }
}

/// Reads the whole file `fd` holds, from its start, into `into` (a file
/// below `/proc` is made anew by a read from offset 0).
pub fn read_whole(fd: RawFd, into: &mut Vec<u8>) -> std::io::Result<()> {
    let mut buffer = [0u8; 4096];
    let from = into.len();
    loop {
        // SAFETY: reads into a local buffer, within its length.
        let n = unsafe {
            libc::pread(
                fd,
                buffer.as_mut_ptr().cast(),
                buffer.len(),
                (into.len() - from) as libc::off_t,
            )
        };
        if n < 0 {
            return Err(std::io::Error::last_os_error());
        }
        if n == 0 {
            return Ok(());
        }
        into.extend_from_slice(&buffer[..n as usize]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pinned_fd_is_found_replaced_when_another_file_is_put_at_its_number() {
        let status = Pinned::open(None, c"/proc/self/status", libc::O_RDONLY).unwrap();
        assert!(status.number() >= 100);
        assert_eq!(status.fd(), Ok(status.number()));
        let other = std::fs::File::open("/proc/self/cmdline").unwrap();
        // SAFETY: dup2 onto the pinned fd, this test's own.
        unsafe { libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&other), status.number()) };
        let replaced = status.fd().unwrap_err();
        assert_eq!(replaced.fd, status.number());
        assert!(
            replaced.to_string().contains("/proc/self/status"),
            "{replaced}"
        );
        // SAFETY: closes the stranger at the pinned number, ours.
        unsafe { libc::close(status.number()) };
        // The number is free now: another test may have it by the drop.
        std::mem::forget(status);
    }

    const F_SETSIG: libc::c_int = 10;

    #[test]
    fn a_pinned_fd_moved_or_given_a_signal_is_found_changed() {
        let status = Pinned::open(None, c"/proc/self/status", libc::O_RDONLY).unwrap();
        let fd = status.number();
        // SAFETY: lseek and fcntl on this test's own fd.
        unsafe { libc::lseek(fd, 7, libc::SEEK_SET) };
        assert!(status.fd().is_err(), "a moved offset");
        // SAFETY: as above.
        unsafe { libc::lseek(fd, 0, libc::SEEK_SET) };
        assert_eq!(status.fd(), Ok(fd));
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, F_SETSIG, libc::SIGUSR1) };
        assert!(status.fd().is_err(), "a signal for its SIGIO");
        // SAFETY: as above.
        unsafe { libc::fcntl(fd, F_SETSIG, 0) };
        assert_eq!(status.fd(), Ok(fd));
    }

    #[test]
    fn a_pinned_fd_whose_flags_changed_is_found_replaced() {
        let comm = Pinned::open(None, c"/proc/self/comm", libc::O_RDONLY).unwrap();
        // SAFETY: clears close-on-exec on this test's own fd.
        unsafe { libc::fcntl(comm.number(), libc::F_SETFD, 0) };
        assert!(comm.fd().is_err());
        // SAFETY: as above, back.
        unsafe { libc::fcntl(comm.number(), libc::F_SETFD, libc::FD_CLOEXEC) };
        assert_eq!(comm.fd(), Ok(comm.number()));
    }

    #[test]
    fn a_listing_reads_the_directory_from_its_start_each_time() {
        let proc_self = ProcSelf::open().unwrap();
        let mut names = Vec::new();
        for _ in 0..2 {
            list(&proc_self.namespaces, &mut names).unwrap();
            assert_eq!(proc_self.namespaces.fd(), Ok(proc_self.namespaces.number()));
            let listed: Vec<&[u8]> = names.split(|&b| b == 0).filter(|n| !n.is_empty()).collect();
            assert!(listed.contains(&&b"mnt"[..]), "{listed:?}");
            assert!(!listed.contains(&&b"."[..]));
        }
    }
}
