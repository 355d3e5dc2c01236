//! The zygote: one thread, CPython embedded, a fork per call.
//!
//! The issues this solves:
//! 1. Importing torch, numpy or pandas costs seconds; forking a process
//!    that already has them costs a millisecond. The zygote imports
//!    `--preload` once and forks a child per call, each in its own session.
//! 2. A node's module-level work (reading a checkpoint on the CPU) belongs
//!    in the zygote too, so `compile` loads the node there and every later
//!    fork starts with it loaded. Per-call state dies with its child.
//! 3. Loading runs the node author's module-level code, which may crash,
//!    exit, or start a thread. So it runs first in a *trial* child: a crash
//!    costs that child; a thread that does not stop at fork keeps the node
//!    out of the zygote (it is then loaded in each call's child). Only a
//!    source that loaded cleanly there is loaded into the zygote, and the
//!    zygote checks itself after every load as well (see `recovery`).
//!
//! The zygote never has a second thread of its own: every fork is checked
//! by `fork::census`, at the moment of the fork.

pub mod app;
pub mod assignment;
pub mod channel;
pub mod child;
pub mod flight;
pub mod learn;
pub mod node;
pub mod recovery;
pub mod reply;
pub mod resident;
pub mod server;
pub mod signals;
mod standby;
pub mod threads;
pub mod warmup;

// CPython's side of the zygote is `fluksio_embed`'s: its start, its forks,
// its captured output, its end-of-call flush. Named here as the zygote's
// modules, which is where the runtime uses them.
use fluksio_embed::{capture, finish, fork, interpreter};

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::path::PathBuf;

use nix::unistd::Pid;
use pyo3::prelude::*;

use crate::end::End;
use crate::output::CallOutput;
use crate::protocol::{self, Op, Request};
use assignment::{Assignment, Function, Task, TrialVerdict};
use capture::LogBuffer;
use flight::{Flight, Landed};
use interpreter::{InterpreterConfig, StartError};
use node::NodeKey;

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
    config.initialize().map_err(StartupError::Interpreter)?;
    Ok(())
}

/// Starts a zygote and serves with it: boots the interpreter, sets the
/// zygote up, runs `serve`. A zygote that cannot start goes to `failed`,
/// and the exit code is 2; what `serve` returns is the exit code otherwise.
pub fn run(
    options: &ZygoteOptions,
    failed: impl FnOnce(&StartupError),
    serve: impl FnOnce(Python<'_>, &mut Zygote) -> std::process::ExitCode,
) -> std::process::ExitCode {
    if let Err(error) = boot(options) {
        failed(&error);
        return std::process::ExitCode::from(2);
    }
    Python::attach(|py| match Zygote::new(py, options) {
        Ok(mut zygote) => serve(py, &mut zygote),
        Err(error) => {
            failed(&error);
            std::process::ExitCode::from(2)
        }
    })
}

/// For `failed` in [`run`]: the error on stderr, as the command line says it.
pub fn print_startup_error(error: &StartupError) {
    eprintln!("fluksio-zygote: {error}");
}

/// Where a compiled node lives.
enum Residence {
    /// Loaded in the zygote: every fork has it.
    Zygote(Py<PyAny>),
    /// Its loading starts a thread that does not stop at fork (or it failed
    /// to load in the zygote after a clean trial): each call's child loads it.
    EachChild,
    /// Its module level is heavy (`--node-zygote-mib`): a zygote of its own
    /// has it loaded and forks its calls, which are relayed there; this
    /// zygote, and every other node's fork, stays small.
    OwnZygote(OwnZygote),
}

/// A node's own zygote, from the worker's side: calls go down its link.
struct OwnZygote {
    node_zygote: app::NodeZygote,
    next_ticket: u64,
}

struct Compiled {
    digest: String,
    source: String,
    residence: Residence,
    /// Why its warm-up was refused, where one was asked for (`warmup`).
    warmup_refused: Option<String>,
}

/// The zygote's state between calls.
pub struct Zygote {
    pid: Pid,
    nodes: HashMap<NodeKey, Compiled>,
    /// Bumped whenever `nodes` changes: a child forked before then holds
    /// the old state, and is not used.
    generation: u64,
    children: standby::Children,
    /// How many children wait ready (`--standby`).
    standby: usize,
    isolation: resident::Isolation,
    max_calls_per_child: Option<u64>,
    /// `--node-zygote-mib`, where heavy nodes get a zygote of their own.
    node_zygote_mib: Option<u64>,
    /// `--isolation node`: each node's child, between its calls.
    residents: HashMap<NodeKey, resident::Resident>,
    /// What the last fork of a standby took, in the zygote.
    fork_cost: std::time::Duration,
    /// Set when forking became unsafe; the owner must restart the zygote.
    needs_recovery: bool,
    /// When it started: a module file newer than this is never learned
    /// (`learn`).
    started: std::time::SystemTime,
}

/// The zygote must re-execute itself before it serves anything else (see
/// `recovery`).
#[derive(Debug)]
pub struct MustRecover {
    /// Whether the request was answered; if not, the new zygote serves it.
    pub answered: bool,
}

/// Why a call stopped short of landing.
enum Stop {
    /// Forking is unsafe: recover first.
    Recover,
    /// Its process could not even start; the reply saying so has been sent.
    Answered,
}

impl Zygote {
    /// Sets up the booted interpreter: the `fluksio` module, the preloads,
    /// the fork baseline, the GC.
    pub fn new(py: Python<'_>, options: &ZygoteOptions) -> Result<Zygote, StartupError> {
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
        Ok(Zygote {
            pid: nix::unistd::getpid(),
            nodes: HashMap::new(),
            generation: 0,
            children: standby::Children::default(),
            standby: options.standby,
            isolation: options.isolation,
            max_calls_per_child: options.max_calls_per_child,
            node_zygote_mib: options.node_zygote_mib,
            residents: HashMap::new(),
            fork_cost: std::time::Duration::from_millis(1),
            needs_recovery: false,
            started: std::time::SystemTime::now(),
        })
    }

    /// Serves one request of the worker contract: every line it produces
    /// (events, then exactly one reply) goes to `out`.
    pub fn serve(
        &mut self,
        py: Python<'_>,
        request: &Request,
        out: &mut dyn CallOutput,
    ) -> Result<(), MustRecover> {
        let log = crate::telemetry::CallLog::for_request(request);
        let mut observed = crate::telemetry::Observed::new(out, log);
        let served = self.serve_maybe_detached(py, request, &mut observed, false);
        observed.finish();
        served.map(|_| ())
    }

    /// Serves one request as [`Zygote::serve`] does, except a run: once its
    /// child is started, its flight is returned for the caller to follow
    /// (the agent reads its pipe); compiles are served whole.
    pub fn serve_detached(
        &mut self,
        py: Python<'_>,
        request: &Request,
        out: &mut dyn CallOutput,
    ) -> Result<Option<Flight>, MustRecover> {
        self.serve_maybe_detached(py, request, out, true)
    }

    fn serve_maybe_detached(
        &mut self,
        py: Python<'_>,
        request: &Request,
        out: &mut dyn CallOutput,
        detach: bool,
    ) -> Result<Option<Flight>, MustRecover> {
        match self.serve_request(py, request, out, detach) {
            Err(Stop::Recover) => Err(MustRecover { answered: false }),
            Ok(flight) if !self.needs_recovery => Ok(flight),
            Err(Stop::Answered) if !self.needs_recovery => Ok(None),
            // A detached flight is still the caller's to follow.
            Ok(Some(flight)) => Ok(Some(flight)),
            _ => Err(MustRecover { answered: true }),
        }
    }

    fn serve_request(
        &mut self,
        py: Python<'_>,
        request: &Request,
        out: &mut dyn CallOutput,
        detach: bool,
    ) -> Result<Option<Flight>, Stop> {
        let digest = node::source_digest(&request.source);
        let assignment = |task| Assignment::for_request(request, task, &digest);

        if request.op == Op::Compile && !request.keep {
            // A question about a draft, not a load: keeping it would throw
            // away the published source later calls are served from.
            let landed = self.call_to_end(py, &assignment(Task::Check), None, out)?;
            self.children.recycle(landed.logs);
            return Ok(None);
        }

        let key = NodeKey {
            flow: request.flow.clone(),
            node: request.node.clone(),
        };
        let current = self.nodes.get(&key).is_some_and(|c| c.digest == digest);
        let mut trial_logs = None;
        if current && request.op == Op::Compile {
            out.reply(&protocol::compiled_reply(&request.id, &request.call_id));
            return Ok(None);
        }
        if current && self.has_own_zygote(&key) {
            return self.relay(&key, request, out).map(|()| None);
        }
        if !current {
            // Load it, as the reference loads an uncached node on compile and
            // on run alike. A run keeps the trial's logs as the start of its own.
            let mut held = HeldReply::default();
            let trial = {
                let mut trial_out = TrialOutput {
                    events: &mut *out,
                    reply: &mut held,
                };
                self.call_to_end(py, &assignment(Task::Trial), None, &mut trial_out)
            };
            let landed = match trial {
                Ok(landed) => landed,
                Err(stop) => {
                    // What the trial could not do was answered into `held`.
                    if !held.line.is_empty() {
                        out.reply(&held.line);
                    }
                    return Err(stop);
                }
            };
            let verdict = match landed.reaped.end {
                crate::process::ChildEnd::Exited(code) if landed.replied => {
                    TrialVerdict::from_exit_code(code)
                }
                _ => None,
            };
            // Refused in the trial, the warm-up is not run here either.
            let refused = warmup::refusal_in(&landed.logs.take_report());
            let warm = match &refused {
                Some(why) => Err(why.as_str()),
                None => Ok(request
                    .warmup
                    .as_deref()
                    .map(serde_json::value::RawValue::get)),
            };
            let own_zygote =
                self.node_zygote_mib.is_some() && self.isolation == resident::Isolation::Call;
            let loaded = match verdict {
                Some(TrialVerdict::LoadedHeavy) if own_zygote => {
                    self.give_own_zygote(py, &key, &request.source, &digest, warm);
                    true
                }
                Some(TrialVerdict::Loaded | TrialVerdict::LoadedHeavy) => {
                    self.load_into_zygote(py, &key, &request.source, &digest, warm);
                    true
                }
                Some(TrialVerdict::LoadedButForkUnsafe) => {
                    tracing::warn!(
                        "node {key} starts a thread while it loads that does not stop at fork; \
                         it is loaded in each call's child instead of the zygote"
                    );
                    self.remember(&key, &request.source, &digest, Residence::EachChild);
                    true
                }
                Some(TrialVerdict::Failed) | None => false,
            };
            if request.op == Op::Run && verdict.is_none() && landed.replied {
                // It loaded and replied, then was killed before it could say
                // whether the zygote may keep it: the run never started.
                let message = format!(
                    "the node's loading process {} after it loaded, so the run did not start",
                    landed.reaped.end
                );
                held.line = End::Lost(message).reply(&request.id, &request.call_id, "");
            }
            if request.op == Op::Compile || !loaded {
                out.reply(&held.line);
                self.children.recycle(landed.logs);
                return Ok(None);
            }
            if self.needs_recovery {
                self.children.recycle(landed.logs);
                return Err(Stop::Recover);
            }
            if self.has_own_zygote(&key) {
                self.children.recycle(landed.logs);
                return self.relay(&key, request, out).map(|()| None);
            }
            trial_logs = Some(landed.logs);
        }
        if self.isolation == resident::Isolation::Node && !detach {
            return self
                .run_in_turn(py, &assignment(Task::Resident), trial_logs, out)
                .map(|()| None);
        }
        let mut flight = self.start(py, &assignment(Task::Run), trial_logs, out)?;
        if detach {
            // The caller hands the pipe over first, then replenishes.
            return Ok(Some(flight));
        }
        // A call shorter than a fork is answered before the next standby is
        // forked; a longer one has that fork made beside it, on the other core.
        let answered = matches!(flight.follow_for(out, Some(self.fork_cost)), Ok(Some(_)));
        if !answered {
            // What the call wrote so far (events, part of its reply) is
            // not the next call's to read.
            let _held = flight.held();
            self.replenish(py);
        }
        let served = self.run(&assignment(Task::Run), flight, out);
        if answered {
            self.replenish(py);
        }
        served.map(|()| None)
    }

    /// A run: its lines out as they come; once it has replied, its session
    /// is killed and it is reaped later, off the next call's clock.
    fn run(
        &mut self,
        assignment: &Assignment,
        mut flight: Flight,
        out: &mut dyn CallOutput,
    ) -> Result<(), Stop> {
        match flight.follow_to_reply(out) {
            Ok(true) => {
                self.children.land_later(flight);
                Ok(())
            }
            Ok(false) => self
                .finish(assignment, flight, out)
                .map(|landed| self.children.recycle(landed.logs)),
            Err(error) => {
                self.children.land_later(flight);
                Err(self.lost(assignment, error, out))
            }
        }
    }

    /// A call followed to its exit (a trial's verdict is its exit code).
    fn call_to_end(
        &mut self,
        py: Python<'_>,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        out: &mut dyn CallOutput,
    ) -> Result<Landed, Stop> {
        let _held = assignment.held();
        let mut flight = self.start(py, assignment, logs_so_far, out)?;
        if assignment.task != Task::Trial {
            // A trial changes the zygote's state: a standby forked now would
            // be discarded.
            self.replenish(py);
        }
        match flight.follow_to_reply(out) {
            Ok(_) => self.finish(assignment, flight, out),
            Err(error) => {
                self.children.land_later(flight);
                Err(self.lost(assignment, error, out))
            }
        }
    }

    /// Starts `assignment` in a standby child; a failure to fork is answered.
    fn start(
        &mut self,
        py: Python<'_>,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        out: &mut dyn CallOutput,
    ) -> Result<Flight, Stop> {
        match self.dispatch(py, assignment, logs_so_far) {
            Ok(flight) => {
                out.started(flight.pid);
                Ok(flight)
            }
            Err(SpawnError::Unsafe | SpawnError::NotCompiled) => Err(Stop::Recover),
            Err(SpawnError::Io(error)) => {
                let message = format!("could not start the node's process: {error}");
                out.reply(&assignment.lost(message));
                Err(Stop::Answered)
            }
        }
    }

    /// Lands a flight and answers for it if it ended without a reply.
    fn finish(
        &mut self,
        assignment: &Assignment,
        flight: Flight,
        out: &mut dyn CallOutput,
    ) -> Result<Landed, Stop> {
        // A line over --max-reply-mb killed it: that is what the reply says.
        let too_large = flight.too_large();
        match flight.land(out) {
            Ok(landed) => {
                if !landed.replied {
                    let reply = match too_large {
                        Some(too_large) => {
                            assignment.failure(crate::lines::TOO_LARGE, &too_large.message())
                        }
                        None => assignment.ended_without_reply(&landed),
                    };
                    out.reply(&reply);
                }
                Ok(landed)
            }
            Err(error) => Err(self.lost(assignment, error, out)),
        }
    }

    /// Only a failed poll or wait gets here: the zygote no longer knows its
    /// own children, and a restart is the honest fix. (The caller has killed
    /// the call's session where it still had the flight.)
    fn lost(
        &mut self,
        assignment: &Assignment,
        error: std::io::Error,
        out: &mut dyn CallOutput,
    ) -> Stop {
        tracing::error!("lost track of a call's process: {error}");
        let message = format!("lost track of the node's process: {error}");
        out.reply(&assignment.lost(message));
        self.needs_recovery = true;
        Stop::Answered
    }

    /// Forks the child for a run of a node compiled here (by a `compile`
    /// served before), without waiting for it: the caller follows the
    /// flight, lands it, and hands its logs back with [`Zygote::recycle`].
    pub fn start_run(&mut self, py: Python<'_>, request: &Request) -> Result<Flight, SpawnError> {
        let assignment = self.compiled_assignment(request, Task::Run)?;
        self.dispatch(py, &assignment, None)
    }

    /// `--isolation node` for `sweep`: forks a resident child for a run of
    /// a node compiled here and hands it the run; its later runs go down
    /// the control pipe returned ([`Zygote::next_in_turn`]).
    pub fn start_in_turn(
        &mut self,
        py: Python<'_>,
        request: &Request,
    ) -> Result<(Flight, crate::fds::Claimed), SpawnError> {
        let assignment = self.compiled_assignment(request, Task::Resident)?;
        self.dispatch_resident(py, &assignment, None)
    }

    /// `task` for `request`, whose node must be compiled here.
    fn compiled_assignment(&self, request: &Request, task: Task) -> Result<Assignment, SpawnError> {
        let digest = self
            .compiled_digest(request)
            .ok_or(SpawnError::NotCompiled)?;
        Ok(Assignment::for_request(request, task, &digest))
    }

    /// Hands a resident child ([`Zygote::start_in_turn`]) its next run.
    pub fn next_in_turn(
        &self,
        control: &crate::fds::Claimed,
        flight: &mut Flight,
        request: &Request,
    ) -> std::io::Result<()> {
        let digest = self
            .compiled_digest(request)
            .unwrap_or_else(|| node::source_digest(&request.source));
        flight.rearm();
        assignment::send_assignment(
            control,
            &Assignment::for_request(request, Task::Resident, &digest),
        )
    }

    /// The digest of the source the request's node was compiled from here.
    fn compiled_digest(&self, request: &Request) -> Option<String> {
        let key = NodeKey {
            flow: request.flow.clone(),
            node: request.node.clone(),
        };
        self.nodes.get(&key).map(|compiled| compiled.digest.clone())
    }

    /// Takes back the log buffer of a landed call, for the next one.
    pub fn recycle(&mut self, logs: LogBuffer) {
        self.children.recycle(logs);
    }

    /// The function of node `flow.node` where it is loaded in the zygote
    /// (`run`/`sweep` read its signature before forking any call); `None`
    /// where it is not compiled, or is loaded in each call's child instead.
    pub fn compiled_function<'py>(
        &self,
        py: Python<'py>,
        flow: &str,
        node: &str,
    ) -> Option<Bound<'py, PyAny>> {
        let key = NodeKey {
            flow: flow.to_string(),
            node: node.to_string(),
        };
        match &self.nodes.get(&key)?.residence {
            Residence::Zygote(function) => Some(function.bind(py).clone()),
            Residence::EachChild | Residence::OwnZygote(_) => None,
        }
    }

    /// The functions of the nodes loaded in the zygote.
    fn loaded_functions(&self) -> impl Iterator<Item = &Py<PyAny>> {
        self.nodes
            .values()
            .filter_map(|compiled| match &compiled.residence {
                Residence::Zygote(function) => Some(function),
                Residence::EachChild | Residence::OwnZygote(_) => None,
            })
    }

    /// How a child resolves its node, from its copy of the zygote's table.
    fn function_for(&self, assignment: &Assignment) -> Function<'_> {
        if !matches!(assignment.task, Task::Run | Task::Resident) {
            return Function::LoadHere { quiet: false };
        }
        match self.nodes.get(&assignment.key) {
            Some(compiled) if compiled.digest == assignment.digest => match &compiled.residence {
                Residence::Zygote(function) => Function::Loaded(function),
                Residence::EachChild | Residence::OwnZygote(_) => {
                    Function::LoadHere { quiet: true }
                }
            },
            _ => Function::LoadHere { quiet: false },
        }
    }

    /// Loads a node whose trial went cleanly into the zygote itself, checks
    /// the zygote can still fork safely, then warms the node up there.
    /// `warm`: the `--warmup` keyword arguments (`None`: the node's own, if
    /// it asks), or why its warm-up is refused.
    fn load_into_zygote(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        source: &str,
        digest: &str,
        warm: Result<Option<&str>, &str>,
    ) {
        // Its output was reported by the trial; here it goes nowhere.
        let loaded = capture::quietly(py, || node::load_in_zygote(py, key, source, digest));
        let residence = match loaded {
            Ok(function) => Residence::Zygote(function.unbind()),
            Err(error) => {
                tracing::warn!(
                    "node {key} loaded in its trial but not in the zygote ({}); it is loaded in \
                     each call's child instead",
                    reply::error_line(py, &error)
                );
                Residence::EachChild
            }
        };
        let function = match &residence {
            Residence::Zygote(function) => Some(function.clone_ref(py)),
            _ => None,
        };
        self.remember(key, source, digest, residence);
        if !fork::forks_safely(py) {
            tracing::error!(
                "loading node {key} into the zygote left a thread running that does not stop at \
                 fork, though its trial did not; restarting the zygote with the node loaded in \
                 each call's child instead"
            );
            if let Some(compiled) = self.nodes.get_mut(key) {
                compiled.residence = Residence::EachChild;
            }
            self.needs_recovery = true;
            return;
        }
        let refused = match (warm, function) {
            (Err(why), _) => Some(why.to_string()),
            (Ok(explicit), Some(function)) => self.warm_up(py, key, function.bind(py), explicit),
            (Ok(_), None) => None,
        };
        if let Some(why) = &refused {
            tracing::warn!("node {key}: its warm-up was refused ({why}); its calls start cold");
        }
        if let Some(compiled) = self.nodes.get_mut(key) {
            compiled.warmup_refused = refused;
        }
    }

    /// Runs node `key`'s warm-up here, if one is asked for; why not, if it
    /// was refused. One that left a thread or a CUDA context here (its
    /// trial did not) restarts the zygote.
    fn warm_up(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        function: &Bound<'_, PyAny>,
        explicit: Option<&str>,
    ) -> Option<String> {
        let kwargs = match warmup::kwargs(py, function, explicit) {
            Ok(Some(kwargs)) => kwargs,
            Ok(None) => return None,
            Err(why) => return Some(why),
        };
        let warmed =
            capture::quietly(py, || Ok(warmup::run(py, function, &kwargs))).unwrap_or(Ok(()));
        match warmed {
            Ok(()) => {
                // What it built stays; standbys forked before it do not have it.
                self.generation += 1;
                tracing::debug!(node = %key, "warmed up in the zygote");
                None
            }
            Err(refusal) => {
                if refusal.poisoned {
                    tracing::error!(
                        "node {key}'s warm-up left the zygote unable to fork safely ({}), though \
                         its trial did not; restarting the zygote",
                        refusal.why
                    );
                    self.needs_recovery = true;
                }
                Some(refusal.why)
            }
        }
    }

    /// Why node `flow.node`'s warm-up was refused, where one was asked for
    /// and it was.
    pub fn warmup_refusal(&self, flow: &str, node: &str) -> Option<String> {
        let key = NodeKey {
            flow: flow.to_string(),
            node: node.to_string(),
        };
        self.nodes.get(&key)?.warmup_refused.clone()
    }

    fn remember(&mut self, key: &NodeKey, source: &str, digest: &str, residence: Residence) {
        Python::attach(|py| node::publish(py, key, source, digest));
        if let Some(Compiled {
            residence: Residence::OwnZygote(own),
            ..
        }) = self.nodes.remove(key)
        {
            own.node_zygote.end();
        }
        self.nodes.insert(
            key.clone(),
            Compiled {
                digest: digest.to_string(),
                source: source.to_string(),
                residence,
                warmup_refused: None,
            },
        );
        self.generation += 1;
    }

    /// What a restarted zygote needs to carry on where this one stopped.
    pub fn resume_nodes(&self) -> Vec<recovery::ResumeNode> {
        self.nodes
            .iter()
            .map(|(key, compiled)| recovery::ResumeNode {
                flow: key.flow.clone(),
                node: key.node.clone(),
                source: compiled.source.clone(),
                in_zygote: matches!(compiled.residence, Residence::Zygote(_)),
            })
            .collect()
    }

    /// Takes back the nodes a previous incarnation had compiled: the ones it
    /// had loaded are loaded again (each checked), the others stay out.
    pub fn restore_nodes(&mut self, py: Python<'_>, nodes: Vec<recovery::ResumeNode>) {
        for resumed in nodes {
            let key = NodeKey {
                flow: resumed.flow,
                node: resumed.node,
            };
            let digest = node::source_digest(&resumed.source);
            if resumed.in_zygote {
                // Not warmed up again: a warm-up may be what made the last
                // incarnation restart.
                let warm = Err("not run again after the zygote restarted");
                self.load_into_zygote(py, &key, &resumed.source, &digest, warm);
            } else {
                self.remember(&key, &resumed.source, &digest, Residence::EachChild);
            }
        }
    }

    /// In a node's own zygote, just forked: the standby, resident and
    /// landing children it copied are its parent's. Forgotten, never
    /// dropped (dropping one would kill its parent's child, or close an fd
    /// number this process uses for something else by then).
    fn forget_inherited_children(&mut self) {
        std::mem::forget(std::mem::take(&mut self.children));
        std::mem::forget(std::mem::take(&mut self.residents));
        // Its parent's node zygotes are its parent's; it makes none itself.
        let own: Vec<NodeKey> = self
            .nodes
            .iter()
            .filter(|(_, compiled)| matches!(compiled.residence, Residence::OwnZygote(_)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in own {
            std::mem::forget(self.nodes.remove(&key));
        }
        self.node_zygote_mib = None;
        child::set_heavy_from_mib(None);
        self.pid = nix::unistd::getpid();
        self.generation += 1;
    }

    /// A fresh child per call, or one per node serving its calls in turn.
    pub fn isolation(&self) -> resident::Isolation {
        self.isolation
    }

    /// Whether forking became unsafe: the zygote must restart before it
    /// serves anything else.
    pub fn needs_recovery(&self) -> bool {
        self.needs_recovery
    }

    /// Ends every child still around: the standby, residents, and calls
    /// being reaped.
    pub fn shutdown(&mut self) {
        self.retire_all();
        self.children.shutdown();
        let own: Vec<NodeKey> = self
            .nodes
            .iter()
            .filter(|(_, compiled)| matches!(compiled.residence, Residence::OwnZygote(_)))
            .map(|(key, _)| key.clone())
            .collect();
        for key in own {
            self.end_own_zygote(&key);
        }
        node::remove_module_dir();
    }

    /// Blocks until `input` is readable, reaping finished children meanwhile.
    pub fn wait_for_input(&mut self, input: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
        self.children.wait_for_input(input)
    }
}

impl Zygote {
    fn has_own_zygote(&self, key: &NodeKey) -> bool {
        self.nodes
            .get(key)
            .is_some_and(|compiled| matches!(compiled.residence, Residence::OwnZygote(_)))
    }

    /// Forks a zygote of its own for a heavy node whose trial went cleanly,
    /// loads the node there, and remembers it; where that fails, the node
    /// is loaded here after all.
    fn give_own_zygote(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        source: &str,
        digest: &str,
        warm: Result<Option<&str>, &str>,
    ) {
        let preload = app::Preload {
            source,
            digest,
            warm,
        };
        let started =
            server::spawn_node_zygote(py, self, key, server::Contract::Worker, Some(preload))
                .map_err(|error| error.to_string())
                .and_then(|node_zygote| {
                    let mut receiver = crate::link::Receiver::default();
                    match app::wait_ready(&node_zygote, &mut receiver) {
                        Ok(()) => Ok(node_zygote),
                        Err(why) => {
                            node_zygote.end();
                            Err(why)
                        }
                    }
                });
        match started {
            Ok(node_zygote) => {
                tracing::info!(
                    node = %key,
                    pid = node_zygote.pid.as_raw(),
                    "the node's module level is heavy: it has a zygote of its own"
                );
                let own = OwnZygote {
                    node_zygote,
                    next_ticket: 0,
                };
                self.remember(key, source, digest, Residence::OwnZygote(own));
            }
            Err(why) => {
                tracing::warn!("node {key}: no zygote of its own ({why}); it is loaded here");
                self.load_into_zygote(py, key, source, digest, warm);
            }
        }
    }

    /// Serves a request of a node in a zygote of its own: the request down
    /// its link, its lines back to `out`. If that zygote has died, the node
    /// is forgotten (its next request loads it again) and the call's reply
    /// says so.
    fn relay(
        &mut self,
        key: &NodeKey,
        request: &Request,
        out: &mut dyn CallOutput,
    ) -> Result<(), Stop> {
        let Some(Compiled {
            residence: Residence::OwnZygote(own),
            ..
        }) = self.nodes.get_mut(key)
        else {
            return Ok(());
        };
        own.next_ticket += 1;
        let ticket = own.next_ticket;
        let call = crate::link::Frame::Call {
            ticket,
            request: request.to_worker_line(),
        };
        let followed = match app::send(&own.node_zygote, &call) {
            Ok(()) => crate::link::follow::follow(
                own.node_zygote.link.as_fd(),
                ticket,
                &request.id,
                &request.call_id,
                out,
            ),
            Err(_) => crate::link::follow::Followed::LinkLost { replied: false },
        };
        if let crate::link::follow::Followed::LinkLost { replied } = followed {
            let pid = own.node_zygote.pid;
            self.end_own_zygote(key);
            if !replied {
                let message = format!(
                    "the zygote of node {key} (pid {pid}) ended during the call; the node's \
                     next call loads it again"
                );
                out.reply(&End::Lost(message).reply(&request.id, &request.call_id, ""));
            }
        }
        Ok(())
    }

    /// Forgets a node in a zygote of its own, and ends that zygote.
    fn end_own_zygote(&mut self, key: &NodeKey) {
        if let Some(Compiled {
            residence: Residence::OwnZygote(own),
            ..
        }) = self.nodes.remove(key)
        {
            own.node_zygote.end();
        }
    }
}

/// Learns what threads the preloads left at fork time: numpy's OpenBLAS
/// stops its pool in a fork handler (tolerated, and gone after this fork);
/// anything else is logged, since forking with it may hang.
fn settle_baseline(py: Python<'_>, preload: &[String]) -> Result<(), StartupError> {
    if fork::forks_safely(py) {
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

/// Why a call could not be started.
pub enum SpawnError {
    /// A stray thread was running at the fork; nothing ran. Recover.
    Unsafe,
    Io(std::io::Error),
    /// `start_run` of a node no `compile` loaded.
    NotCompiled,
}

/// The held-back reply of a trial: a run serves its own reply after it.
#[derive(Default)]
struct HeldReply {
    line: Vec<u8>,
}

/// A trial's events go out as the call's; its reply is held.
struct TrialOutput<'a> {
    events: &'a mut dyn CallOutput,
    reply: &'a mut HeldReply,
}

impl CallOutput for TrialOutput<'_> {
    fn event(&mut self, line: &[u8]) {
        self.events.event(line);
    }

    fn reply(&mut self, line: &[u8]) {
        self.reply.line = line.to_vec();
    }

    /// The trial's child is the call's while it runs: a cancel kills it.
    fn started(&mut self, pid: Pid) {
        self.events.started(pid);
    }
}
