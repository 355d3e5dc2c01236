//! Room in the heap for a call's allocations, made before the snapshot.
//!
//! A call that allocates past the heap's free space grows it (`brk`); the
//! put-back returns the break, and the next call grows it again, each page
//! faulted in and zeroed anew (a pandas groupby point: ~190 pages, three
//! `brk`s, every call). A reused process keeps its heap's growth. So glibc's
//! malloc is asked for the room once, before the snapshot, and given it
//! back: the top of its heap keeps it, untouched, so the snapshot holds it
//! as a hole (nothing copied, nothing resident), and a page a call writes
//! there stays the resident's own, put back by a copy as any other.
//!
//! Only the allocator's bookkeeping changes, as it would in a process that
//! had served calls: no call can tell a page of it from a fresh one.

/// The room made: a pandas point's growth many times over, and a hole until
/// a call writes to it.
const ROOM: usize = 16 << 20;

/// An allocation glibc serves by `mmap`, and whose `free` raises its
/// dynamic `mmap` threshold to the most it goes (32 MiB on 64-bit) and its
/// trim threshold to twice that, as the first large array a reused process
/// frees does.
const RAISES_THRESHOLDS: usize = (32 << 20) - (64 << 10);

/// Makes the room; what an allocator other than glibc's makes of it is
/// harmless (a block allocated and freed).
pub fn make_room() {
    // SAFETY: each block is freed at once, unread and unwritten. Seen
    // through `black_box`: a pair of malloc and free is otherwise dropped
    // by the optimiser as doing nothing.
    unsafe {
        libc::free(std::hint::black_box(libc::malloc(RAISES_THRESHOLDS)));
        // Below the mmap threshold now: from the heap, which grows by it,
        // and freed below the trim threshold: kept at its top.
        libc::free(std::hint::black_box(libc::malloc(ROOM)));
    }
}
