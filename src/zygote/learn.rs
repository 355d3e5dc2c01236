//! Learned preloads: the modules a node's calls import, imported into the
//! zygote for the calls after them.
//!
//! The issue this solves: a call that imports `sklearn.model_selection`
//! (or whatever its library imports lazily on first use) pays for that
//! import in its child, which then exits: the next call's child, forked
//! from the same zygote, pays again, every call. A reused worker pays once.
//! CPython's forkserver has the same problem (gh-157216). So:
//!
//! 1. A call's child lists, in its log buffer's report, the modules it
//!    imported that the zygote did not have ([`report`]). It does so before
//!    its reply: a replied child is killed at once.
//! 2. The zygote collects the names as it takes the buffer back, and before
//!    it forks its next standby tries them in a child of their own
//!    ([`try_in_child`]): only modules of the Python installation (its
//!    standard library and site-packages), no newer than the zygote, so that
//!    no file a call wrote (beside the node, in the working directory)
//!    becomes code in the zygote; and that child must still fork safely
//!    once they are imported.
//! 3. What the child imported cleanly, the zygote imports; a name that
//!    failed, or whose batch left a thread, is never tried again.
//!
//! `--learn-imports off` turns it off.

use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use pyo3::prelude::*;
use pyo3::types::PyList;

use fluksio_embed::capture::{self, LogBuffer};
use fluksio_embed::fork;

/// The first line of a run's report that lists what it imported.
const IMPORTED: &str = "imported\n";

/// The most names tried at once: a call that imports a whole ecosystem is
/// learned over a few calls rather than in one long stop of the zygote.
const BATCH: usize = 2048;

/// How long the trying child may take: an import that hangs must not
/// hold the zygote.
const TRY_FOR: Duration = Duration::from_secs(60);

/// Exit code of the trying child when the zygote could fork safely with
/// what it imported.
const FORKS_SAFELY: i32 = 0;
const FORK_UNSAFE: i32 = 1;

/// Set in the zygote at start-up (`--learn-imports`); its children have it.
static ENABLED: AtomicBool = AtomicBool::new(false);

pub fn enable(on: bool) {
    ENABLED.store(on, Ordering::Relaxed);
}

/// How many modules `sys.modules` held when this child stood by (0: not
/// counted). A count, not a copy: copying the names would write to each
/// name's reference count, a copy-on-write fault for every page holding one.
static AT_FORK: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// `sys.modules`, borrowed from the interpreter's state.
fn modules(py: Python<'_>) -> Option<Bound<'_, pyo3::types::PyDict>> {
    py.import("sys")
        .and_then(|sys| sys.getattr("modules"))
        .ok()?
        .cast_into::<pyo3::types::PyDict>()
        .ok()
}

/// In a standby child: counts the modules it was forked with (off the
/// call's clock).
pub fn remember_modules(py: Python<'_>) {
    if !ENABLED.load(Ordering::Relaxed) {
        return;
    }
    if let Some(modules) = modules(py) {
        AT_FORK.store(modules.len(), Ordering::Relaxed);
    }
}

/// In a call's child, before its reply: the modules it imported (those
/// after the first counted ones, in the dict's insertion order), into its
/// report for the zygote.
pub fn report(py: Python<'_>, logs: &LogBuffer) {
    let before = AT_FORK.load(Ordering::Relaxed);
    if before == 0 {
        return;
    }
    let Some(modules) = modules(py) else {
        return;
    };
    // The usual case, once learned: nothing new, told by the count.
    if modules.len() <= before {
        return;
    }
    // Borrowed keys only: no reference count of the zygote's objects moves,
    // so their pages stay shared.
    let names = fluksio_embed::objects::str_keys_after(&modules, before);
    if !names.is_empty() {
        logs.set_report(format!("{IMPORTED}{}", names.join("\n")).as_bytes());
    }
}

/// The names a run's report lists.
pub fn imported_in(report: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(report);
    match text.strip_prefix(IMPORTED) {
        Some(names) => names
            .lines()
            .filter(|n| !n.is_empty())
            .map(str::to_string)
            .collect(),
        None => Vec::new(),
    }
}

/// What the zygote has learned and tried.
#[derive(Default)]
pub struct Learned {
    /// Names calls imported, not yet tried.
    pending: Vec<String>,
    /// Every name tried (imported here, or refused), never tried again.
    tried: HashSet<String>,
}

impl Learned {
    /// Takes the names a landed call's report lists.
    pub fn take(&mut self, report: &[u8]) {
        if !ENABLED.load(Ordering::Relaxed) {
            return;
        }
        for name in imported_in(report) {
            if !self.tried.contains(&name) && !self.pending.contains(&name) {
                self.pending.push(name);
            }
        }
    }

    /// Whether calls imported something not yet tried.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// The next batch to try, in the order the calls imported them, minus
    /// what this process has meanwhile.
    fn next_batch(&mut self, py: Python<'_>) -> Vec<String> {
        let modules = py.import("sys").and_then(|sys| sys.getattr("modules"));
        let mut batch = Vec::new();
        while batch.len() < BATCH && !self.pending.is_empty() {
            let name = self.pending.remove(0);
            let have = modules
                .as_ref()
                .is_ok_and(|m| m.contains(name.as_str()).unwrap_or(false));
            if self.tried.insert(name.clone()) && !have {
                batch.push(name);
            }
        }
        batch
    }
}

/// Python, run in the trying child: which of `names` pass the checks and
/// import cleanly. A name is checked before it is imported (its parent
/// package was, earlier in the list or in the zygote).
const TRY: &str = r#"
def _fluksio_try(names, started):
    import importlib, importlib.util, os, sys, sysconfig
    paths = sysconfig.get_paths()
    roots = tuple(
        os.path.join(os.path.realpath(paths[key]), "")
        for key in ("stdlib", "platstdlib", "purelib", "platlib")
        if paths.get(key)
    )

    def installed(path):
        real = os.path.realpath(path)
        return real.startswith(roots) and os.stat(real).st_mtime <= started

    imported = []
    for name in names:
        try:
            if name not in sys.modules:
                spec = importlib.util.find_spec(name)
                if spec is None:
                    continue
                if spec.has_location:
                    if not spec.origin or not installed(spec.origin):
                        continue
                elif spec.submodule_search_locations is not None:
                    if not all(installed(p) for p in spec.submodule_search_locations):
                        continue
                elif spec.origin not in ("built-in", "frozen"):
                    continue
                importlib.import_module(name)
            imported.append(name)
        except BaseException:
            continue
    return imported
"#;

/// Tries the pending names in a child; `Some` of those the zygote may
/// import (none, where the child could not fork safely or failed).
pub fn try_in_child(
    py: Python<'_>,
    learned: &mut Learned,
    logs: &LogBuffer,
    started: std::time::SystemTime,
) -> Option<Vec<String>> {
    if !ENABLED.load(Ordering::Relaxed) || learned.pending.is_empty() {
        return None;
    }
    let batch = learned.next_batch(py);
    if batch.is_empty() {
        return None;
    }
    let started = started
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let forked = fork::fork(py).ok()?;
    match forked {
        fork::Forked::Child => {
            // Its own session, dead with the zygote, none of the zygote's
            // fds or other calls' buffers; nothing of it is kept.
            crate::fds::close_in_child();
            logs.unmap_all_others();
            fork::become_call_child(nix::unistd::getppid());
            capture::drop_writes();
            let _ = capture::redirect_stdio(py);
            let imported = run_try(py, &batch, started).unwrap_or_default();
            let code = if super::threads::forks_safely(py) {
                FORKS_SAFELY
            } else {
                FORK_UNSAFE
            };
            logs.set_report(format!("{IMPORTED}{}", imported.join("\n")).as_bytes());
            crate::process::exit_now(code)
        }
        fork::Forked::Parent { pid, safe } => {
            let ended = wait_for(pid, TRY_FOR);
            let report = logs.take_report();
            match ended {
                Some(crate::process::ChildEnd::Exited(FORKS_SAFELY)) if safe => {
                    Some(imported_in(&report))
                }
                other => {
                    tracing::warn!(
                        "modules a call imported were not learned into the zygote ({}): {}",
                        match other {
                            Some(crate::process::ChildEnd::Exited(FORK_UNSAFE)) => {
                                "importing them left a thread running that does not stop at \
                                 fork"
                                    .to_string()
                            }
                            Some(end) => format!("the child trying them {end}"),
                            None => "the child trying them took too long".to_string(),
                        },
                        batch.join(", ")
                    );
                    None
                }
            }
        }
    }
}

fn run_try(py: Python<'_>, names: &[String], started: f64) -> PyResult<Vec<String>> {
    let globals = pyo3::types::PyDict::new(py);
    let code = std::ffi::CString::new(TRY).expect("no NUL in the source");
    py.run(&code, Some(&globals), None)?;
    let names = PyList::new(py, names)?;
    globals
        .get_item("_fluksio_try")?
        .ok_or_else(|| pyo3::exceptions::PyRuntimeError::new_err("no _fluksio_try"))?
        .call1((names, started))?
        .extract()
}

/// Waits up to `limit` for `pid` to exit, then kills its session; how it
/// ended (`None`: killed for taking too long).
fn wait_for(pid: nix::unistd::Pid, limit: Duration) -> Option<crate::process::ChildEnd> {
    let watch = crate::process::ExitWatch::new(pid);
    if !crate::poll_set::wait_exit(pid, &watch, limit) {
        crate::process::kill_group(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = crate::process::reap(pid);
        return None;
    }
    crate::process::kill_group(pid, nix::sys::signal::Signal::SIGKILL);
    crate::process::reap(pid).ok().map(|reaped| reaped.end)
}

/// In the zygote: imports what its trying child imported cleanly, undoing
/// what they did to signals here (kept for the calls, as a preload's).
pub fn import_here(py: Python<'_>, names: &[String]) -> usize {
    let (imported, installed) = super::signals::watch(py, || {
        let mut imported = 0;
        let importlib = match py.import("importlib") {
            Ok(importlib) => importlib,
            Err(_) => return 0,
        };
        for name in names {
            if importlib.call_method1("import_module", (name,)).is_ok() {
                imported += 1;
            }
        }
        imported
    });
    super::signals::add_to_preloads(installed);
    imported
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_lists_names_and_nothing_else_reads_as_one() {
        assert_eq!(imported_in(b"imported\na\nb.c\n"), vec!["a", "b.c"]);
        assert!(imported_in(b"warm-up refused\nit raised").is_empty());
        assert!(imported_in(b"").is_empty());
    }
}
