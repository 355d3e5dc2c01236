//! A node called once in its zygote, before its calls are forked.
//!
//! The issue this solves: a library does work on its first call in a
//! process and keeps it for the next (lazy imports, caches, probes of
//! optional dependencies, BLAS buffers). A reused worker pays it once; a
//! fork per call pays it on every call and throws it away (measured: a
//! 160×160 `eigh` took 15 ms in a child forked from a cold process, 3.7 ms
//! from a warmed one). So the node is called once where its calls are
//! forked from, and every fork starts with what that call built:
//!
//! 1. Asked for by `run`/`sweep --warmup`, or by the node itself, with a
//!    module-level `__fluksio_warmup__ = {"x": 1}` (its keyword arguments):
//!    a name `worker_main.py` ignores, so the same file runs there.
//! 2. Tried first in the node's trial child, as its loading is. A warm-up
//!    that raises, or that leaves a thread running that does not stop at
//!    fork (an OpenMP pool, a CUDA context, a thread it started), is
//!    refused there, with the reason, and the zygote is never touched: the
//!    node is served cold.
//! 3. Then run in the zygote, its OpenMP and MKL pools held at one thread
//!    (`threads::single_threaded`), its output dropped, what it emits or
//!    yields dropped.
//!
//! Whatever it leaves in module state, every call sees: that is its point,
//! and the price of it.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use fluksio_embed::fork;

use super::channel;

/// The module-level name a node asks for a warm-up with.
pub const ATTRIBUTE: &str = "__fluksio_warmup__";

/// The first line of a trial's report when its warm-up was refused; the
/// reason follows.
const REFUSED: &str = "warm-up refused\n";

/// The keyword arguments to warm `function` up with: `explicit` (the JSON
/// object of `--warmup`), else its module's [`ATTRIBUTE`]; `None` where
/// neither asks for one.
pub fn kwargs<'py>(
    py: Python<'py>,
    function: &Bound<'py, PyAny>,
    explicit: Option<&str>,
) -> Result<Option<Bound<'py, PyDict>>, String> {
    if let Some(text) = explicit {
        let decoded = channel::loads(py, text).map_err(|e| super::reply::error_line(py, &e))?;
        return decoded
            .cast_into::<PyDict>()
            .map(Some)
            .map_err(|_| "--warmup must be a JSON object of keyword arguments".to_string());
    }
    let asked = function
        .getattr("__globals__")
        .ok()
        .and_then(|globals| globals.get_item(ATTRIBUTE).ok());
    match asked {
        None => Ok(None),
        Some(value) if value.is_none() => Ok(None),
        Some(value) => value.cast_into::<PyDict>().map(Some).map_err(|value| {
            format!(
                "{ATTRIBUTE} must be a dict of the keyword arguments to call the node with, \
                 not {}",
                value
                    .into_inner()
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            )
        }),
    }
}

/// Why a warm-up was refused.
#[derive(Debug)]
pub struct Refusal {
    pub why: String,
    /// It left what a fork cannot carry (a thread, a CUDA context): this
    /// process can no longer fork safely.
    pub poisoned: bool,
}

/// Calls `function(**kwargs)` as a warm-up (a generator drained), events
/// muted, OpenMP and MKL at one thread; then checks what it left.
pub fn run(
    py: Python<'_>,
    function: &Bound<'_, PyAny>,
    kwargs: &Bound<'_, PyDict>,
) -> Result<(), Refusal> {
    let called = channel::muted(|| {
        super::threads::single_threaded(|| -> PyResult<()> {
            let result = function.call((), Some(kwargs))?;
            if fluksio_embed::generator::is_generator(&result) {
                for item in result.try_iter()? {
                    item?;
                }
            }
            Ok(())
        })
    });
    // What it left is checked whether or not it raised.
    if let Some(hazard) = hazard(py) {
        return Err(Refusal {
            why: hazard,
            poisoned: true,
        });
    }
    match called {
        Ok(()) => Ok(()),
        Err(error) => Err(Refusal {
            why: if error.is_instance_of::<pyo3::exceptions::PySystemExit>(py) {
                "it called sys.exit()".into()
            } else {
                format!("it raised {}", super::reply::short_description(py, &error))
            },
            poisoned: false,
        }),
    }
}

/// What node code run in this process left that a fork cannot carry.
fn hazard(py: Python<'_>) -> Option<String> {
    if cuda_is_mapped() {
        return Some(
            "it created a CUDA context, which no forked call could use: initialise CUDA in the \
             call, not in the warm-up"
                .into(),
        );
    }
    if !super::threads::forks_safely(py) {
        let left = fork::threads_at_last_fork().saturating_sub(1);
        return Some(format!(
            "it left {left} {} running that {} not stop at fork (an OpenMP pool, a CUDA \
             context, or a thread it started), and a call forked beside {} could hang: stop \
             {} before it returns, or leave the warm-up out",
            if left == 1 { "thread" } else { "threads" },
            if left == 1 { "does" } else { "do" },
            if left == 1 { "it" } else { "them" },
            if left == 1 { "it" } else { "them" },
        ));
    }
    None
}

/// Whether an NVIDIA device is mapped into this process: a CUDA context.
fn cuda_is_mapped() -> bool {
    std::fs::read_to_string("/proc/self/maps")
        .is_ok_and(|maps| maps.lines().any(|line| line.contains("/dev/nvidia")))
}

/// A trial's report that its warm-up was refused, and why.
pub fn refusal_report(why: &str) -> Vec<u8> {
    format!("{REFUSED}{why}").into_bytes()
}

/// Why a trial's warm-up was refused, read off its report.
pub fn refusal_in(report: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(report);
    text.strip_prefix(REFUSED).map(str::to_string)
}
