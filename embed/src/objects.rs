//! Questions about Python objects that the safe API answers only by running
//! Python, or by touching what must stay untouched.
//!
//! The issues this solves:
//! 1. `isinstance` runs `__instancecheck__` and reads `__class__`, both
//!    Python; the end-of-call flush asks of every object the collector
//!    tracks whether its type derives from a file base, and asks the type
//!    object itself (`type_derives_from`).
//! 2. Iterating a dict through pyo3 takes a strong reference to each key
//!    and value: a write to its reference count, which in a forked child
//!    copies the page the zygote's object lives on. [`str_keys_after`]
//!    walks with borrowed references only.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyString, PyType};

/// Whether `object` is a plain Python function (`types.FunctionType`).
pub(crate) fn is_function(object: &Bound<'_, PyAny>) -> bool {
    // SAFETY: PyFunction_Check only reads the type of a live object, with
    // the GIL held (the `Bound` proves both).
    unsafe { pyo3::ffi::PyFunction_Check(object.as_ptr()) != 0 }
}

/// Whether the type of `object` is `base` or a subclass of it, by the
/// type's own MRO: no `__instancecheck__`, no `__class__`.
pub(crate) fn type_derives_from(object: &Bound<'_, PyAny>, base: &Bound<'_, PyType>) -> bool {
    // SAFETY: both are live objects, the GIL is held (the `Bound`s), and
    // `base` is a type object, as PyType_IsSubtype requires.
    unsafe {
        pyo3::ffi::PyType_IsSubtype(
            pyo3::ffi::Py_TYPE(object.as_ptr()),
            base.as_ptr().cast::<pyo3::ffi::PyTypeObject>(),
        ) != 0
    }
}

/// The first `chars` characters of `text`.
pub(crate) fn str_prefix<'py>(
    text: &Bound<'py, PyString>,
    chars: usize,
) -> PyResult<Bound<'py, PyString>> {
    let end = pyo3::ffi::Py_ssize_t::try_from(chars).unwrap_or(pyo3::ffi::Py_ssize_t::MAX);
    // SAFETY: `text` is a live str with the GIL held; PyUnicode_Substring
    // clamps `end` to its length and returns a new reference to a str, or
    // NULL with an exception set, which from_owned_ptr_or_err turns into
    // the error.
    unsafe {
        let ptr = pyo3::ffi::PyUnicode_Substring(text.as_ptr(), 0, end);
        Ok(Bound::from_owned_ptr_or_err(text.py(), ptr)?.cast_into_unchecked())
    }
}

/// The keys of `dict` after its first `skip` (in insertion order) that are
/// `str`s with a UTF-8 form, copied out; no reference count of a key or a
/// value moves. The dict must not change while it is walked, which holds:
/// nothing here runs Python.
pub fn str_keys_after(dict: &Bound<'_, PyDict>, skip: usize) -> Vec<String> {
    let mut names = Vec::new();
    let mut position: pyo3::ffi::Py_ssize_t = 0;
    let mut key: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    let mut value: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
    let mut seen = 0;
    // SAFETY: PyDict_Next over a live dict with the GIL held (the `Bound`)
    // hands out borrowed references, never written to; the dict is not
    // changed while it is walked (nothing below runs Python).
    while unsafe { pyo3::ffi::PyDict_Next(dict.as_ptr(), &mut position, &mut key, &mut value) } != 0
    {
        seen += 1;
        if seen <= skip {
            continue;
        }
        let mut size: pyo3::ffi::Py_ssize_t = 0;
        // SAFETY: a borrowed key of the dict; a str's UTF-8 form (an ASCII
        // name's is its own data) or NULL with an error, cleared below.
        let utf8 = unsafe { pyo3::ffi::PyUnicode_AsUTF8AndSize(key, &mut size) };
        if utf8.is_null() {
            // SAFETY: clears the error a non-str key raised; the GIL is held.
            unsafe { pyo3::ffi::PyErr_Clear() };
            continue;
        }
        // SAFETY: `size` bytes at `utf8`, owned by the key, which the dict
        // keeps alive while it is walked.
        let bytes = unsafe { std::slice::from_raw_parts(utf8.cast::<u8>(), size as usize) };
        if let Ok(name) = std::str::from_utf8(bytes) {
            names.push(name.to_string());
        }
    }
    names
}
