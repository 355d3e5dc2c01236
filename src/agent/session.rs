//! One connection to the engine: `hello`, `welcome`, then calls until the
//! socket ends.
//!
//! One task per concern: this loop reads the socket, a writer task owns its
//! sink (and pings), each call and service is a task with its own heartbeat,
//! sending through the session's [`Outbox`], where a cancel finds it.
//! When the session ends, for whatever reason, every call and service in it
//! ends too, its processes killed, before the caller reconnects.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use futures_util::{SinkExt, StreamExt};
use serde_json::value::RawValue;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinSet;
use tokio_tungstenite::tungstenite::client::IntoClientRequest;
use tokio_tungstenite::tungstenite::{self, Message};

use super::outbox::Outbox;
use super::state::Agent;
use super::{call, service};
use crate::protocol;

/// WebSocket pings, so a dead connection is noticed and proxies keep it.
const PING_EVERY: Duration = Duration::from_secs(20);
/// Frames waiting for the socket; past this, a call producing events waits.
const OUTGOING: usize = 1024;

/// How a session ended, which decides what the agent does next.
#[derive(Debug)]
pub enum SessionEnd {
    /// The engine closed the connection cleanly: reconnect at once.
    Closed,
    /// A connection error: reconnect after a backoff.
    Failed(String),
    /// The engine will not have this worker: stop, exit 1.
    Refused(String),
    /// Nothing ran for `--max-idle`: stop, exit 0.
    Idle,
    /// SIGTERM or Ctrl-C: stop, exit 0.
    Stopped,
}

/// Connects, greets, serves until the socket ends; then ends every call.
pub async fn run(agent: &Arc<Agent>, mut shutdown: watch::Receiver<bool>) -> SessionEnd {
    let stream = tokio::select! {
        stream = connect(agent) => match stream {
            Ok(stream) => stream,
            Err(end) => return end,
        },
        _ = shutdown.changed() => return SessionEnd::Stopped,
    };
    let (mut sink, mut stream) = stream.split();
    let hello = super::hello::hello(&agent.options, &agent.venv_digest().await);
    let lost = |why: &dyn std::fmt::Display| {
        SessionEnd::Failed(format!(
            "lost the connection to {}: {why}",
            agent.options.url
        ))
    };
    if let Err(error) = sink.send(Message::text(hello.to_string())).await {
        return lost(&error);
    }
    let welcome = tokio::select! {
        first = stream.next() => first,
        _ = shutdown.changed() => return SessionEnd::Stopped,
    };
    match welcome {
        Some(Ok(Message::Text(text))) => {
            let answer: serde_json::Value = serde_json::from_str(text.as_str()).unwrap_or_default();
            if answer["op"] != "welcome" {
                // Nothing about this machine will change the answer, so
                // reconnecting would only be a quiet loop in the job's log.
                let reason = answer["reason"].as_str().unwrap_or("refused").to_string();
                return SessionEnd::Refused(reason);
            }
            tracing::info!(
                "attached to {} as '{}' with labels {:?}",
                agent.options.url,
                answer["name"].as_str().unwrap_or(&agent.options.name),
                agent.options.labels
            );
        }
        Some(Ok(other)) => {
            return SessionEnd::Refused(format!("the engine answered hello with {other:?}"));
        }
        Some(Err(error)) => return lost(&error),
        None => return lost(&"the engine closed it after hello"),
    }

    let (out, mut outgoing) = mpsc::channel::<Message>(OUTGOING);
    let writer = tokio::spawn(async move {
        let mut pings =
            tokio::time::interval_at(tokio::time::Instant::now() + PING_EVERY, PING_EVERY);
        loop {
            let message = tokio::select! {
                message = outgoing.recv() => match message {
                    Some(message) => message,
                    None => break,
                },
                _ = pings.tick() => Message::Ping(Vec::new().into()),
            };
            // Everything already waiting goes in one flush: a node yielding
            // a hundred thousand events must not cost a write each.
            if sink.feed(message).await.is_err() {
                break;
            }
            let mut fed = true;
            while let Ok(message) = outgoing.try_recv() {
                if sink.feed(message).await.is_err() {
                    fed = false;
                    break;
                }
            }
            if !fed || sink.flush().await.is_err() {
                break;
            }
        }
        let _ = sink.close().await;
    });
    let outbox = Arc::new(Outbox::new(out, agent.heartbeat));
    agent.touch();
    let mut calls = JoinSet::new();
    let idle_tick = agent.idle_tick();
    let mut idle = tokio::time::interval(idle_tick.unwrap_or(Duration::from_secs(3600)));
    let end = loop {
        tokio::select! {
            message = stream.next() => match message {
                Some(Ok(Message::Text(text))) => dispatch(agent, &outbox, &mut calls, text.as_str()),
                Some(Ok(Message::Close(_))) | None => break SessionEnd::Closed,
                Some(Ok(_)) => {}
                Some(Err(error)) => break lost(&error),
            },
            _ = shutdown.changed() => break SessionEnd::Stopped,
            _ = idle.tick(), if idle_tick.is_some() => {
                if agent.idle_past_limit() {
                    break SessionEnd::Idle;
                }
            }
            Some(_) = calls.join_next(), if !calls.is_empty() => {}
        }
    };
    // The engine has failed these calls already, and a process left running
    // would keep its port and its card for the next one.
    outbox.end_everything();
    while calls.join_next().await.is_some() {}
    drop(outbox);
    let _ = writer.await;
    end
}

/// The WebSocket, with the token in a header (never the URL, which logs
/// keep) and no limit on a frame's size.
async fn connect(
    agent: &Agent,
) -> Result<
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>,
    SessionEnd,
> {
    let mut request = agent
        .options
        .url
        .as_str()
        .into_client_request()
        .map_err(|e| {
            SessionEnd::Refused(format!("{} is not a WebSocket URL: {e}", agent.options.url))
        })?;
    let bearer = format!("Bearer {}", agent.options.token);
    request.headers_mut().insert(
        "Authorization",
        bearer
            .parse()
            .map_err(|_| SessionEnd::Refused("the token is not a valid header value".into()))?,
    );
    let config = tungstenite::protocol::WebSocketConfig::default()
        .max_message_size(None)
        .max_frame_size(None);
    let connector = tokio_tungstenite::Connector::Rustls(Arc::clone(&agent.tls));
    match tokio_tungstenite::connect_async_tls_with_config(
        request,
        Some(config),
        true,
        Some(connector),
    )
    .await
    {
        Ok((stream, _response)) => Ok(stream),
        Err(tungstenite::Error::Http(response))
            if matches!(response.status().as_u16(), 401 | 403) =>
        {
            let body = response
                .body()
                .as_deref()
                .map(String::from_utf8_lossy)
                .unwrap_or_default();
            let first = body.lines().next().unwrap_or("").trim().to_string();
            Err(SessionEnd::Refused(format!(
                "the engine refused the token (HTTP {}){}",
                response.status().as_u16(),
                if first.is_empty() {
                    String::new()
                } else {
                    format!(": {first}")
                }
            )))
        }
        Err(error) => Err(SessionEnd::Failed(format!(
            "could not connect to {}: {error}",
            agent.options.url
        ))),
    }
}

/// What one text frame from the engine asks for.
#[derive(Debug)]
enum Incoming {
    /// A `run` or `compile`.
    Call {
        call_id: String,
        message: BTreeMap<String, Box<RawValue>>,
    },
    Serve {
        call_id: String,
        message: BTreeMap<String, Box<RawValue>>,
    },
    Cancel(String),
    /// Answered here with this reply line, nothing run: a call nested
    /// deeper than [`crate::nesting::MAX_NESTING`].
    Refused {
        call_id: String,
        reply: Vec<u8>,
    },
    /// Logged and dropped: not a JSON object, or a frame too deep that
    /// names no call to answer.
    Unreadable(&'static str),
    /// An op this agent does not serve: dropped, as agent.py drops it.
    Ignored,
}

/// Reads one frame. Never runs anything, so the fuzz tests drive it alone.
///
/// A frame nested deeper than [`crate::nesting::MAX_NESTING`] is refused before
/// anything of it is used: a `run`, `compile` or `serve` with a `call_id`
/// gets a `ProtocolError` reply (`id` null, the `id` may be the deep part)
/// so the engine's call ends; any other is ignored like an unreadable one.
fn decode(text: &str) -> Incoming {
    let too_deep = crate::nesting::nested_deeper_than(text.as_bytes(), crate::nesting::MAX_NESTING);
    // serde_json reads raw values without recursing, so even a frame too
    // deep parses here without blowing the stack; only its top level is kept.
    let Ok(message) = serde_json::from_str::<BTreeMap<String, Box<RawValue>>>(text) else {
        return Incoming::Unreadable(if too_deep {
            "ignored a message nested too deep to read"
        } else {
            "ignored a message that is not a JSON object"
        });
    };
    let call_id = crate::python_str::python_str_or_empty(message.get("call_id").map(|r| &**r));
    // Not `str()` of it: an op that is not a string is no op served here.
    let op = message
        .get("op")
        .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
        .unwrap_or_default();
    if too_deep {
        if call_id.is_empty() || !matches!(op.as_str(), "run" | "compile" | "serve") {
            return Incoming::Unreadable("ignored a message nested too deep, naming no call");
        }
        let refusal = protocol::too_deep();
        let reply = protocol::failure_reply(
            protocol::null(),
            &call_id,
            "ProtocolError",
            &refusal.message,
            "",
        );
        return Incoming::Refused { call_id, reply };
    }
    match op.as_str() {
        "run" | "compile" => Incoming::Call { call_id, message },
        "serve" => Incoming::Serve { call_id, message },
        "cancel" => Incoming::Cancel(call_id),
        _ => Incoming::Ignored,
    }
}

/// One message from the engine: a call starts, a cancel lands, the rest
/// is ignored.
fn dispatch(agent: &Arc<Agent>, outbox: &Arc<Outbox>, calls: &mut JoinSet<()>, text: &str) {
    match decode(text) {
        Incoming::Call { call_id, message } => {
            let key = outbox.enter_call(call_id);
            agent.call_started();
            calls.spawn(call::serve(
                Arc::clone(agent),
                Arc::clone(outbox),
                key,
                message,
            ));
        }
        Incoming::Serve { call_id, message } => {
            let (stop, stopped) = oneshot::channel();
            let key = outbox.enter_service(call_id, stop);
            agent.call_started();
            calls.spawn(service::serve(
                Arc::clone(agent),
                Arc::clone(outbox),
                key,
                message,
                stopped,
            ));
        }
        Incoming::Cancel(call_id) => outbox.cancel(&call_id),
        Incoming::Refused { call_id, reply } => {
            tracing::warn!(call = %call_id, "refused a call nested too deep");
            let outbox = Arc::clone(outbox);
            calls.spawn(async move { outbox.send_raw(&reply).await });
        }
        Incoming::Unreadable(why) => tracing::warn!("{why}"),
        Incoming::Ignored => {}
    }
}

/// The engine's frames under attack: whatever one holds, `decode` answers
/// without a panic, and what it refuses it answers as one line of JSON.
#[cfg(test)]
mod fuzz {
    use super::*;
    use crate::protocol::fuzz::{config, soup, value};
    use proptest::prelude::*;

    fn check(text: &str) -> Incoming {
        let incoming = decode(text);
        let deep = crate::nesting::nested_deeper_than(text.as_bytes(), crate::nesting::MAX_NESTING);
        match &incoming {
            Incoming::Call { .. } | Incoming::Serve { .. } | Incoming::Cancel(_) => {
                assert!(!deep, "a frame too deep was served");
            }
            Incoming::Refused { call_id, reply } => {
                assert!(deep);
                assert!(!call_id.is_empty());
                assert_eq!(reply.last(), Some(&b'\n'));
                assert!(!reply[..reply.len() - 1].contains(&b'\n'), "one line");
                let reply: serde_json::Value = serde_json::from_slice(reply).unwrap();
                assert_eq!(reply["call_id"], call_id.as_str());
                assert_eq!(reply["id"], serde_json::Value::Null);
                assert_eq!(reply["error"]["type"], "ProtocolError");
            }
            Incoming::Unreadable(_) | Incoming::Ignored => {}
        }
        incoming
    }

    fn frame() -> impl Strategy<Value = serde_json::Value> {
        let key = prop_oneof![
            Just("op".to_string()),
            Just("id".to_string()),
            Just("call_id".to_string()),
            Just("env".to_string()),
            Just("argv".to_string()),
            Just("weights".to_string()),
            Just("kwargs".to_string()),
            any::<String>(),
        ];
        let field = prop_oneof![
            Just(serde_json::json!("run")),
            Just(serde_json::json!("compile")),
            Just(serde_json::json!("serve")),
            Just(serde_json::json!("cancel")),
            Just(serde_json::json!("c1")),
            value(),
        ];
        prop::collection::btree_map(key, field, 0..8)
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn arbitrary_text_never_panics(text in any::<String>()) {
            check(&text);
        }

        #[test]
        fn json_token_soup_never_panics(bytes in soup()) {
            check(&String::from_utf8_lossy(&bytes));
        }

        #[test]
        fn any_frame_object_is_decoded(frame in frame()) {
            check(&frame.to_string());
        }
    }

    proptest! {
        #![proptest_config(config(300))]

        #[test]
        fn a_frame_too_deep_is_refused_where_it_names_a_call(
            levels in 0usize..3000,
            op in prop_oneof![Just("run"), Just("compile"), Just("serve"), Just("cancel"), Just("other")],
            field in prop_oneof![Just("id"), Just("kwargs"), Just("env"), Just("call_id")],
        ) {
            let deep = format!("{}1{}", "[".repeat(levels), "]".repeat(levels));
            let text = format!(r#"{{"op":"{op}","call_id":"c1","{field}":{deep}}}"#);
            let incoming = check(&text);
            let too_deep = levels + 1 > crate::nesting::MAX_NESTING;
            match incoming {
                Incoming::Refused { .. } => {
                    prop_assert!(too_deep && op != "cancel" && op != "other" && field != "call_id");
                }
                Incoming::Unreadable(_) => prop_assert!(too_deep),
                Incoming::Ignored => prop_assert_eq!(op, "other"),
                Incoming::Cancel(_) => prop_assert!(!too_deep && op == "cancel"),
                Incoming::Call { .. } | Incoming::Serve { .. } => prop_assert!(!too_deep),
            }
        }
    }

    #[test]
    fn a_call_too_deep_is_answered_with_its_call_id() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        let text = format!(r#"{{"op":"run","call_id":"c7","id":{deep},"flow":"f","node":"n"}}"#);
        let Incoming::Refused { call_id, reply } = decode(&text) else {
            panic!("not refused");
        };
        assert_eq!(call_id, "c7");
        let reply = String::from_utf8(reply).unwrap();
        assert!(reply.contains("512 levels deep"), "{reply}");
    }
}
