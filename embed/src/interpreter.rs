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
//! 4. Another *build* of the same version (Debian's 3.11.2 beside pyenv's
//!    3.11.7) passes a version check and then fails every node's `import
//!    math`: its stdlib is not the embedded library's. The target's
//!    `sys.version` (number, build date, compiler) must be the embedded
//!    library's own (`Py_GetVersion`, readable before initialising); a venv
//!    made from the embedded interpreter reports the same.
//! 5. `--python python3` is looked up on PATH, and a pyenv shim or a
//!    symlink is replaced by the `sys.executable` it reports. Without
//!    `--python`: an activated venv (`VIRTUAL_ENV`), then the venv this
//!    binary is installed in (`pip install .`), then the interpreter it was
//!    built against.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use pyo3::ffi;

/// The interpreter this binary was built against (`PYO3_PYTHON` at build).
pub const BUILD_PYTHON: &str = env!("FLUKSIO_BUILD_PYTHON");
/// Its `major.minor`, the only version whose stdlib this binary can load.
pub const BUILD_PYTHON_VERSION: &str = env!("FLUKSIO_BUILD_PYTHON_VERSION");
/// The base interpreter of [`BUILD_PYTHON`] where that is a venv (a build
/// tool's throwaway one, say), else the same.
pub const BUILD_BASE_PYTHON: &str = env!("FLUKSIO_BUILD_BASE_PYTHON");

/// Where the default `--python` came from, for the error that names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Chosen {
    /// `--python` or `FLUKSIO_PYTHON`.
    Given,
    /// `VIRTUAL_ENV`, an activated venv.
    VirtualEnv,
    /// The venv this binary is installed in.
    Beside,
    /// The interpreter this binary was built against.
    Built,
}

/// The interpreter node code runs on: `given` (a path, or a name looked up
/// on PATH), else the defaults in the module docs.
pub fn resolve(given: Option<&Path>) -> (PathBuf, Chosen) {
    if let Some(given) = given {
        let is_name = !given.as_os_str().as_bytes().contains(&b'/');
        if is_name && let Some(found) = on_path(given) {
            return (found, Chosen::Given);
        }
        return (given.to_path_buf(), Chosen::Given);
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV").filter(|v| !v.is_empty()) {
        return (Path::new(&venv).join("bin/python"), Chosen::VirtualEnv);
    }
    if let Some(beside) = std::env::current_exe().ok().and_then(|exe| {
        let bin = exe.parent()?;
        let python = bin.join("python");
        (bin.parent()?.join("pyvenv.cfg").is_file() && python.exists()).then_some(python)
    }) {
        return (beside, Chosen::Beside);
    }
    if Path::new(BUILD_PYTHON).exists() {
        (PathBuf::from(BUILD_PYTHON), Chosen::Built)
    } else {
        (PathBuf::from(BUILD_BASE_PYTHON), Chosen::Built)
    }
}

fn on_path(name: &Path) -> Option<PathBuf> {
    use std::os::unix::fs::PermissionsExt;
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join(name))
        .find(|path| {
            path.metadata()
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The embedded library's `sys.version`.
pub fn embedded_version() -> String {
    // SAFETY: Py_GetVersion returns a static string and may be called before
    // the interpreter is initialised.
    unsafe { std::ffi::CStr::from_ptr(ffi::Py_GetVersion()) }
        .to_string_lossy()
        .into_owned()
}

/// What `check` learnt: the executable to initialise with (a shim's or a
/// symlink's target, as the interpreter reports it).
static PROBED: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();

/// What the interpreter says of itself: `major.minor`, `sys.version`,
/// `sys.executable`, one a line (a bare `major.minor` is enough to refuse
/// another version).
const PROBE: &str = "import sys; print('%d.%d' % sys.version_info[:2]); \
                     print(sys.version.replace(chr(10), ' ')); print(sys.executable)";

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
    Unrunnable {
        python: PathBuf,
        why: String,
    },
    WrongVersion {
        python: PathBuf,
        found: String,
    },
    /// The same version, another build: its stdlib is not the embedded one's.
    OtherBuild {
        python: PathBuf,
        found: String,
    },
    Init(String),
}

impl std::fmt::Display for StartError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartError::Missing(python) if !python.as_os_str().as_bytes().contains(&b'/') => {
                write!(
                    f,
                    "--python {}: no such command on PATH\nhint: pass a path to the interpreter (or venv's bin/python) that node code should run on",
                    python.display()
                )
            }
            StartError::Missing(python) => write!(
                f,
                "{} does not exist\nhint: pass --python with the interpreter (or venv's bin/python) that node code should run on",
                python.display()
            ),
            StartError::OtherBuild { python, found } => write!(
                f,
                "{} is another build of Python {BUILD_PYTHON_VERSION} ({found}) than the one this \
                 fluksio-zygote embeds ({}, {BUILD_BASE_PYTHON}): its standard library does not \
                 load into it\nhint: use --python {BUILD_BASE_PYTHON} or a venv made from it \
                 ({BUILD_BASE_PYTHON} -m venv DIR), or rebuild for this one: PYO3_PYTHON={} \
                 cargo build --release",
                python.display(),
                short_version(&embedded_version()),
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
        if self.python == Path::new(BUILD_PYTHON) || self.python == Path::new(BUILD_BASE_PYTHON) {
            return Ok(());
        }
        let output = Command::new(&self.python)
            .args(["-S", "-c", PROBE])
            .output()
            .map_err(|e| StartError::Unrunnable {
                python: self.python.clone(),
                why: e.to_string(),
            })?;
        let stdout = String::from_utf8_lossy(&output.stdout);
        let mut lines = stdout.lines().map(str::trim);
        let found = lines.next().unwrap_or("").to_string();
        let (version, executable) = (lines.next(), lines.next());
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
        if let Some(version) = version
            && version != embedded_version().replace('\n', " ").trim()
        {
            return Err(StartError::OtherBuild {
                python: self.python.clone(),
                found: short_version(version),
            });
        }
        if let Some(executable) = executable.filter(|e| e.starts_with('/')) {
            let _ = PROBED.set(PathBuf::from(executable));
        }
        Ok(())
    }

    /// Initialises CPython on this thread, then releases the GIL: use
    /// `Python::attach` afterwards, as usual.
    ///
    /// Must run once, before any other Python call, on the thread that will
    /// fork (signal handling and `PyOS_AfterFork_Child` assume it). The
    /// interpreter installs no signal handler of its own: whoever needs to
    /// tell the kernel's actions before it from those after reads them just
    /// before this call.
    pub fn initialize(&self) -> Result<(), StartError> {
        let python = PROBED.get().unwrap_or(&self.python);
        let executable = CString::new(python.as_os_str().as_bytes())
            .map_err(|_| StartError::Init("the --python path contains a NUL byte".into()))?;
        // SAFETY: the PyConfig is initialised by PyConfig_InitPythonConfig
        // before any field is read, every string goes through the setter that
        // copies it, and the config is cleared on every path out.
        unsafe {
            let mut config = std::mem::MaybeUninit::<ffi::PyConfig>::zeroed();
            ffi::PyConfig_InitPythonConfig(config.as_mut_ptr());
            let config = config.assume_init_mut();
            // Signals are the runtime's to set: the zygote's are its own, a
            // call's child's a fresh python3's.
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
        // SAFETY: the interpreter was just initialised on this thread, which
        // holds the GIL; releasing it lets pyo3's attach take it the usual
        // way. The thread state it returns is the main one, which CPython
        // keeps and `Python::attach` finds again on this thread.
        unsafe { ffi::PyEval_SaveThread() };
        Ok(())
    }
}

/// `3.11.2 (main, Mar 13 2023, 12:18:29)` of a `sys.version`: without the
/// compiler.
fn short_version(version: &str) -> String {
    version.split(" [").next().unwrap_or(version).to_string()
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
