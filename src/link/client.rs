//! The owner's side of a link, one call at a time, from a thread that may
//! block: a pool slot and its shared zygote, a zygote and a node's own
//! zygote. (The agent's side, many calls at once from async tasks, is
//! `crate::agent::zygote`; both follow a call with [`Follower`].)

use std::os::fd::{AsFd, BorrowedFd};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use serde_json::value::RawValue;

use super::follow::Follower;
use super::{Frame, NotReady, Receiver};
use crate::output::CallOutput;

/// Calls over one link, and what has arrived on it: frames outlive the call
/// they were read with (a frame can arrive in two reads).
#[derive(Default)]
pub struct Client {
    receiver: Receiver,
    next_ticket: u64,
}

/// The link closed (the serving process ended) before the call was over.
/// The call is the caller's to answer, once it has ended what served it
/// ([`Follower::lost`]).
pub struct LinkLost(pub Box<Follower>);

/// The link closed, or could not be read.
struct Closed;

impl Client {
    /// Blocks for the link's first frame: `Ready`, or why not.
    pub fn wait_ready(&mut self, link: BorrowedFd<'_>) -> Result<(), NotReady> {
        super::wait_ready(link, &mut self.receiver)
    }

    /// Serves one request over `link`: the request sent, its lines to `out`
    /// until its reply. `Err` where the link closed first: it is of no more
    /// use, and the call is not over.
    pub fn call(
        &mut self,
        link: BorrowedFd<'_>,
        request: Vec<u8>,
        (id, call_id): (&RawValue, &str),
        out: &mut dyn CallOutput,
    ) -> Result<(), LinkLost> {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let mut follower = Follower::new(ticket, id, call_id);
        let followed = match super::send(link, &Frame::Call { ticket, request }) {
            Ok(()) => self.follow(link, &mut follower, out),
            Err(_) => Err(Closed),
        };
        followed.map_err(|Closed| LinkLost(Box::new(follower)))
    }

    fn follow(
        &mut self,
        link: BorrowedFd<'_>,
        follower: &mut Follower,
        out: &mut dyn CallOutput,
    ) -> Result<(), Closed> {
        loop {
            while !follower.is_over()
                && let Some(frame) = self.receiver.next_frame().map_err(|_| Closed)?
            {
                follower.frame(frame, out);
            }
            if follower.is_over() {
                return Ok(());
            }
            let (link_ready, pipe_ready) = {
                let mut fds = vec![PollFd::new(link, PollFlags::POLLIN)];
                fds.extend(
                    follower
                        .pipe()
                        .map(|pipe| PollFd::new(pipe.as_fd(), PollFlags::POLLIN)),
                );
                match poll(&mut fds, PollTimeout::NONE) {
                    Ok(_) | Err(nix::errno::Errno::EINTR) => {}
                    Err(_) => return Err(Closed),
                }
                let ready = |fd: &PollFd<'_>| fd.revents().is_some_and(|r| !r.is_empty());
                (ready(&fds[0]), fds.get(1).is_some_and(ready))
            };
            if pipe_ready {
                let _ = follower.read_pipe(out);
            } else if link_ready {
                self.receive(link)?;
            }
        }
    }

    /// One read of the link, waiting for it if there is nothing yet.
    fn receive(&mut self, link: BorrowedFd<'_>) -> Result<(), Closed> {
        self.receiver
            .receive_waiting(link)
            .then_some(())
            .ok_or(Closed)
    }
}
