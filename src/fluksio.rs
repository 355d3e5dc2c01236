//! `import fluksio` inside a node: the module, native.
//!
//! Node code's whole interface to the engine. Installed in `sys.modules`
//! before anything can import, so it wins over an SDK of the same name in
//! the venv, as `worker_main.py`'s `_Reporter` does.
//!
//! - `emit(**ports)`: publish on output ports without returning yet.
//! - `logger`: the `fluksio` logger, INFO, not propagated; its records land
//!   in the call's logs like a print.
//! - `Port`, `node`, `use`, `Flow`: the authoring API, inert. A node made by
//!   `fluksio sync` imports its author's module, which declares ports and
//!   flows at the top; those were read at sync time, so here they import and
//!   do nothing.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyTuple};

use crate::zygote::channel;

/// Puts the native `fluksio` module into `sys.modules`.
pub fn install(py: Python<'_>) -> PyResult<()> {
    let module = PyModule::new(py, "fluksio")?;
    module.setattr("__doc__", "Report metrics and progress from inside a node.")?;
    module.add_function(wrap_pyfunction!(emit, &module)?)?;
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
    channel::send_event("emit", outputs.as_any(), "emit() got")
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
        // SAFETY: PyFunction_Check only reads the object's type.
        if unsafe { pyo3::ffi::PyFunction_Check(only.as_ptr()) } != 0 {
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
struct CurrentStderr;

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
