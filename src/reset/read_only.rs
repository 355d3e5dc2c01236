//! A resident's code and read-only data, made so that no call can write
//! them.
//!
//! A private mapping is copy-on-write even where it is read-only:
//! `/proc/self/mem` writes through it (as a debugger sets a breakpoint;
//! plain Python can), and so does `mprotect` made writable and back. The
//! page written becomes the process's own and stays, where the mapping
//! looks as it did: the put-back, which compares mappings and not their
//! pages, would hand it to every later call. Mapped shared from a file
//! opened read-only instead, the same pages can be written by neither (the
//! kernel refuses a forced write to a shared mapping, and `mprotect`
//! refuses to make it writable), and every call reads the file's bytes,
//! as a fresh child would.
//!
//! What cannot be so mapped (a mapping already holding pages of its own,
//! RELRO's relocated pointers; anonymous memory) is a snapshot region
//! instead ([`super::memory`]).

use std::os::fd::RawFd;

use super::maps::{self, Mapping};

/// What [`map_shared`] made of a mapping.
#[derive(Debug, PartialEq, Eq)]
pub enum Remapped {
    /// Shared from its file.
    Shared,
    /// As it was: its file could not be opened again (gone from its path,
    /// and no `/proc/self/map_files` for this user) or mapped so.
    Left,
    /// Gone: the kernel unmapped it and refused the new mapping (kernels
    /// before 6.12 may), so that this process runs without it.
    Lost,
}

/// Maps `mapping`, a private read-only mapping of a file that holds only
/// the file's pages, shared from the same file over itself: the same
/// bytes, at the same address, with the same protection. No allocation:
/// the snapshot is being taken.
pub fn map_shared(mapping: &Mapping, maps: Option<RawFd>) -> Remapped {
    let Some(file) = open_mapped_file(mapping, maps) else {
        return Remapped::Left;
    };
    let length = mapping.end - mapping.start;
    // SAFETY: maps the file's bytes over the range that maps them now,
    // with its protection: nothing that reads or runs it sees a change.
    let at = unsafe {
        let at = libc::mmap(
            mapping.start as *mut libc::c_void,
            length,
            mapping.prot,
            libc::MAP_SHARED | libc::MAP_FIXED,
            file,
            mapping.offset as libc::off_t,
        );
        libc::close(file);
        at
    };
    if at != libc::MAP_FAILED {
        return Remapped::Shared;
    }
    // A refused mapping leaves the one before in place (Linux checks the
    // file first, and since 6.12 keeps it on any failure); `mincore`
    // fails on a range that is not all mapped.
    let mut pages = [0u8; 64];
    let mut from = mapping.start;
    while from < mapping.end {
        let step = (mapping.end - from).min(pages.len() * 4096);
        // SAFETY: mincore writes one byte a page of the range into `pages`.
        if unsafe { libc::mincore(from as *mut libc::c_void, step, pages.as_mut_ptr()) } != 0 {
            return Remapped::Lost;
        }
        from += step;
    }
    Remapped::Left
}

/// The file `mapping` maps, opened read-only: by `/proc/self/map_files`
/// (the very file, where this user may open it), else by the path the
/// kernel gives the mapping, checked to be the same file.
fn open_mapped_file(mapping: &Mapping, maps: Option<RawFd>) -> Option<RawFd> {
    let mut path = [0u8; 64];
    let mut cursor = &mut path[..];
    std::io::Write::write_fmt(
        &mut cursor,
        format_args!(
            "/proc/self/map_files/{:x}-{:x}\0",
            mapping.start, mapping.end
        ),
    )
    .ok()?;
    if let Some(file) = open_same(&path, mapping) {
        return Some(file);
    }
    let mut path = [0u8; libc::PATH_MAX as usize];
    let path = maps::path_of(maps?, mapping.start, &mut path)?;
    open_same(path, mapping)
}

/// `path` (NUL-terminated) opened read-only, if it is the file `mapping`
/// maps, and a regular file (a device's mapping is left as it is: opening
/// one again may do more than read it).
fn open_same(path: &[u8], mapping: &Mapping) -> Option<RawFd> {
    // SAFETY: open with a NUL-terminated path; fstat into a zeroed struct
    // of the fd just opened, closed unless returned.
    unsafe {
        let flags = libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK;
        let file = libc::open(path.as_ptr().cast(), flags);
        if file < 0 {
            return None;
        }
        let mut stat: libc::stat = std::mem::zeroed();
        let same = libc::fstat(file, &mut stat) == 0
            && stat.st_mode & libc::S_IFMT == libc::S_IFREG
            && stat.st_ino == mapping.inode
            && maps::device(libc::major(stat.st_dev), libc::minor(stat.st_dev)) == mapping.dev;
        if same {
            return Some(file);
        }
        libc::close(file);
        None
    }
}
