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
use tokio::io::AsyncBufReadExt;

use super::Agent;
use super::session::Session;
use super::zygote::Event;
use crate::link::Frame;
use crate::process::ChildEnd;
use crate::protocol;

/// A call in flight, as a cancel finds it.
#[derive(Default)]
pub struct Running {
    /// The call's current child (a trial, then the run).
    pidfd: Option<OwnedFd>,
    pub cancelled: bool,
}

impl Running {
    /// SIGKILL to the call's child, now: its pidfd names exactly it, so no
    /// reused pid is ever hit. The zygote kills the rest of its session when
    /// it reaps it.
    pub fn kill(&mut self) {
        self.cancelled = true;
        if let Some(pidfd) = &self.pidfd {
            // SAFETY: pidfd_send_signal on a pidfd we own; no pointers but a null siginfo.
            unsafe {
                libc::syscall(
                    libc::SYS_pidfd_send_signal,
                    pidfd.as_raw_fd(),
                    libc::SIGKILL,
                    std::ptr::null::<libc::siginfo_t>(),
                    0,
                )
            };
        }
    }
}

/// Serves one run or compile to its end.
pub async fn serve(
    agent: Arc<Agent>,
    session: Arc<Session>,
    mut request: BTreeMap<String, Box<RawValue>>,
) {
    let started = Instant::now();
    let call_id = text_of(request.get("call_id").map(|r| &**r));
    let id = request
        .get("id")
        .map(|raw| raw.to_owned())
        .unwrap_or_else(|| raw("null"));
    let op = text_of(request.get("op").map(|r| &**r));
    let env = take_env(&mut request, agent.cuda_mask.as_deref());
    if !env.is_empty() {
        request.insert(
            "env".into(),
            raw(&serde_json::to_string(&env).expect("strings")),
        );
    }
    let line = serde_json::to_vec(&request).expect("raw JSON values serialise");
    tracing::info!(call = %call_id, "{op} started");
    session
        .running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(call_id.clone(), Running::default());
    let heartbeat = session.heartbeat(&call_id);
    let outcome = follow(&agent, &session, &call_id, &id, line).await;
    heartbeat.abort();
    session
        .running
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&call_id);
    agent.call_ended();
    tracing::info!(call = %call_id, seconds = started.elapsed().as_secs_f64(), "{op} ended: {outcome}");
}

/// The call's lines to the engine; what happened, for the log.
async fn follow(
    agent: &Agent,
    session: &Session,
    call_id: &str,
    id: &RawValue,
    line: Vec<u8>,
) -> String {
    let zygote = match agent.zygote().await {
        Ok(zygote) => zygote,
        Err(why) => {
            session
                .send_raw(&protocol::failure_reply(
                    id,
                    call_id,
                    "RemoteError",
                    &why,
                    "",
                ))
                .await;
            return format!("no zygote: {why}");
        }
    };
    let (ticket, mut events) = match zygote.call(line).await {
        Ok(call) => call,
        Err(why) => {
            session
                .send_raw(&protocol::failure_reply(
                    id,
                    call_id,
                    "RemoteError",
                    &why,
                    "",
                ))
                .await;
            return why;
        }
    };
    let mut replied = false;
    let outcome = loop {
        let Some(event) = events.recv().await else {
            break "the zygote dropped the call".to_string();
        };
        match event {
            Event::Frame(Frame::Started { pidfd, .. }) => {
                let mut running = session.running.lock().unwrap_or_else(|e| e.into_inner());
                if let Some(running) = running.get_mut(call_id) {
                    running.pidfd = Some(pidfd);
                    if running.cancelled {
                        running.kill();
                    }
                }
            }
            Event::Frame(Frame::Line { line, .. }) => {
                replied |= !protocol::is_event(&line);
                session.send_raw(&line).await;
            }
            Event::Frame(Frame::Pipe { pipe, .. }) => {
                replied |= forward_pipe(session, pipe).await;
            }
            Event::Frame(Frame::Ended { end, logs, .. }) => {
                if replied {
                    break "replied".into();
                }
                let cancelled = session.cancelled(call_id);
                session
                    .send_raw(&ended_reply(id, call_id, end, cancelled, &logs))
                    .await;
                break format!("the node process {end}");
            }
            Event::Frame(Frame::Done { .. }) => {
                break if replied {
                    "replied".into()
                } else {
                    "no reply".into()
                };
            }
            Event::Frame(other) => tracing::warn!("unexpected from the zygote: {other:?}"),
            Event::Gone(why) => {
                if !replied {
                    let message =
                        format!("{why} while the call ran; a new zygote serves the next calls");
                    session
                        .send_raw(&protocol::failure_reply(
                            id,
                            call_id,
                            "RemoteError",
                            &message,
                            "",
                        ))
                        .await;
                }
                break why;
            }
        }
    };
    zygote.done(ticket);
    outcome
}

/// Forwards every line of a run's pipe; whether the reply was among them.
async fn forward_pipe(session: &Session, pipe: OwnedFd) -> bool {
    let Ok(pipe) = tokio::net::unix::pipe::Receiver::from_owned_fd(pipe) else {
        return false;
    };
    let mut reader = tokio::io::BufReader::with_capacity(1 << 20, pipe);
    let mut replied = false;
    loop {
        let mut line = Vec::new();
        match reader.read_until(b'\n', &mut line).await {
            Ok(0) | Err(_) => return replied,
            Ok(_) => {}
        }
        if line.pop() != Some(b'\n') {
            // Half a line, cut short by the child's death: no line at all.
            return replied;
        }
        if replied {
            continue;
        }
        replied = !protocol::is_event(&line);
        session.send_raw(&line).await;
    }
}

/// The reply for a child that ended without one (PROTOCOL.md, section 2),
/// saying how it ended.
fn ended_reply(
    id: &RawValue,
    call_id: &str,
    end: ChildEnd,
    cancelled: bool,
    logs: &str,
) -> Vec<u8> {
    let (kind, message) = if cancelled {
        (
            "NodeCancelled",
            format!("the node process was cancelled ({end})"),
        )
    } else {
        (
            protocol::ENDED_WITHOUT_REPLY,
            format!("the node process {end} before it replied"),
        )
    };
    protocol::failure_reply(id, call_id, kind, &message, logs)
}

/// The call's `env`, taken off the request: values as strings,
/// `CUDA_VISIBLE_DEVICES` read as positions in this agent's own mask.
fn take_env(
    request: &mut BTreeMap<String, Box<RawValue>>,
    mask: Option<&str>,
) -> BTreeMap<String, String> {
    let Some(raw) = request.remove("env") else {
        return BTreeMap::new();
    };
    let Ok(map) = serde_json::from_str::<BTreeMap<String, serde_json::Value>>(raw.get()) else {
        return BTreeMap::new();
    };
    let mut env: BTreeMap<String, String> = map
        .into_iter()
        .map(|(key, value)| {
            let value = match value {
                serde_json::Value::String(s) => s,
                other => other.to_string(),
            };
            (key, value)
        })
        .collect();
    if let (Some(mask), Some(requested)) = (
        mask.filter(|m| !m.is_empty()),
        env.get("CUDA_VISIBLE_DEVICES").filter(|r| !r.is_empty()),
    ) {
        let remapped = super::env::remap_cuda(mask, requested);
        env.insert("CUDA_VISIBLE_DEVICES".into(), remapped);
    }
    env
}

/// A JSON value as `str()` of it would read: a string's text, else its JSON.
pub fn text_of(raw: Option<&RawValue>) -> String {
    match raw.map(|r| serde_json::from_str::<serde_json::Value>(r.get())) {
        Some(Ok(serde_json::Value::String(s))) => s,
        Some(Ok(serde_json::Value::Null)) | None => String::new(),
        Some(Ok(other)) => other.to_string(),
        Some(Err(_)) => String::new(),
    }
}

pub fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("valid JSON")
}
