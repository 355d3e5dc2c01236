//! The node-zygote router (`placement::NodeZygotes::Every`): each node's requests
//! go to a zygote of its own, forked on its node's first request, so this
//! process runs no node code, no compile holds up another node's calls,
//! and its forks stay as cheap as its preloads.
//!
//! A request goes down under a ticket of the router's own (its route), and
//! the frames that come back go to the call's link under the call's own
//! ticket. A node zygote's socket is written without waiting (it reads
//! nothing while it loads a node); one that ends has every call it had
//! answered with how it ended. Past `MAX_NODE_ZYGOTES`, the least recently
//! used idle node's is ended, as each holds its node's module-level objects
//! and its standby children.

use std::collections::HashMap;
use std::os::fd::AsFd;

use nix::unistd::Pid;
use pyo3::prelude::*;

use super::lanes::LANE_AT_IN_FLIGHT;
use super::link_output::{LinkOutput, send};
use super::{Relay, Route, Server, spawn_node_zygote};
use crate::end::End;
use crate::link::{Frame, Received, Receiver};
use crate::output::CallOutput;
use crate::protocol;
use crate::zygote::Zygote;
use crate::zygote::node::NodeKey;

/// The most node zygotes kept: past it, the least recently used one with
/// no call in flight is ended (a flow of many nodes, each process holding
/// its node's module-level objects and its standby children).
const MAX_NODE_ZYGOTES: usize = 16;

impl Server {
    /// Hands a request to its node's own zygote, forking one if the node
    /// has none yet; its frames come back through [`Server::read_node_zygote`].
    pub(super) fn relay(
        &mut self,
        py: Python<'_>,
        zygote: &mut Zygote,
        link: u64,
        ticket: u64,
        parsed: &protocol::Request,
        request: &[u8],
    ) {
        let key = NodeKey {
            flow: parsed.flow.clone(),
            node: parsed.node.clone(),
        };
        self.next_route += 1;
        let relayed = self.next_route;
        let pid = match self.node_zygote_for(py, zygote, &key, relayed) {
            Ok(pid) => pid,
            Err(error) => {
                if let Some(socket) = self.socket_of(link) {
                    let message = format!("could not start the node's zygote: {error}");
                    LinkOutput { socket, ticket }.reply(&End::Lost(message).reply(
                        &parsed.id,
                        &parsed.call_id,
                        "",
                    ));
                    send(socket, Frame::Done { ticket });
                }
                return;
            }
        };
        self.routes.insert(
            relayed,
            Route {
                link,
                ticket,
                node_zygote: pid,
                run: parsed.op == protocol::Op::Run,
            },
        );
        self.post(
            pid,
            &Frame::Call {
                ticket: relayed,
                request: request.to_vec(),
            },
        );
    }

    /// The fork loop of `key` with the fewest calls in flight: its node
    /// zygote, forked now if it has none, or one of its lanes. `used` marks
    /// it as the most recently used. Where every loop of the node is busy
    /// and it may have more, its node zygote is asked for a lane.
    fn node_zygote_for(
        &mut self,
        py: Python<'_>,
        zygote: &mut Zygote,
        key: &NodeKey,
        used: u64,
    ) -> std::io::Result<Pid> {
        let mut loops = 0;
        let mut least: Option<(usize, usize)> = None;
        for (index, relay) in self.node_zygotes.iter().enumerate() {
            if relay.node_zygote.key != *key {
                continue;
            }
            loops += 1;
            let in_flight = self.in_flight(relay.node_zygote.pid);
            if least.is_none_or(|(_, fewest)| in_flight < fewest) {
                least = Some((index, in_flight));
            }
        }
        if let Some((index, in_flight)) = least {
            self.node_zygotes[index].last_used = used;
            let pid = self.node_zygotes[index].node_zygote.pid;
            if in_flight >= LANE_AT_IN_FLIGHT && loops < self.lanes_per_node {
                self.ask_for_lane(key);
            }
            return Ok(pid);
        }
        self.retire_one();
        let pending = self.pending_held();
        let node_zygote = spawn_node_zygote(py, zygote, key, self.contract, None, None)?;
        drop(pending);
        crate::fds::set_nonblocking(node_zygote.raw_link());
        let pid = node_zygote.pid;
        tracing::debug!(node = %key, pid = pid.as_raw(), "forked the node's own zygote");
        self.node_zygotes.push(Relay {
            node_zygote,
            lane: false,
            lane_asked: false,
            last_used: used,
            receiver: Receiver::claiming(),
            outbox: Vec::new(),
        });
        Ok(pid)
    }

    /// Calls relayed to node zygote (or lane) `pid` and not yet ended.
    fn in_flight(&self, pid: Pid) -> usize {
        self.routes
            .values()
            .filter(|route| route.node_zygote == pid)
            .count()
    }

    /// Makes room for one more node zygote: past [`MAX_NODE_ZYGOTES`], ends
    /// the least recently used node's zygote and lanes, none of them with
    /// a call in flight.
    fn retire_one(&mut self) {
        let nodes = self.node_zygotes.iter().filter(|r| !r.lane).count();
        if nodes < MAX_NODE_ZYGOTES {
            return;
        }
        let busy: std::collections::HashSet<&NodeKey> = self
            .node_zygotes
            .iter()
            .filter(|relay| self.in_flight(relay.node_zygote.pid) > 0)
            .map(|relay| &relay.node_zygote.key)
            .collect();
        let mut last_used: HashMap<&NodeKey, u64> = HashMap::new();
        for relay in &self.node_zygotes {
            let used = last_used.entry(&relay.node_zygote.key).or_default();
            *used = (*used).max(relay.last_used);
        }
        let Some(key) = last_used
            .into_iter()
            .filter(|(key, _)| !busy.contains(key))
            .min_by_key(|(_, used)| *used)
            .map(|(key, _)| key.clone())
        else {
            return;
        };
        tracing::debug!(node = %key, "ended the least recently used node zygote");
        let (retired, kept) = std::mem::take(&mut self.node_zygotes)
            .into_iter()
            .partition(|relay| relay.node_zygote.key == key);
        self.node_zygotes = kept;
        end_all(retired);
    }

    /// Where node zygote `pid` is in `node_zygotes`.
    fn relay_index(&self, pid: Pid) -> Option<usize> {
        self.node_zygotes
            .iter()
            .position(|relay| relay.node_zygote.pid == pid)
    }

    /// Queues a frame for a node zygote and sends what its socket takes.
    pub(super) fn post(&mut self, pid: Pid, frame: &Frame) {
        if let Some(index) = self.relay_index(pid) {
            self.node_zygotes[index]
                .outbox
                .extend_from_slice(&frame.bytes());
        }
        self.flush_to(pid);
    }

    /// Sends what a node zygote's socket takes of its outbox, without
    /// waiting.
    pub(super) fn flush_to(&mut self, pid: Pid) {
        let Some(relay) = self.relay_index(pid).map(|i| &mut self.node_zygotes[i]) else {
            return;
        };
        while !relay.outbox.is_empty() {
            match nix::sys::socket::send(
                relay.node_zygote.raw_link(),
                &relay.outbox,
                nix::sys::socket::MsgFlags::MSG_NOSIGNAL | nix::sys::socket::MsgFlags::MSG_DONTWAIT,
            ) {
                // A call's request must not stay behind in this memory.
                Ok(sent) => crate::scrub::drain_front(&mut relay.outbox, sent),
                Err(nix::errno::Errno::EINTR) => {}
                // Full, or gone (its end is read next).
                Err(_) => return,
            }
        }
    }

    /// Reads a node zygote's frames and passes each to the call it belongs
    /// to, under that call's own ticket.
    pub(super) fn read_node_zygote(&mut self, pid: Pid) {
        let Some(index) = self.relay_index(pid) else {
            return;
        };
        loop {
            let relay = &mut self.node_zygotes[index];
            match relay.receiver.receive(relay.node_zygote.link.as_fd()) {
                Ok(Received::Data) => {}
                Ok(Received::WouldBlock) => break,
                Ok(Received::Closed) | Err(_) => {
                    self.forward_frames(index);
                    self.node_zygote_ended(pid);
                    return;
                }
            }
        }
        self.forward_frames(index);
    }

    fn forward_frames(&mut self, index: usize) {
        loop {
            let frame = match self.node_zygotes[index].receiver.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return,
                Err(error) => {
                    tracing::error!("a node's zygote sent a frame the zygote cannot read: {error}");
                    return;
                }
            };
            let Some(relayed) = frame.ticket() else {
                match frame {
                    Frame::Lane { pid, link, pidfd } => self.add_lane(index, pid, link, pidfd),
                    Frame::Failed { message } => {
                        // (A lane it could not fork: it may be asked again.)
                        self.node_zygotes[index].lane_asked = false;
                        tracing::error!("a node's zygote failed: {message}")
                    }
                    _ => {}
                }
                continue;
            };
            let Some(route) = self.routes.get(&relayed) else {
                // Its caller is gone (the run was abandoned).
                continue;
            };
            let (link, ticket) = (route.link, route.ticket);
            if frame.is_last() {
                self.routes.remove(&relayed);
            }
            if let Some(socket) = self.socket_of(link) {
                send(socket, frame.with_ticket(ticket));
            }
        }
    }

    /// A node's zygote has ended: each call it had is told so, with how it
    /// ended; what its calls left is ended too. Its node's next request
    /// forks a new one.
    pub(super) fn node_zygote_ended(&mut self, pid: Pid) {
        let Some(index) = self.relay_index(pid) else {
            return;
        };
        let relay = self.node_zygotes.swap_remove(index);
        let key = relay.node_zygote.key.clone();
        if relay.lane {
            // Its parent, the node's zygote, reaps it and ends what its
            // calls left.
            drop(relay);
            self.fail_routes(pid, &key, "ended");
            return;
        }
        let how = match crate::process::reap(pid) {
            Ok(reaped) => reaped.end.to_string(),
            Err(_) => "ended".to_string(),
        };
        drop(relay);
        crate::containment::end_node_zygote(pid.as_raw());
        // Its lanes die with it (a parent-death SIGKILL) and come to this
        // process (a subreaper) to be reaped; none is given another call.
        let (lanes, kept): (Vec<Relay>, Vec<Relay>) = std::mem::take(&mut self.node_zygotes)
            .into_iter()
            .partition(|r| r.lane && r.node_zygote.key == key);
        self.node_zygotes = kept;
        for lane in lanes {
            let lane_pid = lane.node_zygote.pid;
            lane.node_zygote.end_orphaned_lane();
            self.fail_routes(lane_pid, &key, "ended with the node's zygote");
        }
        self.fail_routes(pid, &key, &how);
    }

    /// Answers every call relayed to node zygote (or lane) `pid`, which
    /// ended (`how`), with a failure saying so.
    fn fail_routes(&mut self, pid: Pid, key: &NodeKey, how: &str) {
        let orphaned: Vec<u64> = self
            .routes
            .iter()
            .filter(|(_, route)| route.node_zygote == pid)
            .map(|(&relayed, _)| relayed)
            .collect();
        if !orphaned.is_empty() {
            tracing::warn!(node = %key, pid = pid.as_raw(), "the node's own zygote {how} with calls in flight");
        }
        for relayed in orphaned {
            let Some(route) = self.routes.remove(&relayed) else {
                continue;
            };
            if let Some(socket) = self.socket_of(route.link) {
                let message = format!("the zygote of node {key} (pid {pid}) {how}");
                send(
                    socket,
                    Frame::Lost {
                        ticket: route.ticket,
                        message,
                    },
                );
            }
        }
    }

    /// Ends every node zygote, and what their calls left.
    pub(super) fn end_node_zygotes(&mut self) {
        end_all(std::mem::take(&mut self.node_zygotes));
    }
}

/// Ends node zygotes, what their calls left, and their lanes (which die
/// with them and come here to be reaped).
fn end_all(relays: Vec<Relay>) {
    let (lanes, node_zygotes): (Vec<Relay>, Vec<Relay>) =
        relays.into_iter().partition(|relay| relay.lane);
    for relay in node_zygotes {
        relay.node_zygote.end();
    }
    for relay in lanes {
        relay.node_zygote.end_orphaned_lane();
    }
}
