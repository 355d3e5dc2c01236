//! A generator node, driven one step at a time.
//!
//! The issue this solves: each yield must be sent the moment it happens,
//! and what the generator *returns* is the call's result. Python's own
//! iteration hides the return value inside `StopIteration`;
//! `PyIter_Send` hands it back as a value ([`resume`]).

use pyo3::exceptions::PyTypeError;
use pyo3::ffi;
use pyo3::prelude::*;

/// Whether `object` is a generator (what calling a generator function
/// returns), not merely an iterator.
pub fn is_generator(object: &Bound<'_, PyAny>) -> bool {
    // SAFETY: PyGen_Check only reads the type of a live object, with the
    // GIL held (the `Bound` proves both).
    unsafe { ffi::PyGen_Check(object.as_ptr()) != 0 }
}

/// Where a generator stopped.
pub enum Step<'py> {
    /// It yielded this value and waits to be resumed.
    Yielded(Bound<'py, PyAny>),
    /// It returned this value (`None` for a bare `return`) and is done.
    Returned(Bound<'py, PyAny>),
}

/// Resumes `generator` (sends it `None`, as `next` does) until its next
/// yield or its end; what it raised, as the error.
pub fn resume<'py>(generator: &Bound<'py, PyAny>) -> PyResult<Step<'py>> {
    let py = generator.py();
    if !is_generator(generator) {
        return Err(PyTypeError::new_err("only a generator can be resumed"));
    }
    let mut out: *mut ffi::PyObject = std::ptr::null_mut();
    // SAFETY: `generator` is a live generator (checked above: PyIter_Send
    // calls a non-iterator's missing `tp_iternext`) and the GIL is held;
    // PyIter_Send borrows its argument (None, which lives as long as the
    // interpreter) and returns a new reference in `out` for NEXT and RETURN.
    let sent = unsafe { ffi::PyIter_Send(generator.as_ptr(), ffi::Py_None(), &mut out) };
    let step = match sent {
        ffi::PySendResult::PYGEN_NEXT => Step::Yielded,
        ffi::PySendResult::PYGEN_RETURN => Step::Returned,
        ffi::PySendResult::PYGEN_ERROR => {
            return Err(PyErr::take(py).unwrap_or_else(|| {
                PyTypeError::new_err("the generator failed without an exception")
            }));
        }
    };
    // SAFETY: for NEXT and RETURN, `out` is a new reference (never NULL),
    // owned from here on.
    Ok(step(unsafe { Bound::from_owned_ptr(py, out) }))
}
