//! `/proc/self/maps`, parsed into fixed-size records with no allocation:
//! the reset reads it while the heap is being put back.

use std::cmp::Ordering;

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
    let special =
        path.starts_with(b"[") && !path.starts_with(b"[heap]") && !path.starts_with(b"[anon");
    Some(Mapping {
        start: hex(&range[..dash])?,
        end: hex(&range[dash + 1..])?,
        offset,
        inode,
        dev: (hex(major)? as u64) << 32 | hex(&minor[1..])? as u64,
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
}
