//! What names an artifact, and the hashing that proves it.

use std::io::{Read, Write};
use std::sync::mpsc::{channel, sync_channel};

use sha2::{Digest as _, Sha256};

/// How much of an artifact is held in memory at a time, as the engine's own
/// store does: a 2 GiB checkpoint is hashed, copied and sent 1 MiB at a time.
pub const CHUNK: usize = 1 << 20;

/// `sha256:` and 64 lowercase hex digits: the only digest accepted, checked
/// before any path is built from it or any request sent with it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Digest {
    hex: String,
}

/// The rule, as every refusal states it.
pub const DIGEST_RULE: &str = "a digest is \"sha256:\" followed by 64 lowercase hex digits";

impl Digest {
    pub fn parse(text: &str) -> Result<Digest, String> {
        let hex = text.strip_prefix("sha256:").filter(|hex| {
            hex.len() == 64
                && hex
                    .bytes()
                    .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
        });
        match hex {
            Some(hex) => Ok(Digest {
                hex: hex.to_string(),
            }),
            None => Err(format!("{text:?} is not an artifact digest: {DIGEST_RULE}")),
        }
    }

    fn from_hasher(hasher: Sha256) -> Digest {
        let hex = hasher
            .finalize()
            .iter()
            .map(|b| format!("{b:02x}"))
            .collect();
        Digest { hex }
    }

    /// The 64 hex digits alone: the file name in a store or a cache.
    pub fn hex(&self) -> &str {
        &self.hex
    }

    /// The first two digits: a directory store's fan-out directory.
    pub fn fan_out(&self) -> &str {
        &self.hex[..2]
    }
}

impl std::fmt::Display for Digest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "sha256:{}", self.hex)
    }
}

/// The digest of bytes in memory.
pub fn of_bytes(bytes: &[u8]) -> Digest {
    let mut hasher = Sha256::new();
    hasher.update(bytes);
    Digest::from_hasher(hasher)
}

/// A reader that hashes what passes through it, so a file is read once
/// whether it is being hashed, uploaded or downloaded.
pub struct Hashing<R> {
    inner: R,
    hasher: Sha256,
    pub size: u64,
}

impl<R: Read> Hashing<R> {
    pub fn new(inner: R) -> Hashing<R> {
        Hashing {
            inner,
            hasher: Sha256::new(),
            size: 0,
        }
    }

    /// Reads to the end, `CHUNK` at a time, and gives the digest.
    pub fn drain(mut self) -> std::io::Result<(Digest, u64)> {
        let mut buffer = vec![0u8; CHUNK];
        while self.read(&mut buffer)? > 0 {}
        Ok(self.finish())
    }

    pub fn finish(self) -> (Digest, u64) {
        (Digest::from_hasher(self.hasher), self.size)
    }
}

impl<R: Read> Read for Hashing<R> {
    fn read(&mut self, buffer: &mut [u8]) -> std::io::Result<usize> {
        let n = self.inner.read(buffer)?;
        self.hasher.update(&buffer[..n]);
        self.size += n as u64;
        Ok(n)
    }
}

/// Copies `reader` into `writer` and hashes what passed, the hashing on a
/// second thread: a chunk is hashed while the next one is read and written,
/// so a transfer takes about as long as the slower of the two, not both.
/// The thread ends before this returns (a zygote never forks beside it).
pub fn copy_hashing(
    reader: &mut impl Read,
    writer: &mut impl Write,
) -> Result<(Digest, u64), Failed> {
    std::thread::scope(|scope| {
        // Two chunks queued at most: memory stays a few CHUNKs whatever the size.
        let (to_hasher, chunks) = sync_channel::<Vec<u8>>(2);
        let (give_back, spare) = channel::<Vec<u8>>();
        let hasher = scope.spawn(move || {
            let mut hasher = Sha256::new();
            for chunk in chunks {
                hasher.update(&chunk);
                let _ = give_back.send(chunk);
            }
            hasher
        });
        let mut size = 0u64;
        let copied = (|| {
            loop {
                let mut chunk = spare.try_recv().unwrap_or_default();
                chunk.resize(CHUNK, 0);
                let n = loop {
                    match reader.read(&mut chunk) {
                        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                        other => break other.map_err(Failed::Reading)?,
                    }
                };
                if n == 0 {
                    return Ok(());
                }
                chunk.truncate(n);
                writer.write_all(&chunk).map_err(Failed::Writing)?;
                size += n as u64;
                if to_hasher.send(chunk).is_err() {
                    // Only a panic ends the hashing thread early; its join says so.
                    return Ok(());
                }
            }
        })();
        drop(to_hasher);
        let hasher = hasher.join().expect("hashing does not panic");
        copied.map(|()| (Digest::from_hasher(hasher), size))
    })
}

/// Which side of a copy failed.
#[derive(Debug)]
pub enum Failed {
    Reading(std::io::Error),
    Writing(std::io::Error),
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_sha256_and_64_lowercase_hex_is_a_digest() {
        let good = format!("sha256:{}", "0a".repeat(32));
        assert_eq!(Digest::parse(&good).unwrap().to_string(), good);
        for bad in [
            "sha256:../../etc/passwd".to_string(),
            format!("sha256:{}", "0A".repeat(32)),
            format!("sha256:{}", "0".repeat(63)),
            format!("sha256:{}", "0".repeat(65)),
            format!("md5:{}", "0".repeat(32)),
            format!("sha256:{}/..", "0".repeat(61)),
            String::new(),
        ] {
            let error = Digest::parse(&bad).unwrap_err();
            assert!(error.contains(DIGEST_RULE), "{error}");
        }
    }

    #[test]
    fn hashing_a_stream_equals_hashing_the_bytes() {
        let bytes = vec![7u8; 3 * CHUNK + 5];
        let (digest, size) = Hashing::new(&bytes[..]).drain().unwrap();
        assert_eq!(digest, of_bytes(&bytes));
        assert_eq!(size, bytes.len() as u64);
        let mut copy = Vec::new();
        assert_eq!(
            copy_hashing(&mut &bytes[..], &mut copy).unwrap(),
            (digest, size)
        );
        assert_eq!(copy, bytes);
        assert_eq!(
            of_bytes(b"").to_string(),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }
}
