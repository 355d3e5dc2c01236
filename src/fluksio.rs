//! `import fluksio` inside a node: the runtime behind the native module.
//!
//! The module itself (its functions' arguments and return values, the
//! logger, the inert authoring API) is `fluksio_embed::module`. What its
//! functions do outside Python is here, as the [`Runtime`] host it is
//! installed with:
//!
//! - `emit(**ports)`: the ports go down the call's channel as an `emit`
//!   event (`zygote::channel`).
//! - `save_artifact` / `load_artifact`: the artifact store the call's
//!   environment names (`crate::artifacts`), its failures raised as the
//!   Python exception a node author would catch.

use std::path::PathBuf;

use fluksio_embed::module::{ArtifactStore, Host, Saved, Source};
use pyo3::exceptions::{
    PyConnectionError, PyConnectionRefusedError, PyFileNotFoundError, PyOSError, PyPermissionError,
    PyRuntimeError, PyTimeoutError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::artifacts::store::Store;
use crate::artifacts::{ArtifactError, Digest};
use crate::zygote::channel;

/// The host `fluksio`'s functions are served by in every runtime process.
pub struct Runtime;

impl Host for Runtime {
    fn emit(&self, ports: &Bound<'_, PyDict>) -> PyResult<()> {
        channel::send_event("emit", ports.as_any(), "emit() got")
    }

    fn artifacts(&self) -> Box<dyn ArtifactStore> {
        Box::new(Store::from_env())
    }
}

impl ArtifactStore for Store {
    fn save(&self, source: Source<'_>, name: &str, media_type: &str) -> Result<Saved, PyErr> {
        let saved = Store::save(self, source, name, media_type).map_err(to_python)?;
        Ok(Saved {
            digest: saved.digest.to_string(),
            size: saved.size,
        })
    }

    fn load(&self, digest: &str) -> Result<PathBuf, PyErr> {
        let digest = Digest::parse(digest).map_err(PyValueError::new_err)?;
        Store::load(self, &digest).map_err(to_python)
    }
}

/// The Python exception a node author would catch for each failure.
fn to_python(error: ArtifactError) -> PyErr {
    let message = error.to_string();
    match error {
        ArtifactError::BadDigest(_) | ArtifactError::Mismatch { .. } => {
            PyValueError::new_err(message)
        }
        ArtifactError::NoStore | ArtifactError::Unreachable(_) => PyRuntimeError::new_err(message),
        ArtifactError::NotFound { .. } => PyFileNotFoundError::new_err(message),
        ArtifactError::Refused { .. } => PyPermissionError::new_err(message),
        ArtifactError::Status { .. } => PyConnectionError::new_err(message),
        ArtifactError::Timeout { .. } => PyTimeoutError::new_err(message),
        ArtifactError::Connection { refused: true, .. } => {
            PyConnectionRefusedError::new_err(message)
        }
        ArtifactError::Connection { .. } => PyConnectionError::new_err(message),
        // As `open()` raises it: OSError picks the subclass from errno.
        ArtifactError::Io { error, path, .. } => match error.raw_os_error() {
            Some(errno) => {
                PyOSError::new_err((errno, strerror(errno), path.to_string_lossy().into_owned()))
            }
            None => PyOSError::new_err(message),
        },
    }
}

/// The C library's text for `errno`, as `OSError` shows it. `strerror_r`
/// (the XSI one, which `libc` binds), not `strerror`: this runs with the GIL
/// released, beside whatever threads the node started.
fn strerror(errno: i32) -> String {
    let mut text = [0u8; 256];
    // SAFETY: strerror_r writes a NUL-terminated message of at most
    // `text.len()` bytes into `text`, which outlives the call; for an
    // unknown errno it writes "Unknown error N" and returns EINVAL.
    unsafe { libc::strerror_r(errno, text.as_mut_ptr().cast(), text.len()) };
    let end = text.iter().position(|&b| b == 0).unwrap_or(text.len());
    match &text[..end] {
        [] => format!("Unknown error {errno}"),
        message => String::from_utf8_lossy(message).into_owned(),
    }
}
