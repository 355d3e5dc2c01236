//! Memory freed by the runtime is zeroed first.
//!
//! The issue this solves: a child is a copy of the zygote's whole address
//! space, freed memory included. The requests the zygote read (kwargs), the
//! replies it relayed (results), the frames it passed on: once freed, their
//! bytes would still sit in the heap every later call's child is forked
//! with, readable through `/proc/self/mem`. So the runtime's allocator
//! zeroes every block it frees. Blocks that glibc maps on their own (128 KiB
//! and up) are returned to the kernel on free and moved by `mremap` on
//! growth, and leave nothing behind; they are passed through as they are.
//! Buffers the runtime reuses rather than frees are zeroed where they are
//! reused (`LogBuffer::clear`, the request reader).

use std::alloc::{GlobalAlloc, Layout, System};

/// glibc's default mmap threshold: blocks this size or larger are their
/// own mappings, unmapped on free.
const OWN_MAPPING: usize = 128 * 1024;

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
            if layout.size() < OWN_MAPPING {
                std::ptr::write_bytes(ptr, 0, layout.size());
            }
            System.dealloc(ptr, layout)
        }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: as in `dealloc`; a moved block is copied whole before
        // the old one is zeroed and freed.
        unsafe {
            if layout.size() >= OWN_MAPPING && new_size >= OWN_MAPPING {
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

/// Forgets the first `n` bytes of `buffer` (a reused read buffer), zeroing
/// what moving the rest forward leaves behind its new end: stale bytes in
/// a buffer's spare capacity are as readable by a later child as freed ones.
pub fn drain_front(buffer: &mut Vec<u8>, n: usize) {
    let n = n.min(buffer.len());
    buffer.drain(..n);
    for byte in &mut buffer.spare_capacity_mut()[..n] {
        byte.write(0);
    }
}

/// Empties a reused read buffer, zeroing what it held.
pub fn clear(buffer: &mut Vec<u8>) {
    buffer.fill(0);
    buffer.clear();
}

#[cfg(test)]
mod tests {
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
