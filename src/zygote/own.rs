//! A node's own zygote, from the side of the zygote that forked it for the
//! worker: the node's calls go down its link, and their lines come back.

use std::os::fd::AsFd;

use nix::unistd::Pid;

use super::app::NodeZygote;
use crate::link::NotReady;
use crate::link::client::{Client, LinkLost};
use crate::output::CallOutput;
use crate::protocol::Request;

/// A node's own zygote: calls go down its link.
pub(super) struct OwnZygote {
    node_zygote: NodeZygote,
    client: Client,
}

impl OwnZygote {
    /// Takes a node zygote once it says it is ready; ends it where it is not.
    pub(super) fn when_ready(node_zygote: NodeZygote) -> Result<OwnZygote, String> {
        let mut client = Client::default();
        match client.wait_ready(node_zygote.link.as_fd()) {
            Ok(()) => Ok(OwnZygote {
                node_zygote,
                client,
            }),
            Err(not) => {
                let pid = node_zygote.pid;
                node_zygote.end();
                Err(match not {
                    NotReady::Failed(message) => message,
                    NotReady::Said(other) => format!("it said {other:?} before it was ready"),
                    NotReady::Closed => format!("it ended as it started (pid {pid})"),
                })
            }
        }
    }

    pub(super) fn pid(&self) -> Pid {
        self.node_zygote.pid
    }

    /// Serves `request` there: the request down its link, its lines back to
    /// `out`. `Err` where its zygote ended during the call: the caller ends
    /// it, then answers ([`LinkLost`]).
    pub(super) fn relay(
        &mut self,
        request: &Request,
        out: &mut dyn CallOutput,
    ) -> Result<(), LinkLost> {
        self.client.call(
            self.node_zygote.link.as_fd(),
            request.to_worker_line(),
            (&request.id, &request.call_id),
            out,
        )
    }

    /// Ends it, and whatever its calls left.
    pub(super) fn end(self) {
        self.node_zygote.end();
    }
}
