//! Memory freed by the runtime is zeroed first.
//!
//! The issue this solves: a child is a copy of the zygote's whole address
//! space, freed memory included. The requests the zygote read (kwargs), the
//! replies it relayed (results), the frames it passed on: once freed, their
//! bytes would still sit in the heap every later call's child is forked
//! with, readable through `/proc/self/mem`. So the runtime's allocator
//! zeroes every block it frees. Blocks that glibc maps on their own are
//! returned to the kernel on free and moved by `mremap` on growth, and
//! leave nothing behind; they are passed through as they are. Which those
//! are is read off the block (glibc raises its mmap threshold as blocks
//! are freed, so a block of megabytes may well be in the heap).
//! Buffers the runtime reuses rather than frees are zeroed where they are
//! reused (`LogBuffer::clear`, the request reader), or as soon as what they
//! hold is passed on (a call's lines: a resident's pipe may not be read
//! again for a long while).
//!
//! Freeing is not enough while a call is being served: its request (the
//! line, the kwargs, the env) is alive in the zygote's memory when the next
//! standby child is forked beside it, or a node's zygote or a lane, and
//! that child never frees its copy. So what a call brings is [`Held`] while
//! it is in memory, and every child wipes what is held the moment it is
//! forked ([`wipe_held_in_child`], the child's fork hook).

use std::alloc::{GlobalAlloc, Layout, System};

/// glibc's smallest mmap threshold: no smaller block is a mapping of its
/// own.
const OWN_MAPPING: usize = 128 * 1024;

/// Whether glibc mapped this block on its own: the `IS_MMAPPED` bit of the
/// size word before it. Elsewhere: assume not (it is zeroed, which is safe).
///
/// # Safety
/// `ptr` is a live block of the system allocator.
unsafe fn own_mapping(ptr: *mut u8) -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: glibc keeps a chunk's size word right before the block.
    unsafe {
        const IS_MMAPPED: usize = 0x2;
        *(ptr as *const usize).sub(1) & IS_MMAPPED != 0
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        let _ = ptr;
        false
    }
}

/// Writes zeros over `length` bytes at `start` with `explicit_bzero`: an
/// optimiser drops a plain memset before a free as a dead store (a release
/// build did, and freed requests stayed in the heap), never this.
///
/// # Safety
/// The range is writable.
unsafe fn write_zeros(start: usize, length: usize) {
    if length > 0 {
        // SAFETY: the caller's range.
        unsafe { libc::explicit_bzero(start as *mut libc::c_void, length) };
    }
}

/// Zeroes bytes a buffer keeps for reuse, so that what they held is not
/// in memory a later child is forked with.
pub fn wipe(bytes: &mut [u8]) {
    // SAFETY: the slice's own bytes.
    unsafe { write_zeros(bytes.as_mut_ptr() as usize, bytes.len()) };
}

/// Zeroes `length` bytes at `start`: whole pages dropped (`MADV_DONTNEED`:
/// they read as zeros, without being touched, let alone copied by a fork),
/// the partial pages at either end written.
///
/// # Safety
/// The range is writable private memory that nothing else uses now.
unsafe fn zero(start: usize, length: usize) {
    // Every block the runtime frees comes here: most are small, and are
    // simply written.
    if length < OWN_MAPPING {
        // SAFETY: the caller's range.
        unsafe { write_zeros(start, length) };
        return;
    }
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(1) as usize;
    let end = start + length;
    let first_page = start.next_multiple_of(page);
    let last_page = end / page * page;
    // SAFETY: inside the caller's range.
    unsafe {
        if first_page >= last_page {
            write_zeros(start, length);
            return;
        }
        write_zeros(start, first_page - start);
        write_zeros(last_page, end - last_page);
        let dropped = libc::madvise(
            first_page as *mut libc::c_void,
            last_page - first_page,
            libc::MADV_DONTNEED,
        );
        if dropped != 0 {
            write_zeros(first_page, last_page - first_page);
        }
    }
}

/// The system allocator, zeroing what it frees.
pub struct ZeroOnFree;

// SAFETY: every method delegates to `System` with the caller's layout; the
// extra work only writes inside blocks the caller still owns.
unsafe impl GlobalAlloc for ZeroOnFree {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded as is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the block is the caller's until dealloc returns.
        unsafe {
            if layout.size() < OWN_MAPPING || !own_mapping(ptr) {
                zero(ptr as usize, layout.size());
            }
            System.dealloc(ptr, layout)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `dealloc`; a moved block is copied whole before
        // the old one is zeroed and freed.
        unsafe {
            if layout.size() >= OWN_MAPPING && new_size >= OWN_MAPPING && own_mapping(ptr) {
                return System.realloc(ptr, layout, new_size);
            }
            let new_layout = Layout::from_size_align_unchecked(new_size, layout.align());
            let new = System.alloc(new_layout);
            if !new.is_null() {
                std::ptr::copy_nonoverlapping(ptr, new, layout.size().min(new_size));
                self.dealloc(ptr, layout);
            }
            new
        }
    }
}

/// Bytes of a call's request in this process's memory, wiped in any child
/// forked while they are held. They must stay where they are (not grow,
/// move or be freed) until the `Held` is dropped.
pub struct Held {
    start: usize,
}

/// The regions held now: `(start, length)`. Only the zygote's one thread
/// touches it; a child reads it right after the fork.
static HELD: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

fn held() -> std::sync::MutexGuard<'static, Vec<(usize, usize)>> {
    HELD.lock().unwrap_or_else(|e| e.into_inner())
}

impl Held {
    pub fn new(bytes: &[u8]) -> Held {
        let start = bytes.as_ptr() as usize;
        if !bytes.is_empty() {
            held().push((start, bytes.len()));
        }
        Held { start }
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut regions = held();
        if let Some(at) = regions.iter().rposition(|(start, _)| *start == self.start) {
            regions.swap_remove(at);
        }
    }
}

/// A call's kwargs and env (as a request or an assignment carries them),
/// held while they are in memory.
pub fn hold_call_data(kwargs: Option<&str>, env: &[(String, String)]) -> Vec<Held> {
    let env = env
        .iter()
        .flat_map(|(name, value)| [name.as_bytes(), value.as_bytes()]);
    kwargs
        .map(str::as_bytes)
        .into_iter()
        .chain(env)
        .map(Held::new)
        .collect()
}

/// In a child just forked: zeroes every region its parent held. The child
/// never returns to the code that holds them (it serves, then exits), so
/// nothing reads them again. Whole pages are dropped (`MADV_DONTNEED`: they
/// read as zeros, and a request of a gigabyte is not copied into every
/// child to be zeroed); only the partial pages at each end are written.
pub fn wipe_held_in_child() {
    let regions = std::mem::take(&mut *held());
    for (start, length) in regions {
        // SAFETY: each region was live, unmoved memory of the parent when
        // it forked (a `Held` pins it), so it is mapped and writable in
        // this copy of it, private (the heap, or a block mapped on its
        // own); the frames that own it never run again here.
        unsafe { zero(start, length) };
    }
}

/// Forgets the first `n` bytes of `buffer` (a reused read buffer), zeroing
/// what moving the rest forward leaves behind its new end: stale bytes in
/// a buffer's spare capacity are as readable by a later child as freed ones.
pub fn drain_front(buffer: &mut Vec<u8>, n: usize) {
    let n = n.min(buffer.len());
    buffer.drain(..n);
    let spare = &mut buffer.spare_capacity_mut()[..n];
    // SAFETY: the vector's own spare capacity, `n` bytes of it.
    unsafe { write_zeros(spare.as_mut_ptr() as usize, spare.len()) };
}

/// Empties a reused read buffer, zeroing what it held.
pub fn clear(buffer: &mut Vec<u8>) {
    // SAFETY: the buffer's own initialised bytes, about to be forgotten.
    unsafe { zero(buffer.as_mut_ptr() as usize, buffer.len()) };
    buffer.clear();
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_cleared_buffer_of_many_pages_reads_as_zeros() {
        let mut buffer = vec![0x5Au8; 1 << 20];
        let at = buffer.as_ptr();
        super::clear(&mut buffer);
        assert!(buffer.is_empty());
        // SAFETY: the same allocation, its bytes initialised (zeroed).
        let kept = unsafe { std::slice::from_raw_parts(at, 1 << 20) };
        assert!(kept.iter().all(|&b| b == 0));
    }

    #[test]
    fn a_block_mapped_on_its_own_is_told_from_one_in_the_heap() {
        use std::alloc::{GlobalAlloc, Layout};
        let allocator = super::ZeroOnFree;
        // Past glibc's highest mmap threshold (32 MiB), and far below its
        // lowest.
        for (size, mapped) in [(64 << 20, true), (64, false)] {
            let layout = Layout::from_size_align(size, 8).unwrap();
            // SAFETY: a fresh block of `layout`, asked about, freed once.
            unsafe {
                // Opaque: an optimiser may otherwise fold a block that
                // is only freed (and its header read) into no block at all.
                let block = std::hint::black_box(allocator.alloc(layout));
                assert_eq!(super::own_mapping(block), mapped, "{size} bytes");
                allocator.dealloc(block, layout);
            }
        }
    }

    #[test]
    fn held_bytes_are_registered_until_dropped() {
        let secret = b"held-secret".to_vec();
        let count = || super::held().len();
        let before = count();
        {
            let _held = super::Held::new(&secret);
            assert_eq!(count(), before + 1);
            assert!(
                super::held()
                    .iter()
                    .any(|&(start, len)| start == secret.as_ptr() as usize && len == secret.len())
            );
        }
        assert_eq!(count(), before);
    }

    #[test]
    fn a_drained_buffer_keeps_nothing_behind_its_end() {
        let mut buffer = b"secret-line\nnext".to_vec();
        super::drain_front(&mut buffer, 12);
        assert_eq!(buffer, b"next");
        // SAFETY: reading the spare capacity the drain zeroed (it was
        // initialised: it held the buffer's old bytes).
        let behind = unsafe { std::slice::from_raw_parts(buffer.as_ptr().add(4), 12) };
        assert!(behind.iter().all(|&b| b == 0), "{behind:?}");
    }
}
