//! Calls in flight for `run` and `sweep`: each forked from the zygote,
//! followed on its pipe and its exit, landed as it ends (in whatever order
//! that is), and killed with everything it started when the run stops.

use std::time::{Duration, Instant};

use nix::poll::PollFlags;
use nix::sys::signal::Signal;
use pyo3::prelude::*;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::end::End;
use crate::output::CallOutput;
use crate::poll_set::PollSet;
use crate::process::ChildEnd;
use crate::protocol::{Op, Request};
use crate::zygote::flight::{Flight, Watched};
use crate::zygote::node::NodeKey;
use crate::zygote::resident::{PutBackWait, Resident};
use crate::zygote::{SpawnError, Zygote};

/// How long a wait may block: a signal that lands between checking for it
/// and polling is seen within this.
const WAKE_MS: u16 = 200;

/// What a node is, for its requests.
#[derive(Clone)]
pub struct Node {
    pub flow: String,
    pub name: String,
    pub source: String,
}

impl Node {
    pub fn request(&self, op: Op, id: &str, kwargs: Option<&Map<String, Value>>) -> Request {
        Request {
            op,
            id: raw(id),
            call_id: String::new(),
            flow: self.flow.clone(),
            node: self.name.clone(),
            source: self.source.clone(),
            keep: true,
            kwargs: kwargs.map(|k| raw(&Value::Object(k.clone()).to_string())),
            env: Vec::new(),
            warmup: None,
        }
    }
}

pub fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("valid JSON")
}

/// A call's lines: its events in order, its reply, when the reply came.
#[derive(Default)]
pub struct Answer {
    pub events: Vec<Vec<u8>>,
    pub reply: Vec<u8>,
    replied_at: Option<Instant>,
    /// The signal that ended its process before it replied, if one did
    /// and the runtime did not send it.
    killed_by: Option<Signal>,
}

impl Answer {
    /// When its reply came, if it has.
    pub fn replied_at(&self) -> Option<Instant> {
        self.replied_at
    }

    /// The signal that ended its process before it replied, if one did
    /// and the runtime did not send it (a crash, a kill from outside).
    pub fn killed_by(&self) -> Option<Signal> {
        self.killed_by
    }
}

impl CallOutput for Answer {
    fn event(&mut self, line: &[u8]) {
        self.events.push(line.to_vec());
    }

    fn reply(&mut self, line: &[u8]) {
        self.reply = line.to_vec();
        self.replied_at = Some(Instant::now());
    }

    fn ended_without_reply(&mut self, end: &End) {
        if let End::Process(ChildEnd::Signaled(signal)) = end {
            self.killed_by = Some(*signal);
        }
    }
}

/// A call that ended: its reply (one the zygote wrote, if the node's
/// process ended without one), its events, how long it took.
pub struct Done {
    pub index: usize,
    pub answer: Answer,
    pub duration: Duration,
    /// The GPU slot it ran in (`--gpus`): the position of its GPU.
    pub gpu: Option<usize>,
}

impl Done {
    /// A call forked in another process (a lane, `super::lanes`).
    pub fn answered(index: usize, duration: Duration, answer: Answer, gpu: Option<usize>) -> Done {
        Done {
            index,
            answer,
            duration,
            gpu,
        }
    }
}

struct Running {
    index: usize,
    child: Child,
    answer: Answer,
    /// Its start and end log lines (`crate::telemetry`).
    log: crate::telemetry::CallLog,
}

/// What serves a call in flight.
enum Child {
    /// A fresh child, for this call alone.
    Fresh(Flight),
    /// `--isolation node`: a resident child of the node's, which serves a
    /// later call once this one has replied (`crate::zygote::resident`).
    Resident(Resident),
}

impl Child {
    fn flight(&self) -> &Flight {
        match self {
            Child::Fresh(flight) => flight,
            Child::Resident(resident) => resident.flight(),
        }
    }

    fn flight_mut(&mut self) -> &mut Flight {
        match self {
            Child::Fresh(flight) => flight,
            Child::Resident(resident) => resident.flight_mut(),
        }
    }

    /// Its flight, to land: a resident serves no call after this.
    fn into_flight(self) -> Flight {
        match self {
            Child::Fresh(flight) => flight,
            Child::Resident(resident) => resident.into_flight(),
        }
    }
}

/// When `call` is to be ended, under `--timeout`.
fn deadline(timeout: Option<Duration>, call: &Running) -> Option<Instant> {
    timeout.map(|timeout| call.child.flight().started + timeout)
}

/// How a call in flight ended this step.
#[derive(Clone, Copy)]
enum Step {
    /// Its child exited.
    Exited,
    /// A resident's call replied: the child stays for the next.
    Replied,
    /// It ran past `--timeout`, and was killed.
    Overdue,
}

/// The calls in flight.
pub struct Calls<'a> {
    zygote: &'a mut Zygote,
    node: &'a Node,
    /// The node's key in the zygote, made once: asked for at every look
    /// at its residents.
    key: NodeKey,
    running: Vec<Running>,
    /// `--isolation node`: each call runs in a resident child, which serves
    /// the calls after it in turn, its module state kept.
    in_turn: bool,
    /// `--timeout`: a call still running this long after it started is
    /// ended, with everything it started (`NodeTimeout`).
    timeout: Option<Duration>,
    /// Since when a call has been left for later ([`Calls::try_start`]).
    left_since: Option<Instant>,
}

/// How long [`Calls::try_start`] leaves a call for later, at most.
const LEAVE_FOR_AT_MOST: Duration = Duration::from_secs(1);

impl<'a> Calls<'a> {
    pub fn new(zygote: &'a mut Zygote, node: &'a Node) -> Calls<'a> {
        // The sweep follows its calls itself: nothing is handed over.
        let in_turn = zygote.placement().resident(false);
        Calls {
            zygote,
            node,
            key: NodeKey {
                flow: node.flow.clone(),
                node: node.name.clone(),
            },
            running: Vec::new(),
            in_turn,
            timeout: None,
            left_since: None,
        }
    }

    /// Ends each call still running `timeout` after it started (`--timeout`).
    pub fn set_timeout(&mut self, timeout: Option<Duration>) {
        self.timeout = timeout;
    }

    pub fn in_flight(&self) -> usize {
        self.running.len()
    }

    /// Forks call `index` with `kwargs`.
    pub fn start(
        &mut self,
        py: Python<'_>,
        index: usize,
        kwargs: &Map<String, Value>,
    ) -> Result<(), String> {
        let request = self.node.request(Op::Run, &index.to_string(), Some(kwargs));
        let started = if self.in_turn && !self.zygote.fresh_fork_instead(&self.key) {
            self.zygote
                .start_resident(py, &request)
                .map(Child::Resident)
        } else {
            self.zygote.start_run(py, &request).map(Child::Fresh)
        };
        let child = match started {
            Ok(child) => child,
            Err(SpawnError::Io(error)) => return Err(format!("could not fork a call: {error}")),
            Err(SpawnError::Unsafe | SpawnError::NotCompiled) => {
                return Err("the zygote can no longer fork safely".into());
            }
        };
        let log = crate::telemetry::CallLog::start(
            "run",
            index.to_string(),
            crate::telemetry::node_name(&self.node.flow, &self.node.name),
        );
        self.running.push(Running {
            index,
            child,
            answer: Answer::default(),
            log,
        });
        Ok(())
    }

    /// Starts call `index` as [`Calls::start`] does, unless that would
    /// wait for a resident to be put back: then it is left for later
    /// (false), and the next [`Calls::step`] wakes once one is, or
    /// sooner for a call in flight. Waiting here would leave the other
    /// calls' replies unread meanwhile, and their residents idle.
    pub fn try_start(
        &mut self,
        py: Python<'_>,
        index: usize,
        kwargs: &Map<String, Value>,
    ) -> Result<bool, String> {
        // With no other call to read meanwhile, waiting in `start` loses
        // nothing, and it looks at once where the sweep would sleep first.
        if self.in_turn && !self.running.is_empty() && self.waits_for_put_back() {
            // Not for ever: one that never says it is put back is taken,
            // and waited for, and retired when it is not.
            let since = *self.left_since.get_or_insert_with(Instant::now);
            if since.elapsed() < LEAVE_FOR_AT_MOST {
                return Ok(false);
            }
        }
        self.left_since = None;
        self.start(py, index, kwargs).map(|()| true)
    }

    /// Whether starting a call would wait for a resident to be put back.
    fn waits_for_put_back(&mut self) -> bool {
        !matches!(
            self.zygote.residents_being_put_back(&self.key),
            PutBackWait::No
        )
    }

    /// Forks the standby children for the next calls, while these run.
    pub fn replenish(&mut self, py: Python<'_>) {
        self.zygote.replenish(py);
    }

    /// The events of the calls in flight so far, by call index.
    pub fn events(&self) -> impl Iterator<Item = (usize, &[Vec<u8>])> {
        self.running
            .iter()
            .map(|call| (call.index, call.answer.events.as_slice()))
    }

    /// Waits (a little while at most) for lines or exits; returns the calls
    /// that ended.
    pub fn step(&mut self) -> Result<Vec<Done>, String> {
        self.step_with(None).map(|(done, _)| done)
    }

    /// [`Calls::step`], woken also by `also` being readable (and saying so).
    pub fn step_with(
        &mut self,
        also: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(Vec<Done>, bool), String> {
        let (readable, exited, also_ready) = self.wait(also)?;
        for &i in &readable {
            let call = &mut self.running[i];
            call.child.flight_mut().read(&mut call.answer);
        }
        // A resident that replied serves the next call; one that exited
        // is landed as any call.
        let replied: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let call = &self.running[i];
                matches!(call.child, Child::Resident(_))
                    && call.answer.replied_at.is_some()
                    && !exited.contains(&i)
            })
            .collect();
        // Past `--timeout` with no reply: killed with its session here, its
        // cell when it lands (as a stop ends a call), a resident too (the
        // next call gets a fresh one, as after a crash).
        let now = Instant::now();
        let overdue: Vec<usize> = (0..self.running.len())
            .filter(|&i| {
                let call = &self.running[i];
                call.answer.replied_at.is_none()
                    && !exited.contains(&i)
                    && deadline(self.timeout, call).is_some_and(|deadline| deadline <= now)
            })
            .collect();
        for &i in &overdue {
            crate::process::kill_group(self.running[i].child.flight().pid, Signal::SIGKILL);
        }
        let mut ended: Vec<(usize, Step)> = exited
            .iter()
            .map(|&i| (i, Step::Exited))
            .chain(replied.iter().map(|&i| (i, Step::Replied)))
            .chain(overdue.iter().map(|&i| (i, Step::Overdue)))
            .collect();
        ended.sort_unstable_by_key(|&(i, _)| i);
        let mut done = Vec::with_capacity(ended.len());
        // From the back, so the indices still to visit stay valid.
        for &(i, end) in ended.iter().rev() {
            let call = self.running.swap_remove(i);
            done.push(match end {
                Step::Replied => self.between(call),
                Step::Exited => self.land(call, false)?,
                Step::Overdue => self.land(call, true)?,
            });
        }
        done.reverse();
        Ok((done, also_ready))
    }

    /// A resident's call has replied: the call is done, the child waits
    /// for the next one.
    fn between(&mut self, call: Running) -> Done {
        let Running {
            index,
            child,
            answer,
            log,
        } = call;
        log.end(Some(&answer.reply));
        let duration = answer.replied_at.unwrap_or_else(Instant::now) - child.flight().started;
        if let Child::Resident(resident) = child {
            self.zygote.keep_resident(resident);
        }
        Done {
            index,
            answer,
            duration,
            gpu: None,
        }
    }

    /// Lands a call whose child exited, or, `overdue`, one killed for
    /// running past `--timeout` (its reply says so, unless it had replied).
    fn land(&mut self, call: Running, overdue: bool) -> Result<Done, String> {
        let Running {
            index,
            child,
            mut answer,
            log,
        } = call;
        // A resident's pipe closed: it is retired with its flight.
        let resident = match &child {
            Child::Resident(resident) => Some(resident.tag()),
            Child::Fresh(_) => None,
        };
        let flight = child.into_flight();
        let started = flight.started;
        let too_large = flight.too_large();
        let landed = flight
            .land(&mut answer)
            .map_err(|e| format!("lost track of a call: {e}"))?;
        let id = raw(&index.to_string());
        if let (false, Some(too_large)) = (landed.replied, too_large) {
            answer.reply(&too_large.reply(&id, ""));
        } else if let (false, true, Some(timeout)) = (landed.replied, overdue, self.timeout) {
            answer.reply(&End::TimedOut(timeout).reply(&id, "", &landed.logs.text_lossy()));
        } else if !landed.replied {
            let end = End::Process(landed.reaped.end);
            answer.ended_without_reply(&end);
            answer.reply(&end.reply(&id, "", &landed.logs.text_lossy()));
        }
        if let (Some(tag), true) = (resident, landed.replied) {
            // It replied, then retired itself rather than be put back.
            self.zygote.resident_ended_after_its_call(&tag);
        }
        self.zygote.recycle(landed.logs);
        log.end(Some(&answer.reply));
        let duration = answer.replied_at.unwrap_or_else(Instant::now) - started;
        Ok(Done {
            index,
            answer,
            duration,
            gpu: None,
        })
    }

    /// Ends every call in flight: each child's session and cell killed, then
    /// reaped. Returns their indices.
    pub fn kill_all(&mut self) -> Vec<usize> {
        for call in &self.running {
            crate::process::kill_group(call.child.flight().pid, Signal::SIGKILL);
        }
        // Residents between calls: their pipes closed, so they write out
        // what they hold and exit; then their cells killed.
        self.zygote.retire_residents();
        let mut ended = Vec::new();
        while let Some(call) = self.running.pop() {
            ended.push(call.index);
            // Landing kills its cell too (what left the session) and reaps.
            let _ = self.land(call, false);
        }
        ended.sort_unstable();
        ended
    }

    /// The indices (into `running`) of calls with something to read, and of
    /// calls that exited, each ascending; and whether `also` is readable.
    fn wait(
        &mut self,
        also: Option<std::os::fd::BorrowedFd<'_>>,
    ) -> Result<(Vec<usize>, Vec<usize>, bool), String> {
        let mut set = PollSet::new();
        let also = also.map(|also| set.fd(also, PollFlags::POLLIN));
        let timeout = self.timeout;
        // A call left for later wakes this once a resident is put back.
        let mut look_again = None;
        if self.in_turn && self.left_since.is_some() {
            match self.zygote.residents_being_put_back(&self.key) {
                PutBackWait::Until {
                    words,
                    look_again: after,
                } => {
                    for control in words {
                        set.fd(control, PollFlags::POLLIN);
                    }
                    look_again = after;
                }
                // Put back since it was left: it starts at once.
                PutBackWait::No => look_again = Some(Duration::ZERO),
            }
        }
        let watched: Vec<Watched> = self
            .running
            .iter()
            .map(|call| call.child.flight().watch(&mut set))
            .collect();
        // Awake for the nearest `--timeout`.
        let now = Instant::now();
        let nearest = self
            .running
            .iter()
            .filter(|call| call.answer.replied_at.is_none())
            .filter_map(|call| deadline(timeout, call))
            .min()
            .map(|nearest| nearest.saturating_duration_since(now));
        let wake = Duration::from_millis(WAKE_MS.into());
        let wake = look_again.map_or(wake, |after| after.min(wake));
        set.wait(Some(nearest.map_or(wake, |nearest| nearest.min(wake))))
            .map_err(|e| format!("poll failed: {e}"))?;
        let also_ready = also.is_some_and(|also| set.ready(also));
        let readable = (watched.iter().enumerate())
            .filter(|(_, w)| w.pipe.is_some_and(|pipe| set.ready(pipe)))
            .map(|(i, _)| i)
            .collect();
        let exited = (watched.iter().enumerate())
            .filter(|(_, w)| set.ready(w.exit))
            .map(|(i, _)| i)
            .collect();
        Ok((readable, exited, also_ready))
    }
}
