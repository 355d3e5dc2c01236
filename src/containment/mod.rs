//! Containment: nothing a call starts outlives the call, and one call's
//! memory cannot take the runtime down.
//!
//! The issues this solves:
//! 1. A session is no container. A node that double-forks and calls
//!    `setsid()` (any classic daemon) leaves the call's session, and the
//!    `killpg` that ends the call misses it.
//! 2. A parent-death signal can be ignored, and when the zygote is
//!    SIGKILLed nothing of it runs to clean up.
//! 3. A node that eats memory must be the one the kernel stops, not the
//!    zygote or the agent beside it.
//!
//! So every call's child joins a *cell* before any node code runs:
//! - **cgroup** (where this process may make cgroups under its own, in the
//!   v2 hierarchy: root, or a systemd unit with `Delegate=yes`): the cell is
//!   a leaf cgroup. Ending the call writes its `cgroup.kill`, which ends
//!   every process in it at once, whatever session it made and however
//!   fast it forks. A [`warden`] process, in a session of its own, holds
//!   the read end of a pipe only this process writes to; when this process
//!   dies, however it dies, the warden kills the whole subtree.
//! - **session** (the fallback, or `FLUKSIO_CONTAINMENT=session`): each call
//!   leads its own session, is a child subreaper, and so is this process:
//!   orphans of a call come back here when it ends, and [`strays`] stops and
//!   kills them, fork bombs included. What it gives up: after a SIGKILL of
//!   the zygote, a process that left its call's session, or ignores the
//!   parent-death signal, is not killed (nothing of ours is left to).
//!
//! Memory (`--call-memory-limit`): a cell's `memory.max` (v2) where the
//! subtree can enable the memory controller, else its v1
//! `memory.limit_in_bytes` (hybrid hosts keep the controllers on v1), else
//! `RLIMIT_DATA` (allocations past it fail with `MemoryError`). Every call's
//! child also raises its `oom_score_adj` to the maximum, so a host-wide OOM
//! picks a call, never the zygote or the agent.

pub mod cgroup;
pub mod strays;
pub mod warden;

use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::Mutex;

use crate::fds::Claimed;
use cgroup::Version;

/// Forces a mechanism (`cgroup` or `session`); unset, cgroups where they
/// can be made.
pub const CONTAINMENT_ENV: &str = "FLUKSIO_CONTAINMENT";

/// What a process wants of its cells.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// Each call's memory limit, MiB.
    pub memory_limit_mib: Option<u64>,
}

/// How calls are contained, chosen once per process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mechanism {
    Cgroup,
    Session,
}

/// How a call's memory is limited.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryLimit {
    /// In the cell's own cgroup (v2), or in a v1 memory cgroup beside it.
    Cgroup(Version),
    /// `RLIMIT_DATA`: counts what is mapped writable, not what is touched.
    Rlimit,
}

/// Why containment cannot be what was asked for.
#[derive(Debug)]
pub struct ContainmentError(String);

impl std::fmt::Display for ContainmentError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ContainmentError {}

/// The cgroup directories of one cell, kept and reused across calls. A
/// cell at rest holds no fd: the zygote's fd count does not grow with the
/// cells it keeps.
#[derive(Debug)]
struct CellDirs {
    /// The v2 leaf: killed with `cgroup.kill`, and where a v2 memory limit is.
    leaf: PathBuf,
    /// A v1 memory cgroup beside it, when memory is limited on v1.
    memory_v1: Option<PathBuf>,
}

impl CellDirs {
    fn memory_dir(&self, limit: Option<MemoryLimit>) -> Option<(&PathBuf, Version)> {
        match limit? {
            MemoryLimit::Cgroup(Version::V2) => Some((&self.leaf, Version::V2)),
            MemoryLimit::Cgroup(Version::V1) => self.memory_v1.as_ref().map(|d| (d, Version::V1)),
            MemoryLimit::Rlimit => None,
        }
    }

    fn empty(&self) -> bool {
        !cgroup::populated(&self.leaf)
            && self
                .memory_v1
                .as_ref()
                .is_none_or(|dir| !cgroup::has_procs(dir))
    }

    /// `cgroup.kill`, when a process is left in the cell.
    fn kill(&self) {
        if cgroup::populated(&self.leaf) {
            let _ = cgroup::write(&self.leaf.join("cgroup.kill"), "1");
        }
    }

    /// The `cgroup.procs` files a child joins the cell through.
    fn open_joins(&self) -> std::io::Result<Joins> {
        Ok(Joins {
            procs: Claimed::new(cgroup::open_procs(&self.leaf)?),
            memory_procs: match &self.memory_v1 {
                Some(dir) => Some(Claimed::new(cgroup::open_procs(dir)?)),
                None => None,
            },
        })
    }
}

/// Open from a cell's handing out until its child is forked.
#[derive(Debug)]
struct Joins {
    procs: Claimed,
    memory_procs: Option<Claimed>,
}

/// This process's containment, once established.
struct State {
    mechanism: Mechanism,
    /// The v2 subtree every cell is made in (cgroup mechanism).
    tree: Option<PathBuf>,
    /// The v1 memory subtree, when memory is limited on v1.
    memory_tree: Option<PathBuf>,
    memory: Option<MemoryLimit>,
    limit_mib: Option<u64>,
    spare: Vec<CellDirs>,
    /// Cells given back with a process still in them: killed again, and
    /// reused once empty.
    draining: Vec<CellDirs>,
    next: u64,
    /// Whether orphans come back here to be ended and reaped (the zygote's
    /// role; an agent's children are its own zygote and services).
    reaps_strays: bool,
    /// The write end of the warden's pipe: closed only when this process
    /// ends (claimed, so no child holds it).
    _warden: Option<Claimed>,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> std::sync::MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whose cells these are.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// Forks calls, and ends what they leave behind.
    Zygote,
    /// Spawns services (and its zygote, which contains its own calls).
    Agent,
}

/// Chooses this process's mechanism and sets it up: its subtree and its
/// warden, or (for a zygote) its subreaper. Call once, early, while the
/// process has one thread.
pub fn establish(role: Role, options: &Options) -> Result<Mechanism, ContainmentError> {
    let forced = std::env::var(CONTAINMENT_ENV).ok();
    let wants_cgroup = match forced.as_deref() {
        None | Some("") | Some("auto") => None,
        Some("cgroup") => Some(true),
        Some("session") => Some(false),
        Some(other) => {
            return Err(ContainmentError(format!(
                "{CONTAINMENT_ENV}={other} is not a containment mechanism\nhint: use cgroup, \
                 session, or leave it unset to use cgroups where this process may make them"
            )));
        }
    };
    // Unique, not just the pid: a zygote that re-executes itself keeps its
    // pid, and its old warden removes the old subtree as the new one is made.
    let started = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let role_name = match role {
        Role::Zygote => "zygote",
        Role::Agent => "agent",
    };
    let name = format!("fluksio-{role_name}-{}-{started}", std::process::id());
    let tree = match wants_cgroup {
        Some(false) => None,
        _ => make_tree(&name),
    };
    if tree.is_none() && wants_cgroup == Some(true) {
        return Err(ContainmentError(format!(
            "{CONTAINMENT_ENV}=cgroup, but this process may not make a cgroup under its own in \
             the v2 hierarchy\nhint: run as root, or under systemd with Delegate=yes, or unset \
             {CONTAINMENT_ENV} to fall back to sessions"
        )));
    }
    let mechanism = if tree.is_some() {
        Mechanism::Cgroup
    } else {
        Mechanism::Session
    };
    let (memory, memory_tree) = match (options.memory_limit_mib, &tree) {
        (None, _) => (None, None),
        (Some(_), Some(tree)) => memory_limit(tree, &name),
        // A session holds no memory cgroup: the rlimit it is.
        (Some(_), None) => (Some(MemoryLimit::Rlimit), None),
    };
    let warden = match (&tree, &memory_tree) {
        (None, None) => None,
        _ => {
            let dirs: Vec<PathBuf> = tree.iter().chain(memory_tree.iter()).cloned().collect();
            match warden::spawn(&dirs) {
                Ok(pipe) => Some(pipe),
                Err(error) => {
                    tracing::warn!(
                        "could not start the warden that ends calls if this process is killed: \
                         {error}; calls still end with their cells"
                    );
                    None
                }
            }
        }
    };
    // Under cgroups too: what a killed cell leaves are zombies, and they
    // are reaped here rather than left to init.
    let reaps_strays = role == Role::Zygote;
    if reaps_strays {
        // Orphans of a call come back here when it ends (see `strays`).
        // SAFETY: prctl on this process alone.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    }
    tracing::debug!(?mechanism, ?memory, "calls are contained");
    *state() = Some(State {
        mechanism,
        tree,
        memory_tree,
        memory,
        limit_mib: options.memory_limit_mib,
        spare: Vec::new(),
        draining: Vec::new(),
        next: 0,
        reaps_strays,
        _warden: warden,
    });
    Ok(mechanism)
}

/// In a node's own zygote, just forked from the
/// zygote: none of its parent's cells are its own, its cells go in a
/// subtree of their own, which its parent ends if it dies (whatever its
/// calls left there, daemons included), and it is a subreaper as its
/// parent is (the attribute is not inherited).
pub fn become_node_zygote() {
    let mut guard = state();
    let Some(state) = guard.as_mut() else {
        return;
    };
    // The warden's pipe was closed with every claimed fd; the handle must
    // never close that number again.
    std::mem::forget(state._warden.take());
    state.spare.clear();
    state.draining.clear();
    state.next = 0;
    let own = node_zygote_dir(std::process::id());
    let memory_v2 = state.memory == Some(MemoryLimit::Cgroup(Version::V2));
    if let Some(tree) = &state.tree {
        let dir = tree.join(&own);
        if std::fs::create_dir(&dir).is_ok() {
            if memory_v2 {
                let _ = cgroup::write(&dir.join("cgroup.subtree_control"), "+memory");
            }
            state.tree = Some(dir);
        }
    }
    if let Some(memory_tree) = &state.memory_tree {
        let dir = memory_tree.join(&own);
        if std::fs::create_dir(&dir).is_ok() {
            state.memory_tree = Some(dir);
        }
    }
    if state.reaps_strays {
        // SAFETY: prctl on this process alone.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
    }
}

/// In the zygote, once a node's own zygote (`pid`) has ended however it
/// ended: kills what its calls left in its cells, removes them, and ends
/// its orphans that came back here.
pub fn end_node_zygote(pid: i32) {
    let (tree, memory_tree) = match state().as_ref() {
        Some(state) => (state.tree.clone(), state.memory_tree.clone()),
        None => (None, None),
    };
    let own = node_zygote_dir(pid as u32);
    if let Some(tree) = tree {
        let dir = tree.join(&own);
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        while cgroup::populated(&dir) && std::time::Instant::now() < deadline {
            let _ = cgroup::write(&dir.join("cgroup.kill"), "1");
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        cgroup::remove_tree(&dir);
    }
    if let Some(memory_tree) = memory_tree {
        cgroup::remove_tree(&memory_tree.join(&own));
    }
    strays::end_all();
}

fn node_zygote_dir(pid: u32) -> String {
    format!("zygote-{pid}")
}

/// The mechanism in force (session before [`establish`]).
pub fn mechanism() -> Mechanism {
    state().as_ref().map_or(Mechanism::Session, |s| s.mechanism)
}

/// The v2 subtree for this process's cells, made under its own cgroup.
fn make_tree(name: &str) -> Option<PathBuf> {
    let placement = cgroup::unified()?;
    let tree = placement.own.join(name);
    match std::fs::create_dir(&tree) {
        Ok(()) => Some(tree),
        Err(error) => {
            tracing::debug!(
                "no cgroup for calls under {}: {error}",
                placement.own.display()
            );
            None
        }
    }
}

/// Where memory can be limited: the v2 subtree itself if it can enable the
/// memory controller, else a v1 memory subtree, else an rlimit.
fn memory_limit(tree: &std::path::Path, name: &str) -> (Option<MemoryLimit>, Option<PathBuf>) {
    let enabled = tree
        .parent()
        .is_some_and(|own| cgroup::write(&own.join("cgroup.subtree_control"), "+memory").is_ok())
        && cgroup::write(&tree.join("cgroup.subtree_control"), "+memory").is_ok();
    if enabled {
        return (Some(MemoryLimit::Cgroup(Version::V2)), None);
    }
    if let Some(placement) = cgroup::memory_v1() {
        let memory_tree = placement.own.join(name);
        if std::fs::create_dir(&memory_tree).is_ok() {
            return (Some(MemoryLimit::Cgroup(Version::V1)), Some(memory_tree));
        }
    }
    tracing::warn!(
        "no memory cgroup can be made for calls; --call-memory-limit is enforced as RLIMIT_DATA, \
         which counts memory mapped writable rather than touched"
    );
    (Some(MemoryLimit::Rlimit), None)
}

/// One call's containment, made before its child is forked.
#[derive(Debug)]
pub struct Cell {
    dirs: Option<CellDirs>,
    /// Its `cgroup.procs` files, until the child is forked ([`Cell::forked`]).
    joins: Option<Joins>,
    /// A zygote's cell: its child is a subreaper, so what the call orphans
    /// stays under it (and under its cell) until the call ends.
    subreaper: bool,
    memory: Option<MemoryLimit>,
    limit_mib: Option<u64>,
    /// The cell's OOM kills when it was handed out.
    oom_kills_before: u64,
}

impl Cell {
    /// A cell for the next child: a spare one, or a new leaf.
    pub fn new() -> std::io::Result<Cell> {
        let mut guard = state();
        let Some(state) = guard.as_mut() else {
            return Ok(Cell {
                dirs: None,
                joins: None,
                subreaper: false,
                memory: None,
                limit_mib: None,
                oom_kills_before: 0,
            });
        };
        let dirs = match state.mechanism {
            Mechanism::Session => None,
            Mechanism::Cgroup => Some(state.take_dirs()?),
        };
        let oom_kills_before = dirs
            .as_ref()
            .and_then(|d| d.memory_dir(state.memory))
            .map_or(0, |(dir, version)| cgroup::oom_kills(dir, version));
        let joins = match &dirs {
            Some(dirs) => Some(dirs.open_joins()?),
            None => None,
        };
        Ok(Cell {
            dirs,
            joins,
            subreaper: state.reaps_strays,
            memory: state.memory,
            limit_mib: state.limit_mib,
            oom_kills_before,
        })
    }

    /// In the freshly forked child, before anything else: joins the cell,
    /// takes its memory limit, offers itself to the OOM killer first.
    /// Async-signal-safe calls only (the fork may have been made from a
    /// process with threads: the agent's services), but for the rlimit
    /// fallback, which reads `/proc` and is set only in a zygote.
    pub fn enter(&self) {
        if let Some(joins) = &self.joins {
            join(joins.procs.as_raw_fd());
            if let Some(procs) = &joins.memory_procs {
                join(procs.as_raw_fd());
            }
        }
        if let (Some(MemoryLimit::Rlimit), Some(limit)) = (self.memory, self.limit_mib) {
            limit_data(limit);
        }
        offer_to_oom_killer();
        if self.subreaper {
            // SAFETY: prctl on this process alone. Its orphans come back to
            // it, and to the zygote when it ends (see `strays`).
            unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1) };
        }
    }

    /// The fd a child spawned with `pre_exec` joins the cell through, and
    /// the v1 memory cgroup's, if any.
    pub fn procs_fds(&self) -> (Option<i32>, Option<i32>) {
        match &self.joins {
            Some(joins) => (
                Some(joins.procs.as_raw_fd()),
                joins.memory_procs.as_ref().map(|p| p.as_raw_fd()),
            ),
            None => (None, None),
        }
    }

    /// In the parent, once the child is forked: the join files are closed.
    pub fn forked(&mut self) {
        self.joins = None;
    }

    /// Ends every process in the cell, whatever session it is in. A no-op
    /// under sessions, where the caller's `killpg` and [`strays`] do it.
    pub fn kill(&self) {
        if let Some(dirs) = &self.dirs {
            dirs.kill();
        }
    }

    /// The call's memory limit, if the kernel's OOM killer acted in this
    /// cell since it was handed out.
    pub fn exceeded_memory_limit(&self) -> Option<u64> {
        let (dir, version) = self.dirs.as_ref()?.memory_dir(self.memory)?;
        (cgroup::oom_kills(dir, version) > self.oom_kills_before).then_some(self.limit_mib?)
    }
}

impl Drop for Cell {
    /// Back to the spares once empty; the caller has reaped the child.
    fn drop(&mut self) {
        let mut guard = state();
        if let (Some(dirs), Some(state)) = (self.dirs.take(), guard.as_mut()) {
            if dirs.empty() {
                state.spare.push(dirs);
            } else {
                dirs.kill();
                state.draining.push(dirs);
            }
        }
        if guard.as_ref().is_some_and(|state| state.reaps_strays) {
            drop(guard);
            strays::end_all();
        }
    }
}

impl State {
    fn take_dirs(&mut self) -> std::io::Result<CellDirs> {
        let (empty, busy): (Vec<_>, Vec<_>) = std::mem::take(&mut self.draining)
            .into_iter()
            .partition(CellDirs::empty);
        self.spare.extend(empty);
        self.draining = busy;
        for dirs in &self.draining {
            dirs.kill();
        }
        if let Some(dirs) = self.spare.pop() {
            return Ok(dirs);
        }
        self.next += 1;
        let name = format!("call-{}", self.next);
        let tree = self.tree.as_ref().expect("the cgroup mechanism has a tree");
        let leaf = tree.join(&name);
        std::fs::create_dir(&leaf)?;
        let limit_bytes = self.limit_mib.map(|mib| (mib * 1024 * 1024).to_string());
        if let (Some(MemoryLimit::Cgroup(Version::V2)), Some(bytes)) = (self.memory, &limit_bytes) {
            cgroup::write(&leaf.join("memory.max"), bytes)?;
            // Past the limit is past it: not a swap-out.
            let _ = cgroup::write(&leaf.join("memory.swap.max"), "0");
        }
        let memory_v1 = match (self.memory, &self.memory_tree, &limit_bytes) {
            (Some(MemoryLimit::Cgroup(Version::V1)), Some(memory_tree), Some(bytes)) => {
                let dir = memory_tree.join(&name);
                std::fs::create_dir(&dir)?;
                cgroup::write(&dir.join("memory.limit_in_bytes"), bytes)?;
                let _ = cgroup::write(&dir.join("memory.memsw.limit_in_bytes"), bytes);
                Some(dir)
            }
            _ => None,
        };
        Ok(CellDirs { leaf, memory_v1 })
    }
}

/// Moves the calling process into the cgroup whose `cgroup.procs` is `fd`.
fn join(fd: i32) {
    // SAFETY: write(2) of a static byte string; "0" names the writer.
    unsafe { libc::write(fd, b"0".as_ptr().cast(), 1) };
}

/// `oom_score_adj` 1000: a host-wide OOM kills a call first.
fn offer_to_oom_killer() {
    // SAFETY: open/write/close of a NUL-terminated static path and value.
    unsafe {
        let fd = libc::open(
            c"/proc/self/oom_score_adj".as_ptr(),
            libc::O_WRONLY | libc::O_CLOEXEC,
        );
        if fd >= 0 {
            libc::write(fd, b"1000".as_ptr().cast(), 4);
            libc::close(fd);
        }
    }
}

/// The limit a call's child took as `RLIMIT_DATA`, MiB (0: none).
static RLIMIT_MIB: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// In a call's child: the memory limit its allocations fail past, if it is
/// an rlimit, for a `MemoryError` to name.
pub fn rlimit_in_force() -> Option<u64> {
    match RLIMIT_MIB.load(std::sync::atomic::Ordering::Relaxed) {
        0 => None,
        mib => Some(mib),
    }
}

/// `RLIMIT_DATA` at what the child has mapped now plus `limit_mib`: the
/// zygote's own memory is the fork's, not the call's.
fn limit_data(limit_mib: u64) {
    RLIMIT_MIB.store(limit_mib, std::sync::atomic::Ordering::Relaxed);
    let mapped = vm_data_bytes().unwrap_or(0);
    let limit = mapped.saturating_add(limit_mib.saturating_mul(1024 * 1024));
    let rlimit = libc::rlimit {
        rlim_cur: limit,
        rlim_max: limit,
    };
    // SAFETY: setrlimit reads a live struct.
    unsafe { libc::setrlimit(libc::RLIMIT_DATA, &rlimit) };
}

/// `VmData` of this process, from `/proc/self/status`.
fn vm_data_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmData:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
