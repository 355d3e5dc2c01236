//! What `python3` flushes at exit, done before a call's child `_exit`s.
//!
//! The issue this solves: a child leaves with `_exit` (no atexit handlers,
//! nothing of the zygote's flushed twice), so a file a node wrote and left
//! open, `sys.__stdout__`, a `logging` handler or C stdio kept what was in
//! their buffers, where `python3` would have written it.
//!
//! So at the end of a call, before its reply is built (a handler may still
//! write to the logs), the child closes the Python files it created
//! (`gc.get_objects()` lists only those: everything the zygote had is in
//! `gc.freeze`'s permanent generation) and the ones the zygote's loads
//! opened (recorded at load), runs `logging.shutdown()`, flushes
//! `sys.stdout`/`sys.stderr`, `sys.__stdout__`/`sys.__stderr__` and C stdio.
//! The zygote flushes the same after every load, so no child inherits data
//! another would write again. All of it runs under a deadline: a write that
//! blocks (a full pipe, a FIFO nobody reads) is interrupted, and the call
//! goes on without it.
//!
//! `atexit` handlers do not run, however a call ends (see PROTOCOL-NOTES).

use std::sync::Mutex;
use std::time::Duration;

use pyo3::exceptions::PyTimeoutError;
use pyo3::prelude::*;
use pyo3::types::{PyList, PyType};

use crate::objects::type_derives_from;

/// How long the flush may take before what is left is abandoned.
pub const BUDGET: Duration = Duration::from_secs(1);
/// After the budget, how often a blocked write is interrupted again.
const AGAIN: Duration = Duration::from_millis(10);

/// How the process goes on after the flush.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ending {
    /// It exits: files are closed, logging shut down, as at exit.
    Exit,
    /// A resident child between two calls: flushed, left open.
    Between,
}

/// Weak references to the files the zygote's loads left open.
static ZYGOTE_FILES: Mutex<Vec<Py<PyAny>>> = Mutex::new(Vec::new());

#[pyfunction]
fn flush_overdue(_signum: i32, _frame: &Bound<'_, PyAny>) -> PyResult<()> {
    Err(PyTimeoutError::new_err(
        "flushing at the end of the call took too long",
    ))
}

/// A timer that interrupts this thread with SIGALRM, whose Python handler
/// raises: a blocked write returns EINTR and is not retried (PEP 475).
struct Deadline {
    timer: libc::timer_t,
    python: Option<Py<PyAny>>,
    kernel: libc::sigaction,
}

fn arm(py: Python<'_>, budget: Duration) -> Option<Deadline> {
    let signals = py.import("_signal").ok()?;
    let handler = wrap_pyfunction!(flush_overdue, py).ok()?;
    // SAFETY: a query into a zeroed struct.
    let kernel = unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGALRM, std::ptr::null(), &mut action);
        action
    };
    let python = signals
        .call_method1("signal", (libc::SIGALRM, handler))
        .ok()?
        .unbind();
    // SAFETY: timer_create with a sigevent aimed at this thread (the node's
    // other threads must not take the signal), then armed; both checked.
    unsafe {
        let mut event: libc::sigevent = std::mem::zeroed();
        event.sigev_notify = libc::SIGEV_THREAD_ID;
        event.sigev_signo = libc::SIGALRM;
        event.sigev_notify_thread_id = libc::gettid();
        let mut timer: libc::timer_t = std::mem::zeroed();
        if libc::timer_create(libc::CLOCK_MONOTONIC, &mut event, &mut timer) != 0 {
            let _ = signals.call_method1("signal", (libc::SIGALRM, python.bind(py)));
            libc::sigaction(libc::SIGALRM, &kernel, std::ptr::null_mut());
            return None;
        }
        let spec = |d: Duration| libc::timespec {
            tv_sec: d.as_secs() as libc::time_t,
            tv_nsec: d.subsec_nanos() as libc::c_long,
        };
        let when = libc::itimerspec {
            it_value: spec(budget),
            it_interval: spec(AGAIN),
        };
        libc::timer_settime(timer, 0, &when, std::ptr::null_mut());
        Some(Deadline {
            timer,
            python: Some(python),
            kernel,
        })
    }
}

fn disarm(py: Python<'_>, deadline: Deadline) {
    // SAFETY: the timer made by `arm`, deleted once.
    unsafe { libc::timer_delete(deadline.timer) };
    // A tick that landed just now runs our handler here, not a later one.
    // SAFETY: called with the GIL held (the `py` token), on the thread the
    // timer signals.
    if unsafe { pyo3::ffi::PyErr_CheckSignals() } != 0 {
        let _ = PyErr::take(py);
    }
    if let (Ok(signals), Some(python)) = (py.import("_signal"), deadline.python) {
        let _ = signals.call_method1("signal", (libc::SIGALRM, python.bind(py)));
    }
    // SAFETY: the action read back in `arm`.
    unsafe { libc::sigaction(libc::SIGALRM, &deadline.kernel, std::ptr::null_mut()) };
}

/// `_io._TextIOBase` and `_io._BufferedIOBase`: every text and buffered
/// file, C or Python.
fn io_bases(py: Python<'_>) -> PyResult<(Bound<'_, PyType>, Bound<'_, PyType>)> {
    let io = py.import("_io")?;
    Ok((
        io.getattr("_TextIOBase")?.cast_into::<PyType>()?,
        io.getattr("_BufferedIOBase")?.cast_into::<PyType>()?,
    ))
}

/// The files among the objects the collector tracks outside the permanent
/// generation (or in `generations` only): text ones first (closing one
/// closes what it wraps).
fn young_files<'py>(
    py: Python<'py>,
    generations: Option<&[u8]>,
) -> PyResult<Vec<Bound<'py, PyAny>>> {
    let (text, buffered) = io_bases(py)?;
    let gc = py.import("gc")?;
    let objects = match generations {
        None => gc.call_method0("get_objects")?.cast_into::<PyList>()?,
        Some(generations) => {
            let all = PyList::empty(py);
            for &generation in generations {
                let kwargs = pyo3::types::PyDict::new(py);
                kwargs.set_item("generation", generation)?;
                let some = gc.call_method("get_objects", (), Some(&kwargs))?;
                for object in some.cast::<PyList>()?.iter() {
                    all.append(object)?;
                }
            }
            all
        }
    };
    let sys = py.import("sys")?;
    // The standard streams and the buffers under them: closing the buffer
    // of `sys.__stdout__` would close it with its text still pending.
    let mut standard: Vec<Bound<'_, PyAny>> = Vec::new();
    for name in [
        "__stdin__",
        "__stdout__",
        "__stderr__",
        "stdin",
        "stdout",
        "stderr",
    ] {
        if let Ok(stream) = sys.getattr(name) {
            if let Ok(buffer) = stream.getattr("buffer") {
                standard.push(buffer);
            }
            standard.push(stream);
        }
    }
    let mut texts = Vec::new();
    let mut buffers = Vec::new();
    for object in objects.iter() {
        let kind = if type_derives_from(&object, &text) {
            &mut texts
        } else if type_derives_from(&object, &buffered) {
            &mut buffers
        } else {
            continue;
        };
        if !standard.iter().any(|s| s.is(&object)) {
            kind.push(object);
        }
    }
    texts.extend(buffers);
    Ok(texts)
}

/// In the zygote, after its boot or a load: remembers the files that left
/// open, and flushes them and the standard streams, so that no child holds
/// a copy of buffered data it would write again.
pub fn settle_zygote(py: Python<'_>) {
    let deadline = arm(py, BUDGET);
    if let Ok(files) = young_files(py, None) {
        let mut kept = ZYGOTE_FILES.lock().unwrap_or_else(|e| e.into_inner());
        for file in files {
            let _ = file.call_method0("flush");
            if let Ok(weak) = py
                .import("weakref")
                .and_then(|w| w.call_method1("ref", (&file,)))
            {
                kept.push(weak.unbind());
            }
        }
        // Those gone since are of no use.
        kept.retain(|weak| weak.bind(py).call0().is_ok_and(|f| !f.is_none()));
    }
    flush_standard(py);
    if let Some(deadline) = deadline {
        disarm(py, deadline);
    }
}

fn flush_standard(py: Python<'_>) {
    if let Ok(sys) = py.import("sys") {
        for name in ["stdout", "stderr", "__stdout__", "__stderr__"] {
            if let Ok(stream) = sys.getattr(name)
                && !stream.is_none()
            {
                let _ = stream.call_method0("flush");
            }
        }
    }
    // SAFETY: fflush(NULL) flushes every C output stream of this process.
    unsafe { libc::fflush(std::ptr::null_mut()) };
}

/// At the end of a call, in its child, before its reply (which carries
/// what a handler still logs). `Exit`: what `python3` writes out at exit.
/// `Between` (a resident child, whose next call comes): its `logging`
/// handlers flushed; the rest after the reply, [`between_calls`].
pub fn at_end(py: Python<'_>, ending: Ending) {
    // The node's error, if one is being raised, is not ours to disturb.
    let pending = PyErr::take(py);
    // Most calls make no logging handler: nothing for `shutdown` to do.
    let handlers = py
        .import("logging")
        .ok()
        .filter(|logging| has_handlers(logging));
    if ending == Ending::Between && handlers.is_none() {
        if let Some(pending) = pending {
            pending.restore(py);
        }
        return;
    }
    let deadline = arm(py, BUDGET);
    if let Some(logging) = handlers {
        let _ = match ending {
            Ending::Exit => logging.call_method0("shutdown").map(|_| ()),
            Ending::Between => flush_handlers(&logging),
        };
    }
    if ending == Ending::Exit {
        if let Ok(files) = young_files(py, None) {
            for file in files {
                let _ = file.call_method0("close");
            }
        }
        for file in live(py, &ZYGOTE_FILES) {
            let _ = file.call_method0("close");
        }
        flush_standard(py);
    }
    if let Some(deadline) = deadline {
        disarm(py, deadline);
    }
    if let Some(pending) = pending {
        pending.restore(py);
    }
}

/// Files a resident child found open after its earlier calls (weak
/// references): written out after each call.
static RESIDENT_FILES: Mutex<Vec<Py<PyAny>>> = Mutex::new(Vec::new());

/// In a resident child, once a call's reply is out: the files it has open
/// written out (not closed: its next call may write on) and the standard
/// streams flushed, under the same deadline as at exit. Only objects young
/// enough to be new since the last call are searched for files (the
/// collector's generations 0 and 1: a resident's heap grows with its
/// module state, and a full search after every call would grow with it);
/// files found once are remembered until they close.
pub fn between_calls(py: Python<'_>) {
    let deadline = arm(py, BUDGET);
    if let Ok(files) = young_files(py, Some(&[0, 1])) {
        let known = live(py, &RESIDENT_FILES);
        let mut kept = RESIDENT_FILES.lock().unwrap_or_else(|e| e.into_inner());
        let weakref = py.import("weakref");
        for file in files {
            if known.iter().any(|k| k.is(&file)) {
                continue;
            }
            if let Ok(weakref) = &weakref
                && let Ok(weak) = weakref.call_method1("ref", (&file,))
            {
                kept.push(weak.unbind());
            }
        }
    }
    for file in live(py, &RESIDENT_FILES)
        .into_iter()
        .chain(live(py, &ZYGOTE_FILES))
    {
        if !file
            .getattr("closed")
            .is_ok_and(|c| c.is_truthy().unwrap_or(false))
        {
            let _ = file.call_method0("flush");
        }
    }
    flush_standard(py);
    if let Some(deadline) = deadline {
        disarm(py, deadline);
    }
}

/// The objects still alive behind a list of weak references (the dead
/// ones are dropped from it).
fn live<'py>(py: Python<'py>, weak: &Mutex<Vec<Py<PyAny>>>) -> Vec<Bound<'py, PyAny>> {
    let mut list = weak.lock().unwrap_or_else(|e| e.into_inner());
    let mut alive = Vec::new();
    list.retain(|weak| match weak.bind(py).call0() {
        Ok(object) if !object.is_none() => {
            alive.push(object);
            true
        }
        _ => false,
    });
    alive
}

/// Whether a `logging` handler is alive other than `logging.lastResort`
/// (made at import) and the `fluksio` logger's: both write straight to
/// `sys.stderr`, which is flushed anyway. Without one, `logging.shutdown()`
/// would find nothing to flush, and most calls make none.
fn has_handlers(logging: &Bound<'_, PyAny>) -> bool {
    let (Ok(handlers), Ok(last_resort)) = (
        logging.getattr("_handlerList"),
        logging.getattr("lastResort"),
    ) else {
        return true;
    };
    let Ok(handlers) = handlers.try_iter() else {
        return true;
    };
    for weak in handlers {
        match weak.and_then(|weak| weak.call0()) {
            Ok(handler)
                if handler.is_none()
                    || handler.is(&last_resort)
                    || handler
                        .getattr("stream")
                        .is_ok_and(|s| s.is_instance_of::<crate::module::CurrentStderr>()) => {}
            _ => return true,
        }
    }
    false
}

/// In a standby child, before its call: the end of a call rehearsed with
/// nothing to flush yet (the deadline armed and disarmed, the collector's
/// young objects listed, the standard streams flushed empty), so the pages
/// the real one touches are copied before the call, not during it.
pub fn rehearse(py: Python<'_>) {
    let deadline = arm(py, BUDGET);
    if let Ok(logging) = py.import("logging") {
        has_handlers(&logging);
    }
    let _ = young_files(py, None);
    flush_standard(py);
    if let Some(deadline) = deadline {
        disarm(py, deadline);
    }
}

/// `logging.shutdown()` without the closing: a resident's next call logs on.
fn flush_handlers(logging: &Bound<'_, PyAny>) -> PyResult<()> {
    let handlers = logging.getattr("_handlerList")?;
    for weak in handlers.try_iter()? {
        let handler = weak?.call0()?;
        if handler.is_none() {
            continue;
        }
        let _ = handler.call_method0("flush");
    }
    Ok(())
}
