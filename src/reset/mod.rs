//! `--isolation reset`: a resident child put back, after each call, to the
//! memory it had when it first waited for one.
//!
//! A fresh child per call pays for copy-on-write on every call; a resident
//! (`--isolation node`) is fast but keeps what each call leaves behind.
//! Here a resident takes a [`memory::Snapshot`] where it waits for its
//! first call, after its set-up, and after each call, signals held:
//! 1. ends every process the call started ([`end_what_the_call_started`]),
//!    and the threads of the numeric libraries' pools it woke;
//! 2. puts back every page the call wrote, unmaps what it mapped, returns
//!    the heap's break ([`memory::Snapshot::restore`]), then the signal
//!    dispositions ([`settings::Settings::put_back_signals`]), the
//!    floating-point environment (rounding, exception flags) and memory
//!    locks (before all else, any syscall user dispatch is turned off and
//!    the restartable-sequences registration set back);
//! 3. compares what memory cannot hold with what it was ([`state::State`]):
//!    fds and their offsets, threads, child processes, signals, cwd, umask,
//!    limits, credentials, keyrings, timers, prctl's settings, the
//!    kernel's copy of the environment; where anything changed, sets back
//!    what it can ([`settings::Settings`]: cwd, umask, limits, timers...)
//!    and compares again.
//!
//! Any change it cannot put back retires the resident: the zygote forks a
//! fresh one, as safe as `--isolation call`, and says why.

pub mod heap;
pub mod maps;
pub mod memory;
pub mod pinned;
pub mod read_only;
pub mod settings;
pub mod state;

use std::time::Duration;

use memory::{Restored, Snapshot};
use pinned::{Pinned, ProcSelf};
use settings::Settings;
use state::State;

/// A resident's snapshot, and what the rest of the process was then.
pub struct Reset {
    snapshot: Snapshot,
    baseline: State,
    /// What of `baseline` is set back after each call rather than only
    /// compared.
    settings: Box<Settings>,
    proc: ProcSelf,
    /// Its cell's `cgroup.procs`, where cells are cgroups.
    cell: Option<Pinned>,
}

impl Reset {
    /// Takes the snapshot, here and now: nothing of a call may be in this
    /// process's memory. One thread only: `end_pools` asks the pools that
    /// run more to end theirs (true where it asked any).
    pub fn take(end_pools: impl FnOnce() -> bool) -> Result<Reset, String> {
        let proc = ProcSelf::open().map_err(|e| format!("opening /proc/self: {e}"))?;
        if one_thread(&proc, end_pools).is_none() {
            return Err("the process runs more than one thread".into());
        }
        let cell = open_cell().map_err(|e| format!("opening its cell's cgroup.procs: {e}"))?;
        heap::make_room();
        let snapshot = Snapshot::prepare().map_err(|e| e.to_string())?;
        let mut reset = Reset {
            baseline: State::default(),
            settings: Settings::read()?,
            snapshot,
            proc,
            cell,
        };
        reset.baseline = reset.state();
        reset.snapshot.take().map_err(|e| e.to_string())?;
        Ok(reset)
    }

    /// Bytes the snapshot holds.
    pub fn size(&self) -> usize {
        self.snapshot.size()
    }

    /// Where the stack starts, for [`wipe_stack_below`].
    pub fn stack_start(&self) -> Option<usize> {
        self.snapshot.stack_start()
    }

    /// After a call has replied: what it started ended (`end_pools` ends
    /// the threads of the pools it woke), its memory put back, the rest
    /// compared. `Err`: why this process can serve no more calls (its
    /// memory may be the call's).
    pub fn after_call(&self, end_pools: impl FnOnce() -> bool) -> Result<AfterCall, String> {
        settings::end_syscall_dispatch();
        // Until the dispositions are the snapshot's again, no signal runs a
        // handler of the call's (in memory put back, or on its stack).
        settings::hold_signals();
        self.end_what_the_call_started()?;
        let Some(ended_threads) = one_thread(&self.proc, end_pools) else {
            return Err("a thread the call started is still running".into());
        };
        // Before memory is put back: a restartable-sequences area of the
        // call's own, still registered, is where the kernel writes the CPU
        // and reads a critical section from, and the restore would put
        // back what was there before (a kill, at the next preemption). And
        // a call's `mlockall(MCL_FUTURE)` would lock every region the
        // restore maps again (past `RLIMIT_MEMLOCK`, refuse it).
        self.settings.put_back_rseq()?;
        self.settings.put_back_memory_locks();
        let restored = self.snapshot.restore().map_err(|e| e.to_string())?;
        self.settings.put_back_signals()?;
        self.settings.put_back_floating_point();
        let mut state = self.state();
        if state != self.baseline {
            self.settings.put_back();
            state = self.state();
        }
        match state.changed_from(&self.baseline) {
            Some(change) => Err(change),
            None => Ok(AfterCall {
                restored,
                ended_threads,
            }),
        }
    }

    /// The state now, every fd this keeps open among it.
    fn state(&self) -> State {
        let mut kept: Vec<&Pinned> = self.proc.all().to_vec();
        kept.extend(self.snapshot.kept());
        kept.extend(&self.cell);
        kept.extend(self.settings.kept());
        State::read(&self.proc, &kept)
    }

    /// Kills every process the call started and reaps what is this
    /// process's: its descendants (a daemon that left its session comes
    /// back to this subreaper), and whoever else is in its cell's cgroup.
    fn end_what_the_call_started(&self) -> Result<(), String> {
        let me = std::process::id() as i32;
        let started = std::time::Instant::now();
        loop {
            reap_all();
            // Most calls start none: one system call says so.
            let mut others = if has_children() {
                descendants(me)
            } else {
                Vec::new()
            };
            others.extend(self.cell_members(me)?);
            if others.is_empty() {
                return Ok(());
            }
            if started.elapsed() > ENDING_WITHIN {
                return Err(format!(
                    "processes the call started did not end: {others:?}"
                ));
            }
            for pid in others {
                // SAFETY: kill with a pid read from /proc: one of ours.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// The other processes in this process's cell, where cells are cgroups.
    fn cell_members(&self, me: i32) -> Result<Vec<i32>, String> {
        let Some(procs) = &self.cell else {
            return Ok(Vec::new());
        };
        let mut text = Vec::with_capacity(64);
        procs
            .read_all(&mut text)
            .map_err(|e| format!("its cell's members cannot be read: {e}"))?;
        let others: Vec<i32> = String::from_utf8_lossy(&text)
            .split_whitespace()
            .filter_map(|p| p.parse().ok())
            .filter(|&p| p != me)
            .collect();
        Ok(others)
    }
}

/// What a put-back after a call did.
pub struct AfterCall {
    pub restored: Restored,
    /// The call ran threads of its pools, ended since: it had more than
    /// one CPU's work.
    pub ended_threads: bool,
}

/// Whether this process runs one thread, once `end_pools` has asked the
/// pools of any others to end theirs: `Some(true)` where it had to. A
/// pool's threads, asked, end at once but leave `/proc` a moment later;
/// any other thread is the call's, and retires the resident (`None`):
/// once none has left for a while, none is waited for longer.
fn one_thread(proc: &ProcSelf, end_pools: impl FnOnce() -> bool) -> Option<bool> {
    let mut left = threads(proc)?;
    if left == 1 {
        return Some(false);
    }
    if !end_pools() {
        return None;
    }
    let asked = std::time::Instant::now();
    let mut last_left = asked;
    loop {
        match threads(proc)? {
            1 => return Some(true),
            now if now < left => (left, last_left) = (now, std::time::Instant::now()),
            _ if last_left.elapsed() > POOLS_ENDING_WITHIN / 5
                || asked.elapsed() > POOLS_ENDING_WITHIN =>
            {
                return None;
            }
            _ => {}
        }
        std::thread::sleep(Duration::from_micros(100));
    }
}

/// How long the threads of pools asked to end are given to leave (a
/// fifth of it with none leaving).
const POOLS_ENDING_WITHIN: Duration = Duration::from_millis(50);

/// Threads of this process, as `proc` lists them (`None`: unreadable).
fn threads(proc: &ProcSelf) -> Option<usize> {
    let mut names = Vec::with_capacity(64);
    pinned::list(&proc.tasks, &mut names).ok()?;
    Some(names.iter().filter(|&&b| b == 0).count())
}

/// How long the processes a call left are given to go.
const ENDING_WITHIN: Duration = Duration::from_secs(5);

/// Whether this process has a child, a zombie or one in another thread's
/// care included: `waitid` with `__WALL` looks at every one.
fn has_children() -> bool {
    // SAFETY: waitid into a zeroed siginfo; WNOWAIT leaves any child as
    // it is.
    unsafe {
        let mut info: libc::siginfo_t = std::mem::zeroed();
        let found = libc::waitid(
            libc::P_ALL,
            0,
            &mut info,
            libc::WEXITED | libc::WNOHANG | libc::WNOWAIT | libc::__WALL,
        );
        !(found < 0 && *libc::__errno_location() == libc::ECHILD)
    }
}

fn reap_all() {
    loop {
        // SAFETY: waitpid on any child of ours, without blocking.
        let pid = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG | libc::__WALL) };
        if pid <= 0 {
            return;
        }
    }
}

/// Every live process below `pid`.
fn descendants(pid: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut queue = vec![pid];
    while let Some(parent) = queue.pop() {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{parent}/task")) else {
            continue;
        };
        for task in tasks.flatten() {
            let children =
                std::fs::read_to_string(task.path().join("children")).unwrap_or_default();
            for child in children.split_whitespace().filter_map(|c| c.parse().ok()) {
                found.push(child);
                queue.push(child);
            }
        }
    }
    found
}

/// This process's cell's `cgroup.procs`, open, where cells are cgroups
/// (found where the v2 hierarchy is mounted: `/sys/fs/cgroup/unified` on
/// a hybrid host).
fn open_cell() -> std::io::Result<Option<Pinned>> {
    if crate::containment::mechanism() != crate::containment::Mechanism::Cgroup {
        return Ok(None);
    }
    let Some(cell) = crate::containment::cgroup::unified() else {
        return Ok(None);
    };
    let procs = std::fs::File::open(cell.own.join("cgroup.procs"))?;
    let fd = std::os::fd::IntoRawFd::into_raw_fd(procs);
    let procs = Pinned::adopt(fd, "its cell's cgroup.procs")?;
    // Its own alone before any call: a cgroup shared with others (its
    // zygote's, had joining its cell failed) is no cell to empty.
    let mut members = Vec::new();
    procs.read_all(&mut members)?;
    let me = std::process::id().to_string();
    if String::from_utf8_lossy(&members)
        .split_whitespace()
        .any(|pid| pid != me)
    {
        return Ok(None);
    }
    Ok(Some(procs))
}

/// Wipes the stack below the caller's frame: what the call's deeper frames
/// left there. The stretch right below is written over, the pages below
/// that dropped, down to `stack`, where the stack's mapping starts.
#[inline(never)]
pub fn wipe_stack_below(stack: usize) {
    fluksio_embed::fork::zero_stack_below();
    let here = std::hint::black_box(0u8);
    let here = std::ptr::addr_of!(here) as usize;
    // Below everything the zeroing's frame wrote over.
    let floor = here.saturating_sub(fluksio_embed::fork::STACK_ZEROED + 8192) & !4095;
    if floor > stack {
        // SAFETY: pages of this thread's stack below every live frame.
        unsafe {
            libc::madvise(
                stack as *mut libc::c_void,
                floor - stack,
                libc::MADV_DONTNEED,
            )
        };
    }
}
