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
//!
//! This file is the `Zygote`: where a request is placed (trial, compiled,
//! resident, a node's own zygote) and its call run to its end. What it
//! uses sits below it and never names it: `runner` (calls run in children),
//! `standby`, `resident` (and its `fallback`), `compiled` (the nodes it
//! holds), `trial`, `own`
//! and `app` (a node's own zygote), `startup`. What drives it over links
//! (`server`), and the worker's zygote, whose heavy nodes get zygotes of
//! their own (`heavy`), sit above it.

pub mod app;
pub mod assignment;
pub mod channel;
pub mod child;
mod compiled;
pub mod device;
pub mod fallback;
pub mod flight;
pub mod heavy;
pub mod learn;
pub mod node;
mod own;
pub mod placement;
pub mod recovery;
pub mod reply;
pub mod resident;
mod runner;
pub mod server;
pub mod signals;
mod standby;
mod startup;
pub mod threads;
mod trial;
pub mod warmup;

pub use standby::SpawnError;
pub use startup::{StartupError, ZygoteOptions, boot, print_startup_error};

use pyo3::prelude::*;

use crate::link::client::LinkLost;
use crate::output::CallOutput;
use crate::protocol::{self, Op, Request};
use assignment::{Assignment, Task, TrialVerdict};
use compiled::{Forks, Nodes, Residence};
use flight::Flight;
use fluksio_embed::capture::LogBuffer;
use node::NodeKey;
use own::OwnZygote;
use placement::{Home, Placement};
use runner::{Runner, Stop};
use trial::{HeldReply, Loading, TrialOutput};

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

/// Forks a zygote of its own for a heavy node, which loads the node and
/// serves its calls over its link (set by `heavy`, which knows the server
/// that zygote runs).
type SpawnOwn =
    fn(Python<'_>, &mut Zygote, &NodeKey, app::Preload<'_>) -> std::io::Result<app::NodeZygote>;

/// The zygote's state between calls.
pub struct Zygote {
    nodes: Nodes,
    runner: Runner,
    /// Where its nodes' calls run.
    placement: Placement,
    /// How a heavy node's own zygote is forked, where this zygote's front
    /// end serves them.
    spawn_own: Option<SpawnOwn>,
}

/// A run started for a caller that follows it itself (a link's owner).
pub enum Detached {
    /// A fresh child: its pipe is the caller's to hand over, and it is the
    /// caller's to land once it exits.
    Child(Flight),
    /// `--isolation reset`: the node's resident, its lines going down
    /// `pipe` (the owner's end). Once it says it is put back it waits for
    /// the node's next call ([`Zygote::keep_resident`]); ended, it lands.
    Resident {
        resident: resident::Resident,
        pipe: std::os::fd::OwnedFd,
    },
}

/// The zygote must re-execute itself before it serves anything else (see
/// `recovery`).
#[derive(Debug)]
pub struct MustRecover {
    /// Whether the request was answered; if not, the new zygote serves it.
    pub answered: bool,
}

impl Zygote {
    /// Sets up the booted interpreter: the `fluksio` module, the preloads,
    /// the fork baseline, the GC.
    pub fn new(py: Python<'_>, options: &ZygoteOptions) -> Result<Zygote, StartupError> {
        startup::set_up(py, options)?;
        Ok(Zygote {
            nodes: Nodes::default(),
            runner: Runner::new(
                options.standby,
                options.max_calls_per_child,
                options.isolation,
            ),
            placement: Placement {
                isolation: options.isolation,
                ..Placement::default()
            },
            spawn_own: None,
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
    ) -> Result<Option<Detached>, MustRecover> {
        self.serve_maybe_detached(py, request, out, true)
    }

    fn serve_maybe_detached(
        &mut self,
        py: Python<'_>,
        request: &Request,
        out: &mut dyn CallOutput,
        detach: bool,
    ) -> Result<Option<Detached>, MustRecover> {
        match self.serve_request(py, request, out, detach) {
            Err(Stop::Recover) => Err(MustRecover { answered: false }),
            Ok(flight) if !self.needs_recovery() => Ok(flight),
            Err(Stop::Answered) if !self.needs_recovery() => Ok(None),
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
    ) -> Result<Option<Detached>, Stop> {
        let digest = node::source_digest(&request.source);
        let assignment = |task| Assignment::for_request(request, task, &digest);

        if request.op == Op::Compile && !request.keep {
            // A question about a draft, not a load: keeping it would throw
            // away the published source later calls are served from.
            let landed = self.runner.call_to_end(
                py,
                &mut self.nodes,
                &assignment(Task::Check),
                None,
                out,
            )?;
            self.runner.recycle(landed.logs);
            return Ok(None);
        }

        let key = NodeKey {
            flow: request.flow.clone(),
            node: request.node.clone(),
        };
        let current = self.nodes.digest(&key) == Some(digest.as_str());
        let mut trial_logs = None;
        if current && request.op == Op::Compile {
            out.reply(&protocol::compiled_reply(&request.id, &request.call_id));
            return Ok(None);
        }
        if current && self.nodes.has_own_zygote(&key) {
            self.relay(&key, request, out);
            return Ok(None);
        }
        if !current {
            // Load it, as the reference loads an uncached node on compile and
            // on run alike. A run keeps the trial's logs as the start of its own.
            let mut held = HeldReply::default();
            let trial = {
                let mut trial_out = TrialOutput::new(&mut *out, &mut held);
                let trial = assignment(Task::Trial);
                let nodes = &mut self.nodes;
                self.runner
                    .call_to_end(py, nodes, &trial, None, &mut trial_out)
            };
            let landed = match trial {
                Ok(landed) => landed,
                Err(stop) => {
                    // What the trial could not do was answered into `held`.
                    held.send_to(out);
                    return Err(stop);
                }
            };
            let loading = Loading::after(request, &landed, &mut held, &self.placement);
            let loaded = self.load(py, &key, request, &digest, &loading);
            if request.op == Op::Compile || !loaded {
                out.reply(held.line());
                self.runner.recycle(landed.logs);
                return Ok(None);
            }
            if self.needs_recovery() {
                self.runner.recycle(landed.logs);
                return Err(Stop::Recover);
            }
            if self.nodes.has_own_zygote(&key) {
                self.runner.recycle(landed.logs);
                self.relay(&key, request, out);
                return Ok(None);
            }
            trial_logs = Some(landed.logs);
        }
        let in_resident = if detach {
            self.placement.resident_for_link()
        } else {
            self.placement.resident(false)
        };
        // Under `--isolation reset`, a node whose residents could not be
        // put back call after call gets fresh forks for a while instead.
        let in_resident = in_resident && !self.runner.fresh_fork_instead(&key, &digest);
        if in_resident && detach {
            let resident = assignment(Task::Resident);
            let _held = resident.held();
            return match self
                .runner
                .resident_for_link(py, &self.nodes, &resident, trial_logs)
            {
                Ok((resident, replenish, pipe)) => {
                    out.started(resident.flight().pid);
                    if replenish {
                        self.replenish(py);
                    }
                    Ok(Some(Detached::Resident { resident, pipe }))
                }
                Err(error) => Err(runner::not_started(&resident, error, out)),
            };
        }
        if in_resident {
            let resident = assignment(Task::Resident);
            return self
                .runner
                .run_in_turn(py, &mut self.nodes, &resident, trial_logs, out)
                .map(|()| None);
        }
        // Built for each use, not kept: the next standby is forked between
        // them, and no child is to find this call's arguments.
        let mut flight =
            self.runner
                .start(py, &self.nodes, &assignment(Task::Run), trial_logs, out)?;
        if detach {
            // The caller hands the pipe over first, then replenishes.
            return Ok(Some(Detached::Child(flight)));
        }
        // A call shorter than a fork is answered before the next standby is
        // forked; a longer one has that fork made beside it, on the other core.
        let fork_cost = self.runner.fork_cost();
        let answered = matches!(flight.follow_for(out, Some(fork_cost)), Ok(Some(_)));
        if !answered {
            // What the call wrote so far (events, part of its reply) is
            // not the next call's to read.
            let _held = flight.held();
            self.replenish(py);
        }
        let served = self.runner.run(&assignment(Task::Run), flight, out);
        if answered {
            self.replenish(py);
        }
        served.map(|()| None)
    }

    /// Places a node whose trial went as `loading` says (`placement`): in
    /// a zygote of its own, here, or in each call's child. False where it
    /// did not load.
    fn load(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        request: &Request,
        digest: &str,
        loading: &Loading,
    ) -> bool {
        let warm = loading.warm();
        match (self.placement.home(loading.verdict), self.spawn_own) {
            (Home::OwnZygote, Some(spawn)) => {
                self.give_own_zygote(py, spawn, key, &request.source, digest, warm);
                true
            }
            (Home::Here | Home::OwnZygote, _) => {
                self.load_into_zygote(py, key, &request.source, digest, warm);
                true
            }
            (Home::EachChild, _) if loading.verdict == Some(TrialVerdict::LoadedWithCuda) => {
                tracing::warn!(
                    "node {key} initialises CUDA while it loads, which no fork of the zygote \
                     could use: each resident child loads it once, with its own CUDA context"
                );
                self.nodes
                    .remember(key, &request.source, digest, Residence::EachChild);
                true
            }
            (Home::EachChild, _) => {
                tracing::warn!(
                    "node {key} starts a thread while it loads that does not stop at fork; \
                     it is loaded in each call's child instead of the zygote"
                );
                self.nodes
                    .remember(key, &request.source, digest, Residence::EachChild);
                true
            }
            (Home::Nowhere, _) => false,
        }
    }

    /// Imports what calls imported (`learn`), then forks standby children
    /// up to `--standby` (see `standby`).
    pub fn replenish(&mut self, py: Python<'_>) {
        self.runner.replenish(py, &mut self.nodes);
    }

    /// Forks the child for a run of a node compiled here (by a `compile`
    /// served before), without waiting for it: the caller follows the
    /// flight, lands it, and hands its logs back with [`Zygote::recycle`].
    pub fn start_run(&mut self, py: Python<'_>, request: &Request) -> Result<Flight, SpawnError> {
        let assignment = self.compiled_assignment(request, Task::Run)?;
        self.runner
            .dispatch(py, &self.nodes, &assignment, None, false)
            .map(|(flight, _)| flight)
    }

    /// `--isolation node` for `sweep`: a run of a node compiled here in a
    /// resident child of the node's, an idle one or one forked for it. The
    /// caller follows its flight, and once it has replied gives it back
    /// ([`Zygote::keep_resident`]) or, ended, lands it.
    pub fn start_resident(
        &mut self,
        py: Python<'_>,
        request: &Request,
    ) -> Result<resident::Resident, SpawnError> {
        let assignment = self.compiled_assignment(request, Task::Resident)?;
        self.runner
            .resident(py, &self.nodes, &assignment, None)
            .map(|(resident, _)| resident)
    }

    /// `--isolation reset`: whether node `key`'s next run gets a fresh
    /// fork ([`Zygote::start_run`]) rather than a resident, its residents
    /// having failed to be put back call after call.
    pub fn fresh_fork_instead(&mut self, key: &NodeKey) -> bool {
        match self.nodes.digest(key) {
            Some(digest) => self.runner.fresh_fork_instead(key, digest),
            None => false,
        }
    }

    /// A resident (`tag`: [`resident::Resident::tag`]) exited on its own
    /// once its run was over, before it was given back: under `--isolation
    /// reset`, it could not be put back.
    pub fn resident_ended_after_its_call(&mut self, tag: &fallback::Tag) {
        self.runner.resident_ended_after_its_call(tag);
    }

    /// `--isolation reset`: whether starting a resident for node `key`
    /// would wait for one to be put back, and for what.
    pub fn residents_being_put_back(&mut self, key: &NodeKey) -> resident::PutBackWait<'_> {
        let generation = self.nodes.generation();
        match self.nodes.digest(key) {
            Some(digest) => self
                .runner
                .residents_being_put_back(key, digest, generation),
            None => resident::PutBackWait::No,
        }
    }

    /// A resident whose run replied: it waits for its node's next run.
    pub fn keep_resident(&mut self, resident: resident::Resident) {
        self.runner.keep_resident(resident);
    }

    /// Ends the idle residents (a stopped sweep).
    pub fn retire_residents(&mut self) {
        self.runner.retire_residents();
    }

    /// `task` for `request`, whose node must be compiled here.
    fn compiled_assignment(&self, request: &Request, task: Task) -> Result<Assignment, SpawnError> {
        let digest = self
            .compiled_digest(request)
            .ok_or(SpawnError::NotCompiled)?;
        Ok(Assignment::for_request(request, task, &digest))
    }

    /// The digest of the source the request's node was compiled from here.
    fn compiled_digest(&self, request: &Request) -> Option<String> {
        let key = NodeKey {
            flow: request.flow.clone(),
            node: request.node.clone(),
        };
        self.nodes.digest(&key).map(str::to_string)
    }

    /// Takes back the log buffer of a landed call, for the next one.
    pub fn recycle(&mut self, logs: LogBuffer) {
        self.runner.recycle(logs);
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
        self.nodes.function(py, &key)
    }

    /// Loads a node whose trial went cleanly into the zygote itself, and
    /// warms it up there (`compiled`); one that leaves the zygote unable to
    /// fork safely restarts it. `warm`: the `--warmup` keyword arguments
    /// (`None`: the node's own, if it asks), or why its warm-up is refused.
    fn load_into_zygote(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        source: &str,
        digest: &str,
        warm: Result<Option<&str>, &str>,
    ) {
        if self.nodes.load_into_zygote(py, key, source, digest, warm) == Forks::Unsafely {
            self.runner.must_recover();
        }
    }

    /// Why node `flow.node`'s warm-up was refused, where one was asked for
    /// and it was.
    pub fn warmup_refusal(&self, flow: &str, node: &str) -> Option<String> {
        let key = NodeKey {
            flow: flow.to_string(),
            node: node.to_string(),
        };
        self.nodes.warmup_refusal(&key)
    }

    /// What a restarted zygote needs to carry on where this one stopped.
    pub fn resume_nodes(&self) -> Vec<recovery::ResumeNode> {
        self.nodes.resume()
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
                self.nodes
                    .remember(&key, &resumed.source, &digest, Residence::EachChild);
            }
        }
    }

    /// Where its nodes' calls run.
    pub fn placement(&self) -> Placement {
        self.placement
    }

    /// Which of its nodes get a zygote of their own: set by the front end
    /// that serves them (`heavy` for the worker, `server` for links).
    pub(crate) fn set_node_zygotes(&mut self, node_zygotes: placement::NodeZygotes) {
        self.placement.node_zygotes = node_zygotes;
    }

    /// Whether forking became unsafe: the zygote must restart before it
    /// serves anything else.
    pub fn needs_recovery(&self) -> bool {
        self.runner.needs_recovery()
    }

    /// Ends every child still around: the standby, residents, and calls
    /// being reaped.
    pub fn shutdown(&mut self) {
        self.runner.shutdown();
        for key in self.nodes.with_own_zygote() {
            self.nodes.end_own_zygote(&key);
        }
        node::remove_module_dir();
    }

    /// Blocks until `input` is readable, reaping finished children meanwhile.
    pub fn wait_for_input(&mut self, input: std::os::fd::BorrowedFd<'_>) -> std::io::Result<()> {
        self.runner.wait_for_input(input)
    }

    /// Forks a zygote of its own for a heavy node whose trial went cleanly,
    /// loads the node there, and remembers it; where that fails, the node
    /// is loaded here after all.
    fn give_own_zygote(
        &mut self,
        py: Python<'_>,
        spawn: SpawnOwn,
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
        let started = spawn(py, self, key, preload)
            .map_err(|error| error.to_string())
            .and_then(OwnZygote::when_ready);
        match started {
            Ok(own) => {
                tracing::info!(
                    node = %key,
                    pid = own.pid().as_raw(),
                    "the node's module level is heavy: it has a zygote of its own"
                );
                self.nodes
                    .remember(key, source, digest, Residence::OwnZygote(own));
            }
            Err(why) => {
                tracing::warn!("node {key}: no zygote of its own ({why}); it is loaded here");
                self.load_into_zygote(py, key, source, digest, warm);
            }
        }
    }

    /// Serves a request of a node in a zygote of its own, there. If that
    /// zygote has died, the node is forgotten (its next request loads it
    /// again) and the call's reply says so.
    fn relay(&mut self, key: &NodeKey, request: &Request, out: &mut dyn CallOutput) {
        let Some(own) = self.nodes.own_zygote(key) else {
            return;
        };
        let pid = own.pid();
        if let Err(LinkLost(mut unanswered)) = own.relay(request, out) {
            self.nodes.end_own_zygote(key);
            let why = format!(
                "the zygote of node {key} (pid {pid}) ended during the call; the node's next \
                 call loads it again"
            );
            unanswered.lost(why, out);
        }
    }
}

impl app::Parent for Zygote {
    /// In a node's own zygote, just forked: the standby, resident and
    /// landing children it copied are its parent's. Forgotten, never
    /// dropped (dropping one would kill its parent's child, or close an fd
    /// number this process uses for something else by then).
    fn forget_inherited(&mut self) {
        self.runner.forget_inherited();
        // Its parent's node zygotes are its parent's; it makes none itself.
        self.nodes.forget_own_zygotes();
        self.set_node_zygotes(placement::NodeZygotes::None);
        child::set_heavy_from_mib(None);
        self.nodes.bump();
    }

    fn must_recover(&mut self) {
        self.runner.must_recover();
    }

    fn shutdown(&mut self) {
        Zygote::shutdown(self);
    }
}
