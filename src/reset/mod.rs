//! `--isolation reset`: a resident child put back, after each call, to the
//! memory it had when it first waited for one.
//!
//! A fresh child per call pays for copy-on-write on every call; a resident
//! (`--isolation node`) is fast but keeps what each call leaves behind.
//! Here a resident takes a [`memory::Snapshot`] where it waits for its
//! first call, after its set-up, and after each call:
//! 1. ends every process the call started ([`end_what_the_call_started`]);
//! 2. puts back every page the call wrote, unmaps what it mapped, returns
//!    the heap's break ([`memory::Snapshot::restore`]);
//! 3. compares what memory cannot hold with what it was ([`state::State`]):
//!    fds and their offsets, threads, child processes, signals, cwd, umask,
//!    limits, credentials, timers, the kernel's copy of the environment.
//!
//! Any change it cannot put back retires the resident: the zygote forks a
//! fresh one, as safe as `--isolation call`, and says why.

pub mod maps;
pub mod memory;
pub mod state;

use std::time::Duration;

use memory::{Restored, Snapshot};
use state::State;

/// A resident's snapshot, and what the rest of the process was then.
pub struct Reset {
    snapshot: Snapshot,
    baseline: State,
}

impl Reset {
    /// Takes the snapshot, here and now: nothing of a call may be in this
    /// process's memory. One thread only.
    pub fn take() -> Result<Reset, String> {
        if threads() != 1 {
            return Err("the process runs more than one thread".into());
        }
        state::open_proc_self();
        let mut snapshot = Snapshot::prepare().map_err(|e| e.to_string())?;
        let baseline = State::read();
        snapshot.take().map_err(|e| e.to_string())?;
        Ok(Reset { snapshot, baseline })
    }

    /// Bytes the snapshot holds.
    pub fn size(&self) -> usize {
        self.snapshot.size()
    }

    /// Where the stack starts, for [`wipe_stack_below`].
    pub fn stack_start(&self) -> Option<usize> {
        self.snapshot.stack_start()
    }

    /// After a call has replied: what it started ended, its memory put
    /// back, the rest compared. `Err`: why this process can serve no more
    /// calls (its memory may be the call's).
    pub fn after_call(&self) -> Result<Restored, String> {
        end_what_the_call_started()?;
        if threads() != 1 {
            return Err("a thread the call started is still running".into());
        }
        let restored = self.snapshot.restore().map_err(|e| e.to_string())?;
        match State::read().changed_from(&self.baseline) {
            Some(change) => Err(change),
            None => Ok(restored),
        }
    }
}

fn threads() -> usize {
    std::fs::read_dir("/proc/self/task").map_or(0, |tasks| tasks.count())
}

/// How long the processes a call left are given to go.
const ENDING_WITHIN: Duration = Duration::from_secs(5);

/// Kills every process the call started and reaps what is this process's:
/// its descendants (a daemon that left its session comes back to this
/// subreaper), and whoever else is in its cell's cgroup.
fn end_what_the_call_started() -> Result<(), String> {
    let me = std::process::id() as i32;
    let started = std::time::Instant::now();
    loop {
        reap_all();
        let mut others = descendants(me);
        others.extend(cell_members(me));
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

fn reap_all() {
    loop {
        // SAFETY: waitpid on any child of ours, without blocking.
        let pid = unsafe { libc::waitpid(-1, std::ptr::null_mut(), libc::WNOHANG) };
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

/// The other processes in this process's cell, where cells are cgroups.
fn cell_members(me: i32) -> Vec<i32> {
    if crate::containment::mechanism() != crate::containment::Mechanism::Cgroup {
        return Vec::new();
    }
    let cgroup = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let Some(path) = cgroup.lines().find_map(|l| l.strip_prefix("0::")) else {
        return Vec::new();
    };
    std::fs::read_to_string(format!("/sys/fs/cgroup{path}/cgroup.procs"))
        .unwrap_or_default()
        .split_whitespace()
        .filter_map(|p| p.parse().ok())
        .filter(|&p| p != me)
        .collect()
}

/// Wipes the stack below the caller's frame: what the call's deeper frames
/// left there. The stretch right below is written over, the pages below
/// that dropped, down to `stack`, where the stack's mapping starts.
#[inline(never)]
pub fn wipe_stack_below(stack: usize) {
    burn();
    let here = std::hint::black_box(0u8);
    let here = std::ptr::addr_of!(here) as usize;
    // Below everything `burn`'s frame wrote over.
    let floor = here.saturating_sub(BURNT + 8192) & !4095;
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

/// Bytes of stack [`burn`] writes over.
const BURNT: usize = 64 * 1024;

/// Writes zeros over `BURNT` bytes of stack right below its caller.
#[inline(never)]
fn burn() {
    let mut burnt = [0u8; BURNT];
    for byte in burnt.iter_mut() {
        // SAFETY: a write to a local; volatile, so it is kept.
        unsafe { std::ptr::write_volatile(byte, 0) };
    }
    std::hint::black_box(&burnt);
}
