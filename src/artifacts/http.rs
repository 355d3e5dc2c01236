//! A store over HTTP: `PUT <url>?name=&media_type=` with the bytes, and
//! `GET <url>/sha256:<hex>`, with the worker's token as a bearer header.
//!
//! Blocking (ureq): a call's child has no async runtime, and needs none for
//! one transfer at a time.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use percent_encoding::{AsciiSet, NON_ALPHANUMERIC, utf8_percent_encode};
use ureq::tls::{RootCerts, TlsConfig};

use super::digest::{self, CHUNK, Digest, Hashing};
use super::{ArtifactError, Saved, Source, Temporary, io, temporary_beside, token};

/// What `urllib.parse.quote_plus` leaves alone; a space becomes `+`.
const QUERY: &AsciiSet = &NON_ALPHANUMERIC
    .remove(b'_')
    .remove(b'.')
    .remove(b'-')
    .remove(b'~')
    .remove(b' ');

fn quote_plus(text: &str) -> String {
    utf8_percent_encode(text, QUERY)
        .to_string()
        .replace(' ', "+")
}

/// An agent whose every read, write and connect gives up after `timeout`
/// of silence, which answers non-2xx statuses rather than failing on them,
/// and which trusts the system's root certificates (and `SSL_CERT_FILE`).
fn agent(timeout: Duration) -> ureq::Agent {
    ureq::Agent::config_builder()
        .http_status_as_error(false)
        .timeout_connect(Some(timeout))
        .timeout_per_read(Some(timeout))
        .timeout_per_write(Some(timeout))
        .input_buffer_size(CHUNK)
        .tls_config(
            TlsConfig::builder()
                .root_certs(RootCerts::PlatformVerifier)
                .build(),
        )
        .build()
        .into()
}

fn with_token<B>(request: ureq::RequestBuilder<B>) -> ureq::RequestBuilder<B> {
    // A header rather than the query string, which access logs keep.
    match token::token() {
        Some(token) => request.header("Authorization", format!("Bearer {token}")),
        None => request,
    }
}

pub fn save(
    base: &str,
    timeout: Duration,
    source: Source<'_>,
    name: &str,
    media_type: &str,
) -> Result<Saved, ArtifactError> {
    let url = format!(
        "{}?name={}&media_type={}",
        base.trim_end_matches('/'),
        quote_plus(name),
        quote_plus(media_type)
    );
    let request = with_token(agent(timeout).put(&url));
    let (response, saved) = match source {
        Source::Bytes(bytes) => {
            let response = request.send(bytes);
            (
                response,
                Saved {
                    digest: digest::of_bytes(bytes),
                    size: bytes.len() as u64,
                },
            )
        }
        Source::File(path) => {
            let file = std::fs::File::open(path).map_err(io("open", path))?;
            let length = file.metadata().map_err(io("read", path))?.len();
            // Hashed as it is sent: the file is read once.
            let mut body = Hashing::new(std::io::BufReader::with_capacity(CHUNK, file));
            let response = request
                .header("Content-Length", length.to_string())
                .send(ureq::SendBody::from_reader(&mut body));
            let (digest, size) = body.finish();
            (response, Saved { digest, size })
        }
    };
    let response = response.map_err(|e| transport(base, timeout, e))?;
    check(response)?;
    Ok(saved)
}

pub fn load(
    base: &str,
    timeout: Duration,
    cache: &Path,
    digest: &Digest,
) -> Result<PathBuf, ArtifactError> {
    let url = format!("{}/{digest}", base.trim_end_matches('/'));
    let response = with_token(agent(timeout).get(&url))
        .call()
        .map_err(|e| transport(base, timeout, e))?;
    if response.status().as_u16() == 404 {
        return Err(ArtifactError::NotFound {
            digest: digest.clone(),
            place: format!("the artifact store at {base}"),
        });
    }
    let mut response = check(response)?;
    std::fs::create_dir_all(cache).map_err(io("create", cache))?;
    let target = cache.join(digest.hex());
    let (mut out, temporary) = temporary_beside(&target)?;
    let temporary = Temporary(Some(temporary));
    let mut body = response.body_mut().with_config().limit(u64::MAX).reader();
    let (got, _) = digest::copy_hashing(&mut body, &mut out).map_err(|failed| match failed {
        digest::Failed::Reading(error) => read_failure(base, timeout, error),
        digest::Failed::Writing(error) => io("write", &target)(error),
    })?;
    drop(out);
    // Verified before the rename: a cache holds only what its name says.
    if got != *digest {
        return Err(ArtifactError::Mismatch {
            asked: digest.clone(),
            got,
        });
    }
    temporary.rename_to(&target)?;
    Ok(target)
}

/// A 2xx response, or the error its status means.
fn check(
    mut response: ureq::http::Response<ureq::Body>,
) -> Result<ureq::http::Response<ureq::Body>, ArtifactError> {
    let status = response.status().as_u16();
    if (200..300).contains(&status) {
        return Ok(response);
    }
    let mut text = String::new();
    let _ = response
        .body_mut()
        .with_config()
        .limit(4096)
        .reader()
        .read_to_string(&mut text);
    let first_line = text
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .chars()
        .take(300)
        .collect();
    Err(match status {
        401 | 403 => ArtifactError::Refused { status, first_line },
        _ => ArtifactError::Status { status, first_line },
    })
}

fn transport(base: &str, timeout: Duration, error: ureq::Error) -> ArtifactError {
    match error {
        ureq::Error::Timeout(_) => ArtifactError::Timeout {
            url: base.to_string(),
            after: timeout,
        },
        ureq::Error::Io(error) => read_failure(base, timeout, error),
        ureq::Error::HostNotFound => ArtifactError::Connection {
            url: base.to_string(),
            why: "the host was not found".into(),
            refused: false,
        },
        ureq::Error::ConnectionFailed => ArtifactError::Connection {
            url: base.to_string(),
            why: "the connection failed".into(),
            refused: false,
        },
        other => ArtifactError::Connection {
            url: base.to_string(),
            why: other.to_string(),
            refused: false,
        },
    }
}

fn read_failure(base: &str, timeout: Duration, error: std::io::Error) -> ArtifactError {
    use std::io::ErrorKind;
    match error.kind() {
        ErrorKind::TimedOut | ErrorKind::WouldBlock => ArtifactError::Timeout {
            url: base.to_string(),
            after: timeout,
        },
        kind => ArtifactError::Connection {
            url: base.to_string(),
            why: error.to_string(),
            refused: kind == ErrorKind::ConnectionRefused,
        },
    }
}
