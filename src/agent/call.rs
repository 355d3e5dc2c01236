//! One `run` or `compile` from the engine, served by a child of the zygote.
//!
//! The request goes to the zygote as it came (its `env` remapped); the
//! zygote forks and hands back the child's pidfd (what a cancel kills) and,
//! for a run, its line pipe. The call is followed by `link::follow`'s
//! `Follower`, the one follower of a linked call, driven here by the
//! agent's event loop: every line goes to the engine as it arrives, events
//! before the reply, and a child that ends without a reply gets the one
//! reply that says how (`NodeCancelled` after a cancel).

use std::collections::BTreeMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;
use std::time::Instant;

use serde_json::value::RawValue;
use tokio::io::unix::AsyncFd;

use super::outbox::Outbox;
use super::state::Agent;
use super::zygote::Event;
use crate::end::End;
use crate::link::Frame;
use crate::link::follow::{CallPipe, Follower};
use crate::output::CallOutput;
use crate::protocol;

/// Serves one run or compile to its end. `key` names it in the outbox's
/// table of running calls (entered before this task first ran).
pub async fn serve(
    agent: Arc<Agent>,
    outbox: Arc<Outbox>,
    key: u64,
    mut request: BTreeMap<String, Box<RawValue>>,
) {
    let started = Instant::now();
    let field =
        |name: &str| crate::python_str::python_str_or_empty(request.get(name).map(|r| &**r));
    let call_id = field("call_id");
    let op = field("op");
    let node = crate::telemetry::node_name(&field("flow"), &field("node"));
    let id = request
        .get("id")
        .map(|raw| raw.to_owned())
        .unwrap_or_else(|| raw("null"));
    let env = take_env(&mut request, agent.cuda_mask.as_deref());
    if !env.is_empty() {
        request.insert(
            "env".into(),
            raw(&serde_json::to_string(&env).expect("strings")),
        );
    }
    let line = serde_json::to_vec(&request).expect("raw JSON values serialise");
    let op_name = if op == "compile" { "compile" } else { "run" };
    let log = crate::telemetry::CallLog::start(op_name, call_id.clone(), node);
    let heartbeat = outbox.heartbeat(&call_id);
    let call = Call {
        outbox: &outbox,
        key,
        call_id: &call_id,
        id: &id,
    };
    let (detail, error_type) = if line.len() > crate::link::MAX_PAYLOAD {
        let message = format!(
            "the request is {} MiB, too big to pass to the zygote: pass large data as an artifact and send its reference",
            line.len() >> 20
        );
        call.fail("ProtocolError", &message).await;
        (message, Some("ProtocolError".to_string()))
    } else {
        follow(&agent, &call, line).await
    };
    heartbeat.abort();
    outbox.leave_call(key);
    agent.call_ended();
    if !detail.is_empty() {
        tracing::debug!(call = %call_id, seconds = started.elapsed().as_secs_f64(), "{op}: {detail}");
    }
    log.end_with(error_type.as_deref());
}

/// One call, as its lines are sent for it.
struct Call<'a> {
    outbox: &'a Outbox,
    key: u64,
    call_id: &'a str,
    id: &'a RawValue,
}

impl Call<'_> {
    /// A reply this agent writes for the call: an error no node code raised.
    async fn fail(&self, kind: &str, message: &str) {
        self.outbox
            .send_raw(&protocol::failure_reply(
                self.id,
                self.call_id,
                kind,
                message,
                "",
            ))
            .await;
    }

    /// The reply for a call that ended without its node's.
    async fn end(&self, end: End, logs: &str) {
        self.outbox
            .send_raw(&end.reply(self.id, self.call_id, logs))
            .await;
    }

    /// The child now running for the call; killed at once if cancelled.
    fn started(&self, pidfd: OwnedFd) {
        self.outbox.started(self.key, pidfd);
    }

    /// The call has its reply: a cancel no longer reaches its child, which
    /// may be a resident serving another call by then.
    fn replied(&self) {
        self.outbox.replied(self.key);
    }

    /// Whether the engine cancelled the call.
    fn cancelled(&self) -> bool {
        self.outbox.cancelled(self.key)
    }
}

/// The call's lines to the engine, as [`Follower`] reads them (the one
/// follower of a call served over a link, here driven by the agent's event
/// loop); what happened, for the log (a detail where the agent answered
/// for the call, and the reply's error type).
async fn follow(agent: &Agent, call: &Call<'_>, line: Vec<u8>) -> (String, Option<String>) {
    let remote = || Some(crate::end::REMOTE_ERROR.to_string());
    let zygote = match agent.zygote().await {
        Ok(zygote) => zygote,
        Err(why) => {
            call.end(End::Lost(why.clone()), "").await;
            return (format!("no zygote: {why}"), remote());
        }
    };
    let (ticket, mut events) = match zygote.call(line).await {
        Ok(ticket_and_events) => ticket_and_events,
        Err(why) => {
            call.end(End::Lost(why.clone()), "").await;
            return (why, remote());
        }
    };
    let mut follower = Follower::<AsyncFd<OwnedFd>>::new(ticket, call.id, call.call_id);
    let mut lines = ToSend::default();
    let mut stale = false;
    while !follower.is_over() {
        tokio::select! {
            readable = readable(follower.pipe(), stale) => {
                stale = readable.is_ok() && !follower.read_pipe(&mut lines);
            }
            event = events.recv() => {
                if call.cancelled() {
                    follower.cancel();
                }
                match event {
                    Some(Event::Frame(Frame::Started { ticket, pid, pidfd })) => {
                        // The outbox kills it on a cancel; the follower, for
                        // a line over the limit.
                        if let Ok(ours) = pidfd.try_clone() {
                            call.started(ours);
                        }
                        follower.frame(Frame::Started { ticket, pid, pidfd }, &mut lines);
                    }
                    Some(Event::Frame(frame)) => follower.frame(frame, &mut lines),
                    Some(Event::Gone(why)) => {
                        let why = format!("{why} while the call ran; a new zygote serves the next calls");
                        follower.lost(why, &mut lines);
                    }
                    None => follower.lost("the zygote dropped the call".into(), &mut lines),
                }
            }
        }
        if follower.is_over() {
            call.replied();
        }
        for line in lines.lines.drain(..) {
            call.outbox.send_raw(&line).await;
        }
    }
    zygote.done(ticket);
    (String::new(), lines.error_type.flatten())
}

/// Waits until the run's pipe is readable; never, while there is none.
/// `stale`: the last read found nothing, so the readiness seen before is
/// spent (a read must come up empty before tokio waits for the next).
async fn readable(pipe: Option<&AsyncFd<OwnedFd>>, stale: bool) -> std::io::Result<()> {
    let Some(pipe) = pipe else {
        return std::future::pending().await;
    };
    let mut guard = pipe.readable().await?;
    if stale {
        guard.clear_ready();
        guard = pipe.readable().await?;
    }
    guard.retain_ready();
    Ok(())
}

impl CallPipe for AsyncFd<OwnedFd> {
    fn hold(pipe: OwnedFd) -> std::io::Result<AsyncFd<OwnedFd>> {
        // SAFETY: an OwnedFd's fd stays open and the same until it drops,
        // which is when the AsyncFd drops.
        unsafe { AsyncFd::register_with_interest(pipe, tokio::io::Interest::READABLE) }
            .map_err(|error| error.into_parts().1)
    }
}

/// A call's lines, handed over by the follower, to be sent to the engine
/// (without their newline: one WebSocket message each).
#[derive(Default)]
struct ToSend {
    lines: Vec<Vec<u8>>,
    /// The reply's error type, once it came (`None` inside: it succeeded).
    error_type: Option<Option<String>>,
}

impl CallOutput for ToSend {
    fn event(&mut self, line: &[u8]) {
        self.lines
            .push(line.strip_suffix(b"\n").unwrap_or(line).to_vec());
    }

    fn reply(&mut self, line: &[u8]) {
        self.error_type = Some(crate::telemetry::error_type(line));
        self.event(line);
    }
}

/// The call's `env`, taken off the request: values as strings,
/// `CUDA_VISIBLE_DEVICES` read as positions in this agent's own mask. An
/// `env` the contract refuses is left in place, for the zygote to refuse
/// with its reason.
fn take_env(
    request: &mut BTreeMap<String, Box<RawValue>>,
    mask: Option<&str>,
) -> BTreeMap<String, String> {
    let Some(raw) = request.get("env") else {
        return BTreeMap::new();
    };
    let Ok(pairs) = protocol::parse_env(raw) else {
        return BTreeMap::new();
    };
    request.remove("env");
    let mut env: BTreeMap<String, String> = pairs.into_iter().collect();
    if let (Some(mask), Some(requested)) = (
        mask.filter(|m| !m.is_empty()),
        env.get("CUDA_VISIBLE_DEVICES").filter(|r| !r.is_empty()),
    ) {
        let remapped = super::env::remap_cuda(mask, requested);
        env.insert("CUDA_VISIBLE_DEVICES".into(), remapped);
    }
    env
}

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("valid JSON")
}
