//! A node's own zygote, as Android's "app zygote": forked from the zygote,
//! it holds one node loaded and forks that node's calls.
//!
//! The issues this solves:
//! 1. A node's module-level work runs where it is loaded. Loaded in the
//!    zygote that serves every node, ten seconds of it (a checkpoint read,
//!    a model built) stop every other node's calls for ten seconds.
//! 2. Fork and exit cost grows with the forking process's page tables: a
//!    node whose module level holds 400 MB of Python objects, loaded in the
//!    shared zygote, makes every other node's calls several times slower.
//!
//! So the zygote forks a process per node that needs one (a fork: about a
//! millisecond, whatever the node does next), and that process loads the
//! node and serves its calls over a link (`crate::link`), exactly as the
//! agent's zygote serves the agent: its children are its own, in cells of
//! a subtree of their own. The zygote relays requests to it and its frames
//! back (the link server); it stays as small as its preloads, and a
//! compile in one node's zygote holds up no other node.
//!
//! It dies with the zygote (a parent-death SIGKILL, and the zygote's warden
//! ends its cells). If it dies alone, the zygote ends what its calls left
//! ([`crate::containment::end_node_zygote`]) and says so to each of them.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::os::unix::net::UnixStream;

use nix::unistd::Pid;
use pyo3::prelude::*;

use super::node::{self, NodeKey};
use crate::fds::{self, Claimed};
use crate::process::ExitWatch;
use fluksio_embed::capture::LogBuffer;
use fluksio_embed::fork;
use fluksio_embed::fork::freeze_gc;

/// A node's own zygote, seen from the zygote that forked it.
pub struct NodeZygote {
    pub key: NodeKey,
    pub pid: Pid,
    pub link: Claimed,
    pub exit: ExitWatch,
}

/// The node to load before serving, when the caller has already tried it
/// (its trial went cleanly): its source and digest.
pub struct Preload<'a> {
    pub source: &'a str,
    pub digest: &'a str,
    /// Its warm-up's `--warmup` arguments, or why it is refused (`super::warmup`).
    pub warm: Result<Option<&'a str>, &'a str>,
}

/// Cores one fork loop keeps busy. Measured on a trivial call: its zygote
/// spends ~1.2 ms of CPU on it (the fork, following, reaping), its child
/// ~2.9 ms (CPython waking up after the fork, the call, the exit), so one
/// zygote feeds the children of about three cores. Fewer cores per loop
/// only adds each loop's own overhead (on 2 cores, a sweep with 2 lanes did
/// ~20% fewer calls/s than with 1).
pub const CORES_PER_LANE: usize = 3;

/// The fork loops (lanes) a node's calls get by default on `cores`.
pub fn default_lanes(cores: usize) -> usize {
    (cores / CORES_PER_LANE).max(1)
}

/// What forking a node's own zygote asks of the zygote it is forked from.
pub trait Parent {
    /// In the child: forgets the children, residents and node zygotes it
    /// copied, which are its parent's, and makes no node zygotes itself.
    fn forget_inherited(&mut self);
    /// Forking was unsafe: the zygote must restart before it serves
    /// anything else.
    fn must_recover(&mut self);
    /// In the child, once served: ends every child still around.
    fn shutdown(&mut self);
}

/// Forks a zygote of its own, connected by a socket pair: in the child,
/// once it has shed what was its parent's, `serve` runs with its end
/// (claimed: no call it forks holds it), and its result is the exit code.
/// Returns in the parent only.
pub fn fork_own<Z: Parent>(
    py: Python<'_>,
    zygote: &mut Z,
    key: &NodeKey,
    serve: impl FnOnce(Python<'_>, &mut Z, Claimed) -> i32,
) -> std::io::Result<NodeZygote> {
    let (ours, theirs) = UnixStream::pair()?;
    let ours = Claimed::new(OwnedFd::from(ours));
    let theirs = Claimed::new(OwnedFd::from(theirs));
    freeze_gc(py);
    let parent = nix::unistd::getpid();
    match fork::fork(py)? {
        fork::Forked::Child => {
            // The parent's end, closed with every claimed fd: never dropped.
            std::mem::forget(ours);
            let link = become_node_zygote(zygote, parent, theirs);
            let code = serve(py, zygote, Claimed::new(link));
            zygote.shutdown();
            crate::process::exit_now(code)
        }
        fork::Forked::Parent { pid, safe } => {
            drop(theirs);
            if !safe {
                // It exits at once, having run nothing.
                let _ = crate::process::reap(pid);
                zygote.must_recover();
                return Err(std::io::Error::other(
                    "a thread that does not stop at fork is running in the zygote",
                ));
            }
            crate::process::set_cloexec(ours.as_fd());
            Ok(NodeZygote {
                key: key.clone(),
                pid,
                link: ours,
                exit: ExitWatch::new(pid),
            })
        }
    }
}

/// In the child: sheds everything that was its parent's (the links, the
/// standby children, the cells and log buffers of other calls), dies with
/// its parent, and returns its end of the link.
fn become_node_zygote(zygote: &mut impl Parent, parent: Pid, link: Claimed) -> OwnedFd {
    // Everything the parent claimed is closed here, this link's end with
    // it: taken out first, and claimed again as this process's own.
    let link = link.release();
    crate::metrics::adopt_in_node_zygote();
    fds::close_in_child();
    fds::closed_all();
    // SAFETY: prctl and getppid act on this process alone.
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong);
        if libc::getppid() != parent.as_raw() {
            libc::_exit(1);
        }
    }
    zygote.forget_inherited();
    LogBuffer::unmap_inherited();
    crate::containment::strays::forget_all();
    crate::containment::become_node_zygote();
    node::forget_module_dir();
    link
}

impl NodeZygote {
    /// Ends it (its link closed, then SIGKILL) and whatever its calls left.
    pub fn end(self) {
        let pid = self.pid;
        drop(self.link);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
        let _ = crate::process::reap(pid);
        crate::containment::end_node_zygote(pid.as_raw());
    }

    /// Ends a lane whose node zygote, its parent, has ended: SIGKILL (it
    /// is dying of its parent's death already) through its pidfd, which
    /// cannot name a reused pid, then reaped, here if it came to this
    /// process (a subreaper) as an orphan.
    pub fn end_orphaned_lane(self) {
        drop(self.link);
        if let Some(pidfd) = self.exit.fd() {
            crate::process::pidfd_kill(pidfd);
            crate::process::reap_orphan(pidfd);
        }
    }

    pub fn raw_link(&self) -> std::os::fd::RawFd {
        self.link.as_raw_fd()
    }
}
