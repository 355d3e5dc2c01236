//! A server's one thread: blocked in `poll` on every fd that can bring it
//! work (the listener, each link, each node zygote's socket and exit, each
//! lane's and run's exit), then handling what is ready. The zygote forks
//! its children from this thread, so it must stay the only one.
//!
//! A shared zygote whose last slot left lingers a while: the pool respawns
//! a killed slot at once, and it should find the zygote warm. Once forking
//! became unsafe, no new call is taken; the runs in flight, each forked
//! safely, land and are reported before the zygote exits for a new one.

use std::os::fd::AsFd;

use nix::poll::PollFlags;
use nix::unistd::Pid;
use pyo3::prelude::*;

use super::{MUST_RESTART, RunChild, Server};
use crate::poll_set::{Key, PollSet};
use crate::zygote::Zygote;

impl Server {
    pub(super) fn serve(&mut self, py: Python<'_>, zygote: &mut Zygote) -> u8 {
        // Set once forking became unsafe: no new call is taken, the runs in
        // flight (each forked safely) land and are reported, then the zygote
        // exits for a new one to be started.
        let mut restarting = false;
        // Since when no link is open (a shared zygote lingers then).
        let mut alone_since: Option<std::time::Instant> = None;
        loop {
            if restarting && self.runs.is_empty() && self.routes.is_empty() {
                return MUST_RESTART;
            }
            let linger = if self.links.is_empty() {
                match (&self.listener, self.next_link) {
                    // The agent's link closed.
                    (None, _) => return 0,
                    // A shared zygote's last slot left: the pool respawns a
                    // killed slot at once, and it should find the zygote warm.
                    (Some(_), n) if n > 0 => {
                        let since = *alone_since.get_or_insert_with(std::time::Instant::now);
                        Some(shared_linger().saturating_sub(since.elapsed()))
                    }
                    _ => None,
                }
            } else {
                alone_since = None;
                None
            };
            let ready = match self.wait(!restarting, linger) {
                Ok(ready) => ready,
                Err(error) => {
                    tracing::error!("the zygote lost track of its links: {error}");
                    return 1;
                }
            };
            // Its time alone is up, with nothing in flight (a node zygote's
            // news may wake it before then).
            let lingered = alone_since.is_some_and(|since| since.elapsed() >= shared_linger());
            if lingered
                && self.links.is_empty()
                && !ready.accept
                && self.runs.is_empty()
                && self.routes.is_empty()
            {
                return 0;
            }
            // Highest first, so that each swap_remove leaves the lower
            // indices in place.
            let mut news: Vec<(usize, bool)> = (ready.exited.into_iter().map(|i| (i, true)))
                .chain(ready.worded.into_iter().map(|i| (i, false)))
                .collect();
            news.sort_unstable_by_key(|&(index, _)| std::cmp::Reverse(index));
            for (index, exited) in news {
                if exited {
                    let run = self.runs.swap_remove(index);
                    self.land(zygote, run);
                } else {
                    self.heard(zygote, index);
                }
            }
            for pid in ready.writable {
                self.flush_to(pid);
            }
            for pid in ready.relayed {
                self.read_node_zygote(pid);
            }
            for pid in ready.ended {
                self.node_zygote_ended(pid);
            }
            for pid in ready.lanes_ended {
                self.lane_ended(pid);
            }
            if ready.accept {
                self.accept();
            }
            for id in ready.links {
                if self.read_link(py, zygote, id) {
                    restarting = true;
                }
            }
        }
    }

    /// Waits for a frame, a slot, a run's exit, or news of a node's zygote.
    fn wait(
        &self,
        taking_calls: bool,
        linger: Option<std::time::Duration>,
    ) -> std::io::Result<Ready> {
        let interest = if taking_calls {
            PollFlags::POLLIN
        } else {
            PollFlags::empty()
        };
        let mut set = PollSet::new();
        let listener = (self.listener.as_ref()).map(|listener| set.fd(listener.as_fd(), interest));
        let links: Vec<Key> = (self.links.iter())
            .map(|link| set.fd(link.socket.as_fd(), interest))
            .collect();
        // Each node zygote: its socket, then its exit.
        let relays: Vec<(Key, Key)> = (self.node_zygotes.iter())
            .map(|relay| {
                let mut flags = PollFlags::POLLIN;
                if !relay.outbox.is_empty() {
                    flags |= PollFlags::POLLOUT;
                }
                let node_zygote = &relay.node_zygote;
                let socket = set.fd(node_zygote.link.as_fd(), flags);
                (socket, set.exit(node_zygote.pid, &node_zygote.exit))
            })
            .collect();
        let lanes: Vec<Key> = (self.lanes.iter())
            .map(|(pid, exit)| set.exit(*pid, exit))
            .collect();
        // Each run: its child's exit, and a resident's word after its call.
        let runs: Vec<(Key, Option<Key>)> = (self.runs.iter())
            .map(|run| {
                let exit = run.flight().watch_exit(&mut set);
                let word = match &run.child {
                    RunChild::Resident {
                        resident,
                        silent: false,
                    } => Some(set.fd(resident.control(), PollFlags::POLLIN)),
                    _ => None,
                };
                (exit, word)
            })
            .collect();
        set.wait(linger)?;
        let accept = taking_calls && listener.is_some_and(|listener| set.ready(listener));
        // A closed link reads as POLLHUP even when calls are not taken.
        let links = (self.links.iter().zip(links))
            .filter(|(_, key)| set.ready(*key))
            .map(|(link, _)| link.id)
            .collect();
        let mut relayed = Vec::new();
        let mut writable = Vec::new();
        let mut ended = Vec::new();
        for (relay, (socket, exit)) in self.node_zygotes.iter().zip(relays) {
            let pid = relay.node_zygote.pid;
            if set.has(
                socket,
                PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR,
            ) {
                relayed.push(pid);
            }
            if set.has(socket, PollFlags::POLLOUT) {
                writable.push(pid);
            }
            if set.ready(exit) {
                ended.push(pid);
            }
        }
        let lanes_ended = (self.lanes.iter().zip(lanes))
            .filter(|(_, key)| set.ready(*key))
            .map(|((pid, _), _)| *pid)
            .collect();
        let mut exited = Vec::new();
        let mut worded = Vec::new();
        for (index, (exit, word)) in runs.into_iter().enumerate() {
            if set.ready(exit) {
                exited.push(index);
            } else if word.is_some_and(|word| set.ready(word)) {
                worded.push(index);
            }
        }
        Ok(Ready {
            accept,
            links,
            exited,
            worded,
            relayed,
            writable,
            ended,
            lanes_ended,
        })
    }
}

/// How long a shared zygote outlives its last slot, waiting for a new one
/// (`FLUKSIO_SHARED_ZYGOTE_LINGER_S`, default 10 s).
fn shared_linger() -> std::time::Duration {
    std::env::var("FLUKSIO_SHARED_ZYGOTE_LINGER_S")
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s >= 0.0)
        .map_or(
            std::time::Duration::from_secs(10),
            std::time::Duration::from_secs_f64,
        )
}

/// What a wait found ready.
struct Ready {
    accept: bool,
    links: Vec<u64>,
    /// Indices of runs whose child has exited, ascending.
    exited: Vec<usize>,
    /// Indices of runs whose resident has something to say, ascending.
    worded: Vec<usize>,
    /// Node zygotes with frames to read (or a closed socket).
    relayed: Vec<Pid>,
    /// Node zygotes whose socket takes more of their outbox.
    writable: Vec<Pid>,
    /// Node zygotes that exited.
    ended: Vec<Pid>,
    /// In a node zygote: lanes it forked that exited.
    lanes_ended: Vec<Pid>,
}
