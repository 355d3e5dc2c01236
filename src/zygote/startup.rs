//! How a zygote starts: its options, CPython booted on the thread that
//! will fork, the interpreter set up before the first fork, and why a
//! start fails.

use std::path::PathBuf;

use fluksio_embed::interpreter::{InterpreterConfig, StartError};
use fluksio_embed::{capture, finish, fork};
use pyo3::prelude::*;

use super::{child, learn, reply, resident, signals, threads};

/// How to start a zygote.
#[derive(Debug, Clone)]
pub struct ZygoteOptions {
    /// The interpreter whose environment node code imports from.
    pub python: PathBuf,
    /// Modules imported once, before the first fork.
    pub preload: Vec<String>,
    /// What each call's child is contained in.
    pub containment: crate::containment::Options,
    /// Children forked ahead of their calls.
    pub standby: usize,
    /// A fresh child per call, or one per node serving its calls in turn.
    pub isolation: resident::Isolation,
    /// Calls a resident child serves before a fresh fork replaces it.
    pub max_calls_per_child: Option<u64>,
    /// A node whose module level leaves this many MiB or more gets a zygote
    /// of its own (`app`), rather than growing this one (`worker` only).
    pub node_zygote_mib: Option<u64>,
    /// The most fork loops (a node's zygote and its lanes) one node's calls
    /// get, where nodes have zygotes of their own (the agent's zygote, a
    /// shared one) [default: one per `app::CORES_PER_LANE` CPUs].
    pub node_lanes: Option<usize>,
    /// Threads each call's BLAS and OpenMP pools get (`--threads-per-call`);
    /// `None`: the CPUs shared among the calls in flight (`threads`).
    pub threads_per_call: Option<usize>,
    /// Import in the zygote what a node's calls import, for the calls after
    /// (`learn`).
    pub learn_imports: bool,
}

/// Why a zygote did not start. Each is printed as is, and exits 2.
#[derive(Debug)]
pub enum StartupError {
    Interpreter(StartError),
    /// A `--preload` module failed to import: its own error, and the fix.
    Preload {
        module: String,
        error: String,
        python: PathBuf,
    },
    Python(String),
    Containment(crate::containment::ContainmentError),
}

impl std::fmt::Display for StartupError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            StartupError::Interpreter(e) => e.fmt(f),
            StartupError::Preload {
                module,
                error,
                python,
            } => write!(
                f,
                "could not preload {module}: {error}\nhint: install it into the environment of {} \
                 ({} -m pip install {module}), or leave it out of --preload",
                python.display(),
                python.display()
            ),
            StartupError::Python(e) => write!(f, "the zygote could not set itself up: {e}"),
            StartupError::Containment(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for StartupError {}

impl From<PyErr> for StartupError {
    fn from(error: PyErr) -> StartupError {
        StartupError::Python(error.to_string())
    }
}

/// Starts CPython on this thread. Call once, first, on the thread that will
/// fork; afterwards use `Python::attach` as usual.
pub fn boot(options: &ZygoteOptions) -> Result<(), StartupError> {
    crate::fds::claim_inherited();
    fork::install(fork::ForkHooks {
        // The requests of calls in flight in the parent are not a child's
        // to read.
        in_child: crate::scrub::wipe_held_in_child,
        forked: |pid| crate::containment::strays::remember(pid.as_raw()),
        reaped: |pid| crate::containment::strays::forget(pid.as_raw()),
    });
    crate::artifacts::take_token();
    // Before the interpreter: the warden is spawned while this process
    // still has one thread.
    crate::containment::establish(crate::containment::Role::Zygote, &options.containment)
        .map_err(StartupError::Containment)?;
    let config = InterpreterConfig {
        python: options.python.clone(),
    };
    config.check().map_err(StartupError::Interpreter)?;
    signals::before_interpreter();
    super::device::answer_availability_from_nvml();
    config.initialize().map_err(StartupError::Interpreter)?;
    Ok(())
}

/// For `failed` in `zygote::run`: the error on stderr, as the command line
/// says it.
pub fn print_startup_error(error: &StartupError) {
    eprintln!("fluksio-zygote: {error}");
}

/// Sets up the booted interpreter: the `fluksio` module, the preloads,
/// the fork baseline, the GC.
pub(super) fn set_up(py: Python<'_>, options: &ZygoteOptions) -> Result<(), StartupError> {
    // First: before anything imports `signal`.
    signals::settle_zygote(py)?;
    fluksio_embed::module::install(py, &crate::fluksio::Runtime)?;
    capture::register_as_text_stream(py)?;
    // What every call needs, imported here so no call pays for it.
    for module in ["json", "traceback", "types", "gc", "logging"] {
        py.import(module)?;
    }
    let (preloaded, installed) = signals::watch(py, || {
        for module in &options.preload {
            if let Err(error) = py.import(module.as_str()) {
                let error = reply::error_line(py, &error);
                return Err(StartupError::Preload {
                    module: module.clone(),
                    error,
                    python: options.python.clone(),
                });
            }
        }
        Ok(())
    });
    preloaded?;
    signals::remember_preloads(installed);
    finish::settle_zygote(py);
    settle_baseline(py, &options.preload)?;
    child::set_heavy_from_mib(options.node_zygote_mib);
    threads::configure(options.threads_per_call);
    learn::enable(options.learn_imports);
    let gc = py.import("gc")?;
    gc.call_method0("disable")?;
    gc.call_method0("freeze")?;
    Ok(())
}

/// Learns what threads the preloads left at fork time: numpy's OpenBLAS
/// stops its pool in a fork handler (tolerated, and gone after this fork);
/// anything else is logged, since forking with it may hang.
fn settle_baseline(py: Python<'_>, preload: &[String]) -> Result<(), StartupError> {
    if super::threads::forks_safely(py) {
        return Ok(());
    }
    let left = fork::threads_at_last_fork();
    tracing::warn!(
        "after preloading {}, {} threads keep running at fork; a child forked with them may hang \
         on a lock one of them held. Tolerating them; preload less if calls hang.",
        preload.join(","),
        left - 1
    );
    fork::tolerate_at_fork(left);
    Ok(())
}
