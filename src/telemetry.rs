//! Logs: `RUST_LOG`, `--log-format text|json`, and one info line when a call
//! starts and one when it ends, in every mode.
//!
//! The end line says how the call went: `ok`, or the error type of its
//! reply (`ValueError`, `RemoteError` for a process that ended without a
//! reply, `NodeCancelled`). It is read off the reply line without parsing
//! the result: a failure carries `ok` before anything large, and a success
//! is the only reply with a `result`, so reading stops at that key.

use std::time::{Duration, Instant};

use serde::de::{DeserializeSeed, IgnoredAny, MapAccess, Visitor};

use crate::metrics::{self, Outcome};

/// The environment variable `--log-format` also reads; set for the
/// processes this one starts (the agent's zygote), so they log alike.
pub const LOG_FORMAT_ENV: &str = "FLUKSIO_LOG_FORMAT";

#[derive(clap::ValueEnum, Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LogFormat {
    /// Human-readable lines (colour on a terminal).
    #[default]
    Text,
    /// One JSON object per line: timestamp, level, fields (call, node,
    /// outcome, seconds …), message.
    Json,
}

/// Logging to stderr at `RUST_LOG`, else at `default` (`info` for the
/// services; `warn` for `run` and `sweep`, whose stderr is a person's
/// terminal, with a progress bar: `RUST_LOG=info` shows their call lines).
pub fn init(format: LogFormat, default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false);
    match format {
        LogFormat::Text => builder
            .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
            .init(),
        LogFormat::Json => builder
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .init(),
    }
}

/// One call, from its start line to its end line.
pub struct CallLog {
    call: String,
    node: String,
    op: &'static str,
    started: Instant,
}

impl CallLog {
    /// Logs the start. `call` is the call id (or the request's `id` where
    /// there is none), `node` the flow's node (`flow/node`).
    pub fn start(op: &'static str, call: String, node: String) -> CallLog {
        tracing::info!(call = %call, node = %node, "{op} started");
        CallLog {
            call,
            node,
            op,
            started: Instant::now(),
        }
    }

    /// A request of the worker contract.
    pub fn for_request(request: &crate::protocol::Request) -> CallLog {
        let op = match request.op {
            crate::protocol::Op::Compile => "compile",
            crate::protocol::Op::Run => "run",
        };
        CallLog::start(
            op,
            call_name(&request.call_id, &request.id),
            node_name(&request.flow, &request.node),
        )
    }

    /// Logs the end with the outcome read off `reply` (no reply: the call
    /// was not answered, logged as `RemoteError`), and counts it.
    pub fn end(self, reply: Option<&[u8]>) {
        let kind = reply.map_or_else(|| Some(crate::end::REMOTE_ERROR.to_string()), error_type);
        self.end_with(kind.as_deref());
    }

    /// As [`CallLog::end`], with the outcome known: `None` is ok, else the
    /// error type.
    pub fn end_with(self, error_type: Option<&str>) {
        let took = self.started.elapsed();
        log_end(self.op, &self.call, &self.node, took, error_type);
        metrics::call_ended(error_type.map_or(Outcome::Ok, Outcome::of_error), took);
    }
}

fn log_end(op: &str, call: &str, node: &str, took: Duration, error_type: Option<&str>) {
    let seconds = (took.as_secs_f64() * 1e6).round() / 1e6;
    let outcome = error_type.unwrap_or("ok");
    tracing::info!(call = %call, node = %node, seconds, outcome = %outcome, "{op} ended");
}

/// How a node is named in the log: `flow/node`.
pub fn node_name(flow: &str, node: &str) -> String {
    if flow.is_empty() {
        node.to_string()
    } else {
        format!("{flow}/{node}")
    }
}

/// How a call is named in the log: its call id, else the request's `id`.
pub fn call_name(call_id: &str, id: &serde_json::value::RawValue) -> String {
    if call_id.is_empty() {
        match id.get() {
            "null" => "-".to_string(),
            id => id.trim_matches('"').to_string(),
        }
    } else {
        call_id.to_string()
    }
}

/// The error type of a reply line; `None` when it is a success. A line that
/// is not a reply reads as `ProtocolError`.
pub fn error_type(reply: &[u8]) -> Option<String> {
    let mut found = Found::default();
    let mut reader = serde_json::Deserializer::from_slice(reply);
    // Reading stops early on purpose (at `result`, or once the error's
    // type is known): the error that leaves is expected.
    let _ = serde::Deserializer::deserialize_map(&mut reader, Scan(&mut found));
    match (found.ok, found.kind) {
        (Some(true), _) | (None, Some(Kind::Result)) => None,
        (_, Some(Kind::Type(kind))) => Some(kind),
        _ => Some("ProtocolError".into()),
    }
}

#[derive(Default)]
struct Found {
    ok: Option<bool>,
    kind: Option<Kind>,
}

enum Kind {
    /// A `result` key: a success.
    Result,
    Type(String),
}

struct Scan<'a>(&'a mut Found);

impl<'de> Visitor<'de> for Scan<'_> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("a reply object")
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<std::borrow::Cow<'de, str>>()? {
            match key.as_ref() {
                "result" if self.0.ok != Some(false) => {
                    self.0.kind = Some(Kind::Result);
                    return Err(serde::de::Error::custom("enough"));
                }
                "ok" => {
                    let ok = map.next_value::<bool>()?;
                    self.0.ok = Some(ok);
                    if ok {
                        return Err(serde::de::Error::custom("enough"));
                    }
                }
                "error" => {
                    map.next_value_seed(ErrorSeed(self.0))?;
                    if matches!(self.0.kind, Some(Kind::Type(_))) {
                        return Err(serde::de::Error::custom("enough"));
                    }
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

struct ErrorSeed<'a>(&'a mut Found);

impl<'de> DeserializeSeed<'de> for ErrorSeed<'_> {
    type Value = ();

    fn deserialize<D: serde::Deserializer<'de>>(self, d: D) -> Result<(), D::Error> {
        #[derive(serde::Deserialize)]
        struct Error {
            #[serde(rename = "type")]
            kind: Option<String>,
        }
        let error: Option<Error> = serde::Deserialize::deserialize(d).ok().flatten();
        if let Some(kind) = error.and_then(|e| e.kind) {
            self.0.kind = Some(Kind::Type(kind));
        }
        Ok(())
    }
}

/// A [`crate::output::CallOutput`] that remembers the reply's
/// outcome as it passes it on.
pub struct Observed<'a> {
    inner: &'a mut dyn crate::output::CallOutput,
    /// Ended as the reply passes, before it is written: whoever reads the
    /// reply finds the call counted.
    log: Option<CallLog>,
}

impl<'a> Observed<'a> {
    pub fn new(inner: &'a mut dyn crate::output::CallOutput, log: CallLog) -> Observed<'a> {
        Observed {
            inner,
            log: Some(log),
        }
    }

    /// The call is over: if no reply passed, it ended without one.
    pub fn finish(mut self) {
        if let Some(log) = self.log.take() {
            log.end_with(Some(crate::end::REMOTE_ERROR));
        }
    }
}

impl crate::output::CallOutput for Observed<'_> {
    fn event(&mut self, line: &[u8]) {
        self.inner.event(line);
    }

    fn reply(&mut self, line: &[u8]) {
        if let Some(log) = self.log.take() {
            log.end_with(error_type(line).as_deref());
        }
        self.inner.reply(line);
    }

    fn started(&mut self, pid: nix::unistd::Pid) {
        self.inner.started(pid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_outcome_is_read_off_the_reply() {
        assert_eq!(
            error_type(br#"{"id": 1, "call_id": "c", "result": [1, 2], "ok": true, "logs": ""}"#),
            None
        );
        assert_eq!(
            error_type(
                br#"{"id": {"result": 1}, "call_id": "c", "ok": false, "error": {"type": "ValueError", "message": "x"}, "logs": ""}"#
            )
            .as_deref(),
            Some("ValueError")
        );
        assert_eq!(
            error_type(&crate::protocol::compiled_reply(
                &serde_json::value::RawValue::from_string("3".into()).unwrap(),
                ""
            )),
            None
        );
        assert_eq!(error_type(b"not json").as_deref(), Some("ProtocolError"));
        // A success is known at `result`: what follows is never read.
        assert_eq!(
            error_type(br#"{"id": 1, "result": 5, "#),
            None,
            "stops at result"
        );
    }
}
