//! A call's reply, built in its child exactly as `worker_main.py` builds it:
//! the same `json.dumps`, the same refusals of what JSON cannot carry, the
//! same `short` and traceback from the node's first frame on.

use pyo3::exceptions::{PyMemoryError, PyRecursionError, PySyntaxError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use serde_json::value::RawValue;

use super::assignment::Assignment;
use super::channel;
use super::node;
use fluksio_embed::capture;

/// `Type: message (line N)` of a node's exception, as a reply's `short`.
pub(super) fn short_description(py: Python<'_>, error: &PyErr) -> String {
    describe(py, error)
        .ok()
        .and_then(|described| described.get_item("short").ok().flatten())
        .and_then(|short| short.str().ok().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| error_line(py, error))
}

/// `sys.exit(code)` as the interpreter would end: None is 0, an int is
/// itself, anything else is printed and is 1.
pub(super) fn system_exit_code(py: Python<'_>, error: &PyErr) -> i32 {
    let code = error.value(py).getattr("code").ok();
    match code {
        None => 0,
        Some(code) if code.is_none() => 0,
        Some(code) => match code.extract::<i64>() {
            Ok(code) => (code & 0xff) as i32,
            Err(_) => {
                if let Ok(stderr) = py.import("sys").and_then(|sys| sys.getattr("stderr")) {
                    let _ = stderr.call_method1("write", (format!("{}\n", code),));
                }
                1
            }
        },
    }
}

/// The reply line, as `worker_main.py` encodes it.
pub(super) fn encode_reply(
    py: Python<'_>,
    call: &Assignment,
    outcome: PyResult<Option<Bound<'_, PyAny>>>,
) -> String {
    match build_reply(py, call, outcome) {
        Ok(reply) => reply,
        Err(error) => {
            // Only a broken exception (a __str__ that raises) gets here.
            let message = format!("the reply could not be encoded: {error}");
            let logs = capture::current_text();
            let id = RawValue::from_string(call.id.clone()).unwrap_or_else(|_| null_id());
            String::from_utf8_lossy(&crate::protocol::failure_reply(
                &id,
                &call.call_id,
                "RuntimeError",
                &message,
                &logs,
            ))
            .trim_end()
            .to_string()
        }
    }
}

fn build_reply(
    py: Python<'_>,
    call: &Assignment,
    outcome: PyResult<Option<Bound<'_, PyAny>>>,
) -> PyResult<String> {
    let logs = capture::current_logs(py)?;
    let result = match outcome {
        Ok(result) => result.unwrap_or_else(|| py.None().into_bound(py)),
        Err(error) => return error_reply(call, &describe(py, &error)?, &logs),
    };
    // Only the result can fail to encode (the rest are strings), so it is
    // encoded alone, with the reference's rule: no NaN, no infinity.
    match channel::dumps(&result, false) {
        Ok(encoded) => Ok(format!(
            r#"{{"id": {}, "call_id": {}, "result": {}, "ok": true, "logs": {}}}"#,
            call.id,
            json_string(&call.call_id),
            encoded.to_str()?,
            encode_logs(&logs)?
        )),
        Err(error)
            if error.is_instance_of::<PyTypeError>(py)
                || error.is_instance_of::<PyValueError>(py)
                || error.is_instance_of::<PyRecursionError>(py) =>
        {
            // Encoding the reply is also the check that the node returned
            // something JSON can carry.
            let trouble = if channel::dumps(&result, true).is_ok() {
                channel::not_finite("returned")
            } else {
                format!(
                    "returned {}, which cannot be sent back as JSON — return numbers, \
                     strings, booleans, lists or dicts.",
                    result.get_type().name()?
                )
            };
            let trouble = node::with_bad_value(trouble, &result);
            let error = PyDict::new(py);
            error.set_item("type", "ValueError")?;
            error.set_item("message", &trouble)?;
            error.set_item("short", format!("ValueError: {trouble}"))?;
            error.set_item("traceback", "")?;
            error_reply(call, &error, &logs)
        }
        Err(error) => Err(error),
    }
}

fn error_reply(
    call: &Assignment,
    error: &Bound<'_, PyDict>,
    logs: &Bound<'_, PyAny>,
) -> PyResult<String> {
    Ok(format!(
        r#"{{"id": {}, "call_id": {}, "ok": false, "error": {}, "logs": {}}}"#,
        call.id,
        json_string(&call.call_id),
        channel::dumps(error.as_any(), true)?.to_str()?,
        encode_logs(logs)?
    ))
}

fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a str serialises")
}

/// The logs as JSON: Python's encoder, which carries a lone surrogate.
pub(super) fn encode_logs(logs: &Bound<'_, PyAny>) -> PyResult<String> {
    if logs.is_truthy()? {
        Ok(channel::dumps(logs, true)?.to_str()?.to_string())
    } else {
        Ok(r#""""#.to_string())
    }
}

/// `{"type", "message", "short", "traceback"}` for a node's exception.
///
/// `short` is one line a node author can act on: the type, the message and
/// the line in their own code (`<node …>` frames). The traceback starts at
/// the node's first frame: what came before is this runtime, which the
/// author did not write. Kept as Python strings throughout: a message may
/// hold a lone surrogate, which `json.dumps` carries and Rust cannot.
fn describe<'py>(py: Python<'py>, error: &PyErr) -> PyResult<Bound<'py, PyDict>> {
    let exception = error.value(py);
    let kind = exception.get_type().name()?.into_any();
    let message = match exception.str() {
        Ok(message) => message.into_any(),
        Err(_) => PyString::new(py, "<exception str() failed>").into_any(),
    };
    // Under the rlimit fallback a call over its memory limit sees its
    // allocations fail: the reply says which limit.
    let message = match crate::containment::rlimit_in_force() {
        Some(mib) if error.is_instance_of::<PyMemoryError>(py) => PyString::new(
            py,
            &match message.str()?.to_string_lossy() {
                what if what.is_empty() => format!(
                    "the node exceeded the call's memory limit of {mib} MiB; raise \
                     --call-memory-limit, or use less memory"
                ),
                what => format!(
                    "the node exceeded the call's memory limit of {mib} MiB ({what}); raise \
                     --call-memory-limit, or use less memory"
                ),
            },
        )
        .into_any(),
        _ => message,
    };
    let traceback = py.import("traceback")?;
    let frames = traceback
        .call_method1("extract_tb", (error.traceback(py),))?
        .cast_into::<PyList>()?;
    let is_node_frame = |frame: &Bound<'py, PyAny>| -> bool {
        frame
            .getattr("filename")
            .and_then(|f| f.extract::<String>())
            .is_ok_and(|f| f.starts_with("<node "))
    };
    let colon = PyString::new(py, ": ").into_any();
    let short = if error.is_instance_of::<PySyntaxError>(py) {
        // Its own message already names the compiled file, which is noise.
        let line = PyString::new(
            py,
            &format!(" (line {})", exception.getattr("lineno")?.str()?),
        );
        join(
            py,
            &[
                &kind,
                &colon,
                &exception.getattr("msg")?.str()?.into_any(),
                &line.into_any(),
            ],
        )?
    } else {
        match frames.iter().filter(|f| is_node_frame(f)).last() {
            Some(frame) => {
                let line =
                    PyString::new(py, &format!(" (line {})", frame.getattr("lineno")?.str()?));
                join(py, &[&kind, &colon, &message, &line.into_any()])?
            }
            None => join(py, &[&kind, &colon, &message])?,
        }
    };
    let start = frames.iter().position(|f| is_node_frame(&f)).unwrap_or(0);
    let listed = traceback.call_method1("format_list", (frames.get_slice(start, frames.len()),))?;
    let only =
        traceback.call_method1("format_exception_only", (exception.get_type(), exception))?;
    let header = PyString::new(py, "Traceback (most recent call last):\n").into_any();
    let text = join(
        py,
        &[&header, &join_all(py, &listed)?, &join_all(py, &only)?],
    )?;
    let described = PyDict::new(py);
    described.set_item("type", kind)?;
    described.set_item("message", message)?;
    described.set_item("short", short)?;
    described.set_item("traceback", text)?;
    Ok(described)
}

fn join<'py>(py: Python<'py>, parts: &[&Bound<'py, PyAny>]) -> PyResult<Bound<'py, PyAny>> {
    join_all(py, PyList::new(py, parts)?.as_any())
}

fn join_all<'py>(py: Python<'py>, parts: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    PyString::new(py, "").call_method1("join", (parts,))
}

fn null_id() -> Box<RawValue> {
    RawValue::from_string("null".into()).expect("null is JSON")
}

/// `Type: message` of a Python error, for a log line or a refusal.
pub fn error_line(py: Python<'_>, error: &PyErr) -> String {
    let kind = error
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    match error.value(py).str() {
        Ok(message) if !message.to_string_lossy().is_empty() => {
            format!("{kind}: {}", message.to_string_lossy())
        }
        _ => kind,
    }
}
