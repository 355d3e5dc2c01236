//! Lanes: one fork loop keeps only a few cores busy, so a node with many
//! calls in flight gets more loops. A lane is a fork of the node's own
//! zygote, the node loaded as there, forking its own share of the node's
//! calls on another core.
//!
//! The router asks the node's zygote for one (`ForkLane`); that zygote
//! forks it, reaps it when it ends, and hands the router its end of the
//! lane's link and a pidfd to watch it by; the router relays to it as to
//! any node zygote.

use std::os::fd::{AsRawFd, OwnedFd};

use nix::unistd::Pid;
use pyo3::prelude::*;

use super::link_output::send;
use super::{Relay, Server};
use crate::fds::Claimed;
use crate::link::{Frame, Receiver};
use crate::process::ExitWatch;
use crate::zygote::Zygote;
use crate::zygote::app::{self, NodeZygote};
use crate::zygote::node::NodeKey;

/// A node's zygote asks for a lane once each of its node's fork loops has
/// this many calls in flight: one loop keeps about this many cores busy
/// with trivial calls ([`app::CORES_PER_LANE`]).
pub(super) const LANE_AT_IN_FLIGHT: usize = app::CORES_PER_LANE;

impl Server {
    /// Asks `key`'s node zygote for a lane, unless one is on its way: a
    /// fork of itself, the node loaded as there, forking its own share of
    /// the node's calls on another core.
    pub(super) fn ask_for_lane(&mut self, key: &NodeKey) {
        let Some(relay) = self
            .node_zygotes
            .iter_mut()
            .find(|r| r.node_zygote.key == *key && !r.lane)
        else {
            return;
        };
        if relay.lane_asked {
            return;
        }
        relay.lane_asked = true;
        let pid = relay.node_zygote.pid;
        tracing::debug!(node = %key, "asked the node's zygote for a lane");
        self.post(pid, &Frame::ForkLane);
    }

    /// The lane node zygote `index` forked: relayed to like it from now on.
    pub(super) fn add_lane(&mut self, index: usize, pid: i32, link: OwnedFd, pidfd: OwnedFd) {
        let parent = &mut self.node_zygotes[index];
        parent.lane_asked = false;
        let key = parent.node_zygote.key.clone();
        let last_used = parent.last_used;
        let pid = Pid::from_raw(pid);
        let link = Claimed::new(link);
        crate::fds::set_nonblocking(link.as_raw_fd());
        tracing::debug!(node = %key, pid = pid.as_raw(), "the node has a new lane");
        self.node_zygotes.push(Relay {
            node_zygote: NodeZygote {
                key,
                pid,
                link,
                // Its parent reaps it; a lane that ended is seen here by
                // this pidfd, which its parent opened while it was its
                // child (so it cannot name a reused pid).
                exit: ExitWatch::from_pidfd(pidfd),
            },
            lane: true,
            lane_asked: false,
            last_used,
            receiver: Receiver::claiming(),
            outbox: Vec::new(),
        });
    }

    /// In a node zygote: forks a lane of itself and hands the zygote on
    /// link `id` its end of the lane's link. True when the zygote must
    /// restart (forking was not safe).
    pub(super) fn fork_lane(&mut self, py: Python<'_>, zygote: &mut Zygote, id: u64) -> bool {
        let Some(key) = self.node.clone() else {
            return false;
        };
        let contract = self.contract;
        let pending = self.pending_held();
        let forked = super::spawn_node_zygote(py, zygote, &key, contract, None, None);
        drop(pending);
        let Some(socket) = self.socket_of(id) else {
            if let Ok(lane) = forked {
                lane.end();
            }
            return zygote.needs_recovery();
        };
        match forked {
            Ok(lane) => {
                let pidfd = lane.exit.fd().and_then(|fd| fd.try_clone_to_owned().ok());
                let Some(pidfd) = pidfd else {
                    // No pidfds here (Linux before 5.3): the zygote could
                    // not watch it safely, so there is no lane.
                    lane.end();
                    return zygote.needs_recovery();
                };
                let NodeZygote {
                    pid, link, exit, ..
                } = lane;
                send(
                    socket,
                    Frame::Lane {
                        pid: pid.as_raw(),
                        link: link.release(),
                        pidfd,
                    },
                );
                self.lanes.push((pid, exit));
            }
            Err(error) => {
                tracing::warn!(node = %key, "could not fork a lane: {error}");
                send(
                    socket,
                    Frame::Failed {
                        message: format!("could not fork a lane of node {key}: {error}"),
                    },
                );
            }
        }
        zygote.needs_recovery()
    }

    /// In a node zygote: a lane it forked has ended; it is reaped, and what
    /// its calls left is ended.
    pub(super) fn lane_ended(&mut self, pid: Pid) {
        self.lanes.retain(|(lane, _)| *lane != pid);
        let _ = crate::process::reap(pid);
        crate::containment::end_node_zygote(pid.as_raw());
    }
}
