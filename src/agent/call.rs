//! One `run` or `compile` from the engine, served by a child of the zygote.
//!
//! The request goes to the zygote as it came (its `env` remapped); the
//! zygote forks and hands back the child's pidfd (what a cancel kills) and,
//! for a run, its line pipe, which is read here: every line goes to the
//! engine as it arrives, events before the reply. A child that ends without
//! a reply gets one written here, saying how it ended.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::Arc;
use std::time::Instant;

use serde_json::value::RawValue;

use super::outbox::Outbox;
use super::state::Agent;
use super::zygote::Event;
use crate::end::End;
use crate::lines::{LineBuffer, Piece, TooLarge};
use crate::link::Frame;
use crate::process::ChildEnd;
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

    /// Kills the call's child now, not as a cancel.
    fn kill_child(&self) {
        self.outbox.kill_child(self.key);
    }

    /// Whether the engine cancelled the call.
    fn cancelled(&self) -> bool {
        self.outbox.cancelled(self.key)
    }
}

/// What ended a call, as it is followed.
enum Until {
    /// With the reply's error type (`None`: it succeeded).
    Replied(Option<String>),
    /// The child's lines ended with no reply; wait for how it ended.
    Silent,
    /// The zygote said how the child ended (it wrote no reply).
    Ended(ChildEnd, String),
    Gone(String),
    /// A line over `--max-reply-mb`: the child was killed.
    TooLarge(TooLarge),
}

/// The call's lines to the engine; what happened, for the log (a detail
/// where the agent answered for the call, and the reply's error type).
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
    let until = loop {
        let Some(event) = events.recv().await else {
            break Until::Gone("the zygote dropped the call".into());
        };
        match event {
            Event::Frame(Frame::Started { pidfd, .. }) => call.started(pidfd),
            Event::Frame(Frame::Line { line, .. }) => {
                if protocol::is_event(&line) {
                    call.outbox.send_raw(&line).await;
                    continue;
                }
                // The zygote answered for a child it saw die; if that was our
                // cancel, the engine hears NodeCancelled.
                let cancelled = call
                    .cancelled()
                    .then(|| crate::end::as_cancelled(&line))
                    .flatten();
                let reply = cancelled.as_deref().unwrap_or(&line);
                call.outbox.send_raw(reply).await;
                break Until::Replied(crate::telemetry::error_type(reply));
            }
            Event::Frame(Frame::Pipe { pipe, .. }) => {
                match forward_pipe(call, pipe, &mut events).await {
                    Until::Silent => {}
                    other => break other,
                }
            }
            Event::Frame(Frame::Ended { end, logs, .. }) => break Until::Ended(end, logs),
            // The zygote is done with a request it never answered (a frame it
            // could not send): the call still gets a reply.
            Event::Frame(Frame::Done { .. }) => {
                break Until::Gone("the zygote ended the call without a reply".into());
            }
            Event::Frame(Frame::Lost { message, .. }) => break Until::Gone(message),
            Event::Frame(other) => tracing::warn!("unexpected from the zygote: {other:?}"),
            Event::Gone(why) => break Until::Gone(why),
        }
    };
    zygote.done(ticket);
    match until {
        Until::Replied(error_type) => (String::new(), error_type),
        Until::Ended(end, logs) => {
            let end = if call.cancelled() {
                End::Cancelled(end)
            } else {
                End::Process(end)
            };
            let reply = end.reply(call.id, call.call_id, &logs);
            call.outbox.send_raw(&reply).await;
            (
                format!("the node process {end}"),
                crate::telemetry::error_type(&reply),
            )
        }
        Until::Gone(why) => {
            let message = format!("{why} while the call ran; a new zygote serves the next calls");
            call.end(End::Lost(message), "").await;
            (why, remote())
        }
        Until::TooLarge(too_large) => {
            call.outbox
                .send_raw(&too_large.reply(call.id, call.call_id))
                .await;
            (
                format!("{} bytes in one line, over --max-reply-mb", too_large.bytes),
                Some(crate::lines::TOO_LARGE.to_string()),
            )
        }
        Until::Silent => unreachable!("a silent pipe is followed by more frames"),
    }
}

/// Forwards a run's lines from its pipe as they come, until the reply;
/// watches the zygote meanwhile, so a child that ended (while something it
/// forked still holds the pipe) or a zygote that died ends the wait too.
/// Lines are split by [`LineBuffer`]: linear in their size, each at most
/// `--max-reply-mb` (one over it kills the child and ends the call).
async fn forward_pipe(
    call: &Call<'_>,
    pipe: OwnedFd,
    events: &mut tokio::sync::mpsc::UnboundedReceiver<Event>,
) -> Until {
    let Ok(pipe) = tokio::net::unix::pipe::Receiver::from_owned_fd(pipe) else {
        return Until::Silent;
    };
    let mut lines = LineBuffer::new();
    loop {
        // Every await below is cancel-safe: what was read is in `lines`.
        tokio::select! {
            ready = pipe.readable() => {
                if ready.is_err() {
                    return Until::Silent;
                }
                let read = pipe.try_io(|| lines.read_fd(pipe.as_raw_fd()));
                match Read::from(read) {
                    Read::Data => {}
                    Read::WouldBlock => continue,
                    // Half a line, cut short by the child's death, is no line at all.
                    Read::Ended => return Until::Silent,
                }
                if let Some(until) = forward_lines(call, &mut lines).await {
                    return until;
                }
            }
            event = events.recv() => match event {
                Some(Event::Frame(Frame::Ended { end, logs, .. })) => {
                    // The child is gone; what it wrote is in the pipe now.
                    return drain(call, &pipe, &mut lines).await.unwrap_or(Until::Ended(end, logs));
                }
                Some(Event::Frame(Frame::Started { pidfd, .. })) => call.started(pidfd),
                Some(Event::Gone(why) | Event::Frame(Frame::Lost { message: why, .. })) => {
                    return drain(call, &pipe, &mut lines).await.unwrap_or(Until::Gone(why));
                }
                Some(Event::Frame(Frame::Done { .. })) => {
                    let why = "the zygote ended the call without a reply".to_string();
                    return drain(call, &pipe, &mut lines).await.unwrap_or(Until::Gone(why));
                }
                Some(other) => tracing::warn!("unexpected from the zygote: {other:?}"),
                None => return Until::Gone("the zygote dropped the call".into()),
            },
        }
    }
}

/// What one read of a call's pipe gave.
enum Read {
    Data,
    WouldBlock,
    /// End of file, or an error: nothing more comes.
    Ended,
}

impl From<std::io::Result<usize>> for Read {
    fn from(read: std::io::Result<usize>) -> Read {
        match read {
            Ok(0) => Read::Ended,
            Ok(_) => Read::Data,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Read::WouldBlock,
            Err(_) => Read::Ended,
        }
    }
}

/// Sends the whole lines read so far; `Some` once the call is over (its
/// reply sent, or a line over the limit, its child then killed).
async fn forward_lines(call: &Call<'_>, lines: &mut LineBuffer) -> Option<Until> {
    while let Some(piece) = lines.next_piece() {
        match piece {
            Piece::Line(line) => {
                let line = line.strip_suffix(b"\n").unwrap_or(line);
                call.outbox.send_raw(line).await;
                if !protocol::is_event(line) {
                    return Some(Until::Replied(crate::telemetry::error_type(line)));
                }
            }
            Piece::TooLarge(too_large) => {
                tracing::warn!(
                    call = %call.call_id,
                    bytes = too_large.bytes,
                    "a call's line is over --max-reply-mb; its process is killed"
                );
                call.kill_child();
                return Some(Until::TooLarge(too_large));
            }
        }
    }
    None
}

/// Forwards the whole lines already in a dead child's pipe, without waiting
/// for more; `Some` if the call ended among them (its reply, a line over
/// the limit).
async fn drain(
    call: &Call<'_>,
    pipe: &tokio::net::unix::pipe::Receiver,
    lines: &mut LineBuffer,
) -> Option<Until> {
    loop {
        if let Some(until) = forward_lines(call, lines).await {
            return Some(until);
        }
        // Straight from the fd (nonblocking), whatever readiness tokio has
        // seen: a grandchild holding the write end must not keep the call
        // waiting for more.
        match Read::from(lines.read_fd(pipe.as_raw_fd())) {
            Read::Data => {}
            Read::WouldBlock | Read::Ended => return None,
        }
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
