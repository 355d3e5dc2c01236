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

/// The node's module name, as `worker_main.py` names it.
pub fn module_name(key: &NodeKey, digest: &str) -> String {
    format!(
        "_fluksio_node_{}_{}_{}",
        key.flow,
        key.node,
        &digest[..8.min(digest.len())]
    )
}

/// `worker_main.py` says `from __future__ import annotations`, and
/// compile() hands the caller's future flags on: node code has always run
/// with postponed annotations, so an annotation naming something never
/// imported has never failed. Keep it that way, explicitly.
fn annotations_flag(py: Python<'_>) -> PyResult<i64> {
    static ANNOTATIONS_FLAG: PyOnceLock<i64> = PyOnceLock::new();
    ANNOTATIONS_FLAG
        .get_or_try_init(py, || {
            py.import("__future__")?
                .getattr("annotations")?
                .getattr("compiler_flag")?
                .extract::<i64>()
        })
        .copied()
}

/// The node's file as `run`/`sweep` were given it: `sys.argv[0]`.
static SCRIPT: std::sync::OnceLock<String> = std::sync::OnceLock::new();

/// For `run` and `sweep`: the node file, as typed, is `sys.argv[0]`.
pub fn set_script(path: &std::path::Path) {
    let _ = SCRIPT.set(path.to_string_lossy().into_owned());
}

/// `sys.argv` for `key`'s code: `[the node file]` under `run` and `sweep`,
/// `[<node flow.node>]` (the name its tracebacks carry) otherwise; and
/// `sys.orig_argv`, `[sys.executable, *sys.argv]`, as `python3 FILE` has it.
fn set_argv(py: Python<'_>, key: &NodeKey) -> PyResult<()> {
    let first = match SCRIPT.get() {
        Some(script) => script.clone(),
        None => format!("<node {key}>"),
    };
    let sys = py.import("sys")?;
    let executable = sys.getattr("executable")?;
    sys.setattr("argv", pyo3::types::PyList::new(py, [&first])?)?;
    sys.setattr(
        "orig_argv",
        pyo3::types::PyList::new(py, [executable, first.into_pyobject(py)?.into_any()])?,
    )?;
    Ok(())
}

/// `sys.argv` and `sys.orig_argv` as each zygote-loaded node's module left
/// them, by module name: its calls start with them.
static ARGV: std::sync::Mutex<Vec<ModuleArgv>> = std::sync::Mutex::new(Vec::new());

/// A module's name, its `sys.argv` and its `sys.orig_argv`.
type ModuleArgv = (String, Py<PyAny>, Py<PyAny>);

/// Loads a node into the zygote itself: what its module-level code did to
/// signals is undone there and kept for its calls, as are `sys.argv` and
/// the files it left open (flushed now, so no child writes them again).
pub fn load_in_zygote<'py>(
    py: Python<'py>,
    key: &NodeKey,
    source: &str,
    digest: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let name = module_name(key, digest);
    let (loaded, installed) = super::signals::watch(py, || load(py, key, source, digest));
    super::signals::remember_node(&name, installed);
    if let Ok(sys) = py.import("sys") {
        let mut argv = ARGV.lock().unwrap_or_else(|e| e.into_inner());
        argv.retain(|(module, _, _)| *module != name);
        if let (Ok(args), Ok(orig)) = (sys.getattr("argv"), sys.getattr("orig_argv")) {
            argv.push((name, args.unbind(), orig.unbind()));
        }
    }
    fluksio_embed::finish::settle_zygote(py);
    loaded
}

/// In a call's child whose node the zygote loaded, before its code runs:
/// `sys.argv` and the signal handlers its module-level code left.
pub fn enter(py: Python<'_>, key: &NodeKey, digest: &str) {
    let name = module_name(key, digest);
    let kept = ARGV
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .find(|(module, _, _)| *module == name)
        .map(|(_, argv, orig)| (argv.clone_ref(py), orig.clone_ref(py)));
    match (kept, py.import("sys")) {
        (Some((argv, orig)), Ok(sys)) => {
            let _ = sys.setattr("argv", argv);
            let _ = sys.setattr("orig_argv", orig);
        }
        _ => {
            let _ = set_argv(py, key);
        }
    }
    super::signals::enter_node(py, &name);
}

/// Runs `source` as the node's module and returns the function to call.
pub fn load<'py>(
    py: Python<'py>,
    key: &NodeKey,
    source: &str,
    digest: &str,
) -> PyResult<Bound<'py, PyAny>> {
    let name = module_name(key, digest);
    let filename = format!("<node {key}>");
    let builtins = py.import("builtins")?;
    set_argv(py, key)?;
    let options = PyDict::new(py);
    options.set_item("flags", annotations_flag(py)?)?;
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

/// Where node modules are written for interpreters multiprocessing starts
/// (spawn, forkserver, `ProcessPoolExecutor` with either): they unpickle a
/// node's function by importing its module by name. On `sys.path`, last.
static MODULE_DIR: std::sync::Mutex<Option<std::path::PathBuf>> = std::sync::Mutex::new(None);

fn dir_prefix() -> String {
    // SAFETY: getuid has no preconditions.
    format!("fluksio-zygote-nodes-{}-", unsafe { libc::getuid() })
}

/// This zygote's module directory: made once (0700, ours), stale ones of
/// zygotes that died without cleaning up removed, and put on `sys.path`.
fn module_dir(py: Python<'_>) -> Option<std::path::PathBuf> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    let mut dir = MODULE_DIR.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(dir) = dir.as_ref() {
        return Some(dir.clone());
    }
    let root = std::env::temp_dir();
    let prefix = dir_prefix();
    if let Ok(entries) = std::fs::read_dir(&root) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            let Some(pid) = name
                .strip_prefix(&prefix)
                .and_then(|p| p.parse::<i32>().ok())
            else {
                continue;
            };
            // SAFETY: signal 0 only asks whether the pid exists.
            let dead = unsafe { libc::kill(pid, 0) } != 0
                && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH);
            if dead {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    // The same pid after a recovery's re-exec: the same directory, if it is
    // still ours.
    let path = root.join(format!("{prefix}{}", std::process::id()));
    let made = std::fs::DirBuilder::new().mode(0o700).create(&path);
    let usable = made.is_ok()
        || std::fs::symlink_metadata(&path).is_ok_and(|m| {
            // SAFETY: getuid has no preconditions.
            m.is_dir() && m.uid() == unsafe { libc::getuid() } && m.mode() & 0o077 == 0
        });
    if !usable {
        return None;
    }
    // Where no `fluksio` is installed, a spawned interpreter importing a
    // node that says `import fluksio` finds this one (last on the path).
    let installed = py
        .import("importlib.machinery")
        .and_then(|m| {
            m.getattr("PathFinder")?
                .call_method1("find_spec", ("fluksio",))
        })
        .is_ok_and(|spec| !spec.is_none());
    if !installed {
        let _ = std::fs::write(path.join("fluksio.py"), FLUKSIO_IN_A_SPAWNED_PROCESS);
    }
    py.import("sys")
        .and_then(|sys| sys.getattr("path"))
        .and_then(|path_list| path_list.call_method1("append", (path.to_string_lossy().as_ref(),)))
        .ok()?;
    *dir = Some(path.clone());
    Some(path)
}

/// `fluksio` in a process multiprocessing started: the authoring API as
/// inert as the native module's; what reaches the engine is refused.
const FLUKSIO_IN_A_SPAWNED_PROCESS: &str = r#""""fluksio in a process multiprocessing started from a node (fluksio-zygote)."""
import logging as _logging

logger = _logging.getLogger("fluksio")


class _Declared:
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Declared()

    def __call__(self, *args, **kwargs):
        return _Declared()


def Port(*args, **kwargs):
    return _Declared()


use = Flow = Port


def node(*args, **kwargs):
    if len(args) == 1 and not kwargs and hasattr(args[0], "__code__"):
        return args[0]
    return lambda function: function


def _only_in_the_node(*args, **kwargs):
    raise RuntimeError(
        "fluksio.emit, save_artifact and load_artifact work only in the node's own process, "
        "not in one multiprocessing started"
    )


emit = save_artifact = load_artifact = _only_in_the_node
"#;

/// Writes node `key`'s module where a spawned interpreter imports it from:
/// its source, compiled as [`load`] compiles it (same filename, same
/// future flags), so its functions are the same code.
pub fn publish(py: Python<'_>, key: &NodeKey, source: &str, digest: &str) {
    let Some(dir) = module_dir(py) else {
        return;
    };
    let Ok(flag) = annotations_flag(py) else {
        return;
    };
    let name = module_name(key, digest);
    let path = dir.join(format!("{name}.py"));
    if path.exists() {
        return;
    }
    let text = format!(
        "# fluksio-zygote: node {key}, importable by name in processes multiprocessing starts.\n\
         exec(compile({}, {}, \"exec\", {flag}, True), globals())\n",
        serde_json::to_string(source).unwrap_or_default(),
        serde_json::to_string(&format!("<node {key}>")).unwrap_or_default(),
    );
    let partial = dir.join(format!(".{name}.partial"));
    if std::fs::write(&partial, text).is_ok() {
        let _ = std::fs::rename(&partial, &path);
    }
}

/// Removes this zygote's module directory (at shutdown).
/// In a node's own zygote: its parent's directory stays its parent's (on
/// `sys.path` still, but never removed from here); it makes its own.
pub fn forget_module_dir() {
    MODULE_DIR.lock().unwrap_or_else(|e| e.into_inner()).take();
}

pub fn remove_module_dir() {
    if let Some(dir) = MODULE_DIR.lock().unwrap_or_else(|e| e.into_inner()).take() {
        let _ = std::fs::remove_dir_all(dir);
    }
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
    // Under run and sweep a numpy value is sent as what it converts to.
    if let Ok(Some(plain)) = super::channel::numpy_plain(value) {
        return bad_value(&plain, path, depth + 1);
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
