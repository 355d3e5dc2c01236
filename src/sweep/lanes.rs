//! A sweep's lanes: more fork loops for its calls, one per few cores.
//!
//! The issue this solves: one zygote forks one child at a time, on one
//! core, and follows and reaps every call itself; on a machine of many
//! cores that single loop caps a sweep of short calls, however many are in
//! flight. So once the node is loaded (and every call checked against it),
//! the sweep forks *lanes*: each a fork of its zygote, the node loaded as
//! there, serving the link as a node's own zygote does (`zygote::server`,
//! the same lanes the agent and a shared zygote fork for a busy node). Each
//! forks and reaps its share of the calls with its own standby children;
//! the sweep sends each point as a request (`Call`, its ticket the point's
//! index) and follows its call as every owner of a link does
//! (`link::follow::Follower`): the child's pipe, handed over, read here.
//!
//! A lane dies with the sweep (a parent-death SIGKILL; the sweep's warden
//! ends its cells). Stopped (Ctrl-C, a closed output), the sweep kills each
//! call in flight through its pidfd and closes the lanes' links: a lane
//! ends the runs of a link that closed, with their cells, and exits.
//!
//! `--timeout` is the sweep's to keep: past it a call's child is killed
//! through its pidfd, and its reply is a `NodeTimeout` failure.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd};
use std::time::{Duration, Instant};

use nix::poll::PollFlags;
use pyo3::prelude::*;

use super::calls::{Answer, Done, Node};
use super::points::Points;
use crate::link::follow::Follower;
use crate::link::{self, Frame, Received, Receiver};
use crate::poll_set::{Key, PollSet};
use crate::protocol::Op;
use crate::zygote::Zygote;
use crate::zygote::app::{self, NodeZygote};
use crate::zygote::device::Gpu;
use crate::zygote::node::NodeKey;
use crate::zygote::server::{self, Contract};

/// How long a wait may block: a signal that lands between checking for it
/// and polling is seen within this.
const WAKE_MS: u64 = 200;

/// How many lanes, and calls in flight in each, for `jobs` calls in
/// flight: `lanes` if given, else one per [`app::CORES_PER_LANE`] cores; at
/// most one per call.
pub fn shape(jobs: usize, lanes: Option<usize>) -> (usize, usize) {
    let lanes = lanes
        .unwrap_or_else(|| app::default_lanes(crate::zygote::threads::cpus()))
        .min(jobs)
        .max(1);
    (lanes, jobs.div_ceil(lanes))
}

/// The sweep's side of one lane.
struct Lane {
    lane: NodeZygote,
    /// Its GPU slot's position in `--gpus`.
    gpu: Option<usize>,
    receiver: Receiver,
    /// Its calls in flight, by point index.
    calls: HashMap<usize, InFlight>,
}

/// One point's call, followed.
struct InFlight {
    follower: Follower,
    answer: Answer,
    /// When it was sent (its duration counts from then), and when its
    /// child was seen started (its `--timeout` counts from then).
    sent: Instant,
    started: Option<Instant>,
    /// Its child was killed past `--timeout`.
    timed_out: bool,
}

/// The lanes of a sweep, seen from the sweep.
pub struct Lanes {
    lanes: Vec<Lane>,
    per_lane: usize,
    node: Node,
    timeout: Option<Duration>,
}

impl Lanes {
    /// Forks `count` lanes from `zygote`, which has `node` loaded; each
    /// serves `per_lane` calls in flight, each ended past `timeout`. With
    /// `gpus`, one lane per GPU, its children seeing that GPU alone.
    pub fn start(
        py: Python<'_>,
        zygote: &mut Zygote,
        node: &Node,
        (count, per_lane): (usize, usize),
        timeout: Option<Duration>,
        gpus: &[Gpu],
    ) -> Result<Lanes, String> {
        let count = if gpus.is_empty() { count } else { gpus.len() };
        let key = NodeKey {
            flow: node.flow.clone(),
            node: node.name.clone(),
        };
        let mut lanes = Vec::with_capacity(count);
        for position in 0..count {
            let gpu = gpus.get(position);
            let lane = server::spawn_node_zygote(py, zygote, &key, Contract::Worker, None, gpu)
                .map_err(|e| format!("could not fork a lane: {e}"))?;
            crate::fds::set_nonblocking(lane.link.as_raw_fd());
            // Fds wait in it claimed: no child forked here may hold one.
            let mut receiver = Receiver::claiming();
            let ready = link::wait_ready(lane.link.as_fd(), &mut receiver);
            let pid = lane.pid;
            lanes.push(Lane {
                lane,
                gpu: gpu.map(|_| position),
                receiver,
                calls: HashMap::new(),
            });
            if let Err(why) = ready {
                Lanes::stop_all(&mut lanes);
                return Err(format!("a lane (pid {pid}) did not start: {why:?}"));
            }
        }
        Ok(Lanes {
            lanes,
            per_lane,
            node: node.clone(),
            timeout,
        })
    }

    pub fn in_flight(&self) -> usize {
        self.lanes.iter().map(|lane| lane.calls.len()).sum()
    }

    /// Hands out the points of `todo` from its `next` on, to lanes with
    /// room, the least loaded first.
    pub fn fill(
        &mut self,
        next: &mut usize,
        todo: &[usize],
        points: &Points,
    ) -> Result<(), String> {
        while *next < todo.len() {
            let per_lane = self.per_lane;
            let Some(lane) = self
                .lanes
                .iter_mut()
                .filter(|lane| lane.calls.len() < per_lane)
                .min_by_key(|lane| lane.calls.len())
            else {
                break;
            };
            let index = todo[*next];
            let request = self
                .node
                .request(Op::Run, &index.to_string(), Some(&points.get(index)));
            let call = Frame::Call {
                ticket: index as u64,
                request: request.to_worker_line(),
            };
            link::send(lane.lane.link.as_fd(), &call)
                .map_err(|e| format!("a lane (pid {}) is gone: {e}", lane.lane.pid))?;
            lane.calls.insert(
                index,
                InFlight {
                    follower: Follower::new(index as u64, &request.id, ""),
                    answer: Answer::default(),
                    sent: Instant::now(),
                    started: None,
                    timed_out: false,
                },
            );
            *next += 1;
        }
        Ok(())
    }

    /// Waits (a little while at most) for the calls' frames and lines;
    /// returns the calls that ended. A lane that ends with calls in flight
    /// is an error.
    pub fn step(&mut self) -> Result<Vec<Done>, String> {
        let (links, pipes): (Vec<bool>, Vec<Vec<usize>>) = {
            let mut set = PollSet::new();
            let mut watched: Vec<(Key, Vec<(usize, Key)>)> = Vec::new();
            for lane in &self.lanes {
                let link = set.fd(lane.lane.link.as_fd(), PollFlags::POLLIN);
                let pipes = (lane.calls.iter())
                    .filter_map(|(&index, call)| {
                        let pipe = call.follower.pipe()?;
                        Some((index, set.fd(pipe.as_fd(), PollFlags::POLLIN)))
                    })
                    .collect();
                watched.push((link, pipes));
            }
            set.wait(Some(self.until_next_deadline()))
                .map_err(|e| format!("poll failed: {e}"))?;
            watched
                .into_iter()
                .map(|(link, pipes)| {
                    let ready = pipes.into_iter().filter(|&(_, pipe)| set.ready(pipe));
                    (set.ready(link), ready.map(|(index, _)| index).collect())
                })
                .unzip()
        };
        let mut done = Vec::new();
        for ((lane, link_ready), ready_pipes) in self.lanes.iter_mut().zip(links).zip(pipes) {
            for index in ready_pipes {
                if let Some(call) = lane.calls.get_mut(&index) {
                    let _ = call.follower.read_pipe(&mut call.answer);
                }
            }
            if link_ready {
                lane.read_frames()?;
            }
            if let Some(timeout) = self.timeout {
                for call in lane.calls.values_mut() {
                    let started = call.started.filter(|_| !call.timed_out);
                    if started.is_some_and(|started| started.elapsed() >= timeout) {
                        call.follower.time_out(timeout);
                        call.timed_out = true;
                    }
                }
            }
            lane.take_done(&mut done);
        }
        Ok(done)
    }

    /// How long until the nearest `--timeout`, at most [`WAKE_MS`].
    fn until_next_deadline(&self) -> Duration {
        let wake = Duration::from_millis(WAKE_MS);
        let Some(timeout) = self.timeout else {
            return wake;
        };
        (self.lanes.iter())
            .flat_map(|lane| lane.calls.values())
            .filter(|call| !call.timed_out)
            .filter_map(|call| call.started)
            .map(|started| (started + timeout).saturating_duration_since(Instant::now()))
            .fold(wake, Duration::min)
    }

    /// Ends every lane, and with it its calls in flight: each call's child
    /// killed, each link closed (its lane ends its runs, with their cells,
    /// and exits), each lane waited for. The indices of the calls that were
    /// in flight, ascending.
    pub fn stop(&mut self) -> Vec<usize> {
        let mut ended: Vec<usize> = Vec::new();
        for lane in &self.lanes {
            for (&index, call) in &lane.calls {
                call.follower.kill();
                ended.push(index);
            }
        }
        ended.sort_unstable();
        Lanes::stop_all(&mut self.lanes);
        ended
    }

    /// Closes each lane's link (it ends the runs of that link, with their
    /// cells, and exits), waits for it, and ends it.
    fn stop_all(lanes: &mut Vec<Lane>) {
        for Lane { lane, .. } in lanes.drain(..) {
            let _ =
                nix::sys::socket::shutdown(lane.link.as_raw_fd(), nix::sys::socket::Shutdown::Both);
            if !crate::poll_set::wait_exit(lane.pid, &lane.exit, Duration::from_secs(5)) {
                tracing::warn!(pid = lane.pid.as_raw(), "a lane did not stop; killing it");
            }
            lane.end();
        }
    }
}

impl Lane {
    /// Takes what the lane sent, each frame to the call it is about.
    fn read_frames(&mut self) -> Result<(), String> {
        let closed = loop {
            match self.receiver.receive(self.lane.link.as_fd()) {
                Ok(Received::Data) => {}
                Ok(Received::WouldBlock) => break false,
                Ok(Received::Closed) | Err(_) => break true,
            }
        };
        loop {
            let frame = match self.receiver.next_frame() {
                Ok(Some(frame)) => frame,
                Ok(None) => break,
                Err(why) => return Err(format!("a lane (pid {}) sent {why}", self.lane.pid)),
            };
            let Some(call) = frame
                .ticket()
                .and_then(|ticket| self.calls.get_mut(&(ticket as usize)))
            else {
                // A call that is over: its late news (how its child ended).
                continue;
            };
            if matches!(frame, Frame::Started { .. }) {
                call.started = Some(Instant::now());
            }
            call.follower.frame(frame, &mut call.answer);
        }
        let unfinished = self
            .calls
            .values()
            .filter(|c| !c.follower.is_over())
            .count();
        if closed && unfinished > 0 {
            return Err(format!(
                "a lane (pid {}) ended with {unfinished} calls unfinished",
                self.lane.pid
            ));
        }
        Ok(())
    }

    /// The calls that are over, to `done`.
    fn take_done(&mut self, done: &mut Vec<Done>) {
        let over: Vec<usize> = (self.calls.iter())
            .filter(|(_, call)| call.follower.is_over())
            .map(|(&index, _)| index)
            .collect();
        for index in over {
            let call = self.calls.remove(&index).expect("listed above");
            // From the request sent: its `Started` frame may be read only
            // after the call is over.
            let replied = call.answer.replied_at().unwrap_or_else(Instant::now);
            let duration = replied - call.sent;
            done.push(Done::answered(index, duration, call.answer, self.gpu));
        }
    }
}
