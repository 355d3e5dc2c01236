//! A node's own zygote, from the side of the zygote that forked it for the
//! worker: the node's calls go down its link, and their lines come back.

use std::os::fd::AsFd;

use nix::unistd::Pid;

use super::app::{self, NodeZygote};
use super::node::NodeKey;
use crate::end::End;
use crate::link::follow::{Followed, follow};
use crate::link::{Frame, Receiver};
use crate::output::CallOutput;
use crate::protocol::Request;

/// A node's own zygote: calls go down its link.
pub(super) struct OwnZygote {
    node_zygote: NodeZygote,
    next_ticket: u64,
}

/// Its zygote ended during a call.
pub(super) struct Lost {
    pid: Pid,
    /// Whether the call's reply had come back before.
    replied: bool,
}

impl OwnZygote {
    /// Takes a node zygote once it says it is ready; ends it where it is not.
    pub(super) fn when_ready(node_zygote: NodeZygote) -> Result<OwnZygote, String> {
        let mut receiver = Receiver::default();
        match app::wait_ready(&node_zygote, &mut receiver) {
            Ok(()) => Ok(OwnZygote {
                node_zygote,
                next_ticket: 0,
            }),
            Err(why) => {
                node_zygote.end();
                Err(why)
            }
        }
    }

    pub(super) fn pid(&self) -> Pid {
        self.node_zygote.pid
    }

    /// Serves `request` there: the request down its link, its lines back to
    /// `out`. Where its zygote has ended, the caller ends it and answers
    /// ([`Lost::answer`]).
    pub(super) fn relay(&mut self, request: &Request, out: &mut dyn CallOutput) -> Option<Lost> {
        self.next_ticket += 1;
        let ticket = self.next_ticket;
        let call = Frame::Call {
            ticket,
            request: request.to_worker_line(),
        };
        let followed = match app::send(&self.node_zygote, &call) {
            Ok(()) => follow(
                self.node_zygote.link.as_fd(),
                ticket,
                &request.id,
                &request.call_id,
                out,
            ),
            Err(_) => Followed::LinkLost { replied: false },
        };
        match followed {
            Followed::LinkLost { replied } => Some(Lost {
                pid: self.node_zygote.pid,
                replied,
            }),
            Followed::Done => None,
        }
    }

    /// Ends it, and whatever its calls left.
    pub(super) fn end(self) {
        self.node_zygote.end();
    }
}

impl Lost {
    /// The call's reply, where its zygote ended before it came: the node is
    /// forgotten, so its next request loads it again.
    pub(super) fn answer(self, key: &NodeKey, request: &Request, out: &mut dyn CallOutput) {
        if !self.replied {
            let pid = self.pid;
            let message = format!(
                "the zygote of node {key} (pid {pid}) ended during the call; the node's next call \
                 loads it again"
            );
            out.reply(&End::Lost(message).reply(&request.id, &request.call_id, ""));
        }
    }
}
