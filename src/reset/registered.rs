//! The snapshot's regions registered with a userfaultfd, so that one
//! `PAGEMAP_SCAN` walks them all.
//!
//! A scan costs ~3 µs before it walks a page (a numpy zygote has ~45
//! regions, pandas ~110), and a scan over the span between the lowest and
//! the highest region would walk the code and read-only data between them
//! too, page by page. The kernel skips a mapping whole where the scan asks
//! for pages of mappings registered in asynchronous write-protect mode
//! (`PAGE_IS_WPALLOWED`), and every region is: registered, never
//! write-protected, so no write of a call faults. Measured on 44 small
//! regions between code mappings: 150-180 µs a put-back in 44 scans,
//! 57-62 µs in one (`BENCHMARKS.md`).
//!
//! Nothing depends on a registration for its correctness. A call can undo
//! one through this fd (`UFFDIO_UNREGISTER`, from `fcntl.ioctl`), and one
//! scan then passes its region by: each region's first page is kept
//! written (its own byte written back after every put-back), so a region
//! the scan found nothing in is one to scan by itself
//! ([`super::memory::Snapshot::restore`]).

use std::os::fd::RawFd;

use super::pinned::Pinned;

/// `UFFD_USER_MODE_ONLY`: faults in user mode only, which an unprivileged
/// process may ask for where `vm.unprivileged_userfaultfd` is 0.
const USER_MODE_ONLY: libc::c_int = 1;
const UFFD_API: u64 = 0xaa;
/// Linux 6.7 and later: a write-protect fault is resolved by the kernel,
/// and the mapping counts as `PAGE_IS_WPALLOWED` to `PAGEMAP_SCAN`.
const FEATURE_WP_ASYNC: u64 = 1 << 15;
/// `_IOWR(0xAA, 0x3F, struct uffdio_api)`.
const UFFDIO_API: libc::c_ulong = 0xc018_aa3f;
/// `_IOWR(0xAA, 0x00, struct uffdio_register)`.
const UFFDIO_REGISTER: libc::c_ulong = 0xc020_aa00;
const REGISTER_MODE_WP: u64 = 1 << 1;

#[repr(C)]
struct Api {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct Register {
    start: u64,
    len: u64,
    mode: u64,
    ioctls: u64,
}

/// A userfaultfd with asynchronous write-protect mode, pinned, or `None`
/// where the kernel has none (before 6.7, or refused: a container's
/// seccomp profile often refuses the system call).
pub fn open() -> Option<Pinned> {
    // SAFETY: the userfaultfd system call, with flags only.
    let fd = unsafe {
        libc::syscall(
            libc::SYS_userfaultfd,
            libc::O_CLOEXEC | libc::O_NONBLOCK | USER_MODE_ONLY,
        )
    };
    if fd < 0 {
        return None;
    }
    let fd = fd as RawFd;
    let mut api = Api {
        api: UFFD_API,
        features: FEATURE_WP_ASYNC,
        ioctls: 0,
    };
    // SAFETY: the ioctl reads and writes `api`, a live local.
    if unsafe { libc::ioctl(fd, UFFDIO_API, &mut api) } != 0 {
        // SAFETY: the fd just opened, ours alone.
        unsafe { libc::close(fd) };
        return None;
    }
    Pinned::adopt(fd, "the snapshot's userfaultfd").ok()
}

/// Registers the mapping from `start` to `end` with `fd`; whether it is.
pub fn register(fd: RawFd, start: usize, end: usize) -> bool {
    let mut register = Register {
        start: start as u64,
        len: (end - start) as u64,
        mode: REGISTER_MODE_WP,
        ioctls: 0,
    };
    // SAFETY: the ioctl reads and writes `register`, a live local.
    unsafe { libc::ioctl(fd, UFFDIO_REGISTER, &mut register) == 0 }
}
