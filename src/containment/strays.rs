//! The session fallback's clean-up: orphans of calls, stopped and killed.
//!
//! Without cgroups a call's processes are found by ancestry. The zygote and
//! every call's child are child subreapers, so a process whose parent dies
//! comes back to the nearest of them rather than to init: to its call's
//! child while the call runs, and to the zygote once the call's child is
//! gone. A child of the zygote that the zygote did not fork itself and that
//! is not in the zygote's own session (a compiled node's module-level
//! `subprocess` is) is a stray: what a call left behind. Each stray's whole
//! tree is stopped first, repeatedly, until no process in it is left
//! running to fork another, and only then killed: a fork bomb cannot
//! outrun a walk of stopped processes.

use std::collections::{HashMap, HashSet};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Children this process forked itself and has not reaped: standbys and
/// calls.
static FORKED: Mutex<Option<HashSet<i32>>> = Mutex::new(None);

/// How long one clean-up may take before it gives up on a process (one in
/// uninterruptible sleep dies when it wakes, and is reaped later).
const DEADLINE: Duration = Duration::from_secs(2);

fn forked() -> std::sync::MutexGuard<'static, Option<HashSet<i32>>> {
    FORKED.lock().unwrap_or_else(|e| e.into_inner())
}

/// A child this process forked: not a stray.
pub fn remember(pid: i32) {
    forked().get_or_insert_with(HashSet::new).insert(pid);
}

/// A child this process reaped.
pub fn forget(pid: i32) {
    if let Some(set) = forked().as_mut() {
        set.remove(&pid);
    }
}

/// In a node's own zygote, just forked: its parent's children are not its.
pub fn forget_all() {
    *forked() = None;
}

/// Stops, kills and reaps every stray (see the module docs).
pub fn end_all() {
    let deadline = Instant::now() + DEADLINE;
    let own_session = session_of(std::process::id() as i32);
    loop {
        let known = forked().clone().unwrap_or_default();
        let strays: Vec<i32> = children_of(std::process::id() as i32)
            .into_iter()
            .filter(|pid| !known.contains(pid) && session_of(*pid) != own_session)
            .collect();
        if strays.is_empty() || Instant::now() > deadline {
            return;
        }
        let tree = stop_trees(&strays, deadline);
        for &pid in &tree {
            // SAFETY: kill(2); a stopped process dies of SIGKILL at once.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        for &pid in &strays {
            reap_by(pid, deadline);
        }
        tracing::debug!(
            strays = strays.len(),
            processes = tree.len(),
            "killed what ended calls left behind"
        );
    }
}

/// SIGSTOPs every process under `roots` (and the roots), walking again
/// until a walk finds none it had not stopped.
fn stop_trees(roots: &[i32], deadline: Instant) -> Vec<i32> {
    let mut stopped: HashSet<i32> = HashSet::new();
    loop {
        let parents = parent_map();
        let mut found = Vec::new();
        let mut frontier: Vec<i32> = roots.to_vec();
        while let Some(pid) = frontier.pop() {
            if !stopped.contains(&pid) {
                found.push(pid);
            }
            if let Some(children) = parents.get(&pid) {
                frontier.extend(children.iter().copied());
            }
        }
        if found.is_empty() || Instant::now() > deadline {
            return stopped.into_iter().collect();
        }
        for pid in found {
            // SAFETY: kill(2) of a process found under a stray.
            unsafe { libc::kill(pid, libc::SIGSTOP) };
            stopped.insert(pid);
        }
    }
}

/// Reaps `pid` (a zombie after SIGKILL), waiting at most until `deadline`.
fn reap_by(pid: i32, deadline: Instant) {
    loop {
        let mut status = 0;
        // SAFETY: waitpid with a live status pointer.
        let done = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if done != 0 || Instant::now() > deadline {
            return;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Children of `pid`, from `/proc/PID/task/*/children` where the kernel
/// has it, else from every process's parent.
fn children_of(pid: i32) -> Vec<i32> {
    let mut children = Vec::new();
    let mut listed = false;
    if let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for task in tasks.flatten() {
            if let Ok(text) = std::fs::read_to_string(task.path().join("children")) {
                listed = true;
                children.extend(
                    text.split_whitespace()
                        .filter_map(|p| p.parse::<i32>().ok()),
                );
            }
        }
    }
    if !listed {
        children = parent_map().remove(&pid).unwrap_or_default();
    }
    children
}

/// Every process's children, by parent, from `/proc/*/stat`.
fn parent_map() -> HashMap<i32, Vec<i32>> {
    let mut map: HashMap<i32, Vec<i32>> = HashMap::new();
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return map;
    };
    for entry in entries.flatten() {
        let Some(pid) = entry
            .file_name()
            .to_str()
            .and_then(|n| n.parse::<i32>().ok())
        else {
            continue;
        };
        if let Some(fields) = stat_fields(pid) {
            // Fields after the command: state, ppid, pgrp, session, …
            if let Some(ppid) = fields.get(1).and_then(|p| p.parse::<i32>().ok()) {
                map.entry(ppid).or_default().push(pid);
            }
        }
    }
    map
}

fn session_of(pid: i32) -> Option<i32> {
    stat_fields(pid)?.get(3)?.parse().ok()
}

/// The fields of `/proc/PID/stat` after the parenthesised command name,
/// which may itself hold spaces and parentheses.
fn stat_fields(pid: i32) -> Option<Vec<String>> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    Some(rest.split_whitespace().map(str::to_string).collect())
}
