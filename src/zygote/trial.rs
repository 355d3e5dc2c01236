//! A node's trial, from the zygote's side: its events go out as the
//! call's while its reply is held back (a run answers with its own), and
//! what its end says about loading the node.

use nix::unistd::Pid;

use super::assignment::TrialVerdict;
use super::flight::Landed;
use super::placement::{Home, Placement};
use super::warmup;
use crate::end::End;
use crate::output::CallOutput;
use crate::protocol::{Op, Request};

/// The error type of a node refused for the CUDA context its load makes.
pub const CUDA_AT_LOAD: &str = "NodeInitialisesCuda";

const CUDA_AT_LOAD_MESSAGE: &str = "the node initialises CUDA while it loads (a .cuda(), a tensor \
     or array on the GPU, at module level), and a CUDA context does not survive a fork: under \
     --isolation call each call's child would load the node and make its own context again \
     (seconds each). Make the GPU work happen in the function (load the model on the first \
     call and keep it in a global), or run with --isolation node (FLUKSIO_ISOLATION=node), \
     where each resident child loads the node once and serves its calls in turn";

/// The held-back reply of a trial: a run serves its own reply after it.
#[derive(Default)]
pub(super) struct HeldReply {
    line: Vec<u8>,
}

impl HeldReply {
    pub(super) fn line(&self) -> &[u8] {
        &self.line
    }

    /// Sends it on, where the trial got as far as one.
    pub(super) fn send_to(&self, out: &mut dyn CallOutput) {
        if !self.line.is_empty() {
            out.reply(&self.line);
        }
    }
}

/// A trial's events go out as the call's; its reply is held.
pub(super) struct TrialOutput<'a> {
    events: &'a mut dyn CallOutput,
    reply: &'a mut HeldReply,
}

impl<'a> TrialOutput<'a> {
    pub(super) fn new(events: &'a mut dyn CallOutput, reply: &'a mut HeldReply) -> TrialOutput<'a> {
        TrialOutput { events, reply }
    }
}

impl CallOutput for TrialOutput<'_> {
    fn event(&mut self, line: &[u8]) {
        self.events.event(line);
    }

    fn reply(&mut self, line: &[u8]) {
        self.reply.line = line.to_vec();
    }

    /// The trial's child is the call's while it runs: a cancel kills it.
    fn started(&mut self, pid: Pid) {
        self.events.started(pid);
    }
}

/// What a trial that ran to its end says about loading its node.
pub(super) struct Loading<'r> {
    /// How the node loaded, where the trial got to say (`None`: it did not).
    pub(super) verdict: Option<TrialVerdict>,
    /// Why the trial refused the node's warm-up, where it did.
    refused: Option<String>,
    /// The `--warmup` keyword arguments of the request.
    warmup: Option<&'r str>,
}

impl<'r> Loading<'r> {
    /// Reads the end of `request`'s trial. A run whose trial replied but
    /// was killed before its verdict gets the reply that says so, in `held`.
    pub(super) fn after(
        request: &'r Request,
        landed: &Landed,
        held: &mut HeldReply,
        placement: &Placement,
    ) -> Loading<'r> {
        let verdict = match landed.reaped.end {
            crate::process::ChildEnd::Exited(code) if landed.replied => {
                TrialVerdict::from_exit_code(code)
            }
            _ => None,
        };
        // Refused in the trial, the warm-up is not run here either.
        let refused = warmup::refusal_in(&landed.logs.take_report());
        if request.op == Op::Run && verdict.is_none() && landed.replied {
            // It loaded and replied, then was killed before it could say
            // whether the zygote may keep it: the run never started.
            let message = format!(
                "the node's loading process {} after it loaded, so the run did not start",
                landed.reaped.end
            );
            held.line = End::Lost(message).reply(&request.id, &request.call_id, "");
        }
        if verdict == Some(TrialVerdict::LoadedWithCuda) && placement.home(verdict) == Home::Nowhere
        {
            held.line = crate::protocol::failure_line(
                &request.id,
                &request.call_id,
                CUDA_AT_LOAD,
                CUDA_AT_LOAD_MESSAGE,
                CUDA_AT_LOAD_MESSAGE,
                "",
            );
        }
        Loading {
            verdict,
            refused,
            warmup: request
                .warmup
                .as_deref()
                .map(serde_json::value::RawValue::get),
        }
    }

    /// The node's warm-up: its `--warmup` arguments (`None`: the node's
    /// own, if it asks), or why it is refused.
    pub(super) fn warm(&self) -> Result<Option<&str>, &str> {
        match &self.refused {
            Some(why) => Err(why.as_str()),
            None => Ok(self.warmup),
        }
    }
}
