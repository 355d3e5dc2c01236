//! What a call's child does, from the fork to `_exit`.
//!
//! 1. Stand by: point `sys.stdout`/`sys.stderr` at the call's log buffer,
//!    re-enable the GC the zygote keeps off, and wait for the assignment on
//!    the control pipe. A child is forked before its call arrives, so all
//!    of this is off the call's clock.
//! 2. Apply the call's environment; load the node if the zygote has not,
//!    then call it; drain a generator, sending each yield as it comes.
//! 3. Write out what `python3` would at exit (`finish`), send the reply
//!    (`reply`), `_exit`: no atexit handlers, no flush of buffers
//!    inherited from the zygote.
//!
//! `sys.exit()` is honoured as an exit: the child leaves with that code and
//! no reply, and whoever reaps it says how it ended (`exited with code 3`).

use std::os::fd::RawFd;

use pyo3::exceptions::{PySystemExit, PyTypeError};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use fluksio_embed::capture::{self, LogBuffer};
use fluksio_embed::finish;
use fluksio_embed::generator::{self, Step};

use super::assignment::{Assignment, Function, Task, TrialVerdict};
use super::reply::{encode_logs, encode_reply, system_exit_code};
use super::{channel, node, signals};

/// Readies a standby child before its call is known: captured output, the
/// GC, and a rehearsal of the call's own machinery, so that none of it is on
/// the call's clock.
///
/// The rehearsal is for the pages: a forked child's first write to each
/// page it shares with the zygote (a refcount is a write) copies that page,
/// a few microseconds each. Decoding arguments, encoding a reply, calling a
/// function touch the same pages every time; touching them here, while the
/// child waits, takes those copies off the call. `functions` are the nodes
/// the zygote has loaded, whose objects a call will touch too.
pub fn stand_by<'a>(
    py: Python<'_>,
    logs: &LogBuffer,
    functions: impl Iterator<Item = &'a Py<PyAny>>,
) {
    // As a fresh python3, whatever the zygote's loads installed.
    signals::reset_in_child(py);
    logs.capture_here();
    let _ = capture::redirect_stdio(py);
    let _ = py.import("gc").and_then(|gc| gc.call_method0("enable"));
    super::learn::remember_modules(py);
    let _ = rehearse(py);
    finish::rehearse(py);
    for function in functions {
        let function = function.bind(py);
        for part in ["__code__", "__globals__", "__defaults__", "__kwdefaults__"] {
            let _ = function.getattr(part);
        }
    }
}

fn rehearse(py: Python<'_>) -> PyResult<()> {
    let sample = channel::loads(
        py,
        r#"{"a": [1, 2.5, "x", null, true, {"b": -1}], "c": "\u00e9"}"#,
    )?;
    let sample = sample.cast::<PyDict>()?;
    channel::dumps(sample.as_any(), false)?;
    channel::dumps(sample.as_any(), true)?;
    py.import("builtins")?
        .getattr("dict")?
        .call((), Some(sample))?;
    let logs = capture::current_logs(py)?;
    encode_logs(&logs)?;
    py.import("sys")?
        .getattr("stdout")?
        .call_method1("write", ("",))?;
    Ok(())
}

/// Serves `call` in this (standing-by) child and exits.
pub fn serve(
    py: Python<'_>,
    call: &Assignment,
    function: Function<'_>,
    reply_fd: RawFd,
    logs: &LogBuffer,
) -> ! {
    channel::open(reply_fd, &call.call_id);
    if let Function::Loaded(_) = function {
        node::enter(py, &call.key, &call.digest);
    }
    let before = (call.task == Task::Trial)
        .then(anonymous_memory_mib)
        .flatten();
    let mut loaded = None;
    let outcome = apply_env(py, &call.env, false)
        .and_then(|()| perform(py, call, function, logs, &mut loaded));
    let heavy = before.is_some_and(|before| {
        heavy_from_mib().is_some_and(|limit| {
            anonymous_memory_mib().is_some_and(|after| after.saturating_sub(before) >= limit)
        })
    });
    if call.task == Task::Run {
        // Before the reply, which carries what a handler still logs.
        finish::at_end(py, finish::Ending::Exit);
    }
    if let Err(error) = &outcome
        && error.is_instance_of::<PySystemExit>(py)
    {
        crate::process::exit_now(system_exit_code(py, error));
    }
    let exit_code = match (call.task, &outcome) {
        // Before the threads' check: the driver starts threads of its own.
        (Task::Trial, Ok(_)) if super::device::cuda_in_use(py) => {
            TrialVerdict::LoadedWithCuda.exit_code()
        }
        (Task::Trial, Ok(_)) if !super::threads::forks_safely(py) => {
            TrialVerdict::LoadedButForkUnsafe.exit_code()
        }
        (Task::Trial, Ok(_)) if heavy => TrialVerdict::LoadedHeavy.exit_code(),
        (Task::Trial, Ok(_)) => TrialVerdict::Loaded.exit_code(),
        (Task::Trial, Err(_)) => TrialVerdict::Failed.exit_code(),
        _ => 0,
    };
    // Its warm-up once the load has its own verdict: what the warm-up leaves
    // is the warm-up's to answer for.
    if (exit_code == TrialVerdict::Loaded.exit_code()
        || exit_code == TrialVerdict::LoadedHeavy.exit_code())
        && let Some(function) = &loaded
        && let Err(why) = warm_up_quietly(py, function.bind(py), call.kwargs.as_deref(), logs)
    {
        logs.set_report(&super::warmup::refusal_report(&why));
    }
    let reply = encode_reply(py, call, outcome);
    if call.task == Task::Run {
        // Before the reply: a replied child is killed at once.
        super::learn::report(py, logs);
    }
    let _ = channel::send_reply(py, &reply);
    if call.task == Task::Run {
        // What is left is the teardown of a process the zygote's size
        // (milliseconds with pandas or torch), which nobody waits for. At
        // a low priority it yields the CPU to whoever the reply woke: the
        // engine's reader, queued behind it on this CPU, waited for all of
        // it (numpy+pandas+scipy, calls 5 ms apart: p50 2.6 ms → 0.9 ms).
        // A trial's exit is its verdict, awaited: it keeps its priority.
        // SAFETY: lowering this process's own priority has no preconditions.
        unsafe { libc::setpriority(libc::PRIO_PROCESS, 0, TEARDOWN_NICE) };
    }
    // The reply woke its reader on this CPU (a pipe's wake-up assumes the
    // writer sleeps next). Tearing this process down first would keep the
    // reader off the CPU for as long as that takes; let it run first.
    // SAFETY: sched_yield has no preconditions.
    unsafe { libc::sched_yield() };
    crate::process::exit_now(exit_code)
}

/// The nice value a replied call's child exits at: low enough that a woken
/// reader preempts it, high enough that its teardown (which frees its
/// memory) still gets a share of a busy CPU.
const TEARDOWN_NICE: libc::c_int = 10;

/// `--node-zygote-mib` plus one, where this process's zygote gives heavy
/// nodes a zygote of their own (0: none does).
static HEAVY_FROM_MIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// Sets what a trial calls heavy: a module level that leaves `mib` MiB or
/// more (`None`: nothing is).
pub fn set_heavy_from_mib(mib: Option<u64>) {
    HEAVY_FROM_MIB.store(
        mib.map_or(0, |mib| mib.saturating_add(1)),
        std::sync::atomic::Ordering::Relaxed,
    );
}

fn heavy_from_mib() -> Option<u64> {
    match HEAVY_FROM_MIB.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        mib => Some(mib - 1),
    }
}

/// `RssAnon` of this process, MiB: what a node's module level allocated
/// and touched shows here.
fn anonymous_memory_mib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("RssAnon:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024)
}

/// The call's environment, through `os.environ` so Python and C both see it;
/// then the thread pools loaded already sized as it says (`threads`; in a
/// resident, `again`, with those its earlier calls loaded).
pub(super) fn apply_env(py: Python<'_>, env: &[(String, String)], again: bool) -> PyResult<()> {
    if env.is_empty() {
        return Ok(());
    }
    let environ = py.import("os")?.getattr("environ")?;
    let mut changed = false;
    for (key, value) in env {
        // A resident's calls mostly bring what the last one set.
        let same = environ
            .get_item(key)
            .ok()
            .and_then(|now| now.extract::<String>().ok())
            .is_some_and(|now| now == *value);
        if !same {
            environ.set_item(key, value)?;
            changed = true;
        }
    }
    super::threads::follow_environment(changed, again);
    Ok(())
}

/// The thread variables a reset resident sets before its snapshot: those
/// the zygote gives a call that brings none of its own (the runtime's, no
/// call's). Every call then finds its share of the CPUs set already, where
/// it would otherwise set seven `os.environ` items, and size its pools,
/// again after every put-back.
pub(super) struct PresetEnv {
    env: Vec<(String, String)>,
}

impl PresetEnv {
    /// Sets `env` now, in this process, where none of it is set yet (with
    /// `--threads-per-call`, the user's own variables are overridden call
    /// by call instead: undone, they would leave the pools as the preset
    /// sized them).
    pub(super) fn set(py: Python<'_>, env: Vec<(String, String)>) -> PresetEnv {
        let unset = env.iter().all(|(key, _)| std::env::var_os(key).is_none());
        if unset && apply_env(py, &env, false).is_ok() {
            PresetEnv { env }
        } else {
            PresetEnv { env: Vec::new() }
        }
    }

    /// A call's environment, set in a process whose memory is the
    /// snapshot's (so its `os.environ` is as `set` left it). One that
    /// differs is set as in a fresh child: the preset variables are taken
    /// out first, so that every variable has a fresh child's value and
    /// place, in `os.environ`'s order and the C environment's (and the
    /// pools are sized again, since the call sets them anew).
    pub(super) fn apply(&self, py: Python<'_>, env: &[(String, String)]) -> PyResult<()> {
        if env == self.env.as_slice() {
            if !env.is_empty() {
                super::threads::resize_eager_pools();
            }
            return Ok(());
        }
        if !self.env.is_empty() {
            let environ = py.import("os")?.getattr("environ")?;
            for (key, _) in &self.env {
                if environ.contains(key)? {
                    environ.del_item(key)?;
                }
            }
        }
        apply_env(py, env, false)
    }
}

/// Loads if needed, then runs: the part that may raise the node's error.
/// A trial's function is left in `loaded`, for its warm-up.
fn perform<'py>(
    py: Python<'py>,
    call: &Assignment,
    function: Function<'_>,
    logs: &LogBuffer,
    loaded: &mut Option<Py<PyAny>>,
) -> PyResult<Option<Bound<'py, PyAny>>> {
    let function = resolve(py, call, function, logs)?;
    match call.task {
        Task::Check => Ok(None),
        Task::Trial => {
            *loaded = Some(function.unbind());
            Ok(None)
        }
        Task::Run | Task::Resident => invoke(py, call, &function).map(Some),
    }
}

/// A trial's warm-up (`super::warmup`), if the node or `--warmup` asks for
/// one, its output dropped; `Err` says why it is refused.
fn warm_up_quietly(
    py: Python<'_>,
    function: &Bound<'_, PyAny>,
    explicit: Option<&str>,
    logs: &LogBuffer,
) -> Result<(), String> {
    let Some(kwargs) = super::warmup::kwargs(py, function, explicit)? else {
        return Ok(());
    };
    let scratch = LogBuffer::new().map_err(|e| e.to_string())?;
    scratch.capture_here();
    let warmed = super::warmup::run(py, function, &kwargs);
    logs.capture_here();
    drop(scratch);
    warmed.map_err(|refusal| refusal.why)
}

/// The node's function: the zygote's, or loaded here.
pub(super) fn resolve<'py>(
    py: Python<'py>,
    call: &Assignment,
    function: Function<'_>,
    logs: &LogBuffer,
) -> PyResult<Bound<'py, PyAny>> {
    Ok(match function {
        Function::Loaded(function) => function.bind(py).clone(),
        Function::LoadHere { quiet: false } => {
            node::load(py, &call.key, &call.source, &call.digest)?
        }
        Function::LoadHere { quiet: true } => {
            let scratch = LogBuffer::new()?;
            scratch.capture_here();
            let loaded = node::load(py, &call.key, &call.source, &call.digest);
            logs.capture_here();
            drop(scratch);
            loaded?
        }
    })
}

/// Calls the node with the call's keyword arguments; drains a generator.
pub(super) fn invoke<'py>(
    py: Python<'py>,
    call: &Assignment,
    function: &Bound<'py, PyAny>,
) -> PyResult<Bound<'py, PyAny>> {
    let result = call_with_kwargs(py, function, call.kwargs.as_deref())?;
    if generator::is_generator(&result) {
        return drain(result);
    }
    Ok(result)
}

/// `function(**(kwargs or {}))`, with Python's own error for a non-mapping.
fn call_with_kwargs<'py>(
    py: Python<'py>,
    function: &Bound<'py, PyAny>,
    kwargs: Option<&str>,
) -> PyResult<Bound<'py, PyAny>> {
    let decoded = match kwargs {
        Some(text) => Some(channel::loads(py, text)?),
        None => None,
    };
    let kwargs = match decoded {
        Some(value) if value.is_truthy()? => value,
        _ => return function.call0(),
    };
    let Ok(kwargs) = kwargs.cast::<PyDict>() else {
        let qualname = function.getattr("__qualname__")?.str()?;
        let module = function
            .getattr("__module__")
            .ok()
            .and_then(|m| m.extract::<String>().ok());
        let name = match module {
            Some(module) if module != "builtins" => format!("{module}.{qualname}"),
            _ => qualname.to_string(),
        };
        return Err(PyTypeError::new_err(format!(
            "{name}() argument after ** must be a mapping, not {}",
            kwargs.get_type().name()?
        )));
    };
    function.call((), Some(kwargs))
}

/// Runs a generator node, sending each yield the moment it happens; what it
/// returns is the result.
fn drain(generator: Bound<'_, PyAny>) -> PyResult<Bound<'_, PyAny>> {
    loop {
        match generator::resume(&generator)? {
            Step::Yielded(value) => channel::send_event("yield", &value, "yielded")?,
            Step::Returned(value) => return Ok(value),
        }
    }
}
