//! This process's mappings, read into fixed-size records with no
//! allocation: the reset reads them while the heap is being put back.
//!
//! Two ways, the same records: `PROCMAP_QUERY` (Linux 6.11), one ioctl a
//! mapping, asks for no file's path (printing the paths is most of what
//! reading the text costs: 0.62 against 1.31 ms for a process with
//! pandas and scipy loaded); older kernels parse `/proc/self/maps`.

use std::cmp::Ordering;
use std::os::fd::RawFd;

/// One mapping, as a line of `/proc/self/maps` gives it.
#[derive(Clone, Copy, Default, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Mapping {
    pub start: usize,
    pub end: usize,
    pub offset: usize,
    pub inode: u64,
    pub dev: u64,
    /// `PROT_*` bits.
    pub prot: i32,
    pub private: bool,
    /// `[stack]`, `[vdso]`, `[vvar]`, `[vsyscall]` and the like: the
    /// kernel's, or the stack in use; never copied, never compared.
    pub special: bool,
}

impl Mapping {
    pub fn is_private_writable(&self) -> bool {
        self.private && self.prot & libc::PROT_WRITE != 0
    }

    pub fn is_special(&self) -> bool {
        self.special
    }

    /// Whether it lies inside the mapping that starts at `at`, of `T`'s size.
    pub fn is_within<T>(&self, at: *mut T) -> bool {
        let start = at as usize;
        let end = start + std::mem::size_of::<T>().next_multiple_of(4096);
        self.start >= start && self.end <= end
    }

    pub fn prot(&self) -> i32 {
        self.prot
    }

    /// Ascending by address, then by what is mapped there: equal only for
    /// the same mapping.
    pub fn order(&self, other: &Mapping) -> Ordering {
        (
            self.start,
            self.end,
            self.offset,
            self.inode,
            self.dev,
            self.prot,
            self.private,
        )
            .cmp(&(
                other.start,
                other.end,
                other.offset,
                other.inode,
                other.dev,
                other.prot,
                other.private,
            ))
    }

    /// The mapping as an error message names it.
    pub fn describe(&self) -> String {
        let perm = |bit, c| if self.prot & bit != 0 { c } else { '-' };
        format!(
            "{:x}-{:x} {}{}{}{} inode {}",
            self.start,
            self.end,
            perm(libc::PROT_READ, 'r'),
            perm(libc::PROT_WRITE, 'w'),
            perm(libc::PROT_EXEC, 'x'),
            if self.private { 'p' } else { 's' },
            self.inode
        )
    }
}

/// `struct procmap_query` (linux/fs.h, 6.11 and later).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)`.
const PROCMAP_QUERY: libc::c_ulong = 0xc068_6611;
const QUERY_COVERING_OR_NEXT_VMA: u64 = 0x10;
const VMA_READABLE: u64 = 0x1;
const VMA_WRITABLE: u64 = 0x2;
const VMA_EXECUTABLE: u64 = 0x4;
const VMA_SHARED: u64 = 0x8;

/// Whether the kernel answers `PROCMAP_QUERY` on `fd`, an open
/// `/proc/self/maps`.
pub fn can_query(fd: RawFd) -> bool {
    query_one(fd, 0, 0, None).is_ok()
}

/// Which mappings [`query`] reads.
#[derive(Clone, Copy, PartialEq, Eq)]
pub enum Which {
    Every,
    /// The writable ones only: the kernel walks past the rest itself,
    /// with no ioctl of their own.
    Writable,
}

/// Reads the mappings `which` names into `into` by `PROCMAP_QUERY` on
/// `fd`, an open `/proc/self/maps`: the count, `Ok(None)` if there are
/// more than `into` holds. Only an anonymous mapping's name is asked for:
/// it tells the kernel's own (`[vdso]`) from the rest. The vsyscall page,
/// outside the process's tree of mappings, is not among them.
pub fn query(fd: RawFd, into: &mut [Mapping], which: Which) -> std::io::Result<Option<usize>> {
    let filter = match which {
        Which::Every => 0,
        Which::Writable => VMA_WRITABLE,
    };
    let mut count = 0;
    let mut at = 0u64;
    let mut name = [0u8; 256];
    loop {
        let found = match query_one(fd, at, filter, None) {
            Ok(found) => found,
            Err(error) if error.raw_os_error() == Some(libc::ENOENT) => return Ok(Some(count)),
            Err(error) => return Err(error),
        };
        let special = found.inode == 0
            && match query_one(fd, found.vma_start, 0, Some(&mut name)) {
                Ok(named) => {
                    let length = (named.vma_name_size as usize).saturating_sub(1);
                    is_special_name(&name[..length.min(name.len())])
                }
                // Longer than any of the kernel's own names.
                Err(error) if error.raw_os_error() == Some(libc::ENAMETOOLONG) => false,
                Err(error) => return Err(error),
            };
        let Some(slot) = into.get_mut(count) else {
            return Ok(None);
        };
        *slot = Mapping {
            special,
            ..mapping_of(&found)
        };
        count += 1;
        at = found.vma_end;
    }
}

/// Whether `mapping` is there now as it is, by one `PROCMAP_QUERY` on
/// `fd` (its name, and so whether it is the kernel's, not compared).
pub fn is_there(fd: RawFd, mapping: &Mapping) -> std::io::Result<bool> {
    match query_one(fd, mapping.start as u64, 0, None) {
        Ok(found) => Ok(mapping_of(&found).order(mapping) == Ordering::Equal),
        Err(error) if error.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(error) => Err(error),
    }
}

/// The mapping a query found, not yet told special or not.
fn mapping_of(found: &ProcmapQuery) -> Mapping {
    let flag = |bit: u64, prot: i32| if found.vma_flags & bit != 0 { prot } else { 0 };
    Mapping {
        start: found.vma_start as usize,
        end: found.vma_end as usize,
        offset: found.vma_offset as usize,
        inode: found.inode,
        dev: device(found.dev_major, found.dev_minor),
        prot: flag(VMA_READABLE, libc::PROT_READ)
            | flag(VMA_WRITABLE, libc::PROT_WRITE)
            | flag(VMA_EXECUTABLE, libc::PROT_EXEC),
        private: found.vma_flags & VMA_SHARED == 0,
        special: false,
    }
}

/// A device number as [`Mapping::dev`] holds it.
pub fn device(major: u32, minor: u32) -> u64 {
    (major as u64) << 32 | minor as u64
}

/// The path of the file mapped at `at`, NUL-terminated in `into`, by
/// `PROCMAP_QUERY` on `fd`; `None` for a mapping of no file, or a path
/// longer than `into`.
pub fn path_of(fd: RawFd, at: usize, into: &mut [u8]) -> Option<&[u8]> {
    let found = query_one(fd, at as u64, 0, Some(into)).ok()?;
    if found.inode == 0 || found.vma_start != at as u64 || found.vma_name_size == 0 {
        return None;
    }
    into.get(..found.vma_name_size as usize)
}

/// The mapping at `at` or the first above it with every `VMA_*` bit of
/// `filter`; its name into `name`.
fn query_one(
    fd: RawFd,
    at: u64,
    filter: u64,
    name: Option<&mut [u8]>,
) -> std::io::Result<ProcmapQuery> {
    let mut query = ProcmapQuery {
        size: std::mem::size_of::<ProcmapQuery>() as u64,
        query_flags: QUERY_COVERING_OR_NEXT_VMA | filter,
        query_addr: at,
        ..ProcmapQuery::default()
    };
    if let Some(name) = name {
        query.vma_name_size = name.len() as u32;
        query.vma_name_addr = name.as_mut_ptr() as u64;
    }
    // SAFETY: the ioctl reads and writes `query`, and writes at most
    // `vma_name_size` bytes at `vma_name_addr`, a live buffer.
    if unsafe { libc::ioctl(fd, PROCMAP_QUERY, &mut query) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(query)
}

/// `[stack]`, `[vdso]`, `[vvar]` and the like, but not the heap or a
/// named anonymous mapping.
fn is_special_name(name: &[u8]) -> bool {
    name.starts_with(b"[") && !name.starts_with(b"[heap]") && !name.starts_with(b"[anon")
}

/// Parses `text` into `into`; the count, or `None` if there are more
/// mappings than `into` holds or a line is not a mapping's.
pub fn parse(text: &[u8], into: &mut [Mapping]) -> Option<usize> {
    let mut count = 0;
    for line in text.split(|&b| b == b'\n') {
        if line.is_empty() {
            continue;
        }
        let mapping = parse_line(line)?;
        *into.get_mut(count)? = mapping;
        count += 1;
    }
    Some(count)
}

fn parse_line(line: &[u8]) -> Option<Mapping> {
    let mut fields = line.split(|&b| b == b' ').filter(|f| !f.is_empty());
    let range = fields.next()?;
    let perms = fields.next()?;
    let offset = hex(fields.next()?)?;
    let dev = fields.next()?;
    let inode = decimal(fields.next()?)?;
    // The path may hold spaces; only its start matters here.
    let path = fields.next().unwrap_or(b"");
    let dash = range.iter().position(|&b| b == b'-')?;
    let (major, minor) = dev.split_at(dev.iter().position(|&b| b == b':')?);
    let flag = |i: usize, c: u8, bit: i32| if perms.get(i) == Some(&c) { bit } else { 0 };
    let special = is_special_name(path);
    Some(Mapping {
        start: hex(&range[..dash])?,
        end: hex(&range[dash + 1..])?,
        offset,
        inode,
        dev: device(hex(major)? as u32, hex(&minor[1..])? as u32),
        prot: flag(0, b'r', libc::PROT_READ)
            | flag(1, b'w', libc::PROT_WRITE)
            | flag(2, b'x', libc::PROT_EXEC),
        private: perms.get(3) == Some(&b'p'),
        special,
    })
}

fn hex(text: &[u8]) -> Option<usize> {
    let mut value: usize = 0;
    for &b in text {
        let digit = (b as char).to_digit(16)? as usize;
        value = value.checked_mul(16)?.checked_add(digit)?;
    }
    (!text.is_empty()).then_some(value)
}

fn decimal(text: &[u8]) -> Option<u64> {
    let mut value: u64 = 0;
    for &b in text {
        let digit = (b as char).to_digit(10)? as u64;
        value = value.checked_mul(10)?.checked_add(digit)?;
    }
    (!text.is_empty()).then_some(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_maps_text_parses_into_its_mappings() {
        let text = b"55d0c0a00000-55d0c0a21000 rw-p 00000000 00:00 0                          [heap]\n\
7f1c2c000000-7f1c2c021000 rw-p 00000000 00:00 0 \n\
7f1c2e3f5000-7f1c2e3f7000 r-xp 00002000 fd:01 1311789                    /usr/lib/x86_64-linux-gnu/libc.so.6\n\
7f1c2e400000-7f1c2e401000 rw-s 00000000 00:01 77                         /memfd:fluksio-reset (deleted)\n\
7ffd1a2b3000-7ffd1a2d4000 rw-p 00000000 00:00 0                          [stack]\n";
        let mut into = [Mapping::default(); 8];
        assert_eq!(parse(text, &mut into), Some(5));
        assert!(into[0].is_private_writable() && !into[0].is_special());
        assert_eq!(into[0].start, 0x55d0c0a00000);
        assert!(into[1].is_private_writable());
        assert_eq!(into[2].prot, libc::PROT_READ | libc::PROT_EXEC);
        assert_eq!(into[2].offset, 0x2000);
        assert_eq!(into[2].dev, 0xfd << 32 | 1);
        assert_eq!(into[2].inode, 1311789);
        assert!(!into[3].private && !into[3].is_private_writable());
        assert!(into[4].is_special());
        let mut small = [Mapping::default(); 2];
        assert_eq!(parse(text, &mut small), None);
    }

    #[test]
    fn the_query_reads_what_the_text_says() {
        let maps = std::fs::File::open("/proc/self/maps").unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&maps);
        if !can_query(fd) {
            eprintln!("SKIPPED: this kernel has no PROCMAP_QUERY (6.11 and later)");
            return;
        }
        // Other tests' threads map and unmap meanwhile (a mapping made
        // and gone again between two reads of the text that agree): read
        // all three until they agree. (Allocated first: a large
        // allocation is a mapping of its own.)
        let mut parsed = vec![Mapping::default(); 4096];
        let mut queried = vec![Mapping::default(); 4096];
        let mut only_writable = vec![Mapping::default(); 4096];
        for _ in 0..20 {
            let text = std::fs::read("/proc/self/maps").unwrap();
            let count = parse(&text, &mut parsed).unwrap();
            let found = query(fd, &mut queried, Which::Every).unwrap().unwrap();
            let writable = query(fd, &mut only_writable, Which::Writable)
                .unwrap()
                .unwrap();
            let again = std::fs::read("/proc/self/maps").unwrap();
            if text != again {
                continue;
            }
            // The vsyscall page is the text's alone.
            let parsed: Vec<Mapping> = parsed[..count]
                .iter()
                .copied()
                .filter(|m| m.start < 0xffff_8000_0000_0000)
                .collect();
            if parsed != queried[..found] {
                continue;
            }
            let parsed_writable: Vec<Mapping> = parsed
                .iter()
                .copied()
                .filter(|m| m.prot & libc::PROT_WRITE != 0)
                .collect();
            if parsed_writable != only_writable[..writable] {
                continue;
            }
            assert!(writable > 0 && writable < found);
            // Each as it is, where none moved meanwhile.
            if !parsed.iter().all(|mapping| is_there(fd, mapping).unwrap()) {
                continue;
            }
            let moved = Mapping {
                end: parsed[0].end + 4096,
                ..parsed[0]
            };
            assert!(!is_there(fd, &moved).unwrap());
            assert!(
                parsed.iter().any(|m| m.special),
                "[stack] or [vdso] is special"
            );
            assert!(parsed.iter().any(|m| m.inode != 0 && m.offset != 0));
            let mut small = [Mapping::default(); 2];
            assert_eq!(query(fd, &mut small, Which::Every).unwrap(), None);
            return;
        }
        panic!("the mappings never held still long enough to compare");
    }
}
