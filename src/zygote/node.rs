//! Loading a node's source as a module, and finding the function to call.
//!
//! As `worker_main.py`'s `load_function`: the source runs as a fresh module
//! named `_fluksio_node_{flow}_{node}_{md5[:8]}` (registered in
//! `sys.modules`), compiled with filename `<node {flow}.{node}>`, the name
//! every traceback and `short` line is cut by.

use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyDict;

/// Which node, as the engine names it: the cache key.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NodeKey {
    pub flow: String,
    pub node: String,
}

impl std::fmt::Display for NodeKey {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}", self.flow, self.node)
    }
}

/// The md5 of a source, hex: what says a cached node is still current,
/// and what names its module, as `hashlib.md5(source.encode())` does.
pub fn source_digest(source: &str) -> String {
    use md5::{Digest, Md5};
    Md5::digest(source.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// Runs `source` as the node's module and returns the function to call.
pub fn load<'py>(
    py: Python<'py>,
    key: &NodeKey,
    source: &str,
    digest: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let name = format!(
        "_fluksio_node_{}_{}_{}",
        key.flow,
        key.node,
        &digest[..8.min(digest.len())]
    );
    let filename = format!("<node {key}>");
    let builtins = py.import("builtins")?;

    // `worker_main.py` says `from __future__ import annotations`, and
    // compile() hands the caller's future flags on: node code has always run
    // with postponed annotations, so an annotation naming something never
    // imported has never failed. Keep it that way, explicitly.
    static ANNOTATIONS_FLAG: PyOnceLock<i64> = PyOnceLock::new();
    let flag = ANNOTATIONS_FLAG.get_or_try_init(py, || {
        py.import("__future__")?
            .getattr("annotations")?
            .getattr("compiler_flag")?
            .extract::<i64>()
    })?;
    let options = PyDict::new(py);
    options.set_item("flags", *flag)?;
    options.set_item("dont_inherit", true)?;
    let code = builtins
        .getattr("compile")?
        .call((source, &filename, "exec"), Some(&options))?;

    let module = py.import("types")?.getattr("ModuleType")?.call1((&name,))?;
    let namespace = module.getattr("__dict__")?;
    py.import("sys")?
        .getattr("modules")?
        .set_item(&name, &module)?;
    builtins.getattr("exec")?.call1((code, &namespace))?;
    choose_function(&module, &name)
}

/// `process` if it is callable, else the one public function the module
/// itself defines.
fn choose_function<'py>(module: &Bound<'py, PyAny>, name: &str) -> PyResult<Bound<'py, PyAny>> {
    if let Ok(process) = module.getattr("process")
        && process.is_callable()
    {
        return Ok(process);
    }
    let namespace = module.getattr("__dict__")?.cast_into::<PyDict>()?;
    let mut functions = Vec::new();
    for (key, value) in namespace.iter() {
        let public = key.extract::<String>().is_ok_and(|k| !k.starts_with('_'));
        let own = value
            .getattr("__module__")
            .ok()
            .and_then(|m| m.extract::<String>().ok())
            .is_some_and(|m| m == name);
        if public && value.is_callable() && own {
            functions.push(value);
        }
    }
    if functions.len() == 1 {
        return Ok(functions.remove(0));
    }
    Err(PyValueError::new_err(format!(
        "Define a function named 'process' — this file has {} functions to choose from.",
        functions.len()
    )))
}

/// Whether a result JSON cannot carry is described down to the value
/// (`result["a"][2] is a set`). Off for the worker contract, whose message
/// is the reference's word for word; `run` and `sweep` turn it on before
/// any child is forked.
static NAME_BAD_VALUES: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Turns on [`with_bad_value`] in this process and the children it forks.
pub fn name_bad_values() {
    NAME_BAD_VALUES.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// `message` (a "returned …, which JSON cannot carry — …" refusal) with the
/// path to the first value JSON cannot carry put before its " — ", where
/// [`name_bad_values`] is on and the value is found.
pub fn with_bad_value(message: String, result: &Bound<'_, PyAny>) -> String {
    if !NAME_BAD_VALUES.load(std::sync::atomic::Ordering::Relaxed) {
        return message;
    }
    let Some(detail) = bad_value(result, "result".to_string(), 0) else {
        return message;
    };
    match message.split_once(" — ") {
        Some((what, rest)) => format!("{what}: {detail} — {rest}"),
        None => format!("{message} ({detail})"),
    }
}

/// Where in `value` the first thing `json.dumps` refuses is, and what it is.
fn bad_value(value: &Bound<'_, PyAny>, path: String, depth: usize) -> Option<String> {
    use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
    if depth > 100 {
        return None;
    }
    if value.is_none()
        || value.is_instance_of::<PyString>()
        || value.is_instance_of::<PyInt>()
        || value.is_instance_of::<PyBool>()
    {
        return None;
    }
    if let Ok(float) = value.cast::<PyFloat>() {
        let number = float.value();
        let shown = if number.is_nan() {
            "nan".to_string()
        } else {
            number.to_string()
        };
        return (!number.is_finite()).then(|| format!("{path} is {shown}"));
    }
    let type_name = |v: &Bound<'_, PyAny>| {
        v.get_type()
            .name()
            .map(|n| n.to_string())
            .unwrap_or_else(|_| "object".into())
    };
    if let Ok(dict) = value.cast::<PyDict>() {
        for (key, item) in dict.iter() {
            let key_text = if let Ok(key) = key.cast::<PyString>() {
                serde_json::to_string(&key.to_string_lossy()).unwrap_or_default()
            } else if key.is_none()
                || key.is_instance_of::<PyInt>()
                || key.is_instance_of::<PyFloat>()
                || key.is_instance_of::<PyBool>()
            {
                key.str()
                    .map(|s| s.to_string_lossy().into_owned())
                    .unwrap_or_default()
            } else {
                return Some(format!("{path} has a key of type {}", type_name(&key)));
            };
            if let Some(found) = bad_value(&item, format!("{path}[{key_text}]"), depth + 1) {
                return Some(found);
            }
        }
        return None;
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        for (index, item) in value.try_iter().ok()?.enumerate() {
            if let Some(found) = bad_value(&item.ok()?, format!("{path}[{index}]"), depth + 1) {
                return Some(found);
            }
        }
        return None;
    }
    let name = type_name(value);
    let article = if name.starts_with(['a', 'e', 'i', 'o', 'u']) {
        "an"
    } else {
        "a"
    };
    Some(format!("{path} is {article} {name}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn digest_is_hashlib_md5_of_the_utf8_source() {
        // python3 -c 'import hashlib; print(hashlib.md5("def process():\n    return \"é\"\n".encode()).hexdigest())'
        assert_eq!(source_digest(""), "d41d8cd98f00b204e9800998ecf8427e");
        assert_eq!(
            source_digest("def process():\n    return \"é\"\n"),
            "eb542ed7ac80455a245212d9748e9eda"
        );
    }
}
