//! `--isolation node`: one child per node, serving its calls in turn.
//!
//! The issue this solves: the engine's pool reuses a `worker_main.py`
//! between crashes, so a trivial call costs it tens of microseconds, where
//! a fork per call costs a millisecond. Where a flow wants that speed (and
//! the module state kept between calls that comes with it), a node's first
//! run forks a *resident* child from the zygote, and its later runs are
//! written down the same control pipe (a sweep keeps one per call in
//! flight, the same way). It is replaced by a fresh fork,
//! never a cold start, after it crashes or exits, when its node's source
//! changes, or after `--max-calls-per-child` calls. It is contained like any
//! call (its cell, its session): what one of its calls leaves running lives
//! until the resident is retired.
//!
//! Under `--isolation reset` the resident is put back after each call
//! (`crate::reset`), and the zygote hands it the next only once it sees it
//! from outside at its wait. Over the usual length: the zygote's side and
//! the child's loop speak one small protocol (the word, the wait, a link's
//! pipe) and are read together.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};

use pyo3::prelude::*;

use super::assignment::{self, Assignment, Function};
use super::child;
use super::fallback::Tag;
use super::flight::Flight;
use super::node::NodeKey;
use crate::fds::Claimed;
use fluksio_embed::capture::LogBuffer;

/// How a call's child relates to the calls after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Isolation {
    /// A fresh child per call: nothing one call does is seen by the next.
    #[default]
    Call,
    /// One child per node serving its calls in turn, as `worker_main.py`.
    Node,
    /// One child per node serving its calls in turn, put back after each
    /// to its memory before the first (`crate::reset`): a fresh fork's
    /// isolation at the price of reuse.
    Reset,
}

/// A node's resident child: serving a call, or between calls.
pub struct Resident {
    flight: Flight,
    /// Where its next call is written; closing it retires the child.
    control: Claimed,
    key: NodeKey,
    digest: String,
    /// The zygote's generation it was forked at: under `--isolation
    /// reset` its snapshot is the zygote's state then, and once the zygote
    /// has learned what calls import (or loaded a node), one forked from it
    /// now starts each call with more done.
    generation: u64,
    calls: u64,
    /// `--isolation reset`: where it blocks waiting for its next call,
    /// as `/proc/PID/syscall` shows it, learned before any call ran in it.
    /// `None` where it has none (its snapshot failed): it is retired at
    /// its next call.
    wait_point: Option<String>,
    /// Stretches of fresh forks its node had begun when it was forked
    /// (`fallback`).
    stretches: u32,
    /// Its `/proc/PID/stat`, `syscall` and `wchan`, open: read each time
    /// it is put back (opening them costs more than reading).
    watched: Option<Watched>,
    /// `--isolation reset`, after a call: how far it is seen put back.
    put_back: PutBack,
    /// `--isolation reset`: a call of its ran its pools' threads (its word
    /// said so): the node's calls have more than one CPU's work.
    ran_threads: bool,
    /// A link's call: the read end of the pipe its lines went down, whose
    /// owner reads them. No one else's call is handed it before that owner
    /// has read them all, so nothing the owner does for its call (a late
    /// cancel) can reach the next.
    owner_end: Option<Claimed>,
}

/// A pipe of a link's call's own, for a resident to write the call's lines
/// down and the call's owner to read them from.
pub struct CallPipe {
    /// The owner's end, to hand over the link.
    pub read: OwnedFd,
    write: OwnedFd,
    /// Kept by the zygote: see [`Resident::owner_has_read`].
    kept: Claimed,
}

impl CallPipe {
    pub(super) fn new() -> std::io::Result<CallPipe> {
        let (read, write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)?;
        let kept = Claimed::new(read.try_clone()?);
        Ok(CallPipe { read, write, kept })
    }
}

impl Resident {
    /// A resident just forked, at the zygote's `generation`, for a call of
    /// node `key`'s source `digest`, which it was handed with its control
    /// pipe; `stretches`, its node's fallback's so far.
    pub(super) fn new(
        flight: Flight,
        control: Claimed,
        key: &NodeKey,
        digest: &str,
        generation: u64,
        stretches: u32,
    ) -> Resident {
        Resident {
            flight,
            control,
            key: key.clone(),
            digest: digest.to_string(),
            generation,
            calls: 0,
            wait_point: None,
            stretches,
            watched: None,
            put_back: PutBack::Serving,
            ran_threads: false,
            owner_end: None,
        }
    }

    /// `--isolation reset`, a resident just forked: waits for it to take
    /// its snapshot, and learns where it then waits for a call. Nothing of
    /// a call has run in it yet, so what it shows is the runtime's own.
    pub(super) fn learn_wait_point(&mut self) -> Result<(), String> {
        self.read_word()?;
        self.watched = Some(
            Watched::open(self.flight.pid.as_raw())
                .map_err(|e| format!("its state cannot be read ({e})"))?,
        );
        self.wait_point = Some(self.first_wait()?);
        // At its wait, asleep: its `wchan` names the kernel function.
        if let Some(watched) = &mut self.watched {
            watched.wchan_names_waits = watched.asleep().unwrap_or(false);
        }
        Ok(())
    }

    /// Hands it its next call, whose lines go down `pipe` where it has one
    /// (a link's call), else down the child's own pipe. A child that died
    /// since its last reply is found out by following it: its flight says
    /// how it ended.
    pub(super) fn hand(&mut self, assignment: &Assignment, pipe: Option<CallPipe>) {
        self.owner_end = None;
        if let Some(CallPipe { write, kept, .. }) = pipe {
            let frame = crate::link::Frame::Pipe {
                ticket: 0,
                pipe: write,
            };
            let _ = crate::link::send(self.control.as_fd(), &frame);
            self.owner_end = Some(kept);
        }
        let _ = assignment::send_assignment(&self.control, assignment);
        self.flight.rearm();
        self.put_back = PutBack::Serving;
    }

    /// Whether the owner of its last call (a link's) has read every line of
    /// it: its reply, and so the end of what it does for that call.
    fn owner_has_read(&self) -> bool {
        let Some(end) = &self.owner_end else {
            return true;
        };
        let mut unread: libc::c_int = 0;
        // SAFETY: FIONREAD writes one int, here a local, for an open pipe.
        let done = unsafe { libc::ioctl(end.as_raw_fd(), libc::FIONREAD, &mut unread) };
        done == 0 && unread == 0
    }

    /// The control socket, for a server to wait on its word after a link's
    /// call (it says it once the call is over and it is put back).
    pub fn control(&self) -> std::os::fd::BorrowedFd<'_> {
        self.control.as_fd()
    }

    /// Its child, followed as any call's.
    pub fn flight(&self) -> &Flight {
        &self.flight
    }

    pub fn flight_mut(&mut self) -> &mut Flight {
        &mut self.flight
    }

    /// Its flight, its control pipe closed: it serves no call after this.
    pub fn into_flight(self) -> Flight {
        drop(self.control);
        self.flight
    }

    /// `--isolation reset`: waits until it is put back after its last call
    /// and seen at its wait (or says why it could not be, and so exits).
    /// A call can write the word itself (it runs in the same process, with
    /// the same socket), so the word alone is not trusted: the next call's
    /// assignment goes only to a child seen from outside with one thread,
    /// blocked where it waits for its next call, where no node code can
    /// be running. One seen there earlier is looked at once more: nothing
    /// may have woken it since.
    fn put_back(&mut self) -> Result<(), String> {
        if self.wait_point.is_none() {
            return Err("it has no snapshot".into());
        }
        if self.put_back == PutBack::AtItsWait {
            return match self.observe()? {
                Seen::AtItsWait => Ok(()),
                seen => Err(format!("it left its wait before its next call ({seen})")),
            };
        }
        if self.put_back == PutBack::Serving {
            self.take_word()?;
        }
        // It said its word right before its wait: looked at again at once
        // for a few turns (it is on its way, on another CPU where one is
        // free), then slept on, so that it has the CPU to get there.
        let spin_until = std::time::Instant::now() + SPIN_FOR;
        loop {
            if self.look()? {
                return Ok(());
            }
            if std::time::Instant::now() < spin_until {
                std::thread::yield_now();
            } else {
                std::thread::sleep(LOOK_AGAIN_AFTER);
            }
        }
    }

    /// `--isolation reset`: how far its put-back has come, as far as can be
    /// seen without waiting: its word read if it has come, then one look.
    /// `Ok(true)` once seen at its wait; `Err` if it cannot be put back.
    fn look(&mut self) -> Result<bool, String> {
        if self.wait_point.is_none() {
            return Err("it has no snapshot".into());
        }
        match self.put_back {
            PutBack::AtItsWait => return Ok(true),
            PutBack::Serving if !self.has_word() => return Ok(false),
            PutBack::Serving => self.take_word()?,
            PutBack::OnItsWay { .. } => {}
        }
        let seen = self.observe()?;
        let PutBack::OnItsWay {
            since,
            elsewhere_since,
        } = &mut self.put_back
        else {
            unreachable!("on its way, from above");
        };
        match seen {
            Seen::AtItsWait => {
                // At its wait nothing more is written for its last call:
                // what waits in its own pipe was written past that call's
                // reply (or down the pipe while a link's call had its
                // own), and would be read as the next call's lines.
                if self.flight.has_unread() {
                    return Err("its last call wrote to its pipe past its reply".into());
                }
                self.put_back = PutBack::AtItsWait;
                return Ok(true);
            }
            // A child on its way to its wait is running, so one that stays
            // blocked elsewhere (in a call's own code) is not coming.
            Seen::Elsewhere(ref syscall) => {
                let elsewhere = *elsewhere_since.get_or_insert_with(std::time::Instant::now);
                if elsewhere.elapsed() > BLOCKED_ELSEWHERE_WITHIN {
                    return Err(format!(
                        "blocked outside its wait for a call ({syscall}; it waits at {})",
                        self.wait_point.as_deref().unwrap_or("?")
                    ));
                }
            }
            Seen::NotAsleep | Seen::Running | Seen::Threads(_) => *elsewhere_since = None,
        }
        if since.elapsed() > PUT_BACK_WITHIN {
            return Err(format!(
                "not at its wait for a call within {PUT_BACK_WITHIN:?} ({seen})"
            ));
        }
        Ok(false)
    }

    /// Reads its word after its last call if it has come (`Err`: it
    /// retired itself, or exited), without looking further.
    fn read_word_if_come(&mut self) -> Result<(), String> {
        if self.put_back == PutBack::Serving && self.has_word() {
            self.take_word()?;
        }
        Ok(())
    }

    /// Reads its word after its last call (waiting for it): on its way to
    /// its wait from now, if the word is "ready".
    fn take_word(&mut self) -> Result<(), String> {
        self.ran_threads |= self.read_word()?;
        self.put_back = PutBack::OnItsWay {
            since: std::time::Instant::now(),
            elsewhere_since: None,
        };
        Ok(())
    }

    /// Whether its word after its last call has come (or it hung up):
    /// taking it then waits for no word.
    fn said_its_word(&self) -> bool {
        self.put_back != PutBack::Serving || self.has_word()
    }

    /// Whether its word is there to read (or it hung up).
    fn has_word(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.control.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
    }

    /// Reads its word from the control socket: `Ok` for "ready" (`true`
    /// where its call ran its pools' threads), the reason it gives (or that
    /// it exited) otherwise.
    fn read_word(&self) -> Result<bool, String> {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.control.as_fd(), PollFlags::POLLIN)];
        let within =
            PollTimeout::try_from(PUT_BACK_WITHIN.as_millis() as u64).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, within) {
            Ok(0) => return Err(format!("not put back within {PUT_BACK_WITHIN:?}")),
            Ok(_) => {}
            Err(error) => return Err(format!("poll failed: {error}")),
        }
        let mut word = [0u8; 1024];
        // SAFETY: reads into a local buffer from the control socket.
        let n = unsafe {
            libc::read(
                self.control.as_raw_fd(),
                word.as_mut_ptr().cast(),
                word.len(),
            )
        };
        let word = String::from_utf8_lossy(&word[..n.max(0) as usize]);
        if let Some(why) = word.lines().find_map(|line| line.strip_prefix(RETIRED)) {
            return Err(why.to_string());
        }
        match word
            .lines()
            .find(|&line| line == READY || line == READY_THREADED)
        {
            Some(line) => Ok(line == READY_THREADED),
            None => Err("it exited".into()),
        }
    }

    /// Where it is now, seen from outside, against its wait point.
    fn observe(&self) -> Result<Seen, String> {
        let watched = self.watched()?;
        if watched.wchan_names_waits && !watched.asleep().map_err(unreadable)? {
            return Ok(Seen::NotAsleep);
        }
        Ok(match (&self.wait_point, self.observe_call()?) {
            (_, (threads, _)) if threads != 1 => Seen::Threads(threads),
            (_, (_, None)) => Seen::Running,
            (Some(wait_point), (_, Some(syscall))) if syscall == *wait_point => Seen::AtItsWait,
            (_, (_, Some(syscall))) => Seen::Elsewhere(syscall),
        })
    }

    fn watched(&self) -> Result<&Watched, String> {
        self.watched
            .as_ref()
            .ok_or_else(|| "its state cannot be read (not open)".into())
    }

    /// Its threads, and the system call it is blocked in, as
    /// `/proc/PID/syscall` shows it (number, arguments, stack, code):
    /// `None` while it runs ("running" on a CPU, "-1 …" stopped outside
    /// any system call: preempted, faulting).
    fn observe_call(&self) -> Result<(usize, Option<String>), String> {
        let (threads, syscall) = self.watched()?.read().map_err(unreadable)?;
        let syscall = wait_of(syscall.trim());
        let blocked = syscall != "running" && !syscall.starts_with("-1") && !syscall.is_empty();
        Ok((threads, blocked.then_some(syscall)))
    }

    /// Waits (within [`PUT_BACK_WITHIN`]) until its one thread is blocked
    /// in a system call, before any call ran in it: where it waits.
    fn first_wait(&self) -> Result<String, String> {
        let started = std::time::Instant::now();
        loop {
            let (threads, syscall) = self.observe_call()?;
            if let Some(syscall) = syscall.filter(|_| threads == 1) {
                return Ok(syscall);
            }
            if started.elapsed() > PUT_BACK_WITHIN {
                return Err(format!(
                    "not at its wait for a call within {PUT_BACK_WITHIN:?} ({threads} threads)"
                ));
            }
            std::thread::sleep(LOOK_AGAIN_AFTER);
        }
    }

    /// Which resident it is, as its node's fallback counts it.
    pub fn tag(&self) -> Tag {
        Tag {
            key: self.key.clone(),
            digest: self.digest.clone(),
            stretches: self.stretches,
        }
    }

    /// Retires it, put back after its call it could not be: the next call
    /// gets a fresh fork, and `fallbacks` counts it against its node.
    fn not_put_back(
        self,
        why: &str,
        land: &mut impl FnMut(Flight),
        fallbacks: &mut super::fallback::Fallbacks,
    ) {
        said_not_put_back(&self.tag(), why, fallbacks);
        self.retire(land);
    }

    /// Ends it: its pipe closed, so it writes out what it holds and exits
    /// (within the flush's deadline); then its flight to `land` (its cell
    /// killed, and it reaped later).
    fn retire(self, land: &mut impl FnMut(Flight)) {
        let flight = self.into_flight();
        flight.wait_exit(RETIRE_WITHIN);
        land(flight);
    }
}

/// `--isolation reset`: how far a resident is seen put back after a call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PutBack {
    /// Serving its call, or putting itself back: no word yet.
    Serving,
    /// It said it is put back (`since` then), and is not yet seen at its
    /// wait; seen blocked somewhere else since `elsewhere_since`.
    OnItsWay {
        since: std::time::Instant,
        elsewhere_since: Option<std::time::Instant>,
    },
    /// Seen at its wait, where no node code runs: it may be handed a call.
    AtItsWait,
}

/// A resident as one look at it from outside finds it.
enum Seen {
    AtItsWait,
    /// Not asleep off the run queues (its `wchan` says so): on its way.
    NotAsleep,
    /// In no system call: running, preempted or faulting.
    Running,
    /// More (or fewer) threads than its one.
    Threads(usize),
    /// One thread, blocked in this system call, not at its wait.
    Elsewhere(String),
}

impl std::fmt::Display for Seen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Seen::AtItsWait => f.write_str("at its wait"),
            Seen::NotAsleep => f.write_str("not asleep"),
            Seen::Running => f.write_str("running"),
            Seen::Threads(threads) => write!(f, "{threads} threads"),
            Seen::Elsewhere(syscall) => write!(f, "blocked in {syscall}"),
        }
    }
}

/// Why a resident's state could not be read.
fn unreadable(error: std::io::Error) -> String {
    format!("its state cannot be read ({error})")
}

/// `--isolation reset`: whether taking a node's resident now would wait
/// for one to be put back, and for what ([`Residents::being_put_back`]).
pub enum PutBackWait<'a> {
    /// It would not: one is at its wait, or none is waited for.
    No,
    /// Until one of these control sockets (of residents yet to say their
    /// word) is readable, or until [`LOOK_AGAIN_AFTER`] where one said it
    /// and is on its way to its wait.
    Until {
        words: Vec<BorrowedFd<'a>>,
        look_again: Option<std::time::Duration>,
    },
}

/// `--isolation node` and `reset`: each node's resident children between
/// their calls (one for the worker, which serves a call at a time; one per
/// call in flight for a sweep).
pub(super) struct Residents {
    idle: HashMap<NodeKey, Vec<Resident>>,
    /// Calls one serves before a fresh fork replaces it.
    max_calls: Option<u64>,
    /// `--isolation reset`: each is put back after its call, and says
    /// whether it could be before it is handed the next.
    reset: bool,
    /// Nodes whose calls ran their pools' threads, as a resident said.
    threaded: std::collections::HashSet<NodeKey>,
    /// Nodes whose residents could not be put back, call after call.
    fallbacks: super::fallback::Fallbacks,
}

/// Whether this zygote's residents are put back after each call: set in
/// the zygote before it forks any, read by them.
static RESET: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

impl Residents {
    pub(super) fn new(max_calls: Option<u64>, reset: bool) -> Residents {
        RESET.store(reset, std::sync::atomic::Ordering::Relaxed);
        Residents {
            idle: HashMap::new(),
            max_calls,
            reset,
            threaded: Default::default(),
            fallbacks: Default::default(),
        }
    }

    /// `--isolation reset`.
    pub(super) fn reset(&self) -> bool {
        self.reset
    }

    /// An idle resident of node `key` for a call of source `digest`, taken
    /// out until its call is served; those of another source, or under
    /// `--isolation reset` forked before the zygote's `generation`, are
    /// retired (their flights to `land`).
    pub(super) fn take(
        &mut self,
        key: &NodeKey,
        digest: &str,
        generation: u64,
        mut land: impl FnMut(Flight),
    ) -> Option<Resident> {
        self.retire_stale(key, digest, generation, &mut land);
        loop {
            let spares = self.spares(key);
            let resident = if self.reset {
                // One seen at its wait first, then one that said its word.
                let idle = self.idle.get_mut(key)?;
                match first_at_its_wait(idle, &mut land, &mut self.fallbacks)
                    .or_else(|| idle.iter().position(Resident::said_its_word))
                {
                    Some(at) => idle.swap_remove(at),
                    // None said its word as it was asked just now: asked
                    // again, one that has since would make this fork a
                    // resident too many.
                    None if idle.len() <= spares => return None,
                    // Whichever is put back first: waiting on one in
                    // particular would leave another, put back meanwhile,
                    // idle. None within the time: all retired, and the
                    // call gets a fresh fork.
                    None => match first_to_say_its_word(idle) {
                        Some(at) => idle.swap_remove(at),
                        None => {
                            tracing::info!(
                                "no resident was put back within {PUT_BACK_WITHIN:?}; \
                                 they are retired, and the next call gets a fresh fork"
                            );
                            let tag = idle.first().map(Resident::tag);
                            self.retire(key, &mut land);
                            if let Some(tag) = tag {
                                self.fallbacks.retired(&tag, "none was put back in time");
                            }
                            return None;
                        }
                    },
                }
            } else {
                self.idle.get_mut(key)?.pop()?
            };
            if !resident.owner_has_read() {
                // Its last call's owner has not read its reply (a slow or
                // a dead one): it may yet act on that call's child.
                tracing::debug!(
                    pid = resident.flight.pid.as_raw(),
                    "a resident's last call is not read yet; it is retired"
                );
                resident.retire(&mut land);
                continue;
            }
            if !self.reset {
                return Some(resident);
            }
            let mut resident = resident;
            match resident.put_back() {
                Ok(()) => {
                    if resident.ran_threads {
                        self.threaded.insert(key.clone());
                    }
                    self.fallbacks.put_back(&resident.tag());
                    return Some(resident);
                }
                Err(why) => resident.not_put_back(&why, &mut land, &mut self.fallbacks),
            }
        }
    }

    /// `--isolation reset`: whether node `key`'s next call gets a fresh
    /// fork rather than a resident, its residents having failed to be put
    /// back call after call (`fallback`).
    pub(super) fn fresh_fork_instead(&mut self, key: &NodeKey, digest: &str) -> bool {
        self.reset && self.fallbacks.fresh_fork_instead(key, digest)
    }

    /// Stretches of fresh forks node `key` has begun: what a resident
    /// forked now is tagged with.
    pub(super) fn stretches(&self, key: &NodeKey) -> u32 {
        self.fallbacks.stretches(key)
    }

    /// Resident `tag` exited on its own once its call was over, before it
    /// was given back (a sweep or a link sees the exit before the word):
    /// under `--isolation reset` it retired itself, not put back.
    pub(super) fn ended_after_its_call(&mut self, tag: &Tag) {
        if self.reset {
            said_not_put_back(tag, "it ended once the call was over", &mut self.fallbacks);
        }
    }

    /// `--isolation reset`: whether [`Residents::take`] would wait for one
    /// of node `key`'s idle residents to be put back, each looked at once
    /// (those that cannot be are retired, their flights to `land`). A
    /// caller with more to do than wait (a sweep reading its other calls)
    /// waits as the answer says, and takes one once it would not.
    pub(super) fn being_put_back(
        &mut self,
        key: &NodeKey,
        digest: &str,
        generation: u64,
        mut land: impl FnMut(Flight),
    ) -> PutBackWait<'_> {
        if !self.reset {
            return PutBackWait::No;
        }
        self.retire_stale(key, digest, generation, &mut land);
        let spares = self.spares(key);
        let Some(idle) = self.idle.get_mut(key) else {
            return PutBackWait::No;
        };
        if first_at_its_wait(idle, &mut land, &mut self.fallbacks).is_some() {
            return PutBackWait::No;
        }
        // None said its word: with no spare, the caller forks one.
        let on_its_way = idle.iter().any(Resident::said_its_word);
        if !on_its_way && idle.len() <= spares {
            return PutBackWait::No;
        }
        PutBackWait::Until {
            words: idle
                .iter()
                .filter(|resident| resident.put_back == PutBack::Serving)
                .map(|resident| resident.control.as_fd())
                .collect(),
            look_again: on_its_way.then_some(LOOK_AGAIN_AFTER),
        }
    }

    /// Idle residents node `key` may have beside its calls in flight (see
    /// [`SPARE_RESIDENTS`]): one put back beside the next call takes a CPU
    /// from it, so none where the calls in flight leave no CPU free, each
    /// counted at its share of them where the node's calls ran their pools'
    /// threads. (Measured, 2 CPUs: at `-j 2` a spare cost 8-15%; at `-j 1`
    /// with two BLAS threads a call, half the throughput.)
    fn spares(&self, key: &NodeKey) -> usize {
        let threads = if self.threaded.contains(key) {
            super::threads::per_call()
        } else {
            1
        };
        if super::threads::calls_in_flight() * threads < super::threads::cpus() {
            SPARE_RESIDENTS
        } else {
            0
        }
    }

    /// Puts back a resident that has replied to one more call; retired
    /// (its flight to `land`) once it has served its last.
    pub(super) fn keep(&mut self, mut resident: Resident, mut land: impl FnMut(Flight)) {
        resident.calls += 1;
        if self.max_calls.is_some_and(|max| resident.calls >= max) {
            resident.retire(&mut land);
            return;
        }
        let key = resident.key.clone();
        // A node whose calls turned out to run their pools' threads keeps
        // no more idle residents than its calls in flight and its spares:
        // one forked as a spare before would go on being put back beside
        // the next call, on the CPUs that call's threads need.
        let room = (self.reset && self.threaded.contains(&key))
            .then(|| super::threads::calls_in_flight() + self.spares(&key));
        let idle = self.idle.entry(key).or_default();
        idle.push(resident);
        while room.is_some_and(|room| idle.len() > room) {
            // The one just kept is the last: others go first.
            idle.remove(0).retire(&mut land);
        }
    }

    /// Ends node `key`'s idle residents that are not for source `digest`,
    /// or under `--isolation reset` were forked before `generation`: a
    /// resident keeps its own module state, but a reset one starts each
    /// call from its snapshot, and a fresh one's has what the zygote
    /// learned since (an import a call would otherwise make every time).
    fn retire_stale(
        &mut self,
        key: &NodeKey,
        digest: &str,
        generation: u64,
        land: &mut impl FnMut(Flight),
    ) {
        let reset = self.reset;
        let Some(idle) = self.idle.get_mut(key) else {
            return;
        };
        let mut at = 0;
        while at < idle.len() {
            let resident = &idle[at];
            if resident.digest != digest || (reset && resident.generation != generation) {
                idle.swap_remove(at).retire(land);
            } else {
                at += 1;
            }
        }
    }

    /// Ends a node's idle residents.
    pub(super) fn retire(&mut self, key: &NodeKey, land: &mut impl FnMut(Flight)) {
        for resident in self.idle.remove(key).unwrap_or_default() {
            resident.retire(land);
        }
    }

    /// The control sockets of the idle residents whose word after their
    /// last call has not been read (under `--isolation reset`).
    pub(super) fn words_awaited(&self) -> Vec<BorrowedFd<'_>> {
        self.idle
            .values()
            .flatten()
            .filter(|resident| resident.put_back == PutBack::Serving)
            .map(|resident| resident.control.as_fd())
            .collect()
    }

    /// Reads every idle resident's word that has come: one that retired
    /// itself, or exited, is said and ended (its flight to `land`).
    pub(super) fn read_words_come(&mut self, mut land: impl FnMut(Flight)) {
        for idle in self.idle.values_mut() {
            let mut at = 0;
            while at < idle.len() {
                match idle[at].read_word_if_come() {
                    Ok(()) => at += 1,
                    Err(why) => {
                        idle.swap_remove(at)
                            .not_put_back(&why, &mut land, &mut self.fallbacks)
                    }
                }
            }
        }
    }

    /// Ends every idle resident.
    pub(super) fn retire_all(&mut self, mut land: impl FnMut(Flight)) {
        let keys: Vec<NodeKey> = self.idle.keys().cloned().collect();
        for key in keys {
            self.retire(&key, &mut land);
        }
    }

    /// In a node's own zygote, just forked: the residents it copied are its
    /// parent's. Forgotten, never dropped (dropping one would kill its
    /// parent's child).
    pub(super) fn forget_inherited(&mut self) {
        std::mem::forget(std::mem::take(&mut self.idle));
    }
}

/// Says at `info` that resident `tag` could not be put back after its call
/// (`why`), and counts it: in the metrics, and against its node.
fn said_not_put_back(tag: &Tag, why: &str, fallbacks: &mut super::fallback::Fallbacks) {
    tracing::info!(
        node = %tag.key,
        "a resident could not be put back after its call ({why}); \
         the next call gets a fresh fork"
    );
    crate::metrics::reset_retired();
    fallbacks.retired(tag, why);
}

/// The first of `idle` seen at its wait: each before it looked at once,
/// each after it only its word read where it has come (those that cannot
/// be put back retired, their flights to `land`).
fn first_at_its_wait(
    idle: &mut Vec<Resident>,
    land: &mut impl FnMut(Flight),
    fallbacks: &mut super::fallback::Fallbacks,
) -> Option<usize> {
    let mut found = None;
    let mut at = 0;
    while at < idle.len() {
        // Past the one found, only a word that has come is read: one that
        // retired itself is said and ended now, not whenever a call next
        // needs it (it would idle meanwhile, in a spare's place).
        let looked = match found {
            None => idle[at].look(),
            Some(_) => idle[at].read_word_if_come().map(|()| false),
        };
        match looked {
            Ok(true) => {
                found = Some(at);
                at += 1;
            }
            Ok(false) => at += 1,
            // The last one takes its place: never one before `found`.
            Err(why) => idle.swap_remove(at).not_put_back(&why, land, fallbacks),
        }
    }
    found
}

/// The one of `idle` that says its word first, or `None` if none does
/// within [`PUT_BACK_WITHIN`].
fn first_to_say_its_word(idle: &[Resident]) -> Option<usize> {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    let deadline = std::time::Instant::now() + PUT_BACK_WITHIN;
    loop {
        let mut fds: Vec<PollFd> = idle
            .iter()
            .map(|resident| PollFd::new(resident.control.as_fd(), PollFlags::POLLIN))
            .collect();
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        let within = PollTimeout::try_from(left.as_millis() as u64).unwrap_or(PollTimeout::MAX);
        match poll(&mut fds, within) {
            Ok(n) if n > 0 => {
                return fds
                    .iter()
                    .position(|fd| fd.revents().is_some_and(|events| !events.is_empty()));
            }
            Err(nix::errno::Errno::EINTR) if !left.is_zero() => continue,
            _ => return None,
        }
    }
}

/// A blocked system call as `/proc/PID/syscall` shows it, less what the
/// call does not use: its number, the three arguments a `read` takes, the
/// stack and code addresses (the other argument registers hold whatever
/// was left in them).
fn wait_of(syscall: &str) -> String {
    let fields: Vec<&str> = syscall.split_whitespace().collect();
    if fields.len() < 9 {
        return syscall.to_string();
    }
    [
        fields[0], fields[1], fields[2], fields[3], fields[7], fields[8],
    ]
    .join(" ")
}

/// A resident's `/proc/PID/stat`, `/proc/PID/syscall` and
/// `/proc/PID/wchan`, open in the zygote (claimed: no child it forks
/// keeps them).
struct Watched {
    stat: Claimed,
    syscall: Claimed,
    wchan: Claimed,
    /// Whether its `wchan` names where it sleeps (the kernel can name
    /// its functions), learned at its first wait.
    wchan_names_waits: bool,
}

impl Watched {
    fn open(pid: i32) -> std::io::Result<Watched> {
        let open = |name: &str| -> std::io::Result<Claimed> {
            let file = std::fs::File::open(format!("/proc/{pid}/{name}"))?;
            Ok(Claimed::new(file.into()))
        };
        Ok(Watched {
            stat: open("stat")?,
            syscall: open("syscall")?,
            wchan: open("wchan")?,
            wchan_names_waits: false,
        })
    }

    /// Whether it is asleep, off every run queue. Asked before its system
    /// call: reading `syscall` of one that is falling asleep but was
    /// preempted on its way (as a zygote its word woke can do) sleeps a
    /// whole tick in the kernel (`wait_task_inactive`); `wchan` never waits.
    fn asleep(&self) -> std::io::Result<bool> {
        Ok(read_from_start(&self.wchan)?.trim() != "0")
    }

    /// Its threads, and its system call now.
    fn read(&self) -> std::io::Result<(usize, String)> {
        let stat = read_from_start(&self.stat)?;
        // After the name's closing parenthesis: state (field 3) on;
        // num_threads is field 20.
        let threads = stat
            .rsplit_once(')')
            .and_then(|(_, fields)| fields.split_whitespace().nth(17))
            .and_then(|threads| threads.parse().ok())
            .unwrap_or(0);
        Ok((threads, read_from_start(&self.syscall)?))
    }
}

/// A `/proc` file read whole from its start (where it is made anew).
fn read_from_start(file: &Claimed) -> std::io::Result<String> {
    let mut bytes = Vec::with_capacity(1024);
    crate::reset::pinned::read_whole(file.as_raw_fd(), &mut bytes)?;
    Ok(String::from_utf8_lossy(&bytes).into_owned())
}

/// Idle residents a node may have beside its calls in flight, each being
/// put back while the others serve: where none of a node's idle ones has
/// said its word, a call waits for one only with more idle than this, and
/// else gets one more, forked (the put-back runs beside the next call, not
/// before it). (Two measured ~5% on trivial calls back to back through
/// `worker`: what a call shares is the put-back's CPU, not the wait for it.)
/// Only where a CPU is free ([`Residents::spares`]).
const SPARE_RESIDENTS: usize = 1;
/// How long [`Resident::put_back`] looks at a resident on its way to its
/// wait turn after turn before it sleeps between looks.
const SPIN_FOR: std::time::Duration = std::time::Duration::from_micros(50);
/// How long the zygote lets a resident on its way to its wait run before
/// it looks again: it sleeps meanwhile, so as not to hold the CPU the
/// resident needs to get there.
pub const LOOK_AGAIN_AFTER: std::time::Duration = std::time::Duration::from_micros(20);
/// How long a resident has to put itself back after a call.
const PUT_BACK_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);
/// How long one may stay blocked outside its wait after its word: between
/// the word and the wait it makes no system call that blocks.
const BLOCKED_ELSEWHERE_WITHIN: std::time::Duration = std::time::Duration::from_millis(250);
/// A reset resident's word: put back, waiting for its next call ...
const READY: &str = "ready";
const READY_LINE: &[u8] = b"ready\n";
/// ... after a call that ran its pools' threads (ended since) ...
const READY_THREADED: &str = "ready, its pools' threads ended";
const READY_THREADED_LINE: &[u8] = b"ready, its pools' threads ended\n";
/// ... or not, and why.
const RETIRED: &str = "retired: ";

/// In a resident child: serves `first`, then every assignment that comes
/// down `control` after it, until the zygote closes it.
pub(super) fn serve_in_turn(
    py: Python<'_>,
    first: Assignment,
    function: Function<'_>,
    control: OwnedFd,
    reply_fd: RawFd,
    logs: &LogBuffer,
) -> ! {
    // SAFETY: the control socket, whose fd this process holds alone.
    let control =
        unsafe { OwnedFd::from_raw_fd(crate::fds::out_of_the_way(control.into_raw_fd())) };
    if RESET.load(std::sync::atomic::Ordering::Relaxed) {
        serve_resetting(py, first, function, control, reply_fd, logs)
    }
    let mut call = first;
    super::channel::open(reply_fd, &call.call_id);
    // Resolved once: a node loaded here keeps its module between calls.
    let function = match function {
        Function::Loaded(function) => {
            super::node::enter(py, &call.key, &call.digest);
            function.bind(py).clone()
        }
        Function::LoadHere { quiet } => {
            match child::resolve(py, &call, Function::LoadHere { quiet }, logs) {
                Ok(loaded) => loaded,
                Err(error) => {
                    // As a fresh child would: the load's error is the reply.
                    answer(py, &call, Err(error));
                    crate::process::exit_now(0)
                }
            }
        }
    };
    let mut first_call = true;
    let mut unflushed = Unflushed::default();
    loop {
        if !first_call {
            // The last call's logs went out with its reply; this one's
            // start empty.
            logs.clear();
            super::channel::open(reply_fd, &call.call_id);
        }
        first_call = false;
        let outcome = child::apply_env(py, &call.env, true)
            .and_then(|()| child::invoke(py, &call, &function))
            .map(Some);
        answer(py, &call, outcome);
        unflushed.calls += 1;
        unflushed.since.get_or_insert_with(std::time::Instant::now);
        if unflushed.due() || !next_call_within(control.as_raw_fd(), FLUSH_WHEN_IDLE_FOR) {
            fluksio_embed::finish::between_calls(py);
            unflushed = Unflushed::default();
        }
        call = match assignment::next_assignment(control.as_raw_fd()) {
            Some(call) => call,
            // Retired: what `python3` writes out at exit, then gone.
            None => {
                fluksio_embed::finish::at_end(py, fluksio_embed::finish::Ending::Exit);
                crate::process::exit_now(0)
            }
        };
    }
}

/// In a resident child under `--isolation reset`: sets the node up for
/// `set_up` (which holds no call), takes the snapshot, then serves every
/// assignment that comes down `control`, put back after each.
fn serve_resetting(
    py: Python<'_>,
    mut set_up: Assignment,
    function: Function<'_>,
    control: OwnedFd,
    reply_fd: RawFd,
    logs: &LogBuffer,
) -> ! {
    let function = match function {
        Function::Loaded(function) => {
            super::node::enter(py, &set_up.key, &set_up.digest);
            function.bind(py).clone()
        }
        Function::LoadHere { quiet } => {
            match child::resolve(py, &set_up, Function::LoadHere { quiet }, logs) {
                Ok(loaded) => loaded,
                Err(error) => {
                    // Its first call is answered with the load's error, as
                    // a fresh child's would be.
                    let mut space = crate::link::ReceiveSpace::new();
                    let Some((call, pipe)) = assignment::next_call(control.as_raw_fd(), &mut space)
                    else {
                        crate::process::exit_now(0)
                    };
                    if let Some(pipe) = pipe {
                        let _ = ReplyFd::new(reply_fd).map(|reply| reply.take(pipe));
                    }
                    super::channel::open(reply_fd, &call.call_id);
                    answer(py, &call, Err(error));
                    crate::process::exit_now(0)
                }
            }
        }
    };
    // Its env is the runtime's thread variables, no call's.
    let preset = child::PresetEnv::set(py, std::mem::take(&mut set_up.env));
    drop(set_up);
    // What its calls import is counted from here: the set-up's imports
    // are in the snapshot.
    super::learn::remember_modules(py);
    // Taken before the snapshot, so its fd is one the reset expects.
    let reply = match ReplyFd::new(reply_fd) {
        Ok(reply) => reply,
        Err(error) => {
            tell(&control, &format!("{RETIRED}its reply pipe: {error}"));
            crate::process::exit_now(0)
        }
    };
    // Made before the snapshot, so it is in it: between its word and its
    // wait a resident allocates nothing and faults nothing in (its pages
    // were just put back), and the zygote, told, finds it waiting.
    let mut space = crate::link::ReceiveSpace::new();
    let reset = crate::reset::Reset::take(super::threads::end_pools);
    match &reset {
        Ok(reset) => {
            // What the zygote's frames left below this one, deeper than it
            // zeroed before the fork, is no call's to read.
            if let Some(stack) = reset.stack_start() {
                crate::reset::wipe_stack_below(stack);
            }
            say_ready(&control, false)
        }
        // Its first call is served as a fresh child's, then it is gone.
        Err(why) => tell(
            &control,
            &format!("{RETIRED}no snapshot could be taken: {why}"),
        ),
    }
    let mut first_call = true;
    loop {
        // Every wait the same, in the same frame: the zygote tells this
        // wait from any other by its stack address. An optimiser that
        // peeled the first turn of this loop would move it.
        let Some((call, pipe)) =
            std::hint::black_box(wait_for_call)(control.as_raw_fd(), &mut space)
        else {
            fluksio_embed::finish::at_end(py, fluksio_embed::finish::Ending::Exit);
            crate::process::exit_now(0)
        };
        if !first_call {
            logs.clear();
        }
        serve_one(py, call, pipe, &function, &reply, &preset, logs);
        first_call = false;
        // The reply woke its reader on this CPU, or found it queued here
        // (the call's hand-off, a sync wake-up, put this child on the
        // zygote's CPU): the put-back would keep it off the CPU for as long
        // as it takes. Let it run first.
        // SAFETY: sched_yield has no preconditions.
        unsafe { libc::sched_yield() };
        let Ok(reset) = &reset else {
            crate::process::exit_now(0)
        };
        let after = match reset.after_call(super::threads::end_pools) {
            Ok(after) => after,
            Err(why) => {
                tell(&control, &format!("{RETIRED}{why}"));
                crate::process::exit_now(0)
            }
        };
        if let Some(stack) = reset.stack_start() {
            crate::reset::wipe_stack_below(stack);
        }
        // Last before the wait: the zygote, told, finds it there at once.
        say_ready(&control, after.ended_threads);
    }
}

/// Where a reset resident waits for its next call (and the only place).
#[inline(never)]
fn wait_for_call(
    control: RawFd,
    space: &mut crate::link::ReceiveSpace,
) -> Option<(Assignment, Option<OwnedFd>)> {
    assignment::next_call(control, space)
}

/// One call of a reset resident, everything it made dropped on return.
/// Its lines go down `pipe` where it came with one (its owner reads them),
/// else down the child's own pipe, which the zygote reads.
#[inline(never)]
fn serve_one(
    py: Python<'_>,
    call: Assignment,
    pipe: Option<OwnedFd>,
    function: &Bound<'_, PyAny>,
    reply: &ReplyFd,
    preset: &child::PresetEnv,
    logs: &LogBuffer,
) {
    let own_pipe = pipe.is_some();
    if let Some(pipe) = pipe {
        reply.take(pipe);
    }
    super::channel::open(reply.fd, &call.call_id);
    let outcome = preset
        .apply(py, &call.env)
        .and_then(|()| child::invoke(py, &call, function))
        .map(Some);
    // Before the reply, as a fresh child's: the zygote learns what every
    // call would import again after its put-back.
    super::learn::report(py, logs);
    answer(py, &call, outcome);
    // What the call left open in files is written out before its memory
    // goes (the files' fds then retire the resident).
    fluksio_embed::finish::between_calls(py);
    if own_pipe {
        // Its owner reads to the end of it once the call's processes are
        // gone too; the fds are again what the reset compares.
        reply.put_back();
    }
}

/// The fd a resident's lines go down, as it was forked with it: a call
/// that brings a pipe of its own (a link's) has it there for the call, and
/// the child's own is put back after it.
struct ReplyFd {
    fd: RawFd,
    own: OwnedFd,
    /// Its `FD_CLOEXEC`, which `dup2` does not carry and the reset compares.
    cloexec: bool,
}

impl ReplyFd {
    fn new(fd: RawFd) -> std::io::Result<ReplyFd> {
        // SAFETY: `fd` is this child's reply pipe, open for its life.
        let borrowed = unsafe { std::os::fd::BorrowedFd::borrow_raw(fd) };
        let flags = nix::fcntl::fcntl(borrowed, nix::fcntl::FcntlArg::F_GETFD)?;
        // Kept next to it, above the fds a node's own code gets first (a
        // test that wants two consecutive fds finds them where it would in
        // a fresh child).
        let own = nix::fcntl::fcntl(borrowed, nix::fcntl::FcntlArg::F_DUPFD_CLOEXEC(fd + 1))?;
        Ok(ReplyFd {
            fd,
            // SAFETY: the kernel just returned this fd to us.
            own: unsafe { OwnedFd::from_raw_fd(own) },
            cloexec: flags & libc::FD_CLOEXEC != 0,
        })
    }

    /// The call's `pipe` in the reply fd's place.
    fn take(&self, pipe: OwnedFd) {
        self.install(pipe.as_raw_fd());
    }

    /// The child's own pipe back in its place (the call's is closed).
    fn put_back(&self) {
        self.install(self.own.as_raw_fd());
    }

    fn install(&self, from: RawFd) {
        // SAFETY: both are this child's open fds; dup2 replaces `self.fd`,
        // which nothing else holds.
        unsafe {
            libc::dup2(from, self.fd);
            libc::fcntl(
                self.fd,
                libc::F_SETFD,
                if self.cloexec { libc::FD_CLOEXEC } else { 0 },
            );
        }
    }
}

/// [`READY`] (or [`READY_THREADED`]) to the zygote, with nothing
/// allocated: right before its wait.
fn say_ready(control: &OwnedFd, ended_threads: bool) {
    let line = if ended_threads {
        READY_THREADED_LINE
    } else {
        READY_LINE
    };
    let _ = super::channel::write_all(control.as_raw_fd(), line);
}

/// A word to the zygote on the control socket.
fn tell(control: &OwnedFd, word: &str) {
    let line = format!("{word}\n");
    let _ = super::channel::write_all(control.as_raw_fd(), line.as_bytes());
}

/// How long a retired resident has to write out what it holds and exit
/// (the flush's own deadline, and some).
pub const RETIRE_WITHIN: std::time::Duration = std::time::Duration::from_millis(1200);

/// A resident writes out its files and streams once it has waited this long
/// for its next call (calls back to back are not held up by it) ...
const FLUSH_WHEN_IDLE_FOR: std::time::Duration = std::time::Duration::from_millis(1);
/// ... or, busy, after this many calls ...
const FLUSH_EVERY_CALLS: u32 = 64;
/// ... or this long after the first call it has not flushed for.
const FLUSH_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// What a resident has served since it last flushed.
#[derive(Default)]
struct Unflushed {
    calls: u32,
    since: Option<std::time::Instant>,
}

impl Unflushed {
    fn due(&self) -> bool {
        self.calls >= FLUSH_EVERY_CALLS || self.since.is_some_and(|s| s.elapsed() >= FLUSH_EVERY)
    }
}

/// Whether the next assignment arrives on `control` within `wait`.
fn next_call_within(control: RawFd, wait: std::time::Duration) -> bool {
    use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
    // SAFETY: the control pipe's read end, open for this child's life.
    let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw(control) };
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    let timeout = PollTimeout::try_from(wait.as_millis() as u64).unwrap_or(PollTimeout::ZERO);
    matches!(poll(&mut fds, timeout), Ok(n) if n > 0)
}

/// Sends the reply for `outcome`; a `SystemExit` leaves as the interpreter
/// would, with no reply.
fn answer(py: Python<'_>, call: &Assignment, outcome: PyResult<Option<Bound<'_, PyAny>>>) {
    use fluksio_embed::finish::{Ending, at_end};
    if let Err(error) = &outcome
        && error.is_instance_of::<pyo3::exceptions::PySystemExit>(py)
    {
        at_end(py, Ending::Exit);
        crate::process::exit_now(super::reply::system_exit_code(py, error));
    }
    // Written out after each call; closed only when the child exits.
    at_end(py, Ending::Between);
    let reply = super::reply::encode_reply(py, call, outcome);
    let _ = super::channel::send_reply(py, &reply);
}
