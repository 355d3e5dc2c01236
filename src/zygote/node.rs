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
