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

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use nix::unistd::Pid;
use pyo3::prelude::*;

use super::{MUST_RESTART, Server};
use crate::zygote::Zygote;
use crate::zygote::flight::FALLBACK_POLL_MS;

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
            for index in ready.exited.into_iter().rev() {
                let run = self.runs.swap_remove(index);
                self.land(zygote, run);
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
        let mut fds = Vec::new();
        if let Some(listener) = &self.listener {
            fds.push(PollFd::new(listener.as_fd(), interest));
        }
        let first_link = fds.len();
        for link in &self.links {
            fds.push(PollFd::new(link.socket.as_fd(), interest));
        }
        // Each node zygote: its socket, then its exit.
        let first_relay = fds.len();
        for relay in &self.node_zygotes {
            let mut flags = PollFlags::POLLIN;
            if !relay.outbox.is_empty() {
                flags |= PollFlags::POLLOUT;
            }
            fds.push(PollFd::new(relay.node_zygote.link.as_fd(), flags));
            match relay.node_zygote.exit.fd() {
                Some(fd) => fds.push(PollFd::new(fd, PollFlags::POLLIN)),
                // Without pidfds its socket closing says it ended.
                None => fds.push(PollFd::new(
                    relay.node_zygote.link.as_fd(),
                    PollFlags::empty(),
                )),
            }
        }
        let first_lane = fds.len();
        let mut watched_all = true;
        for (_, exit) in &self.lanes {
            match exit.fd() {
                Some(fd) => fds.push(PollFd::new(fd, PollFlags::POLLIN)),
                None => watched_all = false,
            }
        }
        let first_run = fds.len();
        let mut owners = Vec::new();
        for (index, run) in self.runs.iter().enumerate() {
            match run.flight.exit_poll() {
                Some(fd) => {
                    fds.push(fd);
                    owners.push(index);
                }
                None => watched_all = false,
            }
        }
        let timeout = match (watched_all, linger) {
            (true, None) => PollTimeout::NONE,
            (true, Some(linger)) => {
                PollTimeout::try_from(linger.as_millis() as u64).unwrap_or(PollTimeout::MAX)
            }
            (false, _) => PollTimeout::from(FALLBACK_POLL_MS),
        };
        match poll(&mut fds, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(error) => return Err(error.into()),
        }
        let is_ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
        let has =
            |fd: &PollFd<'_>, flag: PollFlags| fd.revents().is_some_and(|r| r.intersects(flag));
        let accept = taking_calls && self.listener.is_some() && is_ready(&fds[0]);
        // A closed link reads as POLLHUP even when calls are not taken.
        let links = self
            .links
            .iter()
            .zip(&fds[first_link..first_relay])
            .filter(|(_, fd)| is_ready(fd))
            .map(|(link, _)| link.id)
            .collect();
        let mut relayed = Vec::new();
        let mut writable = Vec::new();
        let mut ended = Vec::new();
        for (relay, pair) in self
            .node_zygotes
            .iter()
            .zip(fds[first_relay..first_lane].chunks(2))
        {
            let pid = relay.node_zygote.pid;
            if has(
                &pair[0],
                PollFlags::POLLIN | PollFlags::POLLHUP | PollFlags::POLLERR,
            ) {
                relayed.push(pid);
            }
            if has(&pair[0], PollFlags::POLLOUT) {
                writable.push(pid);
            }
            if relay.node_zygote.exit.fd().is_some() && is_ready(&pair[1]) {
                ended.push(pid);
            }
        }
        let mut watched = fds[first_lane..first_run].iter();
        let lanes_ended = self
            .lanes
            .iter()
            .filter(|(pid, exit)| match exit.fd() {
                Some(_) => watched.next().is_some_and(is_ready),
                None => crate::process::has_exited(*pid),
            })
            .map(|(pid, _)| *pid)
            .collect();
        let mut exited: Vec<usize> = owners
            .iter()
            .zip(&fds[first_run..])
            .filter(|(_, fd)| is_ready(fd))
            .map(|(&i, _)| i)
            .collect();
        if !watched_all {
            exited.extend((0..self.runs.len()).filter(|&i| {
                self.runs[i].flight.exit_poll().is_none() && self.runs[i].flight.has_exited()
            }));
            exited.sort_unstable();
            exited.dedup();
        }
        Ok(Ready {
            accept,
            links,
            exited,
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
    /// Node zygotes with frames to read (or a closed socket).
    relayed: Vec<Pid>,
    /// Node zygotes whose socket takes more of their outbox.
    writable: Vec<Pid>,
    /// Node zygotes that exited.
    ended: Vec<Pid>,
    /// In a node zygote: lanes it forked that exited.
    lanes_ended: Vec<Pid>,
}
