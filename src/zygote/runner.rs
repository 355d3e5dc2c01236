//! The zygote's calls run to their end: each started in a child (a
//! standby, or a node's resident), followed, landed, and answered for
//! where its child did not answer; the children kept between calls.

use std::os::fd::OwnedFd;
use std::time::{Duration, SystemTime};

use fluksio_embed::capture::LogBuffer;
use pyo3::prelude::*;

use super::assignment::{Assignment, Task};
use super::compiled::Nodes;
use super::flight::{Flight, Landed};
use super::resident::{CallPipe, Isolation, Resident, Residents};
use super::standby::{Children, Origin, SpawnError};
use crate::fds::Claimed;
use crate::output::CallOutput;

/// Why a call stopped short of landing.
pub(super) enum Stop {
    /// Forking is unsafe: recover first.
    Recover,
    /// Its process could not even start; the reply saying so has been sent.
    Answered,
}

/// The zygote's children, and the calls run in them.
pub(super) struct Runner {
    /// The zygote's pid: a call's child dies with it.
    pid: nix::unistd::Pid,
    children: Children,
    /// How many children wait ready (`--standby`).
    standby: usize,
    /// `--isolation node`: each node's child, between its calls.
    residents: Residents,
    /// Set when forking became unsafe; the owner must restart the zygote.
    needs_recovery: bool,
    /// When it started: a module file newer than this is never learned
    /// (`learn`).
    started: SystemTime,
}

impl Runner {
    /// `standby`: children kept ready; `max_calls_per_child`: calls a
    /// resident serves before a fresh fork replaces it.
    pub(super) fn new(
        standby: usize,
        max_calls_per_child: Option<u64>,
        isolation: Isolation,
    ) -> Runner {
        Runner {
            pid: nix::unistd::getpid(),
            children: Children::default(),
            standby,
            residents: Residents::new(max_calls_per_child, isolation == Isolation::Reset),
            needs_recovery: false,
            started: SystemTime::now(),
        }
    }

    /// Whether forking became unsafe: the zygote must restart before it
    /// serves anything else.
    pub(super) fn needs_recovery(&self) -> bool {
        self.needs_recovery
    }

    /// Forking became unsafe (see [`Runner::needs_recovery`]).
    pub(super) fn must_recover(&mut self) {
        self.needs_recovery = true;
    }

    /// What the last fork of a standby took, in the zygote.
    pub(super) fn fork_cost(&self) -> Duration {
        self.children.fork_cost()
    }

    /// Starts `assignment` in a child, the standby when it is current
    /// (`standby`); with `keep_control`, a resident's control pipe comes
    /// back with it. The caller forks the next standby
    /// ([`Runner::replenish`]) once whoever reads the call can, so that
    /// fork overlaps the call.
    pub(super) fn dispatch(
        &mut self,
        py: Python<'_>,
        nodes: &Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        keep_control: bool,
    ) -> Result<(Flight, Option<Claimed>), SpawnError> {
        let origin = Origin {
            pid: self.pid,
            nodes,
        };
        let dispatched = self
            .children
            .dispatch(py, &origin, assignment, logs_so_far, keep_control);
        if matches!(dispatched, Err(SpawnError::Unsafe)) {
            self.needs_recovery = true;
        }
        dispatched
    }

    /// Imports what calls imported (`learn`), then forks standby children
    /// up to `--standby` (see `standby`).
    pub(super) fn replenish(&mut self, py: Python<'_>, nodes: &mut Nodes) {
        if self.children.learn(py, self.started) {
            // Standbys forked before do not have them.
            nodes.bump();
        }
        let origin = Origin {
            pid: self.pid,
            nodes,
        };
        // The call being started forked safely; recovery is flagged.
        if let Err(SpawnError::Unsafe) = self.children.replenish(py, &origin, self.standby) {
            self.needs_recovery = true;
        }
    }

    /// Starts `assignment` in a standby child; a failure to fork is answered.
    pub(super) fn start(
        &mut self,
        py: Python<'_>,
        nodes: &Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        out: &mut dyn CallOutput,
    ) -> Result<Flight, Stop> {
        match self.dispatch(py, nodes, assignment, logs_so_far, false) {
            Ok((flight, _)) => {
                out.started(flight.pid);
                Ok(flight)
            }
            Err(error) => Err(not_started(assignment, error, out)),
        }
    }

    /// A call followed to its exit (a trial's verdict is its exit code).
    pub(super) fn call_to_end(
        &mut self,
        py: Python<'_>,
        nodes: &mut Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        out: &mut dyn CallOutput,
    ) -> Result<Landed, Stop> {
        let _held = assignment.held();
        let mut flight = self.start(py, nodes, assignment, logs_so_far, out)?;
        if assignment.task != Task::Trial {
            // A trial changes the zygote's state: a standby forked now would
            // be discarded.
            self.replenish(py, nodes);
        }
        match flight.follow_to_reply(out) {
            Ok(_) => self.finish(assignment, flight, out),
            Err(error) => {
                self.children.land_later(flight);
                Err(self.lost(assignment, error, out))
            }
        }
    }

    /// A run: its lines out as they come; once it has replied, its session
    /// is killed and it is reaped later, off the next call's clock.
    pub(super) fn run(
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

    /// Node `assignment.key`'s resident for `assignment`: an idle one
    /// handed it, or one forked for it; and whether the caller replenishes
    /// ([`Runner::replenish`]) beside the call once it can: a standby to
    /// fork in place of the one used, or imports to learn.
    pub(super) fn resident(
        &mut self,
        py: Python<'_>,
        nodes: &Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
    ) -> Result<(Resident, bool), SpawnError> {
        self.resident_with(py, nodes, assignment, logs_so_far, None)
    }

    /// `--isolation reset` for a link's call, whose owner reads its lines:
    /// node `assignment.key`'s resident, handed the call with a pipe of the
    /// call's own, and the owner's end of that pipe.
    pub(super) fn resident_for_link(
        &mut self,
        py: Python<'_>,
        nodes: &Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
    ) -> Result<(Resident, bool, OwnedFd), SpawnError> {
        let mut owners_end = None;
        let (resident, replenish) =
            self.resident_with(py, nodes, assignment, logs_so_far, Some(&mut owners_end))?;
        match owners_end {
            Some(read) => Ok((resident, replenish, read)),
            None => {
                self.children.land_later(resident.into_flight());
                Err(SpawnError::Io(std::io::Error::other(
                    "could not make the call's pipe",
                )))
            }
        }
    }

    /// With `link_pipe`, the call gets a pipe of its own, made once the
    /// resident is forked (no fork holds it), and its read end goes there.
    fn resident_with(
        &mut self,
        py: Python<'_>,
        nodes: &Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        mut link_pipe: Option<&mut Option<OwnedFd>>,
    ) -> Result<(Resident, bool), SpawnError> {
        let mut call_pipe = || -> Option<CallPipe> {
            let slot = link_pipe.as_deref_mut()?;
            let pipe = CallPipe::new().ok()?;
            *slot = Some(pipe.read.try_clone().ok()?);
            Some(pipe)
        };
        let children = &mut self.children;
        let idle = self.residents.take(
            &assignment.key,
            &assignment.digest,
            nodes.generation(),
            |flight| children.land_later(flight),
        );
        if let Some(mut resident) = idle {
            if let Some(logs) = logs_so_far {
                self.children.recycle(logs);
            }
            resident.hand(assignment, call_pipe());
            // What earlier calls imported is learned beside this one (the
            // residents forked before then are replaced).
            return Ok((resident, self.children.has_learned_something()));
        }
        if !self.residents.reset() {
            let (flight, control) = self.dispatch(py, nodes, assignment, logs_so_far, true)?;
            let control = control.expect("kept");
            let resident = Resident::new(
                flight,
                control,
                &assignment.key,
                &assignment.digest,
                nodes.generation(),
                self.residents.stretches(&assignment.key),
            );
            return Ok((resident, true));
        }
        // Its snapshot is taken before its first call is in its memory:
        // the node first, the call after it.
        let set_up = assignment.without_call();
        let (flight, control) = self.dispatch(py, nodes, &set_up, logs_so_far, true)?;
        let control = control.expect("kept");
        let mut resident = Resident::new(
            flight,
            control,
            &assignment.key,
            &assignment.digest,
            nodes.generation(),
            self.residents.stretches(&assignment.key),
        );
        if let Err(why) = resident.learn_wait_point() {
            // It serves this call as a fresh child would, and is retired
            // before the next.
            // (Counted as retired once it is: looked at, or seen to exit.)
            tracing::info!("a resident could not take its snapshot ({why}); it serves one call");
        }
        resident.hand(assignment, call_pipe());
        Ok((resident, true))
    }

    /// Whether node `key`'s next call gets a fresh fork rather than a
    /// resident: see [`Residents::fresh_fork_instead`].
    pub(super) fn fresh_fork_instead(&mut self, key: &super::node::NodeKey, digest: &str) -> bool {
        self.residents.fresh_fork_instead(key, digest)
    }

    /// See [`Residents::ended_after_its_call`].
    pub(super) fn resident_ended_after_its_call(&mut self, tag: &super::fallback::Tag) {
        self.residents.ended_after_its_call(tag);
    }

    /// Where taking node `key`'s resident would wait for a put-back: see
    /// [`Residents::being_put_back`].
    pub(super) fn residents_being_put_back(
        &mut self,
        key: &super::node::NodeKey,
        digest: &str,
        generation: u64,
    ) -> super::resident::PutBackWait<'_> {
        let children = &mut self.children;
        self.residents
            .being_put_back(key, digest, generation, |flight| {
                children.land_later(flight)
            })
    }

    /// A resident whose call replied: it waits for its node's next call.
    /// What the call imported is learned, as a fresh child's would be.
    pub(super) fn keep_resident(&mut self, resident: Resident) {
        self.children.learn_from(resident.flight());
        let children = &mut self.children;
        self.residents
            .keep(resident, |flight| children.land_later(flight));
    }

    /// Ends the idle residents.
    pub(super) fn retire_residents(&mut self) {
        let children = &mut self.children;
        self.residents
            .retire_all(|flight| children.land_later(flight));
    }

    /// Serves a run in the node's resident child, forking one if there is
    /// none (or its source changed).
    pub(super) fn run_in_turn(
        &mut self,
        py: Python<'_>,
        nodes: &mut Nodes,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        out: &mut dyn CallOutput,
    ) -> Result<(), Stop> {
        let _held = assignment.held();
        let (mut resident, replenish) = match self.resident(py, nodes, assignment, logs_so_far) {
            Ok(started) => started,
            Err(error) => return Err(not_started(assignment, error, out)),
        };
        out.started(resident.flight().pid);
        if replenish {
            self.replenish(py, nodes);
        }
        match resident.flight_mut().follow_to_reply(out) {
            Ok(true) => {
                self.keep_resident(resident);
                if self.children.has_learned_something() {
                    // Off the call's clock, before the next: it has replied.
                    self.replenish(py, nodes);
                }
                Ok(())
            }
            Ok(false) => self
                .finish(assignment, resident.into_flight(), out)
                .map(|landed| self.children.recycle(landed.logs)),
            Err(error) => {
                self.children.land_later(resident.into_flight());
                Err(self.lost(assignment, error, out))
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

    /// Takes back the log buffer of a landed call, for the next one.
    pub(super) fn recycle(&mut self, logs: LogBuffer) {
        self.children.recycle(logs);
    }

    /// Ends every child still around: the residents, the standby, and
    /// calls being reaped.
    pub(super) fn shutdown(&mut self) {
        self.retire_residents();
        self.children.shutdown();
    }

    /// Blocks until `input` is readable, reaping finished children meanwhile.
    pub(super) fn wait_for_input(
        &mut self,
        input: std::os::fd::BorrowedFd<'_>,
    ) -> std::io::Result<()> {
        loop {
            // A reset resident's word after its call, read as it comes: one
            // that retired itself is said and ended now, not at the next
            // call (which may be long in coming).
            let words = self.residents.words_awaited();
            if self.children.wait_for_input_or(input, &words)? {
                return Ok(());
            }
            drop(words);
            let children = &mut self.children;
            self.residents
                .read_words_come(|flight| children.land_later(flight));
        }
    }

    /// In a node's own zygote, just forked: the standby, resident and
    /// landing children it copied are its parent's (forgotten, never
    /// dropped), and its calls' children die with it.
    pub(super) fn forget_inherited(&mut self) {
        self.children.forget_inherited();
        self.residents.forget_inherited();
        self.pid = nix::unistd::getpid();
    }
}

/// Why a call's process did not start, as a stop: forking became unsafe
/// (recover first), or it failed, which the call's reply says.
pub(super) fn not_started(
    assignment: &Assignment,
    error: SpawnError,
    out: &mut dyn CallOutput,
) -> Stop {
    match error {
        SpawnError::Unsafe | SpawnError::NotCompiled => Stop::Recover,
        SpawnError::Io(error) => {
            let message = format!("could not start the node's process: {error}");
            out.reply(&assignment.lost(message));
            Stop::Answered
        }
    }
}
