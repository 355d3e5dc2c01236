//! The store a process sees, read from its environment: a directory on
//! this machine, an HTTP store (its downloads cached by digest), or none.

use std::path::PathBuf;
use std::time::Duration;

use super::digest::Digest;
use super::{ArtifactError, CACHE_ENV, DIR_ENV, Saved, Source, TIMEOUT_ENV, URL_ENV};
use super::{directory, http};

/// As `worker_main.py`'s `ARTIFACT_TIMEOUT_S`: a checkpoint over a slow link
/// takes a while, but a store that says nothing for five minutes is gone.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The store this process sees, read from its environment now.
pub struct Store {
    location: Location,
    cache: PathBuf,
    timeout: Duration,
}

enum Location {
    Directory(PathBuf),
    Http(String),
    Nowhere,
}

impl Store {
    pub fn from_env() -> Store {
        Store::from_vars(|name| std::env::var(name).ok())
    }

    /// The store another environment would see (a service's, in the agent).
    pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Store {
        let set = |name: &str| var(name).filter(|v| !v.is_empty());
        let location = match (set(DIR_ENV), set(URL_ENV)) {
            (Some(dir), _) => Location::Directory(PathBuf::from(dir)),
            (None, Some(url)) => Location::Http(url),
            (None, None) => Location::Nowhere,
        };
        let cache = set(CACHE_ENV)
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("fluksio-artifacts"));
        let timeout = set(TIMEOUT_ENV)
            .and_then(|v| v.parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Store {
            location,
            cache,
            timeout,
        }
    }

    /// Stores `source` and says what it is. `name` and `media_type` travel
    /// to an HTTP store with the upload.
    pub fn save(
        &self,
        source: Source<'_>,
        name: &str,
        media_type: &str,
    ) -> Result<Saved, ArtifactError> {
        match &self.location {
            Location::Directory(dir) => directory::save(dir, source),
            Location::Http(url) => http::save(url, self.timeout, source, name, media_type),
            Location::Nowhere => Err(ArtifactError::NoStore),
        }
    }

    /// A local path holding the artifact's bytes, downloading it if needed.
    pub fn load(&self, digest: &Digest) -> Result<PathBuf, ArtifactError> {
        match &self.location {
            Location::Directory(dir) => directory::load(dir, digest),
            // Cached by digest: content addressing means a file once fetched
            // is never stale, so a sweep pulls a shared input across once.
            _ => {
                let cached = self.cache.join(digest.hex());
                if cached.is_file() {
                    return Ok(cached);
                }
                match &self.location {
                    Location::Http(url) => http::load(url, self.timeout, &self.cache, digest),
                    _ => Err(ArtifactError::Unreachable(digest.clone())),
                }
            }
        }
    }
}
