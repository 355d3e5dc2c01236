//! Starting the embedded interpreter: which Python, configured how.
//!
//! The issues this solves:
//! 1. Node code must import from the environment of `--python` (a venv's
//!    `bin/python` included), not from wherever `python3` is on PATH. Setting
//!    `PyConfig.executable` makes CPython's own path calculation find that
//!    environment's prefix and site-packages, also under `env -i`.
//! 2. The embedded libpython is one version; another version's stdlib does
//!    not load into it. That is refused before initialising, with the fix.
//! 3. pyo3's `Python::initialize` installs signal handlers and guesses its
//!    home from PATH; the zygote needs neither.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pyo3::ffi;

/// The interpreter this binary was built against (`PYO3_PYTHON` at build).
pub const BUILD_PYTHON: &str = env!("FLUKSIO_BUILD_PYTHON");
/// Its `major.minor`, the only version whose stdlib this binary can load.
pub const BUILD_PYTHON_VERSION: &str = env!("FLUKSIO_BUILD_PYTHON_VERSION");

/// How to start the embedded interpreter.
#[derive(Debug, Clone)]
pub struct InterpreterConfig {
    /// The interpreter whose environment node code imports from.
    pub python: PathBuf,
}

/// Why the interpreter could not start; each says what to do about it.
#[derive(Debug)]
pub enum StartError {
    Missing(PathBuf),
    Unrunnable { python: PathBuf, why: String },
    WrongVersion { python: PathBuf, found: String },
    Init(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Missing(python) => write!(
                f,
                "{} does not exist\nhint: pass --python with the interpreter (or venv's bin/python) that node code should run on",
                python.display()
            ),
            StartError::Unrunnable { python, why } => write!(
                f,
                "could not ask {} for its version: {why}\nhint: --python must name a Python interpreter",
                python.display()
            ),
            StartError::WrongVersion { python, found } => write!(
                f,
                "{} is Python {found}, but this fluksio-zygote embeds Python {BUILD_PYTHON_VERSION} \
                 (built against {BUILD_PYTHON}), and one version cannot load the other's modules\n\
                 hint: use a Python {BUILD_PYTHON_VERSION} environment, or rebuild for this one: \
                 PYO3_PYTHON={} cargo build --release",
                python.display(),
                python.display()
            ),
            StartError::Init(why) => write!(f, "the embedded Python did not start: {why}"),
        }
    }
}

impl std::error::Error for StartError {}

impl InterpreterConfig {
    /// Checks that `python` exists and is the embedded version.
    ///
    /// Asking the interpreter costs one short process at start; reading
    /// `pyvenv.cfg` instead would miss a plain interpreter, and a wrong
    /// guess here ends in CPython's fatal "could not find the encodings
    /// module", which says nothing about versions.
    pub fn check(&self) -> Result<(), StartError> {
        if !self.python.exists() {
            return Err(StartError::Missing(self.python.clone()));
        }
        if self.python == Path::new(BUILD_PYTHON) {
            return Ok(());
        }
        let output = Command::new(&self.python)
            .args([
                "-S",
                "-c",
                "import sys; print('%d.%d' % sys.version_info[:2])",
            ])
            .output()
            .map_err(|e| StartError::Unrunnable {
                python: self.python.clone(),
                why: e.to_string(),
            })?;
        let found = String::from_utf8_lossy(&output.stdout).trim().to_string();
        if !output.status.success() || found.is_empty() {
            return Err(StartError::Unrunnable {
                python: self.python.clone(),
                why: format!("it {}", output.status),
            });
        }
        if found != BUILD_PYTHON_VERSION {
            return Err(StartError::WrongVersion {
                python: self.python.clone(),
                found,
            });
        }
        Ok(())
    }

    /// Initialises CPython on this thread, which keeps the GIL afterwards.
    ///
    /// Must run once, before any other Python call, on the thread that will
    /// fork (signal handling and `PyOS_AfterFork_Child` assume it).
    pub fn initialize(&self) -> Result<(), StartError> {
        let executable = CString::new(self.python.as_os_str().as_bytes())
            .map_err(|_| StartError::Init("the --python path contains a NUL byte".into()))?;
        // SAFETY: the PyConfig is initialised by PyConfig_InitPythonConfig
        // before any field is read, every string goes through the setter that
        // copies it, and the config is cleared on every path out.
        unsafe {
            let mut config = std::mem::MaybeUninit::<ffi::PyConfig>::zeroed();
            ffi::PyConfig_InitPythonConfig(config.as_mut_ptr());
            let config = config.assume_init_mut();
            // The zygote and its children handle signals themselves; a
            // KeyboardInterrupt handler would also swallow the agent's SIGINT.
            config.install_signal_handlers = 0;
            config.parse_argv = 0;
            // Never put the current directory on sys.path, as `python script`
            // never does for the worker either.
            config.safe_path = 1;
            let status =
                ffi::PyConfig_SetBytesString(config, &mut config.executable, executable.as_ptr());
            if ffi::PyStatus_Exception(status) != 0 {
                ffi::PyConfig_Clear(config);
                return Err(StartError::Init(status_message(status)));
            }
            let status = ffi::Py_InitializeFromConfig(config);
            ffi::PyConfig_Clear(config);
            if ffi::PyStatus_Exception(status) != 0 {
                return Err(StartError::Init(status_message(status)));
            }
        }
        Ok(())
    }
}

fn status_message(status: ffi::PyStatus) -> String {
    if status.err_msg.is_null() {
        return "unknown error".into();
    }
    // SAFETY: err_msg is a static C string CPython set with the status.
    unsafe { std::ffi::CStr::from_ptr(status.err_msg) }
        .to_string_lossy()
        .into_owned()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_interpreter_is_named_with_a_hint() {
        let config = InterpreterConfig {
            python: "/nonexistent/bin/python".into(),
        };
        let message = config.check().unwrap_err().to_string();
        assert!(message.contains("/nonexistent/bin/python does not exist"));
        assert!(message.contains("hint: "));
    }
}
