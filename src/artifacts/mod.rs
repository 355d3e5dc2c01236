//! The artifact store, from a node's side: save bytes or a file, get a
//! local path for a digest.
//!
//! Which store is read from the environment at each use, as
//! `worker_main.py` does: `FLUKSIO_ARTIFACT_DIR` (the engine's filesystem,
//! `<dir>/<hex[0:2]>/<hex>`) or `FLUKSIO_ARTIFACT_URL` (over HTTP, fetched
//! files cached by digest under `FLUKSIO_ARTIFACT_CACHE`, default
//! `$TMPDIR/fluksio-artifacts`). Plain Rust: `fluksio.save_artifact` /
//! `load_artifact` wrap it for node code, `fluksio-zygote fetch` and the
//! agent call it directly.
//!
//! Nothing is ever held whole in memory: files are hashed, copied, sent and
//! received [`digest::CHUNK`] at a time, and a download is verified against
//! its digest before it is renamed into the cache.

pub mod digest;
mod directory;
mod http;
pub mod store;
mod token;

use std::path::{Path, PathBuf};
use std::time::Duration;

pub use digest::{DIGEST_RULE, Digest};
pub use token::{
    TOKEN_ENV, hide_argument, hide_credentials, hide_variable, is_credential, reinstate_token_for,
    take_token, use_token,
};

pub const DIR_ENV: &str = "FLUKSIO_ARTIFACT_DIR";
pub const URL_ENV: &str = "FLUKSIO_ARTIFACT_URL";
pub const CACHE_ENV: &str = "FLUKSIO_ARTIFACT_CACHE";
/// Seconds an HTTP store may stay silent before a transfer fails.
pub const TIMEOUT_ENV: &str = "FLUKSIO_ARTIFACT_TIMEOUT";

/// What is saved: bytes already in memory, or a file read a chunk at a
/// time (as `fluksio.save_artifact` was given it).
pub use fluksio_embed::module::Source;

/// A saved artifact, as the reference's dict carries it (`name` and
/// `media_type` are the caller's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub digest: Digest,
    pub size: u64,
}

/// Why a save or a load failed; each says what a node author can act on,
/// and none ever shows the token.
#[derive(Debug)]
pub enum ArtifactError {
    BadDigest(String),
    /// Neither variable is set.
    NoStore,
    /// No variable names a store, and the digest is not in the cache.
    Unreachable(Digest),
    NotFound {
        digest: Digest,
        place: String,
    },
    /// 401 or 403: the token is missing, wrong or not allowed.
    Refused {
        status: u16,
        first_line: String,
    },
    /// Any other answer than 2xx.
    Status {
        status: u16,
        first_line: String,
    },
    Timeout {
        url: String,
        after: Duration,
    },
    Connection {
        url: String,
        why: String,
        refused: bool,
    },
    /// Downloaded bytes that are not the artifact asked for.
    Mismatch {
        asked: Digest,
        got: Digest,
    },
    Io {
        what: String,
        path: PathBuf,
        error: std::io::Error,
    },
}

impl std::fmt::Display for ArtifactError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ArtifactError::BadDigest(why) => f.write_str(why),
            ArtifactError::NoStore => write!(
                f,
                "this worker has no artifact store — neither {DIR_ENV} nor {URL_ENV} is set"
            ),
            ArtifactError::Unreachable(digest) => {
                write!(f, "this worker cannot reach the artifact store: {digest}")
            }
            ArtifactError::NotFound { digest, place } => {
                write!(f, "no artifact {digest} in {place}")
            }
            ArtifactError::Refused { status, first_line } => write!(
                f,
                "the artifact store refused this worker's token (HTTP {status}){}",
                suffix(first_line)
            ),
            ArtifactError::Status { status, first_line } => {
                write!(
                    f,
                    "the artifact store answered HTTP {status}{}",
                    suffix(first_line)
                )
            }
            ArtifactError::Timeout { url, after } => write!(
                f,
                "the artifact store at {url} said nothing for {} s ({TIMEOUT_ENV} sets how long to wait)",
                after.as_secs()
            ),
            ArtifactError::Connection { url, why, .. } => {
                write!(f, "could not reach the artifact store at {url}: {why}")
            }
            ArtifactError::Mismatch { asked, got } => write!(
                f,
                "the artifact store sent bytes that are not {asked} (their sha256 is {}); nothing was cached",
                got.hex()
            ),
            ArtifactError::Io { what, path, error } => {
                write!(f, "could not {what} {}: {error}", path.display())
            }
        }
    }
}

fn suffix(first_line: &str) -> String {
    if first_line.is_empty() {
        String::new()
    } else {
        format!(": {first_line}")
    }
}

impl std::error::Error for ArtifactError {}

/// An I/O error with what was being done, and to which path.
fn io(what: &str, path: &Path) -> impl FnOnce(std::io::Error) -> ArtifactError {
    let (what, path) = (what.to_string(), path.to_path_buf());
    move |error| ArtifactError::Io { what, path, error }
}

/// A new file beside `target`, only ours (`O_EXCL`, mode 0600 as
/// `mkstemp` makes it): where an artifact is written before it is renamed
/// into place, so a reader never opens half of one.
fn temporary_beside(target: &Path) -> Result<(std::fs::File, PathBuf), ArtifactError> {
    use std::os::unix::fs::OpenOptionsExt;
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let dir = target.parent().unwrap_or(Path::new("."));
    loop {
        let name = format!(
            ".{}.{}-{}.tmp",
            target
                .file_name()
                .map(|n| n.to_string_lossy())
                .unwrap_or_default(),
            std::process::id(),
            COUNTER.fetch_add(1, Ordering::Relaxed)
        );
        let path = dir.join(name);
        match std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)
        {
            Ok(file) => return Ok((file, path)),
            Err(error) if error.kind() == std::io::ErrorKind::AlreadyExists => continue,
            Err(error) => return Err(io("create a file in", dir)(error)),
        }
    }
}

/// Removes a temporary file on every path out that did not rename it.
struct Temporary(Option<PathBuf>);

impl Temporary {
    fn rename_to(mut self, target: &Path) -> Result<(), ArtifactError> {
        let path = self.0.take().expect("renamed once");
        std::fs::rename(&path, target).map_err(|e| {
            let _ = std::fs::remove_file(&path);
            io("move an artifact into", target)(e)
        })
    }
}

impl Drop for Temporary {
    fn drop(&mut self) {
        if let Some(path) = self.0.take() {
            let _ = std::fs::remove_file(path);
        }
    }
}
