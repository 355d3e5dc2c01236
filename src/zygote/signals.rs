//! Signal dispositions: the zygote's are the runtime's, a call's are those
//! of a fresh `python3` plus what its own node installed.
//!
//! The issues this solves:
//! 1. The interpreter starts with `install_signal_handlers = 0`, so nothing
//!    ignores SIGXFSZ, and SIGINT got Python's handler only once something
//!    imported `signal`: a call's SIGINT was KeyboardInterrupt or death
//!    depending on what an earlier node imported.
//! 2. A node's module-level code runs in the zygote. A handler it installs
//!    there (or `import signal`, which installs Python's SIGINT handler)
//!    changed what SIGINT and SIGTERM do to the worker itself, and was seen
//!    by every other node's calls.
//!
//! So: `_signal` is imported at boot and its table made a fresh `python3`'s
//! (SIGINT `default_int_handler`, SIGPIPE and SIGXFSZ `SIG_IGN`, a signal
//! this process was started with ignored still ignored, the rest
//! `SIG_DFL`), while the kernel keeps the runtime's dispositions (SIGINT and
//! SIGTERM as the process was started, or `run`/`sweep`'s handlers; SIGPIPE
//! and SIGXFSZ ignored). Every load in the zygote is watched: what it
//! installed (Python's table, the kernel, the mask, timers, the wakeup fd)
//! is recorded for that node and undone in the zygote. A call's child resets
//! every disposition to a fresh `python3`'s, then applies the preloads' and
//! its own node's recorded handlers.

use std::sync::Mutex;

use pyo3::prelude::*;

/// The highest signal number (Python's `NSIG - 1` on Linux).
fn max_signal() -> libc::c_int {
    libc::SIGRTMAX()
}

/// Signals the runtime owns in a call's child: never reset. The
/// parent-death signal (`fork::become_call_child`).
fn owned_by_runtime(signal: libc::c_int) -> bool {
    signal == libc::SIGRTMAX() - 1
}

fn query(signal: libc::c_int) -> Option<libc::sigaction> {
    // SAFETY: a query (no new action) into a zeroed, valid struct.
    unsafe {
        let mut action: libc::sigaction = std::mem::zeroed();
        (libc::sigaction(signal, std::ptr::null(), &mut action) == 0).then_some(action)
    }
}

fn set(signal: libc::c_int, action: &libc::sigaction) {
    // SAFETY: a valid action read back from the kernel or built here.
    unsafe { libc::sigaction(signal, action, std::ptr::null_mut()) };
}

fn plain(handler: libc::sighandler_t) -> libc::sigaction {
    // SAFETY: a zeroed sigaction is valid (empty mask, no flags).
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = handler;
    action
}

/// Whether two actions do the same (the restorer glibc adds aside; the
/// mask as the kernel keeps it, signal by signal).
fn same(a: &libc::sigaction, b: &libc::sigaction) -> bool {
    const SA_RESTORER: libc::c_int = 0x0400_0000;
    // SAFETY: sigismember reads valid sets.
    let masks_agree = (1..=max_signal())
        .all(|s| unsafe { libc::sigismember(&a.sa_mask, s) == libc::sigismember(&b.sa_mask, s) });
    a.sa_sigaction == b.sa_sigaction
        && (a.sa_flags & !SA_RESTORER) == (b.sa_flags & !SA_RESTORER)
        && masks_agree
}

type Kernel = Vec<Option<libc::sigaction>>;

fn kernel_now() -> Kernel {
    (0..=max_signal())
        .map(|s| if s == 0 { None } else { query(s) })
        .collect()
}

/// What a load (or the preloads) installed, to be applied in a call's child.
#[derive(Default)]
pub struct Installed {
    /// `signal.signal(signum, handler)` calls, as Python's table shows them.
    python: Vec<(libc::c_int, Py<PyAny>)>,
    /// Kernel actions afterwards, for every signal whose action changed.
    kernel: Vec<(libc::c_int, libc::sigaction)>,
}

struct State {
    /// What a call's child starts with, before any node's own.
    child: Kernel,
    /// What the preloads installed: every call has it, as every
    /// `python3` importing them would.
    preloads: Installed,
    /// Each node's own, by its module name.
    nodes: Vec<(String, Installed)>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// The signals this process was started with ignored. A `python3` started
/// in its place keeps them ignored (an ignored signal stays ignored across
/// exec: `nohup`'s SIGHUP, a background job's SIGINT), and so does a call.
static IGNORED_AT_START: std::sync::OnceLock<Vec<libc::c_int>> = std::sync::OnceLock::new();

/// Call first thing in `main`, before the runtime changes any disposition.
pub fn note_ignored_at_start() {
    IGNORED_AT_START.get_or_init(|| {
        (1..=max_signal())
            .filter(|&s| query(s).is_some_and(|a| a.sa_sigaction == libc::SIG_IGN))
            .collect()
    });
}

fn ignored_at_start(signal: libc::c_int) -> bool {
    IGNORED_AT_START
        .get()
        .is_some_and(|ignored| ignored.contains(&signal))
}

/// Kernel actions before the interpreter starts, to tell what its own start
/// installed (faulthandler under `PYTHONFAULTHANDLER`) from the runtime's.
static BEFORE_INIT: Mutex<Option<Kernel>> = Mutex::new(None);

/// Call just before the interpreter starts (`InterpreterConfig::initialize`).
pub fn before_interpreter() {
    *BEFORE_INIT.lock().unwrap_or_else(|e| e.into_inner()) = Some(kernel_now());
}

/// What a fresh `python3` has in its table for `signal`.
fn python3_default<'py>(
    signals: &Bound<'py, PyModule>,
    signal: libc::c_int,
) -> PyResult<Bound<'py, PyAny>> {
    match signal {
        libc::SIGPIPE | libc::SIGXFSZ => signals.getattr("SIG_IGN"),
        _ if ignored_at_start(signal) => signals.getattr("SIG_IGN"),
        libc::SIGINT => signals.getattr("default_int_handler"),
        _ => signals.getattr("SIG_DFL"),
    }
}

/// At boot, once the interpreter runs: Python's table as a fresh
/// `python3`'s, the kernel as the runtime's, and the child's start computed.
pub fn settle_zygote(py: Python<'_>) -> PyResult<()> {
    let runtime = kernel_now();
    let after_init = runtime.clone();
    let signals = py.import("_signal")?;
    for signal in 1..=max_signal() {
        let wanted = python3_default(&signals, signal)?;
        let current = signals.call_method1("getsignal", (signal,))?;
        if !current.eq(&wanted)? {
            // SIGKILL, SIGSTOP and glibc's own two refuse; nothing to do.
            let _ = signals.call_method1("signal", (signal, wanted));
        }
    }
    let python_handler = query(libc::SIGINT);
    let before_init = BEFORE_INIT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take()
        .unwrap_or_else(|| after_init.clone());
    let mut child = vec![None; runtime.len()];
    for signal in 1..=max_signal() {
        let index = signal as usize;
        // The kernel: back to the runtime's, but SIGXFSZ ignored, as Python
        // ignores it (a write past RLIMIT_FSIZE is then an OSError).
        let mut zygote = runtime[index];
        if signal == libc::SIGXFSZ {
            zygote = Some(plain(libc::SIG_IGN));
        }
        if let (Some(wanted), Some(now)) = (zygote, query(signal))
            && !same(&wanted, &now)
        {
            set(signal, &wanted);
        }
        if owned_by_runtime(signal) || runtime[index].is_none() {
            continue;
        }
        let started_by_python = match (&before_init[index], &after_init[index]) {
            (Some(before), Some(after)) => !same(before, after),
            _ => false,
        };
        child[index] = Some(match signal {
            _ if started_by_python => after_init[index].expect("read above"),
            _ if ignored_at_start(signal) => plain(libc::SIG_IGN),
            libc::SIGINT => python_handler.unwrap_or_else(|| plain(libc::SIG_DFL)),
            libc::SIGPIPE | libc::SIGXFSZ => plain(libc::SIG_IGN),
            _ => plain(libc::SIG_DFL),
        });
    }
    *state() = Some(State {
        child,
        preloads: Installed::default(),
        nodes: Vec::new(),
    });
    Ok(())
}

/// Python's table, every signal.
fn table(py: Python<'_>) -> PyResult<Vec<Option<Py<PyAny>>>> {
    let signals = py.import("_signal")?;
    let getsignal = signals.getattr("getsignal")?;
    (0..=max_signal())
        .map(|s| {
            if s == 0 {
                return Ok(None);
            }
            Ok(getsignal.call1((s,)).ok().map(Bound::unbind))
        })
        .collect()
}

fn mask_now() -> libc::sigset_t {
    // SAFETY: a query of this thread's mask into a valid set.
    unsafe {
        let mut mask: libc::sigset_t = std::mem::zeroed();
        libc::pthread_sigmask(libc::SIG_SETMASK, std::ptr::null(), &mut mask);
        mask
    }
}

/// Runs `load` in the zygote and undoes what it did to signals there: the
/// result, and what it installed (for its calls' children).
pub fn watch<R>(py: Python<'_>, load: impl FnOnce() -> R) -> (R, Installed) {
    let (kernel, python, mask) = (kernel_now(), table(py).unwrap_or_default(), mask_now());
    let result = load();
    let loaded = kernel_now();
    let mut installed = Installed::default();
    if let (Ok(after), Ok(signals)) = (table(py), py.import("_signal")) {
        for (signal, (was, now)) in python.iter().zip(&after).enumerate() {
            let (Some(was), Some(now)) = (was, now) else {
                continue;
            };
            if !was.bind(py).is(now.bind(py)) && !was.bind(py).eq(now.bind(py)).unwrap_or(false) {
                installed
                    .python
                    .push((signal as libc::c_int, now.clone_ref(py)));
                let _ = signals.call_method1("signal", (signal, was.bind(py)));
            }
        }
        // A loop's wakeup fd (asyncio) is the zygote's no more.
        let _ = signals.call_method1("set_wakeup_fd", (-1,));
    }
    for signal in 1..=max_signal() {
        let index = signal as usize;
        let (Some(was), Some(then)) = (kernel[index], loaded[index]) else {
            continue;
        };
        if !same(&was, &then) {
            installed.kernel.push((signal, then));
        }
        // Python's own restore above may have moved it too.
        if query(signal).is_some_and(|now| !same(&was, &now)) {
            set(signal, &was);
        }
    }
    // SAFETY: the mask read above, and zeroed timers: an alarm a node set
    // at module level must not go off in the zygote.
    unsafe {
        libc::pthread_sigmask(libc::SIG_SETMASK, &mask, std::ptr::null_mut());
        let off: libc::itimerval = std::mem::zeroed();
        for timer in [libc::ITIMER_REAL, libc::ITIMER_VIRTUAL, libc::ITIMER_PROF] {
            libc::setitimer(timer, &off, std::ptr::null_mut());
        }
    }
    (result, installed)
}

/// Keeps what the preloads installed, for every call.
pub fn remember_preloads(installed: Installed) {
    if let Some(state) = state().as_mut() {
        state.preloads = installed;
    }
}

/// Adds what modules imported into the zygote later installed (learned
/// preloads, `super::learn`) to what the preloads did, for every call.
pub fn add_to_preloads(installed: Installed) {
    if let Some(state) = state().as_mut() {
        state.preloads.python.extend(installed.python);
        state.preloads.kernel.extend(installed.kernel);
    }
}

/// Keeps what node `module`'s loading installed, for its calls.
pub fn remember_node(module: &str, installed: Installed) {
    if let Some(state) = state().as_mut() {
        state.nodes.retain(|(name, _)| name != module);
        if !installed.python.is_empty() || !installed.kernel.is_empty() {
            state.nodes.push((module.to_string(), installed));
        }
    }
}

fn apply(py: Python<'_>, installed: &Installed) {
    if installed.python.is_empty() && installed.kernel.is_empty() {
        return;
    }
    if let Ok(signals) = py.import("_signal") {
        for (signal, handler) in &installed.python {
            let _ = signals.call_method1("signal", (*signal, handler.bind(py)));
        }
    }
    for (signal, action) in &installed.kernel {
        set(*signal, action);
    }
}

/// In a freshly forked child, before any node code: a fresh `python3`'s
/// dispositions and an empty mask, then what the preloads installed.
pub fn reset_in_child(py: Python<'_>) {
    let guard = state();
    let Some(state) = guard.as_ref() else {
        return;
    };
    for (signal, action) in state.child.iter().enumerate() {
        if let Some(action) = action {
            set(signal as libc::c_int, action);
        }
    }
    // SAFETY: an empty set, applied to this (the only) thread.
    unsafe {
        let mut empty: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut empty);
        libc::pthread_sigmask(libc::SIG_SETMASK, &empty, std::ptr::null_mut());
    }
    apply(py, &state.preloads);
}

/// In a call's child whose node the zygote loaded: what its own
/// module-level code installed, as `python3 node.py` would have it.
pub fn enter_node(py: Python<'_>, module: &str) {
    let guard = state();
    if let Some((_, installed)) = guard
        .as_ref()
        .and_then(|s| s.nodes.iter().find(|(name, _)| name == module))
    {
        apply(py, installed);
    }
}
