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
//! The wire, over a socket pair per lane, is the link's (`crate::link`):
//! the sweep sends a `Call` frame per point, its ticket the point's index
//! and no request (the lane was forked with the points), and shuts its
//! side down when none are left; a lane sends each ended call back as its
//! lines in `Line` frames, its reply last, then `Answered` with how long
//! it ran.
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

use std::collections::{BTreeSet, HashMap, VecDeque};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::Duration;

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use pyo3::prelude::*;

use super::calls::{Answer, Calls, Done, Node};
use super::points::Points;
use super::signals;
use crate::fds::Claimed;
use crate::link::{self, Frame, Received, Receiver};
use crate::output::CallOutput;
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
    receiver: Receiver,
    /// The lines of calls not yet answered, by index.
    answers: HashMap<usize, Answer>,
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
                receiver: Receiver::default(),
                answers: HashMap::new(),
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
            let call = Frame::Call {
                ticket: *next as u64,
                request: Vec::new(),
            };
            link::send_bytes(lane.lane.link.as_fd(), &call.bytes())
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
            let ended = lane.read(&mut done)?;
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
    let mut receiver = Receiver::default();
    let mut queue: VecDeque<usize> = VecDeque::new();
    let mut no_more = false;
    let mut readable = true;
    loop {
        if signals::received().is_some() {
            calls.kill_all();
            return 0;
        }
        if readable && !no_more {
            no_more = receive_all(&mut receiver, link.as_fd());
            while let Ok(Some(frame)) = receiver.next_frame() {
                if let Frame::Call { ticket, .. } = frame {
                    queue.push_back(ticket as usize);
                }
            }
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
            if crate::link::send_bytes(link.as_fd(), &encode(done)).is_err() {
                // The sweep is gone: so are these calls.
                calls.kill_all();
                return 1;
            }
        }
    }
}

/// A call that ended, as the frames that tell the sweep: its lines (as
/// they cross the link, without their newline), then how long it ran.
fn encode(done: &Done) -> Vec<u8> {
    let ticket = done.index as u64;
    let answer = &done.answer;
    let mut bytes = Vec::new();
    for line in answer.events.iter().chain([&answer.reply]) {
        let line = line.strip_suffix(b"\n").unwrap_or(line).to_vec();
        bytes.extend(Frame::Line { ticket, line }.bytes());
    }
    let took = done.duration;
    bytes.extend(Frame::Answered { ticket, took }.bytes());
    bytes
}

impl Lane {
    /// Reads what the lane sent; the calls it answered go to `done`. True
    /// once it closed its link.
    fn read(&mut self, done: &mut Vec<Done>) -> Result<bool, String> {
        let ended = receive_all(&mut self.receiver, self.lane.link.as_fd());
        loop {
            let frame = match self.receiver.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => return Ok(ended),
                Err(error) => {
                    return Err(format!("a lane (pid {}) sent {error}", self.lane.pid));
                }
            };
            match frame {
                Frame::Line { ticket, mut line } => {
                    line.push(b'\n');
                    let answer = self.answers.entry(ticket as usize).or_default();
                    if crate::protocol::is_event(&line) {
                        answer.event(&line);
                    } else {
                        answer.reply(&line);
                    }
                }
                Frame::Answered { ticket, took } => {
                    let index = ticket as usize;
                    let answer = self.answers.remove(&index).unwrap_or_default();
                    self.outstanding.remove(&index);
                    done.push(Done::answered(index, took, answer));
                }
                other => tracing::warn!("unexpected from a lane: {other:?}"),
            }
        }
    }
}

/// Reads what the (nonblocking) socket holds now; true once it closed.
fn receive_all(receiver: &mut Receiver, link: BorrowedFd<'_>) -> bool {
    loop {
        match receiver.receive(link) {
            Ok(Received::Data) => {}
            Ok(Received::WouldBlock) => return false,
            Ok(Received::Closed) | Err(_) => return true,
        }
    }
}

/// Whether a lane exited within `limit`.
fn wait_exit(lane: &NodeZygote, limit: Duration) -> bool {
    crate::poll_set::wait_exit(lane.pid, &lane.exit, limit)
}
