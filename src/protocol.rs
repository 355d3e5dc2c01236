//! Wire types of the worker contract (PROTOCOL.md, section 1).
//!
//! A request is read in Rust only as far as the zygote needs it: which op,
//! which node, which source. `id` and `kwargs` stay as the JSON text they
//! arrived as and are decoded by Python's own `json` in the call's child, so
//! a big int, a `-0.0` or a lone surrogate means there exactly what it meant
//! to `worker_main.py`.
//!
//! Replies are mostly written by the child (see `zygote::child`); the few the
//! zygote writes itself are built here: a refused line, a call whose process
//! ended without a reply, a compile of a source already loaded.

use std::borrow::Cow;
use std::collections::BTreeMap;

use serde::Serialize;
use serde_json::value::RawValue;

use crate::nesting::{MAX_NESTING, nested_deeper_than};

/// What the request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Compile,
    Run,
}

/// One request line, parsed as far as the zygote reads it.
#[derive(Debug)]
pub struct Request {
    pub op: Op,
    /// The `id` as it arrived (`null` when absent), echoed untouched.
    pub id: Box<RawValue>,
    /// `""` when absent or falsy, as `str(request.get("call_id") or "")`.
    pub call_id: String,
    pub flow: String,
    pub node: String,
    pub source: String,
    /// `compile` only: false = check that it compiles, cache nothing.
    pub keep: bool,
    /// The keyword arguments as JSON text, decoded in the child.
    pub kwargs: Option<Box<RawValue>>,
    /// Agent protocol only: environment for this call's process (never
    /// read off a worker-contract request: `parse_worker_request`).
    pub env: Vec<(String, String)>,
    /// `compile` from `run`/`sweep --warmup` only: the keyword arguments the
    /// node is called with once in its zygote after it loads
    /// (`zygote::warmup`). Never read off a request line.
    pub warmup: Option<Box<RawValue>>,
}

impl Request {
    /// What of this request no other call may see (its kwargs, its env),
    /// held while it is served: a child forked meanwhile wipes it
    /// (`crate::scrub`).
    pub fn held(&self) -> Vec<crate::scrub::Held> {
        crate::scrub::hold_call_data(self.kwargs.as_deref().map(RawValue::get), &self.env)
    }

    /// This request as a line of the worker contract, for a zygote that
    /// serves it elsewhere (a node's own zygote): what it would read had
    /// it come first-hand, `env` left out as the contract leaves it.
    pub fn to_worker_line(&self) -> Vec<u8> {
        #[derive(Serialize)]
        struct Line<'a> {
            id: &'a RawValue,
            op: &'static str,
            call_id: &'a str,
            flow: &'a str,
            node: &'a str,
            source: &'a str,
            keep: bool,
            #[serde(skip_serializing_if = "Option::is_none")]
            kwargs: Option<&'a RawValue>,
        }
        let line = Line {
            id: &self.id,
            op: match self.op {
                Op::Compile => "compile",
                Op::Run => "run",
            },
            call_id: &self.call_id,
            flow: &self.flow,
            node: &self.node,
            source: &self.source,
            keep: self.keep,
            kwargs: self.kwargs.as_deref(),
        };
        serde_json::to_vec(&line).expect("a request of JSON values serialises")
    }
}

/// A line that cannot be served: answered with a `ProtocolError` reply.
#[derive(Debug)]
pub struct ProtocolError {
    /// The request's `id`, when the line was an object that had one.
    pub id: Option<Box<RawValue>>,
    pub call_id: String,
    pub message: String,
}

impl ProtocolError {
    fn new(message: impl Into<String>) -> ProtocolError {
        ProtocolError {
            id: None,
            call_id: String::new(),
            message: message.into(),
        }
    }

    /// A line over the size limit, skipped unread.
    pub fn too_long(size: usize, limit: usize) -> ProtocolError {
        ProtocolError::new(format!(
            "the request is {} MiB, over the limit of {} MiB (--max-request-mb): \
             pass large data as an artifact and send its reference instead",
            size.div_ceil(1 << 20),
            limit >> 20
        ))
    }

    pub fn reply(&self) -> Vec<u8> {
        let id: &RawValue = match &self.id {
            Some(id) => id,
            None => null(),
        };
        failure_reply(id, &self.call_id, "ProtocolError", &self.message, "")
    }
}

/// The JSON `null`, as a raw value.
pub fn null() -> &'static RawValue {
    serde_json::from_str("null").expect("null is JSON")
}

/// The refusal of a request nested deeper than [`MAX_NESTING`]. Its `id` is
/// not echoed: the `id` may be the deep part.
pub fn too_deep() -> ProtocolError {
    ProtocolError::new(format!(
        "the request nests arrays and objects more than {MAX_NESTING} levels deep, \
         deeper than the engine's JSON reader takes back: send flatter data, \
         or pass it as an artifact and send its reference"
    ))
}

/// Parses one request line as the agent's zygote reads it over its link:
/// `env` is applied to the call's process. Empty lines never reach here
/// (they are skipped).
pub fn parse_request(line: &[u8]) -> Result<Request, ProtocolError> {
    parse(line, true)
}

/// Parses one request line of the worker contract (`fluksio-zygote worker`
/// on stdin). `env` is no field of that contract: it is ignored, whatever it
/// holds, as `worker_main.py` ignores it (only the agent takes `env` off a
/// request, and it sends it on with [`parse_request`]).
pub fn parse_worker_request(line: &[u8]) -> Result<Request, ProtocolError> {
    parse(line, false)
}

fn parse(line: &[u8], with_env: bool) -> Result<Request, ProtocolError> {
    let text = std::str::from_utf8(line).map_err(|e| {
        ProtocolError::new(format!(
            "the request is not UTF-8 (invalid byte at offset {}): send one JSON object per line",
            e.valid_up_to()
        ))
    })?;
    if nested_deeper_than(line, MAX_NESTING) {
        return Err(too_deep());
    }
    let value: Box<RawValue> = serde_json::from_str(text).map_err(|e| {
        ProtocolError::new(format!(
            "the request is not JSON ({e}): send one JSON object per line"
        ))
    })?;
    let fields: BTreeMap<Cow<'_, str>, &RawValue> =
        serde_json::from_str(value.get()).map_err(|_| {
            ProtocolError::new(format!(
                "the request must be a JSON object, not {}",
                json_kind(value.get())
            ))
        })?;

    let id = fields.get("id").map(|raw| (*raw).to_owned());
    let call_id = crate::python_str::python_str_or_empty(fields.get("call_id").copied());
    let refuse = |message: String| ProtocolError {
        id: id.clone(),
        call_id: call_id.clone(),
        message,
    };

    let op = match fields.get("op").map(|raw| raw.get()) {
        Some(r#""compile""#) => Op::Compile,
        Some(r#""run""#) => Op::Run,
        Some(other) => {
            return Err(refuse(format!(
                "unknown op {other}: send \"compile\" or \"run\""
            )));
        }
        None => {
            return Err(refuse(
                "the request has no \"op\": send \"compile\" or \"run\"".into(),
            ));
        }
    };
    let string = |name: &str, required: bool| -> Result<String, ProtocolError> {
        match fields.get(name) {
            None if required => Err(refuse(format!("the request has no \"{name}\""))),
            None => Ok(String::new()),
            Some(raw) if raw.get() == "null" && !required => Ok(String::new()),
            Some(raw) => serde_json::from_str::<String>(raw.get()).map_err(|_| {
                refuse(format!(
                    "\"{name}\" must be a string, not {}",
                    json_kind(raw.get())
                ))
            }),
        }
    };
    let flow = string("flow", true)?;
    let node = string("node", true)?;
    let source = string("source", false)?;
    let keep = fields
        .get("keep")
        .is_none_or(|raw| crate::python_str::python_truth(raw));
    let kwargs = fields
        .get("kwargs")
        .filter(|raw| raw.get() != "null")
        .map(|raw| (*raw).to_owned());
    let env = match fields.get("env") {
        _ if !with_env => Vec::new(),
        None => Vec::new(),
        Some(raw) if raw.get() == "null" => Vec::new(),
        Some(raw) => parse_env(raw).map_err(refuse)?,
    };
    Ok(Request {
        op,
        id: id.unwrap_or_else(|| null().to_owned()),
        call_id,
        flow,
        node,
        source,
        keep,
        kwargs,
        env,
        warmup: None,
    })
}

/// `env` values are taken as strings, as agent.py's `str(v)` does.
pub fn parse_env(raw: &RawValue) -> Result<Vec<(String, String)>, String> {
    let map: BTreeMap<String, Box<RawValue>> = serde_json::from_str(raw.get())
        .map_err(|_| format!("\"env\" must be an object, not {}", json_kind(raw.get())))?;
    if let Some(bad) = map
        .keys()
        .find(|k| k.is_empty() || k.contains('=') || k.contains('\0'))
    {
        return Err(format!("{bad:?} is not an environment variable name"));
    }
    Ok(map
        .into_iter()
        .map(|(key, value)| (key, crate::python_str::python_str(&value)))
        .collect())
}

/// "an array", "a number", … for messages about the wrong kind of value.
fn json_kind(text: &str) -> &'static str {
    match text.trim_start().as_bytes().first() {
        Some(b'[') => "an array",
        Some(b'{') => "an object",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

#[derive(Serialize)]
struct Failure<'a> {
    id: &'a RawValue,
    call_id: &'a str,
    ok: bool,
    error: ErrorBody<'a>,
    logs: &'a str,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    #[serde(rename = "type")]
    kind: &'a str,
    message: &'a str,
    short: String,
    traceback: &'a str,
}

/// `{"id", "call_id", "ok": false, "error": {...}, "logs"}` with `short` as
/// `"{type}: {message}"` and no traceback: an error no node frame raised.
pub fn failure_reply(
    id: &RawValue,
    call_id: &str,
    kind: &str,
    message: &str,
    logs: &str,
) -> Vec<u8> {
    failure_line(
        id,
        call_id,
        kind,
        message,
        &format!("{kind}: {message}"),
        logs,
    )
}

pub(crate) fn failure_line(
    id: &RawValue,
    call_id: &str,
    kind: &str,
    message: &str,
    short: &str,
    logs: &str,
) -> Vec<u8> {
    let reply = Failure {
        id,
        call_id,
        ok: false,
        error: ErrorBody {
            kind,
            message,
            short: short.to_string(),
            traceback: "",
        },
        logs,
    };
    let mut line = serde_json::to_vec(&reply).expect("a reply of strings serialises");
    line.push(b'\n');
    line
}

#[derive(Serialize)]
struct Compiled<'a> {
    id: &'a RawValue,
    call_id: &'a str,
    result: (),
    ok: bool,
    logs: &'a str,
}

/// `compile` of a source already loaded: nothing runs, so nothing is logged.
pub fn compiled_reply(id: &RawValue, call_id: &str) -> Vec<u8> {
    let reply = Compiled {
        id,
        call_id,
        result: (),
        ok: true,
        logs: "",
    };
    let mut line = serde_json::to_vec(&reply).expect("a reply of strings serialises");
    line.push(b'\n');
    line
}

/// Whether a line the child wrote is an event rather than the reply. The
/// child is the only writer on its pipe and writes every event as a dict
/// whose first key is `event`, so the prefix decides without parsing a
/// payload that may be megabytes long.
pub fn is_event(line: &[u8]) -> bool {
    line.starts_with(br#"{"event": "#)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Request, ProtocolError> {
        parse_request(text.as_bytes())
    }

    #[test]
    fn a_run_request_keeps_id_and_kwargs_as_sent() {
        let r = parse(r#"{"op":"run","id":12345678901234567890123,"flow":"f","node":"n","source":"x","kwargs":{"a":-0.0}}"#).unwrap();
        assert_eq!(r.op, Op::Run);
        assert_eq!(r.id.get(), "12345678901234567890123");
        assert_eq!(r.kwargs.unwrap().get(), r#"{"a":-0.0}"#);
        assert!(r.keep);
        assert_eq!(r.call_id, "");
    }

    #[test]
    fn falsy_keep_and_call_id_read_as_the_reference_reads_them() {
        let r = parse(r#"{"op":"compile","flow":"f","node":"n","keep":0,"call_id":0}"#).unwrap();
        assert!(!r.keep);
        assert_eq!(r.call_id, "");
        let r = parse(r#"{"op":"compile","flow":"f","node":"n","keep":null,"call_id":7}"#).unwrap();
        assert!(!r.keep);
        assert_eq!(r.call_id, "7");
    }

    #[test]
    fn bad_lines_are_refused_with_the_id_echoed_where_there_is_one() {
        let e = parse("{not json").unwrap_err();
        assert!(e.message.contains("not JSON"), "{}", e.message);
        assert!(e.id.is_none());
        let e = parse("[1,2]").unwrap_err();
        assert!(e.message.contains("not an array"), "{}", e.message);
        let e = parse(r#"{"id":5,"op":"explode","flow":"f","node":"n"}"#).unwrap_err();
        assert_eq!(e.id.unwrap().get(), "5");
        assert!(
            e.message.contains(r#"unknown op "explode""#),
            "{}",
            e.message
        );
        let e = parse(r#"{"id":"x","op":"run","node":"n"}"#).unwrap_err();
        assert!(e.message.contains(r#"no "flow""#), "{}", e.message);
        let e = parse_request(b"{\"op\":\"run\xff\"}").unwrap_err();
        assert!(e.message.contains("not UTF-8"), "{}", e.message);
    }

    #[test]
    fn refusal_reply_has_the_contract_shape() {
        let e = parse(r#"{"id":[1],"op":"run"}"#).unwrap_err();
        let reply: serde_json::Value = serde_json::from_slice(&e.reply()).unwrap();
        assert_eq!(reply["id"], serde_json::json!([1]));
        assert_eq!(reply["ok"], false);
        assert_eq!(reply["error"]["type"], "ProtocolError");
        assert!(
            reply["error"]["short"]
                .as_str()
                .unwrap()
                .starts_with("ProtocolError: ")
        );
        assert_eq!(reply["logs"], "");
    }
}

/// The decoder under attack: whatever a line holds, `parse_request` answers
/// without a panic, within bounded time, and every refusal is one line of
/// JSON the engine can read back.
#[cfg(test)]
pub(crate) mod fuzz {
    use super::*;
    use proptest::prelude::*;

    /// `cases` cases, drawn with xorshift: proptest's default ChaCha is
    /// most of the time a debug build spends here.
    pub(crate) fn config(cases: u32) -> ProptestConfig {
        ProptestConfig {
            cases,
            rng_algorithm: proptest::test_runner::RngAlgorithm::XorShift,
            ..ProptestConfig::default()
        }
    }

    /// Parses `line` both ways and checks what any answer must be.
    fn check(line: &[u8]) {
        for parsed in [parse_request(line), parse_worker_request(line)] {
            match parsed {
                Ok(request) => {
                    assert!(!nested_deeper_than(line, MAX_NESTING));
                    assert!(serde_json::from_str::<&RawValue>(request.id.get()).is_ok());
                    if let Some(kwargs) = &request.kwargs {
                        assert!(serde_json::from_str::<&RawValue>(kwargs.get()).is_ok());
                    }
                }
                Err(refusal) => {
                    let reply = refusal.reply();
                    assert_eq!(reply.last(), Some(&b'\n'));
                    assert!(!reply[..reply.len() - 1].contains(&b'\n'), "one line");
                    assert!(!nested_deeper_than(&reply, MAX_NESTING));
                    let value: serde_json::Value = serde_json::from_slice(&reply)
                        .unwrap_or_else(|e| panic!("refusal not JSON ({e}): {reply:?}"));
                    assert_eq!(value["error"]["type"], "ProtocolError");
                    assert_eq!(value["ok"], false);
                }
            }
        }
    }

    /// Any JSON value, a few levels deep.
    pub(crate) fn value() -> impl Strategy<Value = serde_json::Value> {
        let leaf = prop_oneof![
            Just(serde_json::Value::Null),
            any::<bool>().prop_map(serde_json::Value::Bool),
            any::<i64>().prop_map(|n| serde_json::json!(n)),
            any::<f64>()
                .prop_filter("finite", |f| f.is_finite())
                .prop_map(|f| serde_json::json!(f)),
            any::<String>().prop_map(serde_json::Value::String),
            "[\\[\\]{}\"\\\\]{0,8}".prop_map(serde_json::Value::String),
        ];
        leaf.prop_recursive(8, 64, 6, |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..6).prop_map(serde_json::Value::Array),
                prop::collection::btree_map(any::<String>(), inner, 0..6)
                    .prop_map(|m| serde_json::Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn depth(value: &serde_json::Value) -> usize {
        match value {
            serde_json::Value::Array(items) => 1 + items.iter().map(depth).max().unwrap_or(0),
            serde_json::Value::Object(map) => 1 + map.values().map(depth).max().unwrap_or(0),
            _ => 0,
        }
    }

    /// A request whose fields are the contract's, each holding anything.
    fn request() -> impl Strategy<Value = serde_json::Value> {
        let key = prop_oneof![
            Just("op".to_string()),
            Just("id".to_string()),
            Just("call_id".to_string()),
            Just("flow".to_string()),
            Just("node".to_string()),
            Just("source".to_string()),
            Just("keep".to_string()),
            Just("kwargs".to_string()),
            Just("env".to_string()),
            Just("run".to_string()),
            any::<String>(),
        ];
        let field = prop_oneof![
            Just(serde_json::json!("run")),
            Just(serde_json::json!("compile")),
            Just(serde_json::json!("f")),
            value(),
        ];
        prop::collection::btree_map(key, field, 0..10)
            .prop_map(|m| serde_json::Value::Object(m.into_iter().collect()))
    }

    /// Text made of JSON's own tokens in any order: mostly not JSON, and
    /// where it is, anything at all.
    pub(crate) fn soup() -> impl Strategy<Value = Vec<u8>> {
        let token = prop_oneof![
            Just(&b"{"[..]),
            Just(&b"}"[..]),
            Just(&b"["[..]),
            Just(&b"]"[..]),
            Just(&b","[..]),
            Just(&b":"[..]),
            Just(&b"\""[..]),
            Just(&b"\\"[..]),
            Just(&b"\\u"[..]),
            Just(&b"\\ud800"[..]),
            Just(&b"\\udfff"[..]),
            Just(&b"\xed\xa0\x80"[..]),
            Just(&b"\"op\""[..]),
            Just(&b"\"run\""[..]),
            Just(&b"\"id\""[..]),
            Just(&b"\"env\""[..]),
            Just(&b"null"[..]),
            Just(&b"1e999999"[..]),
            Just(&b"-0"[..]),
            Just(&b"123456789012345678901234567890"[..]),
            Just(&b" "[..]),
            Just(&b"\0"[..]),
        ];
        prop::collection::vec(token, 0..200).prop_map(|tokens| tokens.concat())
    }

    proptest! {
        #![proptest_config(config(2000))]

        #[test]
        fn arbitrary_bytes_never_panic(line in prop::collection::vec(any::<u8>(), 0..2048)) {
            check(&line);
        }

        #[test]
        fn json_token_soup_never_panics(line in soup()) {
            check(&line);
        }

        #[test]
        fn any_request_object_is_served_or_refused(request in request()) {
            check(request.to_string().as_bytes());
        }

        #[test]
        fn the_depth_scan_agrees_with_a_parse(value in value(), limit in 0usize..10) {
            let text = value.to_string();
            prop_assert_eq!(nested_deeper_than(text.as_bytes(), limit), depth(&value) > limit);
        }

    }

    proptest! {
        // Lines of up to 200 kB: fewer cases, the same seconds.
        #![proptest_config(config(300))]

        #[test]
        fn deep_nesting_is_refused_past_the_limit_and_only_there(
            levels in 0usize..3000,
            object in any::<bool>(),
            place in 0usize..3,
        ) {
            let (open, close) = if object { (r#"{"a":"#, "}") } else { ("[", "]") };
            let deep = format!("{}1{}", open.repeat(levels), close.repeat(levels));
            let field = ["id", "kwargs", "call_id"][place];
            let line = format!(r#"{{"op":"run","flow":"f","node":"n","{field}":{deep}}}"#);
            check(line.as_bytes());
            let parsed = parse_request(line.as_bytes());
            if levels + 1 > MAX_NESTING {
                let refusal = parsed.unwrap_err();
                prop_assert!(refusal.id.is_none());
                prop_assert!(refusal.message.contains("512 levels deep"), "{}", refusal.message);
            } else {
                prop_assert!(parsed.is_ok());
            }
        }

        #[test]
        fn long_strings_and_surrogates_never_panic(
            length in 0usize..200_000,
            escape in prop_oneof![Just("\\ud800"), Just("\\udc00"), Just("\\ud83d\\ude00"), Just("\\u0000"), Just("x")],
            field in prop_oneof![Just("id"), Just("call_id"), Just("source"), Just("flow"), Just("env")],
        ) {
            let text = format!("{}{escape}", "[".repeat(length % 7) + &"y".repeat(length));
            let line = format!(r#"{{"op":"run","flow":"f","node":"n","{field}":"{text}"}}"#);
            check(line.as_bytes());
        }
    }

    /// Why the scan is needed: serde_json's limit of 128 does not apply to
    /// a raw value, which is how `id` and `kwargs` are kept.
    #[test]
    fn serde_json_reads_a_raw_value_at_any_depth() {
        let deep = format!("{}{}", "[".repeat(100_000), "]".repeat(100_000));
        assert!(serde_json::from_str::<Box<RawValue>>(&deep).is_ok());
        assert!(serde_json::from_str::<serde_json::Value>(&deep).is_err());
        let line = format!(r#"{{"op":"run","flow":"f","node":"n","id":{deep}}}"#);
        let refusal = parse_request(line.as_bytes()).unwrap_err();
        assert!(refusal.id.is_none());
        assert!(refusal.message.contains("flatter"), "{}", refusal.message);
    }

    #[test]
    fn brackets_in_strings_do_not_count() {
        let line = format!(
            r#"{{"op":"run","flow":"f","node":"n","id":"{}\"{}"}}"#,
            "[".repeat(1000),
            "{".repeat(1000)
        );
        assert_eq!(parse_request(line.as_bytes()).unwrap().id.get().len(), 2004);
        // An escaped quote does not end a string; an escaped backslash
        // before a quote does.
        assert!(!nested_deeper_than(br#"["\"[[[" ]"#, 2));
        assert!(nested_deeper_than(br#"["\\" [[ ]]]"#, 2));
    }

    #[test]
    fn the_worker_contract_ignores_env_and_the_link_applies_it() {
        let line = br#"{"op":"run","flow":"f","node":"n","env":{"A":"1","B":2}}"#;
        assert_eq!(
            parse_request(line).unwrap().env,
            vec![
                ("A".to_string(), "1".to_string()),
                ("B".to_string(), "2".to_string())
            ]
        );
        assert!(parse_worker_request(line).unwrap().env.is_empty());
        // worker_main.py never looks at it, so no shape of it is refused.
        let bad = br#"{"op":"run","flow":"f","node":"n","env":5}"#;
        assert!(parse_request(bad).is_err());
        assert!(parse_worker_request(bad).unwrap().env.is_empty());
    }
}
