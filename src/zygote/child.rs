//! What a call's child does, from the fork to `_exit`.
//!
//! 1. Stand by: point `sys.stdout`/`sys.stderr` at the call's log buffer,
//!    re-enable the GC the zygote keeps off, and wait for the assignment on
//!    the control pipe. A child is forked before its call arrives, so all
//!    of this is off the call's clock.
//! 2. Apply the call's environment; load the node if the zygote has not,
//!    then call it; drain a generator, sending each yield as it comes.
//! 3. Encode the reply exactly as `worker_main.py` does (the same
//!    `json.dumps`, the same refusals of what JSON cannot carry), send it,
//!    `_exit`: no atexit handlers, no flush of buffers inherited from the
//!    zygote.
//!
//! `sys.exit()` is honoured as an exit: the child leaves with that code and
//! no reply, and whoever reaps it says how it ended (`exited with code 3`).

use std::io::Read;
use std::os::fd::{FromRawFd, RawFd};

use pyo3::exceptions::{
    PyMemoryError, PyRecursionError, PySyntaxError, PySystemExit, PyTypeError, PyValueError,
};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList, PyString};
use serde_json::value::RawValue;

use super::capture::{self, LogBuffer};
use super::channel;
use super::fork;
use super::node::{self, NodeKey};
use super::{finish, signals};

/// How a trial ended, told by its exit code once its reply is sent: the
/// code is ours to choose there, and needs no second channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrialVerdict {
    /// Loaded, and the zygote can fork with it loaded.
    Loaded,
    /// Loaded, but a thread it started does not stop at fork: load it in
    /// each call's child instead.
    LoadedButForkUnsafe,
    /// Loaded, and its module level left more memory than
    /// `--node-zygote-mib`: it gets a zygote of its own (`super::app`).
    LoadedHeavy,
    /// The source did not load; the reply says why.
    Failed,
}

impl TrialVerdict {
    const LOADED: i32 = 0;
    const FORK_UNSAFE: i32 = 118;
    const FAILED: i32 = 119;
    const HEAVY: i32 = 120;

    fn exit_code(self) -> i32 {
        match self {
            TrialVerdict::Loaded => Self::LOADED,
            TrialVerdict::LoadedButForkUnsafe => Self::FORK_UNSAFE,
            TrialVerdict::Failed => Self::FAILED,
            TrialVerdict::LoadedHeavy => Self::HEAVY,
        }
    }

    /// The verdict of a trial that replied and then exited with `code`.
    pub fn from_exit_code(code: i32) -> Option<TrialVerdict> {
        match code {
            Self::LOADED => Some(TrialVerdict::Loaded),
            Self::FORK_UNSAFE => Some(TrialVerdict::LoadedButForkUnsafe),
            Self::FAILED => Some(TrialVerdict::Failed),
            Self::HEAVY => Some(TrialVerdict::LoadedHeavy),
            _ => None,
        }
    }
}

/// What the child is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// `compile` with `keep: false`: does the source load? Nothing kept.
    Check,
    /// Before the zygote loads a node: does it load, and can the zygote
    /// still fork safely with it loaded? The answer is the exit code.
    Trial,
    /// Call the node with the assignment's keyword arguments.
    Run,
    /// A run whose child stays, serving the node's later calls in turn
    /// (`--isolation node`): its module state lives on, as in a reused
    /// `worker_main.py`.
    Resident,
}

/// Where the node's function comes from.
pub enum Function<'a> {
    /// Loaded in the zygote; every fork has it.
    Loaded(&'a Py<PyAny>),
    /// Loaded here. `quiet`: its output was already reported once (at
    /// compile), so it is not captured again.
    LoadHere { quiet: bool },
}

/// One call, as the zygote hands it to a child: sent down the child's
/// control pipe, since a standby child is forked before its call exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub task: Task,
    /// The request's `id`, as the JSON text it arrived as.
    pub id: String,
    pub call_id: String,
    pub key: NodeKey,
    pub source: String,
    /// md5 of `source`, hex.
    pub digest: String,
    /// `Run` only: the keyword arguments as JSON text.
    pub kwargs: Option<String>,
    /// Environment applied before any node code runs.
    pub env: Vec<(String, String)>,
}

impl Assignment {
    /// Its copies of the call's kwargs and env, held while it is in memory
    /// (`crate::scrub`): a child forked meanwhile wipes them.
    pub fn held(&self) -> Vec<crate::scrub::Held> {
        crate::scrub::hold_call_data(self.kwargs.as_deref(), &self.env)
    }

    /// Length-prefixed fields: no escaping, no second JSON parse of a
    /// payload of megabytes.
    pub fn encode(&self) -> Vec<u8> {
        let task = match self.task {
            Task::Check => "check",
            Task::Trial => "trial",
            Task::Run => "run",
            Task::Resident => "resident",
        };
        let mut fields: Vec<&str> = vec![
            task,
            &self.id,
            &self.call_id,
            &self.key.flow,
            &self.key.node,
            &self.source,
            &self.digest,
            self.kwargs.as_deref().unwrap_or(""),
            if self.kwargs.is_some() { "1" } else { "0" },
        ];
        for (key, value) in &self.env {
            fields.push(key);
            fields.push(value);
        }
        let mut bytes = Vec::with_capacity(fields.iter().map(|f| f.len() + 8).sum());
        for field in fields {
            bytes.extend_from_slice(&(field.len() as u64).to_le_bytes());
            bytes.extend_from_slice(field.as_bytes());
        }
        bytes
    }

    pub fn decode(mut bytes: &[u8]) -> Option<Assignment> {
        let mut fields = Vec::new();
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at_checked(8)?;
            let len = u64::from_le_bytes(len.try_into().ok()?) as usize;
            let (field, rest) = rest.split_at_checked(len)?;
            fields.push(String::from_utf8(field.to_vec()).ok()?);
            bytes = rest;
        }
        if fields.len() < 9 || fields.len() % 2 == 0 {
            return None;
        }
        let mut fields = fields.into_iter();
        let mut next = || fields.next().unwrap_or_default();
        let task = match next().as_str() {
            "check" => Task::Check,
            "trial" => Task::Trial,
            "run" => Task::Run,
            "resident" => Task::Resident,
            _ => return None,
        };
        let (id, call_id, flow, node, source, digest) =
            (next(), next(), next(), next(), next(), next());
        let kwargs = next();
        let kwargs = (next() == "1").then_some(kwargs);
        // The rest are pairs (the count is odd with them: checked above); an
        // empty name is a name like any other here.
        let mut rest: Vec<String> = fields.collect();
        let mut env = Vec::with_capacity(rest.len() / 2);
        while rest.len() >= 2 {
            let value = rest.pop().unwrap_or_default();
            let key = rest.pop().unwrap_or_default();
            env.push((key, value));
        }
        env.reverse();
        Some(Assignment {
            task,
            id,
            call_id,
            key: NodeKey { flow, node },
            source,
            digest,
            kwargs,
            env,
        })
    }
}

/// A standby's wake-up call: an eventfd, not the control pipe itself. A
/// pipe wakes its reader as a "sync" wake-up, which places it on the
/// writer's CPU on the guess that the writer is about to sleep; the zygote
/// is about to fork the next standby instead, and the call would wait for
/// that fork to finish. An eventfd wake-up goes to an idle CPU.
pub fn wake_up_call() -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: eventfd returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Wakes the standby holding `go`'s other copy.
pub fn wake(go: &impl std::os::fd::AsRawFd) {
    let one: u64 = 1;
    // SAFETY: an 8-byte write from a live u64 to an eventfd.
    unsafe { libc::write(go.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Blocks until the zygote calls. A standby that is not wanted any more is
/// killed by the zygote (an eventfd has no end to wait for).
pub fn wait_for_call(go: &impl std::os::fd::AsRawFd) {
    let mut count: u64 = 0;
    loop {
        // SAFETY: an 8-byte read into a live u64 from an eventfd.
        let n = unsafe { libc::read(go.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        if n == 8 {
            return;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        exit(0);
    }
}

/// Writes `assignment` down a child's control pipe, length first: a
/// resident child reads one assignment after another from the same pipe.
/// Closing the pipe ends the child.
pub fn send_assignment(
    control: &impl std::os::fd::AsRawFd,
    assignment: &Assignment,
) -> std::io::Result<()> {
    let body = assignment.encode();
    let mut frame = Vec::with_capacity(8 + body.len());
    frame.extend_from_slice(&(body.len() as u64).to_le_bytes());
    frame.extend_from_slice(&body);
    channel::write_all(control.as_raw_fd(), &frame)
}

/// A child waiting for its assignment; exits quietly if none comes (the
/// zygote closed the pipe: a standby not wanted).
pub fn receive(control: RawFd) -> Assignment {
    match next_assignment(control) {
        Some(assignment) => assignment,
        None => exit(0),
    }
}

/// The next assignment on `control`; `None` once the zygote closed it (a
/// resident retired). A garbled one ends the child.
pub fn next_assignment(control: RawFd) -> Option<Assignment> {
    // SAFETY: the control pipe's read end is this child's alone.
    let mut file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(control) });
    let mut length = [0u8; 8];
    file.read_exact(&mut length).ok()?;
    let mut bytes = vec![0u8; u64::from_le_bytes(length) as usize];
    file.read_exact(&mut bytes).ok()?;
    match Assignment::decode(&bytes) {
        Some(assignment) => Some(assignment),
        None => exit(1),
    }
}

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
        exit(system_exit_code(py, error));
    }
    let exit_code = match (call.task, &outcome) {
        (Task::Trial, Ok(_)) if !fork::forks_safely(py) => {
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
    exit(exit_code)
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

pub(super) fn exit(code: i32) -> ! {
    // SAFETY: _exit ends the process at once; nothing of ours needs to run.
    unsafe { libc::_exit(code) }
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

/// `Type: message (line N)` of a node's exception, as a reply's `short`.
pub(super) fn short_description(py: Python<'_>, error: &PyErr) -> String {
    describe(py, error)
        .ok()
        .and_then(|described| described.get_item("short").ok().flatten())
        .and_then(|short| short.str().ok().map(|s| s.to_string_lossy().into_owned()))
        .unwrap_or_else(|| super::error_line(py, error))
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
    // SAFETY: PyGen_Check only reads the object's type.
    if unsafe { pyo3::ffi::PyGen_Check(result.as_ptr()) } != 0 {
        return drain(py, result);
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
fn drain<'py>(py: Python<'py>, generator: Bound<'py, PyAny>) -> PyResult<Bound<'py, PyAny>> {
    loop {
        let mut out: *mut pyo3::ffi::PyObject = std::ptr::null_mut();
        // SAFETY: `generator` is a live generator (PyGen_Check), and
        // PyIter_Send returns a new reference in `out` for NEXT and RETURN.
        let sent =
            unsafe { pyo3::ffi::PyIter_Send(generator.as_ptr(), pyo3::ffi::Py_None(), &mut out) };
        match sent {
            pyo3::ffi::PySendResult::PYGEN_NEXT => {
                // SAFETY: a new reference, owned from here on.
                let value = unsafe { Bound::from_owned_ptr(py, out) };
                channel::send_event("yield", &value, "yielded")?;
            }
            // SAFETY: as above.
            pyo3::ffi::PySendResult::PYGEN_RETURN => {
                return Ok(unsafe { Bound::from_owned_ptr(py, out) });
            }
            pyo3::ffi::PySendResult::PYGEN_ERROR => {
                return Err(PyErr::take(py).unwrap_or_else(|| {
                    PyTypeError::new_err("the generator failed without an exception")
                }));
            }
        }
    }
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
fn encode_logs(logs: &Bound<'_, PyAny>) -> PyResult<String> {
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_survives_its_wire_form() {
        let assignment = Assignment {
            task: Task::Run,
            id: "[1, \"x\"]".into(),
            call_id: "r:f.n".into(),
            key: NodeKey {
                flow: "f".into(),
                node: "n".into(),
            },
            source: "def process(x):\n    return x\n".into(),
            digest: "0123456789abcdef0123456789abcdef".into(),
            kwargs: Some("{\"x\": \"\"}".into()),
            env: vec![
                ("CUDA_VISIBLE_DEVICES".into(), "1".into()),
                ("EMPTY".into(), "".into()),
            ],
        };
        assert_eq!(
            Assignment::decode(&assignment.encode()),
            Some(assignment.clone())
        );
        let check = Assignment {
            task: Task::Check,
            kwargs: None,
            env: vec![],
            ..assignment
        };
        assert_eq!(Assignment::decode(&check.encode()), Some(check));
        assert_eq!(Assignment::decode(b"\x05\x00"), None);
    }
}
