//! How a call ended when its node wrote no reply, and the one reply that
//! says so.
//!
//! Every path that answers for a call renders that reply here (the worker,
//! a pool slot, the agent, `run` and `sweep`; a fresh child, a resident, a
//! node's own zygote), so they cannot disagree. No node frame is there to
//! point at, so `short` is `message` (PROTOCOL.md, section 2).

use std::fmt;
use std::time::Duration;

use serde_json::value::RawValue;

use crate::process::ChildEnd;

/// The type a reply carries when the call's process ended without one. The
/// pool re-raises it under this name, as it does agent.py's own.
pub const REMOTE_ERROR: &str = "RemoteError";
/// A call the engine cancelled.
pub const NODE_CANCELLED: &str = "NodeCancelled";
/// A call `--timeout` ended: the reference pool's name.
pub const NODE_TIMEOUT: &str = "NodeTimeout";

/// Why a call has no reply of its node's.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum End {
    /// Its process ended: an exit, a crash, a kill, its memory limit.
    Process(ChildEnd),
    /// The engine cancelled it; its process was then killed.
    Cancelled(ChildEnd),
    /// It ran past `--timeout` and was ended, with all it started.
    TimedOut(Duration),
    /// What serves it failed: the zygote could not start, or ended during
    /// the call, or the link to it closed. Says what, and what comes next.
    Lost(String),
}

impl End {
    /// The reply's `error.type`.
    pub fn error_type(&self) -> &'static str {
        match self {
            End::Process(ChildEnd::OverMemoryLimit(_)) => "MemoryError",
            End::Process(_) | End::Lost(_) => REMOTE_ERROR,
            End::Cancelled(_) => NODE_CANCELLED,
            End::TimedOut(_) => NODE_TIMEOUT,
        }
    }

    /// The reply for call `id`/`call_id`, with what the node printed.
    pub fn reply(&self, id: &RawValue, call_id: &str, logs: &str) -> Vec<u8> {
        let message = self.to_string();
        crate::protocol::failure_line(id, call_id, self.error_type(), &message, &message, logs)
    }
}

impl fmt::Display for End {
    /// The reply's `message` (and `short`).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            End::Process(end @ ChildEnd::OverMemoryLimit(_)) => write!(
                f,
                "the node process {end}; raise --call-memory-limit, or use less memory"
            ),
            End::Process(end) => write!(f, "the node process {end} before it replied"),
            End::Cancelled(end) => write!(f, "the node process was cancelled ({end})"),
            End::TimedOut(timeout) => write!(
                f,
                "the call ran past --timeout {} s and was ended, with everything it started",
                timeout.as_secs_f64()
            ),
            End::Lost(what) => f.write_str(what),
        }
    }
}

/// A reply that says a call's process ended without one, rewritten for a
/// call that was cancelled meanwhile (the engine expects `NodeCancelled`).
/// `None` for any other reply: the node answered before the kill landed.
pub fn as_cancelled(line: &[u8]) -> Option<Vec<u8>> {
    let mut reply: serde_json::Value = serde_json::from_slice(line).ok()?;
    let error = reply.get_mut("error")?.as_object_mut()?;
    let message = error.get("message")?.as_str()?;
    if error.get("type")?.as_str()? != REMOTE_ERROR {
        return None;
    }
    // The process's end, as `End::Process` wrote it.
    let how = message
        .strip_prefix("the node process ")?
        .trim_end_matches(" before it replied");
    let message = format!("the node process was cancelled ({how})");
    error.insert("type".into(), NODE_CANCELLED.into());
    error.insert("short".into(), message.clone().into());
    error.insert("message".into(), message.into());
    serde_json::to_vec(&reply).ok()
}

#[cfg(test)]
mod tests {
    use nix::sys::signal::Signal;

    use super::*;

    fn error_of(line: &[u8]) -> serde_json::Value {
        serde_json::from_slice::<serde_json::Value>(line).unwrap()["error"].clone()
    }

    #[test]
    fn every_end_has_short_equal_to_message() {
        let id = RawValue::from_string("7".into()).unwrap();
        for end in [
            End::Process(ChildEnd::Exited(3)),
            End::Process(ChildEnd::Signaled(Signal::SIGSEGV)),
            End::Process(ChildEnd::OverMemoryLimit(64)),
            End::Cancelled(ChildEnd::Signaled(Signal::SIGKILL)),
            End::TimedOut(Duration::from_millis(1500)),
            End::Lost("the shared zygote ended during the call".into()),
        ] {
            let error = error_of(&end.reply(&id, "c", ""));
            assert_eq!(error["short"], error["message"], "{end:?}");
            assert_eq!(error["type"], end.error_type());
            assert_eq!(error["traceback"], "");
        }
    }

    #[test]
    fn a_crash_reply_rewritten_as_cancelled_reads_as_a_cancel_rendered_here() {
        let id = RawValue::from_string("1".into()).unwrap();
        let killed = ChildEnd::Signaled(Signal::SIGKILL);
        let crashed = End::Process(killed).reply(&id, "c", "printed\n");
        let rewritten = as_cancelled(&crashed).unwrap();
        let direct = End::Cancelled(killed).reply(&id, "c", "printed\n");
        assert_eq!(
            serde_json::from_slice::<serde_json::Value>(&rewritten).unwrap(),
            serde_json::from_slice::<serde_json::Value>(&direct).unwrap()
        );
        // A reply of the node's own is left alone.
        let raised = br#"{"id":1,"ok":false,"error":{"type":"RemoteError","message":"mine","short":"RemoteError: mine","traceback":"t"}}"#;
        assert_eq!(as_cancelled(raised), None);
    }
}
