//! A sweep's lanes: one zygote per core, each forking its own calls.
//!
//! The issue this solves: one zygote forks one child at a time, on one
//! core, and follows and reaps every call itself; on a machine of many
//! cores that single loop caps a sweep of short calls, however many are in
//! flight. So once the node is loaded (and every call checked against it),
//! the sweep forks a *lane* per core: a zygote of its own (`zygote::app`),
//! the node loaded as in its parent, forking, following and reaping its
//! share of the calls with its own standby children. The sweep itself only
//! hands out call indices and writes the results as they come back.
//!
//! The wire, over a socket pair per lane: the sweep sends call indices
//! (`u64`, little-endian) and shuts its side down when none are left; a
//! lane sends each ended call back as `[u32 length][u64 index][u64
//! nanoseconds][u32 events]([u32 length][event])*[u32 length][reply]`.
//!
//! A lane dies with the sweep (a parent-death SIGKILL; the sweep's warden
//! ends its cells). Stopped (Ctrl-C, a closed output), the sweep sends each
//! lane SIGTERM: it ends its calls in flight and exits. The sweep keeps the
//! indices it handed each lane until their results come back: those are
//! the lane's calls in flight, named when it is stopped.
//!
//! `--timeout` is the lane's own to keep: its calls are forked, followed
//! and killed there, and a call it ended comes back as any other, its reply
//! a `NodeTimeout` failure.

use std::collections::{BTreeSet, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, RawFd};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use pyo3::prelude::*;

use super::calls::{Calls, Done, Node};
use super::points::Points;
use super::signals;
use crate::fds::Claimed;
use crate::zygote::Zygote;
use crate::zygote::app::{self, NodeZygote};
use crate::zygote::node::NodeKey;

/// How long a wait may block: a signal that lands between checking for it
/// and polling is seen within this.
const WAKE_MS: u16 = 200;

/// How many lanes, and calls in flight in each, for `jobs` calls in
/// flight: `lanes` if given, else one per [`app::CORES_PER_LANE`] cores; at
/// most one per call.
pub fn shape(jobs: usize, lanes: Option<usize>) -> (usize, usize) {
    let lanes = lanes
        .unwrap_or_else(|| {
            app::default_lanes(std::thread::available_parallelism().map_or(1, |n| n.get()))
        })
        .min(jobs)
        .max(1);
    (lanes, jobs.div_ceil(lanes))
}

/// The sweep's side of one lane.
struct Lane {
    lane: NodeZygote,
    /// Bytes of results not yet whole.
    inbox: Vec<u8>,
    /// Indices handed out whose results have not come back.
    outstanding: BTreeSet<usize>,
    /// Its share of the indices is handed out: its socket is shut for writing.
    closed: bool,
}

/// The lanes of a sweep, seen from the sweep.
pub struct Lanes {
    lanes: Vec<Lane>,
    per_lane: usize,
}

impl Lanes {
    /// Forks `count` lanes from `zygote`, which has the node loaded; each
    /// serves `per_lane` calls in flight, each ended past `timeout`.
    pub fn start(
        py: Python<'_>,
        zygote: &mut Zygote,
        node: &Node,
        calls: &Points,
        (count, per_lane): (usize, usize),
        timeout: Option<Duration>,
    ) -> Result<Lanes, String> {
        let key = NodeKey {
            flow: node.flow.clone(),
            node: node.name.clone(),
        };
        let mut lanes = Vec::with_capacity(count);
        for _ in 0..count {
            let lane = app::fork_own(py, zygote, &key, |py, zygote, link| {
                serve(py, zygote, node, calls, link, (per_lane, timeout))
            })
            .map_err(|e| format!("could not fork a lane: {e}"))?;
            crate::fds::set_nonblocking(lane.raw_link());
            lanes.push(Lane {
                lane,
                inbox: Vec::new(),
                outstanding: BTreeSet::new(),
                closed: false,
            });
        }
        Ok(Lanes { lanes, per_lane })
    }

    pub fn in_flight(&self) -> usize {
        self.lanes.iter().map(|lane| lane.outstanding.len()).sum()
    }

    /// Hands out indices from `next` up to `total`, to lanes with room;
    /// once none are left, tells each lane so.
    pub fn fill(&mut self, next: &mut usize, total: usize) -> Result<(), String> {
        // One at a time round the lanes, the least loaded first.
        while *next < total {
            let Some(lane) = self
                .lanes
                .iter_mut()
                .filter(|lane| lane.outstanding.len() < self.per_lane)
                .min_by_key(|lane| lane.outstanding.len())
            else {
                break;
            };
            write_all(lane.lane.raw_link(), &(*next as u64).to_le_bytes())
                .map_err(|e| format!("a lane (pid {}) is gone: {e}", lane.lane.pid))?;
            lane.outstanding.insert(*next);
            *next += 1;
        }
        for lane in &mut self.lanes {
            if *next == total && !lane.closed {
                let _ = nix::sys::socket::shutdown(
                    lane.lane.raw_link(),
                    nix::sys::socket::Shutdown::Write,
                );
                lane.closed = true;
            }
        }
        Ok(())
    }

    /// Waits (a little while at most) for results; returns the calls that
    /// ended. A lane that ends with calls unfinished is an error.
    pub fn step(&mut self) -> Result<Vec<Done>, String> {
        let ready: Vec<bool> = {
            let mut fds: Vec<PollFd<'_>> = self
                .lanes
                .iter()
                .map(|lane| PollFd::new(lane.lane.link.as_fd(), PollFlags::POLLIN))
                .collect();
            match poll(&mut fds, PollTimeout::from(WAKE_MS)) {
                Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                Err(e) => return Err(format!("poll failed: {e}")),
            }
            fds.iter()
                .map(|fd| fd.revents().is_some_and(|r| !r.is_empty()))
                .collect()
        };
        let mut done = Vec::new();
        for (lane, ready) in self.lanes.iter_mut().zip(ready) {
            if !ready {
                continue;
            }
            let ended = read_available(lane.lane.raw_link(), &mut lane.inbox);
            while let Some(result) = take_result(&mut lane.inbox) {
                lane.outstanding.remove(&result.index);
                done.push(result);
            }
            if ended && !lane.outstanding.is_empty() {
                return Err(format!(
                    "a lane (pid {}) ended with {} calls unfinished",
                    lane.lane.pid,
                    lane.outstanding.len()
                ));
            }
        }
        Ok(done)
    }

    /// Ends every lane, and with it its calls in flight: SIGTERM (it kills
    /// its calls, each with its cell, and exits), then waits for it. The
    /// indices of the calls that were in flight (handed out, no result
    /// back), ascending.
    pub fn stop(&mut self) -> Vec<usize> {
        let mut ended: Vec<usize> = self
            .lanes
            .iter()
            .flat_map(|lane| lane.outstanding.iter().copied())
            .collect();
        ended.sort_unstable();
        for lane in &self.lanes {
            let _ = nix::sys::signal::kill(lane.lane.pid, nix::sys::signal::Signal::SIGTERM);
        }
        for lane in self.lanes.drain(..) {
            let pid = lane.lane.pid;
            if !wait_exit(&lane.lane, Duration::from_secs(5)) {
                tracing::warn!(pid = pid.as_raw(), "a lane did not stop; killing it");
            }
            lane.lane.end();
        }
        ended
    }
}

/// In a lane: serves the indices the sweep sends, `jobs` calls in flight,
/// until none are left and its calls have ended, or until it is stopped.
fn serve(
    py: Python<'_>,
    zygote: &mut Zygote,
    node: &Node,
    source: &Points,
    link: Claimed,
    (jobs, timeout): (usize, Option<Duration>),
) -> i32 {
    crate::fds::set_nonblocking(link.as_raw_fd());
    let mut calls = Calls::new(zygote, node);
    calls.set_timeout(timeout);
    let mut inbox = Vec::new();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut no_more = false;
    let mut readable = true;
    loop {
        if signals::received().is_some() {
            calls.kill_all();
            return 0;
        }
        if readable && !no_more {
            no_more = read_available(link.as_raw_fd(), &mut inbox);
            let whole = inbox.len() / 8 * 8;
            for index in inbox[..whole].chunks_exact(8) {
                queue.push_back(u64::from_le_bytes(index.try_into().expect("8 bytes")) as usize);
            }
            inbox.drain(..whole);
        }
        while calls.in_flight() < jobs {
            let Some(index) = queue.pop_front() else {
                break;
            };
            if let Err(message) = calls.start(py, index, &source.get(index)) {
                eprintln!("fluksio-zygote sweep: {message}");
                calls.kill_all();
                return 1;
            }
        }
        if !no_more || !queue.is_empty() {
            calls.replenish(py);
        }
        if no_more && queue.is_empty() && calls.in_flight() == 0 {
            return 0;
        }
        let also = (!no_more).then(|| link.as_fd());
        let finished = match calls.step_with(also) {
            Ok((finished, link_ready)) => {
                readable = link_ready;
                finished
            }
            Err(message) => {
                eprintln!("fluksio-zygote sweep: {message}");
                calls.kill_all();
                return 1;
            }
        };
        for done in &finished {
            if write_all(link.as_raw_fd(), &encode(done)).is_err() {
                // The sweep is gone: so are these calls.
                calls.kill_all();
                return 1;
            }
        }
    }
}

fn encode(done: &Done) -> Vec<u8> {
    let mut body = Vec::new();
    body.extend_from_slice(&(done.index as u64).to_le_bytes());
    body.extend_from_slice(&(done.duration.as_nanos() as u64).to_le_bytes());
    body.extend_from_slice(&(done.answer.events.len() as u32).to_le_bytes());
    for event in &done.answer.events {
        body.extend_from_slice(&(event.len() as u32).to_le_bytes());
        body.extend_from_slice(event);
    }
    body.extend_from_slice(&(done.answer.reply.len() as u32).to_le_bytes());
    body.extend_from_slice(&done.answer.reply);
    let mut message = (body.len() as u32).to_le_bytes().to_vec();
    message.append(&mut body);
    message
}

/// The next whole result in `inbox`, taken out of it.
fn take_result(inbox: &mut Vec<u8>) -> Option<Done> {
    let length = u32::from_le_bytes(inbox.get(..4)?.try_into().ok()?) as usize;
    let body = inbox.get(4..4 + length)?;
    let mut at = 0;
    let mut take = |n: usize| {
        let piece = &body[at..at + n];
        at += n;
        piece
    };
    let u32_at = |bytes: &[u8]| u32::from_le_bytes(bytes.try_into().expect("4 bytes")) as usize;
    let index = u64::from_le_bytes(take(8).try_into().expect("8 bytes")) as usize;
    let nanos = u64::from_le_bytes(take(8).try_into().expect("8 bytes"));
    let count = u32_at(take(4));
    let mut events = Vec::with_capacity(count);
    for _ in 0..count {
        let len = u32_at(take(4));
        events.push(take(len).to_vec());
    }
    let len = u32_at(take(4));
    let reply = take(len).to_vec();
    inbox.drain(..4 + length);
    Some(Done::from_parts(
        index,
        Duration::from_nanos(nanos),
        events,
        reply,
    ))
}

/// Reads what the socket holds now into `inbox`; true at end of file.
fn read_available(fd: RawFd, inbox: &mut Vec<u8>) -> bool {
    let mut chunk = [0u8; 64 * 1024];
    loop {
        match nix::unistd::read(unsafe_borrow(fd), &mut chunk) {
            Ok(0) => return true,
            Ok(n) => inbox.extend_from_slice(&chunk[..n]),
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => return false,
            Err(_) => return true,
        }
    }
}

/// Writes all of `bytes` to a non-blocking socket, waiting while it is full.
fn write_all(fd: RawFd, mut bytes: &[u8]) -> std::io::Result<()> {
    while !bytes.is_empty() {
        match nix::sys::socket::send(fd, bytes, nix::sys::socket::MsgFlags::MSG_NOSIGNAL) {
            Ok(n) => bytes = &bytes[n..],
            Err(nix::errno::Errno::EINTR) => {}
            Err(nix::errno::Errno::EAGAIN) => {
                let mut fds = [PollFd::new(unsafe_borrow(fd), PollFlags::POLLOUT)];
                let _ = poll(&mut fds, PollTimeout::from(WAKE_MS));
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

/// Whether a lane exited within `limit`.
fn wait_exit(lane: &NodeZygote, limit: Duration) -> bool {
    crate::poll_set::wait_exit(lane.pid, &lane.exit, limit)
}

fn unsafe_borrow<'a>(fd: RawFd) -> BorrowedFd<'a> {
    // SAFETY: every fd passed here is a lane socket owned by a value that
    // outlives the call.
    unsafe { BorrowedFd::borrow_raw(fd) }
}
