//! A process's writable memory, kept and put back.
//!
//! [`Snapshot::take`] copies every private writable mapping (the heap,
//! pymalloc's arenas, anonymous mappings, libraries' data and bss) into a
//! sealed memfd, and maps each back over itself, `MAP_PRIVATE` from it. A
//! page written since is then a private copy: present, and no longer the
//! file's (`PAGEMAP_SCAN`, or bit 61 of `/proc/self/pagemap`), while a
//! page only read is still the memfd's. [`Snapshot::restore`] finds the
//! written pages and copies the snapshot's bytes back over them: the copy
//! stays private, so the next call writes it without a fault (the faults a
//! fresh fork pays on every call are paid once). It also returns the
//! heap's break, unmaps what was mapped since, and maps again a region
//! that was unmapped or remapped.
//!
//! Read-only memory is copy-on-write too, by force (`/proc/self/mem`) or
//! through `mprotect`: a read-only mapping that holds pages of its own
//! (RELRO, anonymous memory) is a region as well, whose written pages are
//! dropped; code and read-only data are mapped shared from their file
//! ([`read_only`]), which nothing can write; what is neither (`[vdso]`) is
//! watched, and a page of a call's own there cannot be put back.
//!
//! Code, read-only data and RELRO are then sealed (`mseal`): no call can
//! unmap, remap or re-protect them, so a restore reads only the mappings a
//! call can change, and the size of them all (`statm`) tells it whether
//! the call left one it did not read (a library it loaded): about 80
//! `PROCMAP_QUERY`s a trivial call's put-back with numpy loaded, where
//! every mapping was ~190.
//!
//! Nothing of this lives in the memory it puts back: the tables are in a
//! shared mapping of their own ([`Keep`]), which the snapshot leaves out,
//! and the restore allocates nothing. The stack is left out too (it is in
//! use); the resident wipes what lies below its own frame.
//!
//! One file, over the usual length: every write this process makes to its
//! own memory is here, with the rules it keeps, to be read together.

use std::os::fd::RawFd;

use super::maps::{self, Mapping};
use super::pinned::Pinned;
use super::read_only::{self, Remapped};

/// Private writable mappings a snapshot holds at most.
const MAX_REGIONS: usize = 16 * 1024;
/// Read-only mappings watched for pages of a call's own at most.
const MAX_WATCHED: usize = 1024;
/// Mappings a process has at most (`vm.max_map_count`'s default, 65,530).
const MAX_MAPPINGS: usize = 64 * 1024;
/// Written ranges one scan returns at most (a scan that fills it goes on).
const MAX_WRITTEN: usize = 4096;
/// `/proc/self/maps` read at most.
const MAPS_BYTES: usize = 16 << 20;

const PAGE: usize = 4096;
/// Where the kernel's half of the address space starts: the vsyscall page,
/// listed in `/proc/self/maps`, is of no process's memory.
const KERNEL_HALF: usize = 0xffff_8000_0000_0000;
/// How far apart two regions one scan covers lie at most: walking the
/// page-table entries between them (9-44 ns each) costs less than a scan
/// of its own (~2.5 µs before its first page).
const SCAN_ACROSS: usize = 32 * PAGE;
/// How often a restore drops the private pages no call changed since the
/// last such restore ([`put_back_pages`]).
const TRIM_EVERY: u64 = 32;

/// A private mapping, as the snapshot holds it: its bytes at `offset` in
/// the memfd. Every writable one, and a read-only one that holds pages of
/// its own (RELRO's relocated pointers, anonymous memory made read-only or
/// inaccessible), which a forced write could change in place.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Region {
    start: usize,
    end: usize,
    offset: usize,
    prot: i32,
    /// Read-only and of a file (RELRO): sealed once mapped from the memfd.
    seals: bool,
}

/// A range of addresses, `start` to `end`.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct Span {
    start: usize,
    end: usize,
}

/// What a snapshot does with a private mapping.
enum Held {
    /// Copied into the memfd and mapped from it: put back after each call.
    Region,
    /// Scanned after each call: a page of the call's own there retires the
    /// resident.
    Watched,
    /// Neither: the stack, in use; code and read-only data mapped shared
    /// from their file, which no call can write.
    Not,
}

/// What the snapshot keeps outside the memory it puts back: a shared
/// anonymous mapping (`rw-s`, left out of every snapshot), reserved and
/// touched only as far as it is used.
#[repr(C)]
struct Keep {
    memfd: RawFd,
    /// The memfd's inode: a mapping of it is a snapshot region.
    memfd_inode: u64,
    /// The memfd mapped shared and read-only: where a restore copies from.
    view: usize,
    size: usize,
    brk: usize,
    /// Restores done: every [`TRIM_EVERY`]th also drops the pages no
    /// call has changed since.
    restores: u64,
    regions: usize,
    region: [Region; MAX_REGIONS],
    /// Private read-only mappings neither held nor made unwritable (the
    /// kernel's `[vdso]`; a file that could not be opened again): a page of
    /// a call's own in one cannot be put back.
    watched: usize,
    watch: [Mapping; MAX_WATCHED],
    /// The mappings right after the snapshot, ascending.
    layout: usize,
    laid_out: [Mapping; MAX_MAPPINGS],
    /// Which of `laid_out` are sealed (`mseal`): no call can unmap,
    /// remap or re-protect them, so a put-back need not read them.
    sealed: [bool; MAX_MAPPINGS],
    /// Their bytes, all together.
    sealed_bytes: usize,
    /// The ranges sealed, ascending.
    seals: usize,
    seal: [Span; MAX_MAPPINGS],
    /// The mappings now, read before a restore.
    current: usize,
    now: [Mapping; MAX_MAPPINGS],
    written: [PageRegion; MAX_WRITTEN],
    maps_text: [u8; MAPS_BYTES],
}

/// One range `PAGEMAP_SCAN` returns.
#[derive(Clone, Copy, Default)]
#[repr(C)]
struct PageRegion {
    start: u64,
    end: u64,
    categories: u64,
}

/// `struct pm_scan_arg` (linux/fs.h, 6.7 and later).
#[repr(C)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// `_IOWR('f', 16, struct pm_scan_arg)`.
const PAGEMAP_SCAN: libc::c_ulong = 0xc060_6610;
const PAGE_IS_FILE: u64 = 1 << 2;
const PAGE_IS_PRESENT: u64 = 1 << 3;
const PAGE_IS_SWAPPED: u64 = 1 << 4;

/// Why memory could not be kept or put back.
#[derive(Debug)]
pub struct MemoryError(pub String);

impl std::fmt::Display for MemoryError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

fn os_error(what: &str) -> MemoryError {
    MemoryError(format!("{what}: {}", std::io::Error::last_os_error()))
}

/// What a restore did.
#[derive(Debug, Default, Clone, Copy)]
pub struct Restored {
    /// Pages copied back from the snapshot.
    pub pages: usize,
    /// Regions mapped again whole (unmapped or remapped by the call).
    pub remapped: usize,
    /// Mappings made by the call, unmapped.
    pub unmapped: usize,
}

/// The memory of this process at one moment, to be put back.
pub struct Snapshot {
    keep: *mut Keep,
    scan: Scan,
    /// How its mappings are read.
    maps: Maps,
    /// `/proc/self/statm`, where the mappings are queried: the size of
    /// them all, which tells a put-back that reads only some of them
    /// whether the call mapped anything it did not read.
    statm: Option<RawFd>,
    /// The fds it keeps (the pagemap, the mappings, `statm`, the memfd),
    /// checked before each restore: a call can put a file of its own at
    /// their numbers.
    kept: Vec<Pinned>,
}

/// How the mappings are read, from `/proc/self/maps` kept open.
#[derive(Clone, Copy)]
enum Maps {
    /// `PROCMAP_QUERY` (6.11 and later): a mapping an ioctl, no paths.
    Query(RawFd),
    /// The text, parsed.
    Text(RawFd),
}

/// How written pages are found.
#[derive(Clone, Copy)]
enum Scan {
    /// The `PAGEMAP_SCAN` ioctl: ranges, holes skipped by the kernel.
    Ioctl(RawFd),
    /// `/proc/self/pagemap`, 8 bytes a page.
    Pagemap(RawFd),
}

impl Snapshot {
    /// Opens what a snapshot needs (its memfd, the pagemap) before it is
    /// taken, so that whatever is read of the process between the two is
    /// read with them open.
    pub fn prepare() -> Result<Snapshot, MemoryError> {
        let keep = reserve_keep()?;
        let mut kept = Vec::with_capacity(3);
        let scan = open_scan(&mut kept)?;
        let maps = open_maps(&mut kept)?;
        let statm = match maps {
            Maps::Query(_) => Some(open_kept(c"/proc/self/statm", &mut kept)?),
            Maps::Text(_) => None,
        };
        // SAFETY: memfd_create with a static name.
        let memfd = unsafe {
            libc::memfd_create(
                c"fluksio-reset".as_ptr(),
                libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING,
            )
        };
        if memfd < 0 {
            return Err(os_error("memfd_create"));
        }
        let memfd = Pinned::adopt(memfd, "the snapshot's memfd")
            .map_err(|e| MemoryError(format!("memfd_create: {e}")))?;
        // SAFETY: a fresh mapping, zeroed, the size of Keep.
        unsafe {
            (*keep).memfd = memfd.number();
            (*keep).memfd_inode = memfd.inode().1;
        }
        kept.push(memfd);
        Ok(Snapshot {
            keep,
            scan,
            maps,
            statm,
            kept,
        })
    }

    /// Takes the snapshot. This process must have one thread, and nothing
    /// may write to its memory meanwhile (a signal handler): every signal
    /// is blocked while it runs.
    pub fn take(&mut self) -> Result<(), MemoryError> {
        let keep = self.keep;
        let scan = self.scan;
        let _blocked = BlockedSignals::new();
        // SAFETY: Keep lives as long as the process, used by this thread.
        let k = unsafe { &mut *keep };
        read_maps(k, self.maps, false)?;
        // Which mappings to keep, and where each goes in the memfd; a
        // library's code and read-only data mapped shared instead, so that
        // no call can write them (`read_only`).
        let query = match self.maps {
            Maps::Query(fd) => Some(fd),
            Maps::Text(_) => None,
        };
        let mut size = 0;
        k.regions = 0;
        k.watched = 0;
        k.seals = 0;
        for i in 0..k.current {
            let mapping = k.now[i];
            if !mapping.private || mapping.is_within(keep) || mapping.start >= KERNEL_HALF {
                continue;
            }
            let writable = mapping.prot & libc::PROT_WRITE != 0;
            let held = if mapping.is_special() {
                // The stack is in use, and the kernel's own (`[vdso]`)
                // cannot be mapped again.
                if writable { Held::Not } else { Held::Watched }
            } else if writable || mapping.inode == 0 || holds_own_pages(scan, k, &mapping)? {
                Held::Region
            } else {
                match read_only::map_shared(&mapping, query) {
                    Remapped::Shared => {
                        seal(k, mapping.start, mapping.end);
                        Held::Not
                    }
                    Remapped::Left => Held::Watched,
                    // Code or data gone from under this process.
                    // SAFETY: _exit is always safe.
                    Remapped::Lost => unsafe { libc::_exit(HALF_TAKEN) },
                }
            };
            match held {
                Held::Not => continue,
                Held::Watched if k.watched == MAX_WATCHED => {
                    return Err(MemoryError(format!(
                        "more than {MAX_WATCHED} read-only mappings to watch"
                    )));
                }
                Held::Watched => {
                    k.watch[k.watched] = mapping;
                    k.watched += 1;
                    continue;
                }
                Held::Region => {}
            }
            if k.regions == MAX_REGIONS {
                return Err(MemoryError(format!(
                    "more than {MAX_REGIONS} private mappings to hold"
                )));
            }
            k.region[k.regions] = Region {
                start: mapping.start,
                end: mapping.end,
                offset: size,
                prot: mapping.prot(),
                // Not anonymous memory made read-only: its owner may free
                // it (a thread stack's guard, a JIT's code), where RELRO
                // stays as long as its library.
                seals: !writable && mapping.inode != 0,
            };
            k.regions += 1;
            size += mapping.end - mapping.start;
        }
        let memfd = k.memfd;
        k.size = size;
        // SAFETY: the memfd just made.
        if unsafe { libc::ftruncate(memfd, size as libc::off_t) } != 0 {
            return Err(os_error("sizing the snapshot"));
        }
        // From here to the last mapping back, nothing writes to the memory
        // being copied: no allocation, no call that sets errno unless it
        // fails (and a failure ends the resident).
        for i in 0..k.regions {
            let region = k.region[i];
            copy_out(memfd, &region, scan, k)?;
        }
        for i in 0..k.regions {
            let region = k.region[i];
            // SAFETY: maps the memfd over a range this process maps, with
            // the bytes that range holds: nothing that reads it sees a change.
            let at = unsafe {
                libc::mmap(
                    region.start as *mut libc::c_void,
                    region.end - region.start,
                    region.prot,
                    libc::MAP_PRIVATE | libc::MAP_FIXED,
                    memfd,
                    region.offset as libc::off_t,
                )
            };
            if at == libc::MAP_FAILED {
                // Half the memory is the memfd's: nothing to go back to.
                // SAFETY: _exit is always safe.
                unsafe { libc::_exit(HALF_TAKEN) };
            }
        }
        // Sealed: no call can write the snapshot, by this fd or another.
        let seals =
            libc::F_SEAL_WRITE | libc::F_SEAL_GROW | libc::F_SEAL_SHRINK | libc::F_SEAL_SEAL;
        // SAFETY: fcntl on the memfd.
        if unsafe { libc::fcntl(memfd, libc::F_ADD_SEALS, seals) } != 0 {
            return Err(os_error("sealing the snapshot"));
        }
        // Sized and sealed (its inode changed): as the fd is kept from here.
        for kept in self.kept.iter_mut().filter(|kept| kept.number() == memfd) {
            kept.settle()
                .map_err(|e| MemoryError(format!("the snapshot's memfd: {e}")))?;
        }
        k.view = map_view(memfd, size.max(PAGE))?;
        // SAFETY: brk(0) reads the break.
        k.brk = unsafe { libc::syscall(libc::SYS_brk, 0) } as usize;
        // RELRO sealed now that it is the memfd's (a refusal sets errno,
        // which the snapshot, whole, no longer minds).
        for i in 0..k.regions {
            let region = k.region[i];
            if region.seals {
                seal(k, region.start, region.end);
            }
        }
        read_maps(k, self.maps, true)?;
        k.seal[..k.seals].sort_unstable_by_key(|span| span.start);
        mark_sealed(k);
        protect_keep(keep, libc::PROT_READ);
        Ok(())
    }

    /// The fds it keeps open.
    pub fn kept(&self) -> impl Iterator<Item = &Pinned> {
        self.kept.iter()
    }

    /// Bytes the snapshot holds (its memfd's size).
    pub fn size(&self) -> usize {
        // SAFETY: Keep lives as long as the process.
        unsafe { (*self.keep).size }
    }

    /// Puts this process's memory back as the snapshot has it. Outside the
    /// stack, every private writable page is then the snapshot's, and
    /// every mapping is one the snapshot had. A mapping that is not
    /// private writable and changed (a library's code or its read-only
    /// data unmapped, remapped or made writable) cannot be put back: the
    /// error says which.
    pub fn restore(&self) -> Result<Restored, MemoryError> {
        for kept in &self.kept {
            kept.fd()
                .map_err(|replaced| MemoryError(replaced.to_string()))?;
        }
        let _blocked = BlockedSignals::new();
        let _writable = KeepWritable::new(self.keep);
        // SAFETY: Keep lives as long as the process, used by this thread.
        let k = unsafe { &mut *self.keep };
        let mut restored = Restored::default();
        // The break first: a heap grown shrinks back, one trimmed grows
        // back (and its region is mapped again below).
        // SAFETY: brk to an address this process's heap had.
        unsafe { libc::syscall(libc::SYS_brk, k.brk) };
        let writable_only = self.read_mappings(k)?;
        // Mappings the call made, or changed: gone. A snapshot region among
        // them is mapped again whole below; any other mapping the snapshot
        // had (code, read-only data, a shared mapping) cannot be put back.
        for i in 0..k.current {
            let mapping = k.now[i];
            if mapping.is_special() || self.is_ours(&mapping) || in_layout(k, &mapping) {
                continue;
            }
            let fixed = k.laid_out[..k.layout].iter().find(|l| {
                l.start < mapping.end && mapping.start < l.end && l.inode != k.memfd_inode
            });
            if let Some(fixed) = fixed.filter(|l| !l.is_special()) {
                return Err(MemoryError(format!(
                    "a mapping the snapshot holds no copy of changed: {} is now {}",
                    fixed.describe(),
                    mapping.describe()
                )));
            }
            // SAFETY: unmaps a range the call mapped or changed; what the
            // snapshot had there is mapped again below.
            unsafe {
                libc::munmap(
                    mapping.start as *mut libc::c_void,
                    mapping.end - mapping.start,
                )
            };
            restored.unmapped += 1;
        }
        for layout in &k.laid_out[..k.layout] {
            // Read only where it could have changed: every read-only one
            // is as it was (sealed, or looked at by `read_mappings`).
            let unread = writable_only && layout.prot & libc::PROT_WRITE == 0;
            if layout.is_special() || unread || in_now(k, layout) {
                continue;
            }
            if layout.inode != k.memfd_inode {
                return Err(MemoryError(format!(
                    "a mapping the snapshot holds no copy of is gone: {}",
                    layout.describe()
                )));
            }
            // SAFETY: maps the snapshot's bytes back at the address the
            // snapshot had them, where nothing is mapped now.
            let at = unsafe {
                libc::mmap(
                    layout.start as *mut libc::c_void,
                    layout.end - layout.start,
                    layout.prot(),
                    libc::MAP_PRIVATE | libc::MAP_FIXED,
                    k.memfd,
                    layout.offset as libc::off_t,
                )
            };
            if at == libc::MAP_FAILED {
                return Err(os_error("mapping a region back"));
            }
            restored.remapped += 1;
        }
        // The pages written: copied back. Regions a few pages apart (a
        // library's RELRO, data and bss; a thread's stack and its guard) are
        // scanned together: a scan costs more before it walks a page than
        // walking the pages between them.
        k.restores += 1;
        let trim = k.restores.is_multiple_of(TRIM_EVERY);
        let mut first = 0;
        while let Some((group, next)) = self.next_group(k, first) {
            let (start, end) = (k.laid_out[group.start].start, k.laid_out[group.end - 1].end);
            let mut region = group.start;
            let mut from = start;
            while from < end {
                let (found, next) = written_pages(self.scan, k, from, end)?;
                for i in 0..found {
                    let range = k.written[i];
                    let (mut at, until) = (range.start as usize, range.end as usize);
                    // Each part of the range in a region, put back as that
                    // region's; what lies between regions is not theirs.
                    while at < until {
                        while region < group.end
                            && (!self.is_region(k, region) || k.laid_out[region].end <= at)
                        {
                            region += 1;
                        }
                        let Some(layout) = k.laid_out[..group.end].get(region).copied() else {
                            break;
                        };
                        if layout.start >= until {
                            break;
                        }
                        let (part_start, part_end) = (at.max(layout.start), until.min(layout.end));
                        put_back(k.view, &layout, part_start, part_end, trim, &mut restored)?;
                        at = part_end;
                    }
                }
                from = next;
            }
            first = next;
        }
        for i in 0..k.watched {
            let watched = k.watch[i];
            if written_pages(self.scan, k, watched.start, watched.end)?.0 > 0 {
                return Err(MemoryError(format!(
                    "the call wrote into read-only memory the snapshot holds no copy of: {}",
                    watched.describe()
                )));
            }
        }
        Ok(restored)
    }

    /// Where this thread's stack mapping starts (its lowest address), as
    /// the last restore read the mappings: nothing maps or grows the stack
    /// between a restore and the wipe that asks.
    pub fn stack_start(&self) -> Option<usize> {
        let here = std::hint::black_box(0u8);
        let here = std::ptr::addr_of!(here) as usize;
        // SAFETY: Keep lives as long as the process; read only.
        let k = unsafe { &*self.keep };
        k.now[..k.current]
            .iter()
            .find(|m| m.start <= here && here < m.end)
            .map(|m| m.start)
    }

    /// Whether the mapping at `index` of the layout is a region: the
    /// memfd's, mapped private. (The view is the memfd's too, mapped
    /// shared: nothing in it is ever written, but its walk read every page
    /// it had copied from, a third of a pandas put-back's scan.)
    fn is_region(&self, k: &Keep, index: usize) -> bool {
        let layout = &k.laid_out[index];
        layout.inode == k.memfd_inode && !layout.is_special() && !self.is_ours(layout)
    }

    /// The regions from the layout's `first` on that one scan covers: the
    /// first region, and each after it no more than [`SCAN_ACROSS`] past
    /// the one before; and where to look for the next group.
    fn next_group(&self, k: &Keep, first: usize) -> Option<(std::ops::Range<usize>, usize)> {
        let start = (first..k.layout).find(|&i| self.is_region(k, i))?;
        let mut last = start;
        let mut next = start + 1;
        while next < k.layout && k.laid_out[next].start - k.laid_out[last].end <= SCAN_ACROSS {
            if self.is_region(k, next) {
                last = next;
            }
            next += 1;
        }
        Some((start..last + 1, last + 1))
    }

    /// Reads the mappings a restore compares with the layout into `now`:
    /// where what was sealed is more than the rest, and nothing but the
    /// writable ones changed, those alone (`true`); else every mapping.
    ///
    /// A call can change only an unsealed mapping. The writable ones are
    /// read by one walk the kernel filters; each unsealed read-only one of
    /// the layout is asked for where it was (the view, `[vdso]`, anonymous
    /// memory made read-only). What is left is what the call mapped that is
    /// not writable, or a read-only mapping it made of a writable one:
    /// either way the size of all the mappings (`statm`) is not that of
    /// those read and the sealed ones, and every mapping is read instead.
    fn read_mappings(&self, k: &mut Keep) -> Result<bool, MemoryError> {
        if self.read_changeable(k)? {
            return Ok(true);
        }
        read_maps(k, self.maps, false)?;
        Ok(false)
    }

    /// The writable mappings into `now`, where nothing else can have
    /// changed (`true`): something sealed, every unsealed read-only one
    /// where it was, and the size of them all as `statm` says.
    fn read_changeable(&self, k: &mut Keep) -> Result<bool, MemoryError> {
        let (Maps::Query(fd), Some(statm)) = (self.maps, self.statm) else {
            return Ok(false);
        };
        if k.sealed_bytes == 0 {
            return Ok(false);
        }
        let unreadable = |e: std::io::Error| MemoryError(format!("reading the mappings: {e}"));
        let count = maps::query(fd, &mut k.now, maps::Which::Writable)
            .map_err(unreadable)?
            .ok_or_else(|| MemoryError("more mappings than a snapshot holds".into()))?;
        k.set_current(count, false);
        let mut bytes = k.sealed_bytes;
        bytes += (k.now[..count].iter())
            .map(|m| m.end - m.start)
            .sum::<usize>();
        for i in 0..k.layout {
            let layout = k.laid_out[i];
            if layout.prot & libc::PROT_WRITE != 0 || k.sealed[i] {
                continue;
            }
            if !maps::is_there(fd, &layout).map_err(unreadable)? {
                return Ok(false);
            }
            bytes += layout.end - layout.start;
        }
        Ok(mapped_bytes(statm)? == bytes)
    }

    /// Keep's mapping, or the view: the snapshot's own.
    fn is_ours(&self, mapping: &Mapping) -> bool {
        // SAFETY: Keep lives as long as the process.
        let k = unsafe { &*self.keep };
        mapping.is_within(self.keep)
            || (mapping.start >= k.view && mapping.end <= k.view + k.size.max(PAGE))
    }
}

/// Puts back the pages of region `layout` from `start` to `end`, found
/// written: compared and copied back in a writable region, dropped in a
/// read-only one (written by force, through `/proc/self/mem`, or made
/// writable and back), where they read as the snapshot's again.
fn put_back(
    view: usize,
    layout: &Mapping,
    start: usize,
    end: usize,
    trim: bool,
    restored: &mut Restored,
) -> Result<(), MemoryError> {
    if layout.prot & libc::PROT_WRITE != 0 {
        let source = view + layout.offset + (start - layout.start);
        // SAFETY: both ranges are mapped: the region's pages and the view
        // of the snapshot's bytes for them.
        unsafe { put_back_pages(source, start, end, trim, restored) };
    } else {
        // SAFETY: pages of a read-only snapshot region, private. (A kernel
        // whose `mseal` refused this for a sealed one would leave them:
        // then the resident cannot be put back.)
        let dropped =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_DONTNEED) };
        if dropped != 0 {
            return Err(os_error("dropping pages written into read-only memory"));
        }
        restored.pages += (end - start) / PAGE;
    }
    Ok(())
}

/// Puts back the private pages from `start` to `end`, whose snapshot bytes
/// are at `source`. A page that differs (written by the call) is copied
/// back and stays this process's own, so the next call that writes it
/// takes no fault; one that does not is left alone. With `trim`, the pages
/// that do not are dropped, and are the snapshot's again: otherwise every
/// page any call ever wrote would be scanned and compared after every
/// later call. (Dropping them each time would cost a system call a page
/// and a fault the next time one is written: more than the reset saves.)
///
/// # Safety
/// Both ranges must be mapped, readable, and the first writable.
unsafe fn put_back_pages(
    source: usize,
    start: usize,
    end: usize,
    trim: bool,
    restored: &mut Restored,
) {
    let mut unchanged_from = None;
    let drop_unchanged = |from: Option<usize>, to: usize| {
        if let (true, Some(from)) = (trim, from) {
            // SAFETY: private pages of a snapshot region, identical to
            // the snapshot's: dropped, they read as the memfd's again.
            unsafe { libc::madvise(from as *mut libc::c_void, to - from, libc::MADV_DONTNEED) };
        }
    };
    let mut page = start;
    while page < end {
        let snapshot = source + (page - start);
        // SAFETY: the caller's ranges, one page of each.
        let (now, then) = unsafe {
            (
                std::slice::from_raw_parts(page as *const u8, PAGE),
                std::slice::from_raw_parts(snapshot as *const u8, PAGE),
            )
        };
        if now == then {
            unchanged_from.get_or_insert(page);
        } else {
            drop_unchanged(unchanged_from.take(), page);
            // SAFETY: as above; the pages do not overlap.
            unsafe { std::ptr::copy_nonoverlapping(snapshot as *const u8, page as *mut u8, PAGE) };
            restored.pages += 1;
        }
        page += PAGE;
    }
    drop_unchanged(unchanged_from, end);
}

/// Whether the snapshot's layout has `mapping`, as it is now.
fn in_layout(k: &Keep, mapping: &Mapping) -> bool {
    (k.laid_out[..k.layout].binary_search_by(|m| m.order(mapping))).is_ok()
}

/// Whether `layout`'s mapping is there now, as the snapshot had it.
fn in_now(k: &Keep, layout: &Mapping) -> bool {
    (k.now[..k.current].binary_search_by(|m| m.order(layout))).is_ok()
}

/// The exit code of a resident whose snapshot failed half-way: its memory
/// is neither the old nor the new.
pub const HALF_TAKEN: i32 = 113;

/// Copies `region` into the memfd at its offset: every page of a file's
/// mapping (an untouched page is the file's, not zero), the present pages
/// of an anonymous one (an untouched one reads as zero, as the memfd's
/// hole does).
fn copy_out(memfd: RawFd, region: &Region, scan: Scan, k: &mut Keep) -> Result<(), MemoryError> {
    if region.prot & libc::PROT_READ == 0 {
        // Inaccessible memory with pages of its own is read to be copied;
        // its mapping from the memfd takes its protection back.
        // SAFETY: adds read access to a range this process maps.
        unsafe {
            libc::mprotect(
                region.start as *mut libc::c_void,
                region.end - region.start,
                libc::PROT_READ,
            )
        };
    }
    let anonymous = k.now[..k.current]
        .iter()
        .find(|m| m.start == region.start)
        .is_some_and(|m| m.inode == 0);
    let write = |start: usize, end: usize| -> Result<(), MemoryError> {
        let mut done = start;
        while done < end {
            // SAFETY: reads the process's own mapped range into the memfd.
            let n = unsafe {
                libc::syscall(
                    libc::SYS_pwrite64,
                    memfd,
                    done as *const libc::c_void,
                    end - done,
                    (region.offset + done - region.start) as libc::off_t,
                )
            };
            if n <= 0 {
                return Err(os_error("copying memory into the snapshot"));
            }
            done += n as usize;
        }
        Ok(())
    };
    if !anonymous {
        return write(region.start, region.end);
    }
    let mut from = region.start;
    while from < region.end {
        let (found, next) = pages_in(
            scan,
            k,
            from,
            region.end,
            PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
            0,
        )?;
        for i in 0..found {
            let range = k.written[i];
            write(range.start as usize, range.end as usize)?;
        }
        from = next;
    }
    Ok(())
}

/// Whether `mapping`, of a file, holds pages of its own: present and not
/// the file's, or swapped out.
fn holds_own_pages(scan: Scan, k: &mut Keep, mapping: &Mapping) -> Result<bool, MemoryError> {
    let (found, _) = written_pages(scan, k, mapping.start, mapping.end)?;
    Ok(found > 0)
}

/// The written pages of a memfd region from `from` to `end`: present and
/// not the file's, or swapped out. Fills `k.written`; the count, and where
/// the scan stopped.
fn written_pages(
    scan: Scan,
    k: &mut Keep,
    from: usize,
    end: usize,
) -> Result<(usize, usize), MemoryError> {
    pages_in(
        scan,
        k,
        from,
        end,
        PAGE_IS_PRESENT | PAGE_IS_SWAPPED,
        PAGE_IS_FILE,
    )
}

/// The pages from `from` to `end` with any of `anyof` and none of `none`,
/// as ranges in `k.written`: how many, and where the scan stopped (`end`
/// once it is done).
fn pages_in(
    scan: Scan,
    k: &mut Keep,
    from: usize,
    end: usize,
    anyof: u64,
    none: u64,
) -> Result<(usize, usize), MemoryError> {
    match scan {
        Scan::Ioctl(fd) => {
            let mut arg = PmScanArg {
                size: std::mem::size_of::<PmScanArg>() as u64,
                flags: 0,
                start: from as u64,
                end: end as u64,
                walk_end: 0,
                vec: k.written.as_mut_ptr() as u64,
                vec_len: MAX_WRITTEN as u64,
                max_pages: 0,
                category_inverted: none,
                category_mask: none,
                category_anyof_mask: anyof,
                return_mask: anyof | none,
            };
            // SAFETY: the ioctl writes at most vec_len regions into `written`.
            let found = unsafe { libc::ioctl(fd, PAGEMAP_SCAN, &mut arg) };
            if found < 0 {
                return Err(os_error("scanning the pagemap"));
            }
            Ok((
                found as usize,
                (arg.walk_end as usize).max(from + PAGE).min(end),
            ))
        }
        Scan::Pagemap(fd) => {
            // 8 bytes a page, read in steps of 512 pages.
            let mut entries = [0u64; 512];
            let mut found = 0;
            let mut page = from;
            while page < end && found < MAX_WRITTEN {
                let count = ((end - page) / PAGE).min(entries.len());
                let bytes = count * 8;
                // SAFETY: reads into a local array of at least `bytes`.
                let n = unsafe {
                    libc::pread(
                        fd,
                        entries.as_mut_ptr().cast(),
                        bytes,
                        ((page / PAGE) * 8) as libc::off_t,
                    )
                };
                if n != bytes as isize {
                    return Err(os_error("reading the pagemap"));
                }
                for (i, entry) in entries[..count].iter().enumerate() {
                    let present = entry >> 63 & 1 == 1;
                    let swapped = entry >> 62 & 1 == 1;
                    let file = entry >> 61 & 1 == 1;
                    let categories = if present { PAGE_IS_PRESENT } else { 0 }
                        | if swapped { PAGE_IS_SWAPPED } else { 0 }
                        | if file { PAGE_IS_FILE } else { 0 };
                    if categories & anyof == 0 || categories & none != 0 {
                        continue;
                    }
                    let at = (page + i * PAGE) as u64;
                    if found > 0 && k.written[found - 1].end == at {
                        k.written[found - 1].end += PAGE as u64;
                    } else if found < MAX_WRITTEN {
                        k.written[found] = PageRegion {
                            start: at,
                            end: at + PAGE as u64,
                            categories,
                        };
                        found += 1;
                    } else {
                        return Ok((found, at as usize));
                    }
                }
                page += count * PAGE;
            }
            Ok((found, page.min(end)))
        }
    }
}

/// `PAGEMAP_SCAN` where the kernel has it (6.7 and later), else the
/// pagemap file.
fn open_scan(kept: &mut Vec<Pinned>) -> Result<Scan, MemoryError> {
    let fd = open_kept(c"/proc/self/pagemap", kept)?;
    let mut probe = [PageRegion::default(); 1];
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags: 0,
        start: 0,
        end: 0,
        walk_end: 0,
        vec: probe.as_mut_ptr() as u64,
        vec_len: 1,
        max_pages: 0,
        category_inverted: 0,
        category_mask: 0,
        category_anyof_mask: PAGE_IS_PRESENT,
        return_mask: PAGE_IS_PRESENT,
    };
    // SAFETY: an empty range: the ioctl answers whether it exists.
    let ioctl = unsafe { libc::ioctl(fd, PAGEMAP_SCAN, &mut arg) } >= 0;
    Ok(if ioctl {
        Scan::Ioctl(fd)
    } else {
        Scan::Pagemap(fd)
    })
}

/// Keep is read-only while a call runs: its tables say what a restore puts
/// back, and `/proc/self/mem` can write a private read-only page but not a
/// shared one, so no call can rewrite them without native code.
fn protect_keep(keep: *mut Keep, prot: libc::c_int) {
    let size = std::mem::size_of::<Keep>().next_multiple_of(PAGE);
    // SAFETY: Keep's own mapping, whole.
    unsafe { libc::mprotect(keep.cast(), size, prot) };
}

/// Keep writable for a restore, and read-only again after it.
struct KeepWritable(*mut Keep);

impl KeepWritable {
    fn new(keep: *mut Keep) -> KeepWritable {
        protect_keep(keep, libc::PROT_READ | libc::PROT_WRITE);
        KeepWritable(keep)
    }
}

impl Drop for KeepWritable {
    fn drop(&mut self) {
        protect_keep(self.0, libc::PROT_READ);
    }
}

/// The mapping Keep lives in: shared and anonymous, so no snapshot holds
/// it; reserved, so only what is used is ever touched.
fn reserve_keep() -> Result<*mut Keep, MemoryError> {
    let size = std::mem::size_of::<Keep>().next_multiple_of(PAGE);
    // SAFETY: a new anonymous mapping.
    let at = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if at == libc::MAP_FAILED {
        return Err(os_error("reserving the snapshot's tables"));
    }
    Ok(at.cast())
}

/// `path` opened to read for the snapshot's life (pinned, into `kept`).
fn open_kept(path: &'static std::ffi::CStr, kept: &mut Vec<Pinned>) -> Result<RawFd, MemoryError> {
    let pinned = Pinned::open(None, path, libc::O_RDONLY)
        .map_err(|e| MemoryError(format!("opening {}: {e}", path.to_string_lossy())))?;
    let fd = pinned.number();
    kept.push(pinned);
    Ok(fd)
}

/// `/proc/self/maps`, open for the snapshot's life: queried where the
/// kernel answers `PROCMAP_QUERY`, else read as text.
fn open_maps(kept: &mut Vec<Pinned>) -> Result<Maps, MemoryError> {
    let fd = open_kept(c"/proc/self/maps", kept)?;
    Ok(if maps::can_query(fd) {
        Maps::Query(fd)
    } else {
        Maps::Text(fd)
    })
}

/// The sealed memfd mapped read-only, through an fd of it opened
/// read-only: where the restore copies from. A shared mapping of the memfd
/// itself (open for writing) is refused before Linux 6.7 once it is sealed
/// against writes; one of a read-only fd is taken, and can never be made
/// writable (`mprotect` refuses it: no call can write the snapshot through
/// it either). No allocation: the snapshot is taken.
fn map_view(memfd: RawFd, size: usize) -> Result<usize, MemoryError> {
    let mut path = [0u8; 32];
    let mut cursor = &mut path[..];
    std::io::Write::write_fmt(&mut cursor, format_args!("/proc/self/fd/{memfd}\0"))
        .map_err(|_| MemoryError("the snapshot's path".into()))?;
    // SAFETY: open with a NUL-terminated path in a local buffer.
    let read_only = unsafe { libc::open(path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if read_only < 0 {
        return Err(os_error("opening the snapshot read-only"));
    }
    // SAFETY: a read-only shared mapping of the fd just opened, closed
    // right after (the mapping holds the file).
    let view = unsafe {
        let view = libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ,
            libc::MAP_SHARED,
            read_only,
            0,
        );
        libc::close(read_only);
        view
    };
    if view == libc::MAP_FAILED {
        return Err(os_error("mapping the snapshot"));
    }
    Ok(view as usize)
}

/// Reads this process's mappings into `k.now` (and, `as_layout`, into
/// `k.laid_out` too), with no allocation.
fn read_maps(k: &mut Keep, maps: Maps, as_layout: bool) -> Result<(), MemoryError> {
    let fd = match maps {
        Maps::Query(fd) => {
            let count = maps::query(fd, &mut k.now, maps::Which::Every)
                .map_err(|e| MemoryError(format!("reading the mappings: {e}")))?
                .ok_or_else(|| MemoryError("more mappings than a snapshot holds".into()))?;
            k.set_current(count, as_layout);
            return Ok(());
        }
        Maps::Text(fd) => fd,
    };
    // From its start: the text is made anew by a read from offset 0.
    let mut length = 0;
    loop {
        // SAFETY: reads into Keep's buffer, within its bounds.
        let n = unsafe {
            libc::pread(
                fd,
                k.maps_text[length..].as_mut_ptr().cast(),
                MAPS_BYTES - length,
                length as libc::off_t,
            )
        };
        if n < 0 {
            return Err(os_error("reading /proc/self/maps"));
        }
        if n == 0 {
            break;
        }
        length += n as usize;
        if length == MAPS_BYTES {
            return Err(MemoryError("/proc/self/maps is too long".into()));
        }
    }
    let count = maps::parse(&k.maps_text[..length], &mut k.now)
        .ok_or_else(|| MemoryError("more mappings than a snapshot holds".into()))?;
    k.set_current(count, as_layout);
    Ok(())
}

/// Seals `start` to `end` (`mseal`, Linux 6.10), remembered in `seal`:
/// from here no call can unmap, remap or re-protect it. Where the kernel
/// refuses (none before 6.10), it is read after each call as before.
fn seal(k: &mut Keep, start: usize, end: usize) {
    // SAFETY: mseal of a range this process maps; it changes no memory.
    let sealed = unsafe { libc::syscall(libc::SYS_mseal, start, end - start, 0) } == 0;
    if sealed && k.seals < MAX_MAPPINGS {
        k.seal[k.seals] = Span { start, end };
        k.seals += 1;
    }
}

/// Marks each mapping of the layout that lies in a sealed range (the
/// kernel merges no sealed mapping with an unsealed one), and counts
/// their bytes.
fn mark_sealed(k: &mut Keep) {
    k.sealed_bytes = 0;
    let mut span = 0;
    for i in 0..k.layout {
        let mapping = k.laid_out[i];
        while span < k.seals && k.seal[span].end <= mapping.start {
            span += 1;
        }
        let sealed = span < k.seals
            && k.seal[span].start <= mapping.start
            && mapping.end <= k.seal[span].end;
        k.sealed[i] = sealed;
        if sealed {
            k.sealed_bytes += mapping.end - mapping.start;
        }
    }
}

/// The bytes this process maps, all its mappings together: `statm`'s
/// first field, in pages. No allocation.
fn mapped_bytes(statm: RawFd) -> Result<usize, MemoryError> {
    let mut text = [0u8; 128];
    // SAFETY: pread into a local buffer, within its length.
    let n = unsafe { libc::pread(statm, text.as_mut_ptr().cast(), text.len(), 0) };
    if n <= 0 {
        return Err(os_error("reading /proc/self/statm"));
    }
    let pages = text[..n as usize]
        .iter()
        .take_while(|b| b.is_ascii_digit())
        .try_fold(0usize, |pages, &b| {
            pages.checked_mul(10)?.checked_add((b - b'0') as usize)
        })
        .ok_or_else(|| MemoryError("/proc/self/statm reads as no number".into()))?;
    Ok(pages * PAGE)
}

impl Keep {
    /// The first `count` of `now` are the mappings read; `as_layout`, the
    /// snapshot's layout too.
    fn set_current(&mut self, count: usize, as_layout: bool) {
        self.current = count;
        if as_layout {
            self.laid_out[..count].copy_from_slice(&self.now[..count]);
            self.layout = count;
        }
    }
}

/// Every signal blocked while memory is copied or put back: a handler
/// would write to it.
struct BlockedSignals(libc::sigset_t);

impl BlockedSignals {
    fn new() -> BlockedSignals {
        // SAFETY: sigset operations on local sets.
        unsafe {
            let mut all: libc::sigset_t = std::mem::zeroed();
            let mut before: libc::sigset_t = std::mem::zeroed();
            libc::sigfillset(&mut all);
            libc::sigprocmask(libc::SIG_SETMASK, &all, &mut before);
            BlockedSignals(before)
        }
    }
}

impl Drop for BlockedSignals {
    fn drop(&mut self) {
        // SAFETY: puts back the mask saved in new().
        unsafe { libc::sigprocmask(libc::SIG_SETMASK, &self.0, std::ptr::null_mut()) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pages `scan` finds written between `start` and `end`, as page
    /// numbers from `start`.
    fn written_in(scan: Scan, k: &mut Keep, start: usize, end: usize) -> Vec<usize> {
        let mut pages = Vec::new();
        let mut from = start;
        while from < end {
            let (found, next) = written_pages(scan, k, from, end).expect("a scan");
            for range in &k.written[..found] {
                pages.extend((range.start as usize..range.end as usize).step_by(PAGE));
            }
            from = next;
        }
        pages.iter().map(|page| (page - start) / PAGE).collect()
    }

    /// Kernels before 6.7 have no `PAGEMAP_SCAN`: the pagemap file, read
    /// instead, must find the same pages.
    #[test]
    fn the_pagemap_file_finds_the_written_pages_the_ioctl_finds() {
        const PAGES: usize = 96;
        // SAFETY: a fresh memfd, sized, mapped private; pages read, some
        // written; all of it this test's own.
        let (start, end) = unsafe {
            let memfd = libc::memfd_create(c"written-pages".as_ptr(), libc::MFD_CLOEXEC);
            assert!(memfd >= 0);
            assert_eq!(libc::ftruncate(memfd, (PAGES * PAGE) as libc::off_t), 0);
            let at = libc::mmap(
                std::ptr::null_mut(),
                PAGES * PAGE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE,
                memfd,
                0,
            );
            assert_ne!(at, libc::MAP_FAILED);
            libc::close(memfd);
            let base = at as usize;
            // Every other page read (present, the file's), a few written.
            for page in (0..PAGES).step_by(2) {
                std::ptr::read_volatile((base + page * PAGE) as *const u8);
            }
            for page in [3, 4, 5, 10, 40, 95] {
                std::ptr::write_volatile((base + page * PAGE) as *mut u8, 1);
            }
            (base, base + PAGES * PAGE)
        };
        let keep = reserve_keep().expect("the tables");
        // SAFETY: the mapping just reserved, this test's alone.
        let k = unsafe { &mut *keep };
        let mut kept = Vec::new();
        let pagemap = open_kept(c"/proc/self/pagemap", &mut kept).expect("the pagemap");
        let by_file = written_in(Scan::Pagemap(pagemap), k, start, end);
        assert_eq!(by_file, [3, 4, 5, 10, 40, 95]);
        // From within the range, where a scan that filled its table goes on.
        let by_file_from_one = written_in(Scan::Pagemap(pagemap), k, start + 4 * PAGE, end);
        assert_eq!(by_file_from_one, [0, 1, 6, 36, 91]);
        match open_scan(&mut kept).expect("a scan") {
            scan @ Scan::Ioctl(_) => assert_eq!(written_in(scan, k, start, end), by_file),
            Scan::Pagemap(_) => eprintln!("no PAGEMAP_SCAN here: the file alone is checked"),
        }
        // SAFETY: both mappings made here, unused from here.
        unsafe {
            libc::munmap(start as *mut libc::c_void, end - start);
            libc::munmap(
                keep.cast(),
                std::mem::size_of::<Keep>().next_multiple_of(PAGE),
            );
        }
    }
}
