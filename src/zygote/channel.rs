//! The line channel from a call's child back to whoever reads the call:
//! events while it runs, then exactly one reply.
//!
//! A child writes on a pipe of its own, never on fd 1, which points at
//! stderr so that a stray `os.write(1, …)` from a node or a native library
//! lands in the log rather than in the protocol. Each line is encoded by
//! CPython's own `json.dumps`, so floats, big ints and non-string keys come
//! out as `worker_main.py` wrote them.

use std::os::fd::RawFd;
use std::sync::{Mutex, OnceLock};
use std::time::{SystemTime, UNIX_EPOCH};

use pyo3::exceptions::{PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyString};

/// This process's channel: set once in a call's child, absent in the zygote
/// (where a node's module-level `emit` during loading goes nowhere: the
/// child that checked the load already sent it).
static CHANNEL: OnceLock<Channel> = OnceLock::new();

/// Held while one line is written, so lines from a node's threads never
/// interleave. Taken without the GIL: a writer blocked on a full pipe must
/// not stop the other threads.
static WRITING: Mutex<()> = Mutex::new(());

struct Channel {
    fd: RawFd,
    /// The call's id, which events carry; a resident child serves one call
    /// after another.
    call_id: Mutex<String>,
}

/// Opens the channel for this child's call (again for each call of a
/// resident child, on the same fd).
pub fn open(fd: RawFd, call_id: &str) {
    match CHANNEL.get() {
        Some(channel) => {
            *channel.call_id.lock().unwrap_or_else(|e| e.into_inner()) = call_id.to_string();
        }
        None => {
            let _ = CHANNEL.set(Channel {
                fd,
                call_id: Mutex::new(call_id.to_string()),
            });
        }
    }
}

/// The message a NaN or an infinity gets, wherever a node sends one.
pub fn not_finite(what: &str) -> String {
    format!(
        "{what} a NaN or an infinity, which JSON cannot carry — publish None, \
         or a number that says the measurement had nothing in it."
    )
}

/// Whether numpy's scalars and arrays go out as the numbers, booleans and
/// lists they hold (`run` and `sweep`). Off for the worker contract, which
/// refuses them as the reference's `worker_main.py` does; set before any
/// child is forked, so the zygote and every call see the same.
static ACCEPT_NUMPY: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns on [`ACCEPT_NUMPY`] in this process and the children it forks.
pub fn accept_numpy() {
    ACCEPT_NUMPY.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `json.dumps(value)` or, with `allow_nan` false, the strict form; where
/// [`accept_numpy`] is on, with numpy's values as the plain ones they hold
/// ([`numpy_plain`]), held to the same rules (a NaN in an array is refused
/// by the strict form as any NaN is).
///
/// Through encoders made once: `json.dumps` with any argument but the
/// value builds a new `JSONEncoder` per call, which a node yielding a
/// hundred thousand events would pay each time. `encode` of an encoder
/// with the same settings is what `dumps` returns.
pub fn dumps<'py>(value: &Bound<'py, PyAny>, allow_nan: bool) -> PyResult<Bound<'py, PyString>> {
    static LENIENT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static STRICT: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static LENIENT_NUMPY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    static STRICT_NUMPY: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    let py = value.py();
    let numpy = ACCEPT_NUMPY.load(std::sync::atomic::Ordering::Relaxed);
    let encoder = || -> PyResult<Py<PyAny>> {
        let options = PyDict::new(py);
        options.set_item("allow_nan", allow_nan)?;
        if numpy {
            options.set_item("default", wrap_pyfunction!(numpy_default, py)?)?;
        }
        let encoder = py
            .import("json")?
            .getattr("JSONEncoder")?
            .call((), Some(&options))?;
        Ok(encoder.getattr("encode")?.unbind())
    };
    let once = match (allow_nan, numpy) {
        (true, false) => &LENIENT,
        (false, false) => &STRICT,
        (true, true) => &LENIENT_NUMPY,
        (false, true) => &STRICT_NUMPY,
    };
    let encode = once.get_or_try_init(py, encoder)?;
    Ok(encode.bind(py).call1((value,))?.cast_into::<PyString>()?)
}

/// The encoder's `default`: what [`numpy_plain`] makes of `value`, or the
/// `TypeError` `json` raises itself (the caller names the value).
#[pyfunction]
fn numpy_default<'py>(value: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    if let Some(plain) = numpy_plain(value)? {
        return Ok(plain);
    }
    Err(PyTypeError::new_err(format!(
        "Object of type {} is not JSON serializable",
        value.get_type().name()?
    )))
}

/// `value` as the plain Python values it holds, where it is a numpy scalar
/// (`.item()`: `np.int64(3)` is `3`, `np.bool_(True)` is `True`) or array
/// (`.tolist()`, nested lists of those); `None` for anything else, and for
/// a scalar no plainer as an item (a `longdouble` stays one).
///
/// Always `None` where [`accept_numpy`] is off (the worker contract).
/// numpy is never imported here: it is looked for in `sys.modules`, where
/// any of its values has put it.
pub fn numpy_plain<'py>(value: &Bound<'py, PyAny>) -> PyResult<Option<Bound<'py, PyAny>>> {
    /// `numpy.generic` and `numpy.ndarray`, once numpy has been seen.
    static TYPES: PyOnceLock<(Py<PyAny>, Py<PyAny>)> = PyOnceLock::new();
    if !ACCEPT_NUMPY.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(None);
    }
    let py = value.py();
    let types = match TYPES.get(py) {
        Some(types) => types,
        None => {
            let numpy = py
                .import("sys")
                .and_then(|sys| sys.getattr("modules"))
                .and_then(|modules| modules.get_item("numpy"));
            // Not imported (or blocked, or something else by that name).
            let found =
                numpy.and_then(|numpy| Ok((numpy.getattr("generic")?, numpy.getattr("ndarray")?)));
            let Ok((generic, ndarray)) = found else {
                return Ok(None);
            };
            TYPES.get_or_init(py, || (generic.unbind(), ndarray.unbind()))
        }
    };
    let (generic, ndarray) = (types.0.bind(py), types.1.bind(py));
    // A value whose conversion fails is one JSON cannot carry, refused as
    // such (the caller names it), whatever `item` or `tolist` raised.
    if value.is_instance(generic)? {
        let item = value.call_method0(pyo3::intern!(py, "item")).ok();
        return Ok(item.filter(|item| !item.is_instance(generic).unwrap_or(true)));
    }
    if value.is_instance(ndarray)? {
        return Ok(value.call_method0(pyo3::intern!(py, "tolist")).ok());
    }
    Ok(None)
}

/// `json.loads(text)`.
pub fn loads<'py>(py: Python<'py>, text: &str) -> PyResult<Bound<'py, PyAny>> {
    static LOADS: PyOnceLock<Py<PyAny>> = PyOnceLock::new();
    LOADS.import(py, "json", "loads")?.call1((text,))
}

/// Set while node code runs that is not a call (a warm-up): what it emits
/// or yields goes nowhere.
static MUTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Runs `f` with events muted (see [`MUTED`]).
pub fn muted<R>(f: impl FnOnce() -> R) -> R {
    MUTED.store(true, std::sync::atomic::Ordering::Relaxed);
    let result = f();
    MUTED.store(false, std::sync::atomic::Ordering::Relaxed);
    result
}

/// Sends `{"event": kind, "outputs": outputs, "call_id", "ts"}`.
///
/// A value JSON cannot carry raises here, in the node's own frame for
/// `emit`: a NaN as a `ValueError` that says what to publish instead.
pub fn send_event(kind: &str, outputs: &Bound<'_, PyAny>, what: &str) -> PyResult<()> {
    let py = outputs.py();
    let Some(channel) = CHANNEL.get() else {
        return Ok(());
    };
    if MUTED.load(std::sync::atomic::Ordering::Relaxed) {
        return Ok(());
    }
    let event = PyDict::new(py);
    event.set_item(pyo3::intern!(py, "event"), kind)?;
    event.set_item(pyo3::intern!(py, "outputs"), outputs)?;
    let call_id = channel
        .call_id
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .clone();
    event.set_item(pyo3::intern!(py, "call_id"), call_id)?;
    event.set_item(pyo3::intern!(py, "ts"), unix_time())?;
    let line = match dumps(event.as_any(), false) {
        Ok(line) => line,
        Err(error) if error.is_instance_of::<PyValueError>(py) => {
            // The strict encoder refuses a NaN and a cycle alike; only the
            // NaN encodes once NaN is allowed.
            if dumps(event.as_any(), true).is_ok() {
                return Err(PyValueError::new_err(not_finite(what)));
            }
            return Err(error);
        }
        Err(error) => return Err(error),
    };
    let bytes = line.to_str()?.as_bytes();
    py.detach(|| write_line(channel.fd, bytes))?;
    Ok(())
}

/// Sends the reply, the last line of the call.
pub fn send_reply(py: Python<'_>, line: &str) -> std::io::Result<()> {
    match CHANNEL.get() {
        Some(channel) => py.detach(|| write_line(channel.fd, line.as_bytes())),
        None => Ok(()),
    }
}

fn unix_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Writes `line` and a newline, whole: partial writes and EINTR retried.
fn write_line(fd: RawFd, line: &[u8]) -> std::io::Result<()> {
    let _one_line_at_a_time = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if line.len() >= ONE_WRITE {
        // A reply of megabytes goes in many writes anyway: not copied to
        // add its newline.
        write_all(fd, line)?;
        return write_all(fd, b"\n");
    }
    // One write for the line and its newline: an event is usually far
    // below PIPE_BUF, and then the reader gets it in one piece.
    let mut whole = Vec::with_capacity(line.len() + 1);
    whole.extend_from_slice(line);
    whole.push(b'\n');
    write_all(fd, &whole)
}

/// A line this long is written as it is, its newline after it.
const ONE_WRITE: usize = 64 * 1024;

pub fn write_all(fd: RawFd, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        // SAFETY: writing from a live slice to an fd this process owns.
        let written = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if written < 0 {
            let error = std::io::Error::last_os_error();
            if error.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(error);
        }
        bytes = &bytes[written as usize..];
    }
    Ok(())
}
