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
    calls: u64,
    /// `--isolation reset`: where it blocks waiting for its next call,
    /// as `/proc/PID/syscall` shows it, learned before any call ran in it.
    /// `None` where it has none (its snapshot failed): it is retired at
    /// its next call.
    wait_point: Option<String>,
    /// Its `/proc/PID/stat` and `/proc/PID/syscall`, open: read each time
    /// it is put back (opening them costs more than reading).
    watched: Option<Watched>,
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
    /// A resident just forked for a call of node `key`'s source `digest`,
    /// which it was handed with its control pipe.
    pub(super) fn new(flight: Flight, control: Claimed, key: &NodeKey, digest: &str) -> Resident {
        Resident {
            flight,
            control,
            key: key.clone(),
            digest: digest.to_string(),
            calls: 0,
            wait_point: None,
            watched: None,
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
        self.wait_point = Some(self.blocked_waiting(None)?);
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

    /// `--isolation reset`: waits for its word after its last call, that
    /// it is put back (or why it could not be, and so exits), then checks
    /// it from outside: one thread, blocked where it waits for its next
    /// call. A call can write the word itself (it runs in the same
    /// process, with the same socket), so the word alone is not trusted:
    /// the next call's assignment goes only to a child that is at the
    /// runtime's own wait, where no node code can be running.
    fn put_back(&self) -> Result<(), String> {
        let Some(wait_point) = &self.wait_point else {
            return Err("it has no snapshot".into());
        };
        self.read_word()?;
        self.blocked_waiting(Some(wait_point))?;
        // At its wait nothing more is written for its last call: what
        // waits in its own pipe was written past that call's reply (or
        // down the pipe while a link's call had its own), and would be
        // read as the next call's lines.
        if self.flight.has_unread() {
            return Err("its last call wrote to its pipe past its reply".into());
        }
        Ok(())
    }

    /// Whether its word after its last call has come (or it hung up):
    /// taking it then waits for no put-back.
    fn said_its_word(&self) -> bool {
        use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
        let mut fds = [PollFd::new(self.control.as_fd(), PollFlags::POLLIN)];
        matches!(poll(&mut fds, PollTimeout::ZERO), Ok(n) if n > 0)
    }

    /// Reads its word from the control socket: `Ok` for "ready", the
    /// reason it gives (or that it exited) otherwise.
    fn read_word(&self) -> Result<(), String> {
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
        if word.lines().any(|line| line == READY) {
            Ok(())
        } else {
            Err("it exited".into())
        }
    }

    /// Waits (within [`PUT_BACK_WITHIN`]) until its one thread is blocked
    /// in a system call, at `expected` where given; the call as
    /// `/proc/PID/syscall` shows it (number, arguments, stack, code).
    fn blocked_waiting(&self, expected: Option<&String>) -> Result<String, String> {
        let watched = self
            .watched
            .as_ref()
            .ok_or("its state cannot be read (not open)")?;
        let started = std::time::Instant::now();
        // Since when it has been blocked somewhere else: a child on its way
        // to its wait is running, so one that stays blocked elsewhere (in a
        // call's own code) is not coming.
        let mut elsewhere_since = None;
        loop {
            let (threads, syscall) = watched
                .read()
                .map_err(|e| format!("its state cannot be read ({e})"))?;
            let syscall = wait_of(syscall.trim());
            // "running" on a CPU, "-1 …" stopped outside any system call
            // (preempted, faulting): on its way, either.
            let blocked = threads == 1
                && syscall != "running"
                && !syscall.starts_with("-1")
                && !syscall.is_empty();
            match expected {
                _ if !blocked => elsewhere_since = None,
                None => return Ok(syscall),
                Some(expected) if *expected == syscall => return Ok(syscall),
                Some(expected) => {
                    let since = *elsewhere_since.get_or_insert_with(std::time::Instant::now);
                    if since.elapsed() > BLOCKED_ELSEWHERE_WITHIN {
                        return Err(format!(
                            "blocked outside its wait for a call ({syscall}; it waits at {expected})"
                        ));
                    }
                }
            }
            let waited = started.elapsed();
            if waited > PUT_BACK_WITHIN {
                return Err(format!(
                    "not at its wait for a call within {PUT_BACK_WITHIN:?} ({threads} threads, {syscall})"
                ));
            }
            // It writes its word right before it waits: the first turns
            // give it the CPU back at once; a slow one is slept on.
            if waited < SPIN_FOR {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
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
        }
    }

    /// `--isolation reset`.
    pub(super) fn reset(&self) -> bool {
        self.reset
    }

    /// An idle resident of node `key` for a call of source `digest`, taken
    /// out until its call is served; those of another source are retired
    /// (their flights to `land`).
    pub(super) fn take(
        &mut self,
        key: &NodeKey,
        digest: &str,
        mut land: impl FnMut(Flight),
    ) -> Option<Resident> {
        let idle = self.idle.get_mut(key)?;
        if idle.iter().any(|resident| resident.digest != digest) {
            self.retire(key, &mut land);
            return None;
        }
        loop {
            let resident = if self.reset {
                // One already put back first (`waits_for_put_back`).
                match idle.iter().position(Resident::said_its_word) {
                    Some(at) => idle.swap_remove(at),
                    None if !waits_for_put_back(idle, digest) => return None,
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
                            self.retire(key, &mut land);
                            return None;
                        }
                    },
                }
            } else {
                idle.pop()?
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
            match resident.put_back() {
                Ok(()) => return Some(resident),
                Err(why) => {
                    tracing::info!(
                        pid = resident.flight.pid.as_raw(),
                        "a resident could not be put back after its call ({why}); \
                         the next call gets a fresh fork"
                    );
                    crate::metrics::reset_retired();
                    resident.retire(&mut land);
                }
            }
        }
    }

    /// `--isolation reset`: the control sockets of node `key`'s idle
    /// residents where [`Residents::take`] would wait for one of them to be
    /// put back (two or more, all still being put back), each readable
    /// once its resident is; empty where it would not wait. A caller with
    /// more to do than wait (a sweep reading its other calls) polls these
    /// and takes one once it is ready.
    pub(super) fn being_put_back(&self, key: &NodeKey, digest: &str) -> Vec<BorrowedFd<'_>> {
        let Some(idle) = self.idle.get(key).filter(|_| self.reset) else {
            return Vec::new();
        };
        if !waits_for_put_back(idle, digest) {
            return Vec::new();
        }
        idle.iter()
            .map(|resident| resident.control.as_fd())
            .collect()
    }

    /// Puts back a resident that has replied to one more call; retired
    /// (its flight to `land`) once it has served its last.
    pub(super) fn keep(&mut self, mut resident: Resident, mut land: impl FnMut(Flight)) {
        resident.calls += 1;
        if self.max_calls.is_some_and(|max| resident.calls >= max) {
            resident.retire(&mut land);
        } else {
            let key = resident.key.clone();
            self.idle.entry(key).or_default().push(resident);
        }
    }

    /// Ends a node's idle residents.
    pub(super) fn retire(&mut self, key: &NodeKey, land: &mut impl FnMut(Flight)) {
        for resident in self.idle.remove(key).unwrap_or_default() {
            resident.retire(land);
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

/// Whether taking one of `idle` for a call of source `digest` waits for
/// a put-back: two or more, all of that source, none put back yet. (With
/// one, the call gets a second resident instead, forked by the caller:
/// the put-back runs beside the next call, not before it. So a node has at
/// most one more than it has calls in flight.)
fn waits_for_put_back(idle: &[Resident], digest: &str) -> bool {
    idle.len() > 1
        && idle.iter().all(|resident| resident.digest == digest)
        && !idle.iter().any(Resident::said_its_word)
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

/// A resident's `/proc/PID/stat` and `/proc/PID/syscall`, open in the
/// zygote (claimed: no child it forks keeps them).
struct Watched {
    stat: Claimed,
    syscall: Claimed,
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
        })
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

/// How long the zygote yields to a resident on its way to its wait before
/// it sleeps between looks.
const SPIN_FOR: std::time::Duration = std::time::Duration::from_micros(200);
/// How long a resident has to put itself back after a call.
const PUT_BACK_WITHIN: std::time::Duration = std::time::Duration::from_secs(10);
/// How long one may stay blocked outside its wait after its word: between
/// the word and the wait it makes no system call that blocks.
const BLOCKED_ELSEWHERE_WITHIN: std::time::Duration = std::time::Duration::from_millis(250);
/// A reset resident's word: put back, waiting for its next call ...
const READY: &str = "ready";
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
    set_up: Assignment,
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
                    let Some((call, pipe)) = assignment::next_call(control.as_raw_fd()) else {
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
    drop(set_up);
    // Taken before the snapshot, so its fd is one the reset expects.
    let reply = match ReplyFd::new(reply_fd) {
        Ok(reply) => reply,
        Err(error) => {
            tell(&control, &format!("{RETIRED}its reply pipe: {error}"));
            crate::process::exit_now(0)
        }
    };
    let reset = crate::reset::Reset::take();
    match &reset {
        Ok(_) => tell(&control, READY),
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
        let Some((call, pipe)) = std::hint::black_box(wait_for_call)(control.as_raw_fd()) else {
            fluksio_embed::finish::at_end(py, fluksio_embed::finish::Ending::Exit);
            crate::process::exit_now(0)
        };
        serve_one(py, call, pipe, &function, &reply, logs, first_call);
        first_call = false;
        let Ok(reset) = &reset else {
            crate::process::exit_now(0)
        };
        if let Err(why) = reset.after_call() {
            tell(&control, &format!("{RETIRED}{why}"));
            crate::process::exit_now(0)
        }
        if let Some(stack) = reset.stack_start() {
            crate::reset::wipe_stack_below(stack);
        }
        // Last before the wait: the zygote, told, finds it there at once.
        tell(&control, READY);
    }
}

/// Where a reset resident waits for its next call (and the only place).
#[inline(never)]
fn wait_for_call(control: RawFd) -> Option<(Assignment, Option<OwnedFd>)> {
    assignment::next_call(control)
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
    logs: &LogBuffer,
    first_call: bool,
) {
    if !first_call {
        logs.clear();
    }
    let own_pipe = pipe.is_some();
    if let Some(pipe) = pipe {
        reply.take(pipe);
    }
    super::channel::open(reply.fd, &call.call_id);
    let outcome = child::apply_env(py, &call.env, false)
        .and_then(|()| child::invoke(py, &call, function))
        .map(Some);
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
