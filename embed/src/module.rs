//! `import fluksio` inside a node: the module, native.
//!
//! Node code's whole interface to the engine. Installed in `sys.modules`
//! before anything can import, so it wins over an SDK of the same name in
//! the venv, as `worker_main.py`'s `_Reporter` does.
//!
//! - `emit(**ports)`: publish on output ports without returning yet.
//! - `save_artifact(source, name, media_type)` / `load_artifact(ref)`: the
//!   artifact store, in Rust, with the GIL released while bytes move.
//! - `logger`: the `fluksio` logger, INFO, not propagated; its records land
//!   in the call's logs like a print.
//! - `Port`, `node`, `use`, `Flow`: the authoring API, inert. A node made by
//!   `fluksio sync` imports its author's module, which declares ports and
//!   flows at the top; those were read at sync time, so here they import and
//!   do nothing.
//!
//! What lies outside Python (where an emitted value goes, which store an
//! artifact goes to) is the runtime's: it hands a [`Host`] to [`install`].
//! Here is only the module's Python face: its arguments, as a node author
//! passes them, and the values it returns.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use pyo3::buffer::PyBuffer;
use pyo3::exceptions::{PyRuntimeError, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::{PyByteArray, PyBytes, PyDict, PyMemoryView, PyString, PyTuple};

/// The runtime behind the module's functions.
pub trait Host: Send + Sync {
    /// `emit(**ports)`: publishes `ports` (a dict, the node's own copy) on
    /// the call's output ports.
    fn emit(&self, ports: &Bound<'_, PyDict>) -> PyResult<()>;

    /// The artifact store as the node's environment names it now. Asked
    /// with the GIL held, before the source is read: a node's thread may be
    /// changing `os.environ`.
    fn artifacts(&self) -> Box<dyn ArtifactStore>;
}

/// Where artifacts go and come from. Its methods run with the GIL
/// released; their errors are the exceptions a node author would catch.
pub trait ArtifactStore: Send + Sync {
    /// Stores `source` as `name`.
    fn save(&self, source: Source<'_>, name: &str, media_type: &str) -> Result<Saved, PyErr>;

    /// A local path to read the artifact `digest` (as the node wrote it,
    /// not yet parsed) from.
    fn load(&self, digest: &str) -> Result<PathBuf, PyErr>;
}

/// What `save_artifact` was given.
#[derive(Debug, Clone, Copy)]
pub enum Source<'a> {
    /// `bytes`, a `bytearray` or a `memoryview`'s bytes, borrowed.
    Bytes(&'a [u8]),
    /// A file, read by the store a chunk at a time.
    File(&'a Path),
}

/// What a store says of an artifact it saved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    /// `sha256:…`.
    pub digest: String,
    pub size: u64,
}

static HOST: OnceLock<&'static dyn Host> = OnceLock::new();

fn host() -> PyResult<&'static dyn Host> {
    HOST.get()
        .copied()
        .ok_or_else(|| PyRuntimeError::new_err("fluksio is not connected to its runtime"))
}

/// Puts the native `fluksio` module into `sys.modules`, its functions
/// served by `host` (the first one installed in this process).
pub fn install(py: Python<'_>, host: &'static dyn Host) -> PyResult<()> {
    let _ = HOST.set(host);
    let module = PyModule::new(py, "fluksio")?;
    module.setattr("__doc__", "Report metrics and progress from inside a node.")?;
    module.add_function(wrap_pyfunction!(emit, &module)?)?;
    module.add_function(wrap_pyfunction!(save_artifact, &module)?)?;
    module.add_function(wrap_pyfunction!(load_artifact, &module)?)?;
    module.add_function(wrap_pyfunction!(port, &module)?)?;
    module.add_function(wrap_pyfunction!(node, &module)?)?;
    module.add_function(wrap_pyfunction!(r#use, &module)?)?;
    module.add_function(wrap_pyfunction!(flow, &module)?)?;
    module.add_class::<Declared>()?;
    module.setattr("logger", make_logger(py)?)?;
    py.import("sys")?
        .getattr("modules")?
        .set_item("fluksio", module)?;
    Ok(())
}

/// Publish on this node's output ports without returning yet.
///
/// Yielding says the same and should be preferred; use this where a yield
/// cannot reach: inside a training framework's callback, say, which calls
/// you rather than the other way round.
#[pyfunction]
#[pyo3(signature = (**ports))]
fn emit(py: Python<'_>, ports: Option<&Bound<'_, PyDict>>) -> PyResult<()> {
    let outputs = match ports {
        Some(ports) => ports.copy()?,
        None => PyDict::new(py),
    };
    host()?.emit(&outputs)
}

/// Store bytes or a file and return the reference to return onward.
///
/// `source` is `bytes`, `bytearray` or a `memoryview`, or a path (`str` or
/// `os.PathLike`), which is read a chunk at a time. Returns
/// `{"digest": "sha256:…", "size", "media_type", "name"}`.
#[pyfunction]
#[pyo3(signature = (source, name = None, media_type = None))]
fn save_artifact<'py>(
    py: Python<'py>,
    source: &Bound<'py, PyAny>,
    name: Option<String>,
    media_type: Option<String>,
) -> PyResult<Bound<'py, PyDict>> {
    let media_type = media_type.unwrap_or_else(|| "application/octet-stream".into());
    let name = name.filter(|n| !n.is_empty());
    // Read with the GIL held: a node's thread may be changing os.environ.
    let store = host()?.artifacts();
    let is_bytes_like = source.is_instance_of::<PyBytes>()
        || source.is_instance_of::<PyByteArray>()
        || source.is_instance_of::<PyMemoryView>();
    let (saved, name) = if is_bytes_like {
        let buffer = match PyBuffer::<u8>::get(source) {
            Ok(buffer) if buffer.is_c_contiguous() => buffer,
            // A strided or typed view: its bytes, copied once.
            _ => PyBuffer::<u8>::get(&py.import("builtins")?.getattr("bytes")?.call1((source,))?)?,
        };
        // SAFETY: the buffer is C-contiguous and stays exported (its object
        // alive, a bytearray unresizable) until `buffer` drops, after this.
        let bytes = unsafe {
            std::slice::from_raw_parts(buffer.buf_ptr() as *const u8, buffer.len_bytes())
        };
        let saved = py.detach(|| {
            store.save(
                Source::Bytes(bytes),
                name.as_deref().unwrap_or("artifact.bin"),
                &media_type,
            )
        });
        drop(buffer);
        (saved, name.unwrap_or_else(|| "artifact.bin".into()))
    } else if source.is_instance_of::<PyString>() || source.hasattr("__fspath__")? {
        let path: PathBuf = py
            .import("os")?
            .call_method1("fsdecode", (source,))?
            .extract::<String>()?
            .into();
        let name = name.unwrap_or_else(|| {
            path.file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default()
        });
        (
            py.detach(|| store.save(Source::File(&path), &name, &media_type)),
            name,
        )
    } else {
        return Err(PyTypeError::new_err(format!(
            "save_artifact takes bytes, a bytearray, a memoryview or a path, not {}",
            source.get_type().name()?
        )));
    };
    let saved = saved?;
    let reference = PyDict::new(py);
    reference.set_item("digest", saved.digest)?;
    reference.set_item("size", saved.size)?;
    reference.set_item("media_type", media_type)?;
    reference.set_item("name", name)?;
    Ok(reference)
}

/// Fetch an artifact and hand back a local path to read it from. `ref` is
/// the dict `save_artifact` returned, or its digest alone.
#[pyfunction]
#[pyo3(signature = (r#ref))]
fn load_artifact(py: Python<'_>, r#ref: &Bound<'_, PyAny>) -> PyResult<String> {
    let text = if let Ok(text) = r#ref.cast::<PyString>() {
        text.to_string()
    } else if r#ref.hasattr("get")? {
        r#ref
            .call_method1("get", ("digest",))?
            .str()
            .map(|s| s.to_string())
            .unwrap_or_default()
    } else {
        return Err(PyTypeError::new_err(format!(
            "load_artifact takes an artifact reference (the dict save_artifact returned) or its digest, not {}",
            r#ref.get_type().name()?
        )));
    };
    let store = host()?.artifacts();
    let path = py.detach(|| store.load(&text))?;
    Ok(path.to_string_lossy().into_owned())
}

/// A port declaration, already read by `fluksio sync`.
#[pyfunction(name = "Port")]
#[pyo3(signature = (*_args, **_kwargs))]
fn port(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Declared {
    Declared
}

/// The decorator, which here gives the function straight back, called
/// (`@node(...)`) or bare (`@node`).
#[pyfunction]
#[pyo3(signature = (*args, **kwargs))]
fn node<'py>(
    args: &Bound<'py, PyTuple>,
    kwargs: Option<&Bound<'py, PyDict>>,
) -> PyResult<Bound<'py, PyAny>> {
    let py = args.py();
    if args.len() == 1 && kwargs.is_none_or(|k| k.is_empty()) {
        let only = args.get_item(0)?;
        if crate::objects::is_function(&only) {
            return Ok(only);
        }
    }
    Ok(Bound::new(py, Identity)?.into_any())
}

/// One use of a node in a flow, already read by `fluksio sync`.
#[pyfunction(name = "use")]
#[pyo3(signature = (*_args, **_kwargs))]
fn r#use(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Declared {
    Declared
}

/// A flow declaration, already read by `fluksio sync`.
#[pyfunction(name = "Flow")]
#[pyo3(signature = (*_args, **_kwargs))]
fn flow(_args: &Bound<'_, PyTuple>, _kwargs: Option<&Bound<'_, PyDict>>) -> Declared {
    Declared
}

/// Stands in for a declaration whose work was done before the run.
///
/// Tolerant on purpose: a module may keep one at module level and touch it
/// in ways a node never exercises, and none of that should fail an import.
#[pyclass(module = "fluksio", frozen)]
struct Declared;

#[pymethods]
impl Declared {
    fn __getattr__(&self, name: &str) -> PyResult<Declared> {
        if name.starts_with("__") {
            return Err(pyo3::exceptions::PyAttributeError::new_err(
                name.to_string(),
            ));
        }
        Ok(Declared)
    }

    #[pyo3(signature = (*_args, **_kwargs))]
    fn __call__(
        &self,
        _args: &Bound<'_, PyTuple>,
        _kwargs: Option<&Bound<'_, PyDict>>,
    ) -> Declared {
        Declared
    }

    fn __repr__(&self) -> &'static str {
        "<fluksio declaration>"
    }
}

/// What `node(...)` returns: a decorator that hands the function back.
#[pyclass(module = "fluksio", frozen)]
struct Identity;

#[pymethods]
impl Identity {
    fn __call__<'py>(&self, function: Bound<'py, PyAny>) -> Bound<'py, PyAny> {
        function
    }
}

/// Writes to whatever `sys.stderr` is at the time of the record.
///
/// A call captures `sys.stderr` into its logs, so a handler holding the
/// stream it was built with would write past every one of them.
#[pyclass(module = "fluksio", frozen)]
pub(crate) struct CurrentStderr;

#[pymethods]
impl CurrentStderr {
    fn write(&self, py: Python<'_>, text: Bound<'_, PyAny>) -> PyResult<()> {
        py.import("sys")?
            .getattr("stderr")?
            .call_method1("write", (text,))?;
        Ok(())
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.import("sys")?.getattr("stderr")?.call_method0("flush")?;
        Ok(())
    }
}

/// The `fluksio` logger: INFO, into the call's logs, not propagated (a node
/// calling `basicConfig` for its own logging would see each record twice).
fn make_logger(py: Python<'_>) -> PyResult<Bound<'_, PyAny>> {
    let logging = py.import("logging")?;
    let logger = logging.call_method1("getLogger", ("fluksio",))?;
    logger.call_method1("setLevel", (logging.getattr("INFO")?,))?;
    let handler = logging.call_method1("StreamHandler", (CurrentStderr,))?;
    logger.call_method1("addHandler", (handler,))?;
    logger.setattr("propagate", false)?;
    Ok(logger)
}
