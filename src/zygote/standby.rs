//! Children forked ahead of their calls, and children being reaped.
//!
//! The issue this solves: forking a Python process and tearing it down is
//! most of a call's cost (the kernel copying page tables, then the child's
//! first writes to each shared page). None of that needs the call. So the
//! zygote keeps *standby* children, forked from its current state and
//! already set up (its session, its captured output, the after-fork work of
//! CPython), blocked on a control pipe. A call is written down that pipe and
//! starts at once; a replacement standby is forked while the call runs, on
//! the other core. A child that has replied is killed with its session at
//! once and reaped later, off the next call's clock.
//!
//! Every call still gets a child of its own, forked from the zygote's state
//! as it is when the call starts: a standby forked before the zygote's
//! state changed (a node loaded) is discarded, never used.

use std::collections::VecDeque;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use nix::poll::PollFlags;
use nix::sys::signal::Signal;
use nix::unistd::Pid;
use pyo3::prelude::*;
use serde_json::value::RawValue;

use super::assignment::{self, Assignment, Task};
use super::child;
use super::compiled::Nodes;
use super::flight::{Flight, Landed, Landing};
use crate::containment::Cell;
use crate::end::End;
use crate::fds;
use crate::fds::Claimed;
use crate::poll_set::PollSet;
use crate::process::{self, ExitWatch};
use crate::protocol::{self, Request};
use fluksio_embed::capture::LogBuffer;
use fluksio_embed::fork;
use fluksio_embed::fork::freeze_gc;

/// A forked child waiting for its call.
struct Standby {
    pid: Pid,
    /// Write end of its control pipe: the assignment goes down it.
    control: OwnedFd,
    /// Read end of its line pipe: events and the reply come up it.
    lines: OwnedFd,
    /// Its wake-up call (see `child::wait_for_call`).
    go: OwnedFd,
    logs: LogBuffer,
    /// What everything it starts is contained in.
    cell: Cell,
    /// The zygote's generation when it was forked.
    generation: u64,
}

/// The zygote's children outside of a call being followed.
pub(super) struct Children {
    /// Ready children, oldest (most likely set up) first.
    standby: VecDeque<Standby>,
    /// Replied (or discarded) children, killed with their sessions, not yet
    /// reaped; their log buffers come back once they are.
    landing: Vec<Landing>,
    /// Log buffers of reaped calls, for the next ones.
    spare_logs: Vec<LogBuffer>,
    /// What the calls taken back imported (`super::learn`).
    learned: super::learn::Learned,
    /// What the last fork of a standby took, in the zygote.
    fork_cost: Duration,
}

impl Default for Children {
    fn default() -> Children {
        Children {
            standby: VecDeque::new(),
            landing: Vec::new(),
            spare_logs: Vec::new(),
            learned: Default::default(),
            fork_cost: Duration::from_millis(1),
        }
    }
}

/// Why a call could not be started.
pub enum SpawnError {
    /// A stray thread was running at the fork; nothing ran. Recover.
    Unsafe,
    Io(std::io::Error),
    /// `start_run` of a node no `compile` loaded.
    NotCompiled,
}

/// Replied children the zygote lets exit in their own time before it waits
/// for the oldest ([`Children::land_later`]).
const MAX_LANDING: usize = 16;

impl Children {
    fn fresh_logs(&mut self) -> std::io::Result<LogBuffer> {
        match self.spare_logs.pop() {
            Some(logs) => {
                logs.clear();
                Ok(logs)
            }
            None => LogBuffer::new(),
        }
    }

    /// Takes back a landed call's log buffer, with what its report says.
    pub(super) fn recycle(&mut self, logs: LogBuffer) {
        self.learned.take(&logs.take_report());
        self.spare_logs.push(logs);
    }

    /// What a resident's call, just replied, reports it imported (a
    /// resident reports before each reply; its buffer is its own).
    pub(super) fn learn_from(&mut self, flight: &Flight) {
        self.learned.take(&flight.take_report());
    }

    /// Whether calls imported something not yet tried here.
    pub(super) fn has_learned_something(&self) -> bool {
        self.learned.has_pending()
    }

    /// A call that has replied: its session (the child, and whatever it
    /// started) is killed now; the child is reaped once it has exited.
    pub(super) fn land_later(&mut self, flight: Flight) {
        self.landing.push(flight.abandon());
        if self.landing.len() > MAX_LANDING {
            self.reap_landed();
            // A replied child exits at a low priority, and its memory is
            // freed only at the end of it: on a saturated machine, never
            // more than this many wait (each was killed, so each ends).
            while self.landing.len() > MAX_LANDING {
                let oldest = self.landing.remove(0);
                self.reap(oldest);
            }
        }
    }

    /// Reaps whatever has exited, without waiting.
    fn reap_landed(&mut self) {
        let mut index = 0;
        while index < self.landing.len() {
            let pid = self.landing[index].pid;
            if process::has_exited(pid) {
                let landing = self.landing.swap_remove(index);
                self.reap(landing);
            } else {
                index += 1;
            }
        }
    }

    /// Reaps a landing child (waiting for it, if it has not exited) and
    /// keeps its log buffer for another call.
    fn reap(&mut self, landing: Landing) {
        let _ = process::reap(landing.pid);
        self.recycle(landing.logs);
    }

    fn discard(&mut self, standby: Standby) {
        fds::forget(standby.go.as_raw_fd());
        fds::forget(standby.control.as_raw_fd());
        fds::forget(standby.lines.as_raw_fd());
        process::kill_group(standby.pid, Signal::SIGKILL);
        standby.cell.kill();
        self.landing.push(Landing {
            pid: standby.pid,
            exit: ExitWatch::new(standby.pid),
            logs: standby.logs,
            cell: standby.cell,
        });
    }

    /// Ends every child: the standby, and the calls being reaped.
    pub(super) fn shutdown(&mut self) {
        while let Some(standby) = self.standby.pop_front() {
            self.discard(standby);
        }
        for landing in self.landing.drain(..) {
            let _ = process::reap(landing.pid);
            self.spare_logs.push(landing.logs);
        }
    }

    /// Waits once for `input`, the exit of a child landing (reaped then, so
    /// no zombie waits for the next request) or one of `also`: whether
    /// `input` is ready.
    pub(super) fn wait_for_input_or(
        &mut self,
        input: BorrowedFd<'_>,
        also: &[BorrowedFd<'_>],
    ) -> std::io::Result<bool> {
        self.reap_landed();
        let mut set = PollSet::new();
        let input = set.fd(input, PollFlags::POLLIN);
        for fd in also {
            set.fd(*fd, PollFlags::POLLIN);
        }
        for landing in &self.landing {
            set.exit(landing.pid, &landing.exit);
        }
        set.wait(None)?;
        Ok(set.ready(input))
    }
}

/// The zygote as a standby is forked from it.
pub(super) struct Origin<'a> {
    /// The zygote's pid: a call's child dies with it.
    pub(super) pid: Pid,
    /// The nodes it has compiled: the functions every fork has loaded, how
    /// a child finds its node, and the generation of the state it copies (a
    /// standby of an older one is not used).
    pub(super) nodes: &'a Nodes,
}

impl Children {
    /// Starts `assignment` in a child, the standby when it is current. The
    /// caller forks the next standby ([`Children::replenish`]) once whoever
    /// reads the call can, so that fork overlaps the call. With
    /// `keep_control` (a resident child), its control pipe is returned, for
    /// the calls after this one. `Unsafe`: recovery is the caller's.
    pub(super) fn dispatch(
        &mut self,
        py: Python<'_>,
        origin: &Origin<'_>,
        assignment: &Assignment,
        logs_so_far: Option<LogBuffer>,
        keep_control: bool,
    ) -> Result<(Flight, Option<Claimed>), SpawnError> {
        self.reap_landed();
        let standby = loop {
            match self.standby.pop_front() {
                Some(standby) if standby.generation == origin.nodes.generation() => break standby,
                Some(stale) => self.discard(stale),
                None => break self.fork_standby(py, origin)?,
            }
        };
        if let Some(logs_so_far) = logs_so_far {
            standby.logs.copy_from(&logs_so_far);
            self.recycle(logs_so_far);
        }
        let Standby {
            pid,
            control,
            lines,
            go,
            logs,
            cell,
            ..
        } = standby;
        fds::forget(control.as_raw_fd());
        fds::forget(go.as_raw_fd());
        assignment::wake(&go);
        drop(go);
        // A child that died before reading this is reported by its flight.
        let _ = assignment::send_assignment(&control, assignment);
        let control = keep_control.then(|| Claimed::new(control));
        Ok((Flight::new(pid, lines, logs, cell, Instant::now()), control))
    }

    /// Forks standby children up to `standby` (`--standby`; default two,
    /// not one: a child forked during a call still has its own setup to do,
    /// the after-fork work and the rehearsal, when the next request arrives
    /// right behind the reply; the older one has had a whole call's time
    /// for it): one per call once full, so each has a whole call's time to
    /// set itself up before it is needed. `Unsafe`: recovery is the
    /// caller's (the call being started forked safely).
    pub(super) fn replenish(
        &mut self,
        py: Python<'_>,
        origin: &Origin<'_>,
        standby: usize,
    ) -> Result<(), SpawnError> {
        while self.standby.len() < standby {
            match self.fork_standby(py, origin) {
                Ok(next) => self.standby.push_back(next),
                Err(SpawnError::Io(error)) => {
                    tracing::warn!("could not fork a standby child: {error}");
                    return Ok(());
                }
                Err(other) => return Err(other),
            }
        }
        Ok(())
    }

    /// Imports here what calls imported, once a child has tried it
    /// (`super::learn`): true when it did, so the children forked after
    /// start with it (the standbys forked before do not have it).
    /// `started`: the zygote's start.
    pub(super) fn learn(&mut self, py: Python<'_>, started: std::time::SystemTime) -> bool {
        if !self.learned.has_pending() {
            return false;
        }
        let Ok(logs) = self.fresh_logs() else {
            return false;
        };
        let imports = super::learn::try_in_child(py, &mut self.learned, &logs, started);
        self.spare_logs.push(logs);
        let Some(names) = imports.filter(|names| !names.is_empty()) else {
            return false;
        };
        let imported =
            fluksio_embed::capture::quietly(py, || Ok(super::learn::import_here(py, &names)))
                .unwrap_or(0);
        if imported > 0 {
            tracing::debug!(
                "learned {imported} modules the calls imported: {}",
                names.join(", ")
            );
        }
        imported > 0
    }

    /// What the last fork of a standby took, in the zygote.
    pub(super) fn fork_cost(&self) -> Duration {
        self.fork_cost
    }

    /// In a node's own zygote, just forked: the standby and landing
    /// children it copied are its parent's. Forgotten, never dropped
    /// (dropping one would kill its parent's child, or close an fd number
    /// this process uses for something else by then).
    pub(super) fn forget_inherited(&mut self) {
        let fork_cost = self.fork_cost;
        std::mem::forget(std::mem::take(self));
        self.fork_cost = fork_cost;
    }

    /// Forks a child from the zygote as it is now, set up and waiting.
    fn fork_standby(&mut self, py: Python<'_>, origin: &Origin<'_>) -> Result<Standby, SpawnError> {
        let pipe = || {
            nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC).map_err(|e| SpawnError::Io(e.into()))
        };
        // A socket, not a pipe: a resident put back after each call says
        // on it whether it could be (`resident`).
        let (control_read, control_write) = nix::sys::socket::socketpair(
            nix::sys::socket::AddressFamily::Unix,
            nix::sys::socket::SockType::Stream,
            None,
            nix::sys::socket::SockFlag::SOCK_CLOEXEC,
        )
        .map_err(|e| SpawnError::Io(e.into()))?;
        let (lines_read, lines_write) = pipe()?;
        let go = assignment::wake_up_call().map_err(SpawnError::Io)?;
        let logs = self.fresh_logs().map_err(SpawnError::Io)?;
        let cell = match Cell::new() {
            Ok(cell) => cell,
            Err(error) => {
                self.recycle(logs);
                return Err(SpawnError::Io(error));
            }
        };
        freeze_gc(py);
        // Found here once, for every child (`threads`).
        super::threads::find_pools();
        let forking = Instant::now();
        let forked = fork::fork(py);
        if !matches!(forked, Ok(fork::Forked::Child)) {
            crate::metrics::forked(forking.elapsed());
        }
        // Bounded, so a slow fork (a loaded machine) never makes a call wait
        // long for its own reply before the next standby is forked.
        self.fork_cost = forking
            .elapsed()
            .clamp(Duration::from_micros(200), Duration::from_millis(5));
        match forked {
            Ok(fork::Forked::Child) => {
                // Contained before anything else runs; then nothing of any
                // other call's (its pipes, pidfds, cells, log buffers) is
                // left in reach.
                cell.enter();
                drop(control_write);
                drop(lines_read);
                fds::close_in_child();
                logs.unmap_all_others();
                super::threads::forget_shared_page();
                fork::become_call_child(origin.pid);
                child::stand_by(py, &logs, origin.nodes.loaded_functions());
                super::device::warm_standby(py);
                assignment::wait_for_call(&go);
                drop(go);
                let assignment = assignment::receive(control_read.as_raw_fd());
                let function = origin.nodes.function_for(&assignment);
                if assignment.task == Task::Resident {
                    super::resident::serve_in_turn(
                        py,
                        assignment,
                        function,
                        control_read,
                        lines_write.as_raw_fd(),
                        &logs,
                    )
                }
                drop(control_read);
                child::serve(py, &assignment, function, lines_write.as_raw_fd(), &logs)
            }
            Ok(fork::Forked::Parent { pid, safe }) => {
                drop(control_read);
                drop(lines_write);
                let mut cell = cell;
                cell.forked();
                if !safe {
                    let _ = process::reap(pid);
                    tracing::error!(
                        "a thread that does not stop at fork is running in the zygote; \
                         restarting it before serving another call"
                    );
                    self.recycle(logs);
                    return Err(SpawnError::Unsafe);
                }
                fds::claim(control_write.as_raw_fd());
                fds::claim(lines_read.as_raw_fd());
                fds::claim(go.as_raw_fd());
                Ok(Standby {
                    pid,
                    control: control_write,
                    lines: lines_read,
                    go,
                    logs,
                    cell,
                    generation: origin.nodes.generation(),
                })
            }
            Err(error) => {
                self.recycle(logs);
                Err(SpawnError::Io(error))
            }
        }
    }
}

impl Assignment {
    /// The assignment for `request`, whose source hashes to `digest`.
    pub(super) fn for_request(request: &Request, task: Task, digest: &str) -> Assignment {
        Assignment {
            task,
            id: request.id.get().to_string(),
            call_id: request.call_id.clone(),
            key: super::node::NodeKey {
                flow: request.flow.clone(),
                node: request.node.clone(),
            },
            source: request.source.clone(),
            digest: digest.to_string(),
            // A trial calls the node only to warm it up (`--warmup`).
            kwargs: match task {
                Task::Trial => request.warmup.as_ref(),
                _ => request.kwargs.as_ref(),
            }
            .map(|k| k.get().to_string()),
            // The call's share of the CPUs, for the pools it loads itself
            // and those loaded already (`threads`).
            env: [request.env.clone(), super::threads::env_for(&request.env)].concat(),
        }
    }

    fn raw_id(&self) -> Box<RawValue> {
        RawValue::from_string(self.id.clone())
            .unwrap_or_else(|_| RawValue::from_string("null".into()).expect("null is JSON"))
    }

    /// A reply the zygote writes for this call: an error no node code raised.
    pub(super) fn failure(&self, kind: &str, message: &str) -> Vec<u8> {
        protocol::failure_reply(&self.raw_id(), &self.call_id, kind, message, "")
    }

    /// The reply for this call when its child ended without one, with the
    /// logs the child left in its buffer.
    pub(super) fn ended_without_reply(&self, landed: &Landed) -> Vec<u8> {
        End::Process(landed.reaped.end).reply(
            &self.raw_id(),
            &self.call_id,
            &landed.logs.text_lossy(),
        )
    }

    /// The reply for this call when the zygote lost it before its child
    /// could answer (`message` says how).
    pub(super) fn lost(&self, message: String) -> Vec<u8> {
        End::Lost(message).reply(&self.raw_id(), &self.call_id, "")
    }
}
