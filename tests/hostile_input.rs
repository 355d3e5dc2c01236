//! Input an attacker or a broken engine would send: fuzzed request lines,
//! nesting deeper than the engine's JSON reader takes back, a 2 GiB line
//! with no newline. The worker answers each line once and serves on.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, channel};

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{LINE_TIMEOUT, ZYGOTE};
use serde_json::value::RawValue;
use serde_json::{Value, json};

/// A worker read line by line as text: a reply may echo an `id` that
/// serde_json's `Value` will not read (too deep for its limit of 128, a
/// lone surrogate), so replies are checked as raw JSON here.
struct RawWorker {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
}

impl RawWorker {
    fn start(args: &[&str]) -> RawWorker {
        let mut child = Command::new(ZYGOTE)
            .arg("worker")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("the worker starts");
        let stdout = child.stdout.take().expect("stdout");
        let (send, lines) = channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).split(b'\n') {
                let Ok(line) = line else { return };
                if send
                    .send(String::from_utf8_lossy(&line).into_owned())
                    .is_err()
                {
                    return;
                }
            }
        });
        RawWorker {
            stdin: child.stdin.take(),
            child,
            lines,
        }
    }

    fn send_line(&mut self, line: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line).expect("request written");
        stdin.write_all(b"\n").expect("request written");
        stdin.flush().expect("request flushed");
    }

    /// The next line: one JSON object, its top-level fields as raw JSON.
    fn next_reply(&self) -> BTreeMap<String, Box<RawValue>> {
        let line = self
            .lines
            .recv_timeout(LINE_TIMEOUT)
            .unwrap_or_else(|e| panic!("no reply within {LINE_TIMEOUT:?}: {e}"));
        serde_json::from_str(&line)
            .unwrap_or_else(|e| panic!("reply not a JSON object ({e}): {line:.300}"))
    }

    fn vm_hwm_kib(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .expect("/proc/PID/status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmHWM:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("VmHWM in /proc/PID/status")
    }
}

impl Drop for RawWorker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn field(reply: &BTreeMap<String, Box<RawValue>>, name: &str) -> Value {
    reply
        .get(name)
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or(Value::Null)
}

fn assert_protocol_error(reply: &BTreeMap<String, Box<RawValue>>, says: &str) {
    let error = field(reply, "error");
    assert_eq!(error["type"], "ProtocolError", "{error}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(says), "{message}");
    assert_eq!(field(reply, "ok"), false);
}

const GOOD: &str = "def process(x):\n    return x * 2\n";

fn good_request(id: &str) -> String {
    json!({"id": id, "op": "run", "flow": "t", "node": "good", "source": GOOD, "kwargs": {"x": 21}})
        .to_string()
}

fn assert_good_reply(reply: &BTreeMap<String, Box<RawValue>>, id: &str) {
    assert_eq!(field(reply, "id"), id);
    assert_eq!(field(reply, "result"), 42, "{reply:?}");
    assert_eq!(field(reply, "ok"), true);
}

/// `levels` arrays around a 1.
fn nested(levels: usize) -> String {
    format!("{}1{}", "[".repeat(levels), "]".repeat(levels))
}

/// xorshift64*: the same lines on every run, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn pick<'a>(&mut self, items: &[&'a str]) -> &'a str {
        items[self.below(items.len())]
    }
}

const TOKENS: &[&str] = &[
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "\"",
    "\\",
    "\\u",
    "\\ud800",
    "\\udfff",
    "\"op\"",
    "\"run\"",
    "\"compile\"",
    "\"id\"",
    "\"flow\"",
    "\"node\"",
    "\"source\"",
    "\"env\"",
    "\"kwargs\"",
    "null",
    "true",
    "1e999999",
    "-0",
    "123456789012345678901234567890",
    " ",
    "\t",
    "\r",
    "\0",
];

/// One hostile line (never holding a newline).
fn hostile_line(rng: &mut Rng) -> Vec<u8> {
    match rng.below(6) {
        // Bytes.
        0 => (0..rng.below(400))
            .map(|_| rng.next() as u8)
            .filter(|&b| b != b'\n')
            .collect(),
        // JSON's tokens in any order.
        1 => (0..rng.below(120))
            .map(|_| rng.pick(TOKENS))
            .collect::<String>()
            .into_bytes(),
        // Nesting: shallow enough for the test to read back, or past the
        // limit (serde_json's `Value` reads 128 levels; the worker 512).
        2 => {
            let levels = if rng.below(2) == 0 {
                rng.below(100)
            } else {
                513 + rng.below(3000)
            };
            let place = rng.pick(&["id", "kwargs", "call_id", "env", "source"]);
            format!(
                r#"{{"op":"run","flow":"t","node":"n","{place}":{}}}"#,
                nested(levels)
            )
            .into_bytes()
        }
        // Long strings with escapes a Unicode string cannot hold.
        3 => {
            let escape = rng.pick(&[
                "\\ud800",
                "\\udc00",
                "\\ud83d\\ude00",
                "\\u0000",
                "\\\"",
                "x",
            ]);
            let place = rng.pick(&["id", "call_id", "source", "flow", "node"]);
            let text = "y".repeat(rng.below(100_000));
            format!(r#"{{"op":"compile","flow":"t","node":"n","{place}":"{text}{escape}"}}"#)
                .into_bytes()
        }
        // The contract's fields, each holding the wrong kind of thing.
        4 => {
            let mut fields = Vec::new();
            for name in [
                "op", "id", "call_id", "flow", "node", "source", "keep", "kwargs", "env",
            ] {
                if rng.below(3) == 0 {
                    continue;
                }
                let value = rng.pick(&[
                    "\"run\"",
                    "\"compile\"",
                    "\"explode\"",
                    "null",
                    "0",
                    "[]",
                    "{}",
                    "\"\"",
                    "\"t\"",
                    "{\"a\":[1,{\"b\":null}]}",
                    "\"def process(:\"",
                    "-1.5e300",
                ]);
                fields.push(format!("\"{name}\":{value}"));
            }
            format!("{{{}}}", fields.join(",")).into_bytes()
        }
        // A good line cut short, or with bytes that are not UTF-8.
        _ => {
            let mut line = good_request("cut").into_bytes();
            let at = rng.below(line.len());
            if rng.below(2) == 0 {
                line.truncate(at);
            } else {
                line.insert(at, 0xff);
            }
            line
        }
    }
}

#[test]
fn every_fuzzed_line_gets_exactly_one_reply_and_the_worker_serves_on() {
    let mut worker = RawWorker::start(&[]);
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let lines: Vec<Vec<u8>> = std::iter::repeat_with(|| hostile_line(&mut rng))
        // An empty or blank line is skipped, unanswered, as the contract says.
        .filter(|line| !line.iter().all(u8::is_ascii_whitespace))
        .take(300)
        .collect();
    // Written from a thread: the replies are read while lines still go in.
    let mut stdin = worker.stdin.take().expect("stdin");
    let writer = std::thread::spawn(move || {
        for line in &lines {
            stdin.write_all(line).expect("written");
            stdin.write_all(b"\n").expect("written");
        }
        stdin
            .write_all(good_request("after").as_bytes())
            .expect("written");
        stdin.write_all(b"\n").expect("written");
        stdin.flush().expect("flushed");
        stdin
    });
    let mut refused = 0;
    for index in 0..300 {
        let reply = worker.next_reply();
        assert!(reply.contains_key("ok"), "reply {index}: {reply:?}");
        assert_ne!(field(&reply, "id"), "after", "reply {index} came too late");
        if field(&reply, "error")["type"] == "ProtocolError" {
            refused += 1;
        }
    }
    assert!(refused > 150, "only {refused} of 300 hostile lines refused");
    assert_good_reply(&worker.next_reply(), "after");
    worker.stdin = Some(writer.join().expect("writer"));
}

#[test]
fn nesting_deeper_than_the_engine_reads_back_is_refused_with_a_null_id() {
    let mut worker = RawWorker::start(&[]);
    // An id 1,000 levels deep, as the issue found it echoed back.
    let line = format!(
        r#"{{"id":{},"op":"run","flow":"t","node":"good","source":{},"kwargs":{{"x":21}}}}"#,
        nested(1000),
        json!(GOOD)
    );
    worker.send_line(line.as_bytes());
    let reply = worker.next_reply();
    assert_protocol_error(&reply, "more than 512 levels deep");
    assert_eq!(field(&reply, "id"), Value::Null);
    // Deep kwargs are refused the same way: the child's `json` would fail.
    let line = format!(
        r#"{{"id":"k","op":"run","flow":"t","node":"good","source":{},"kwargs":{{"x":{}}}}}"#,
        json!(GOOD),
        nested(600)
    );
    worker.send_line(line.as_bytes());
    assert_protocol_error(&worker.next_reply(), "send flatter data");
    // At the limit it is served: the request object and 511 levels of id.
    let line = format!(
        r#"{{"id":{},"op":"run","flow":"t","node":"good","source":{},"kwargs":{{"x":21}}}}"#,
        nested(511),
        json!(GOOD)
    );
    worker.send_line(line.as_bytes());
    let reply = worker.next_reply();
    assert_eq!(reply["id"].get(), nested(511));
    assert_eq!(field(&reply, "result"), 42);
    worker.send_line(good_request("after").as_bytes());
    assert_good_reply(&worker.next_reply(), "after");
}

#[test]
fn a_2_gib_line_without_a_newline_is_refused_in_bounded_memory() {
    let mut worker = RawWorker::start(&["--max-request-mb", "1"]);
    let mut stdin = worker.stdin.take().expect("stdin");
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 2048;
    let writer = std::thread::spawn(move || {
        // One megabyte, written 2,048 times: the test never holds more.
        let chunk: Vec<u8> = (0..CHUNK).map(|i| b"[{\"a"[i % 4]).collect();
        for _ in 0..CHUNKS {
            stdin.write_all(&chunk).expect("written");
        }
        stdin.write_all(b"\n").expect("written");
        stdin
            .write_all(good_request("after").as_bytes())
            .expect("written");
        stdin.write_all(b"\n").expect("written");
        stdin.flush().expect("flushed");
        stdin
    });
    let reply = worker.next_reply();
    assert_protocol_error(
        &reply,
        "the request is 2048 MiB, over the limit of 1 MiB (--max-request-mb)",
    );
    assert_eq!(field(&reply, "id"), Value::Null);
    assert_good_reply(&worker.next_reply(), "after");
    let peak = worker.vm_hwm_kib();
    assert!(
        peak < 200 * 1024,
        "the worker's peak RSS was {} MiB",
        peak / 1024
    );
    worker.stdin = Some(writer.join().expect("writer"));
}

/// The agent refuses a frame too deep the same way, answering the call by
/// its `call_id`, and serves the next one.
#[test]
fn the_agent_refuses_a_frame_nested_too_deep_and_serves_on() {
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    let mut deep = json!(1);
    for _ in 0..1000 {
        deep = Value::Array(vec![deep]);
    }
    connection.send(&json!({"op": "run", "id": deep, "call_id": "deep", "flow": "f", "node": "n", "source": GOOD, "kwargs": {"x": 1}}));
    let (_, reply) = connection.reply("deep", WAIT);
    assert_eq!(reply["error"]["type"], "ProtocolError", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("more than 512 levels deep"),
        "{reply}"
    );
    assert_eq!(reply["id"], Value::Null);
    assert_eq!(reply["ok"], false);
    connection.send(&json!({"op": "run", "id": 2, "call_id": "after", "flow": "f", "node": "n", "source": GOOD, "kwargs": {"x": 21}}));
    let (_, reply) = connection.reply("after", WAIT);
    assert_eq!(reply["result"], 42, "{reply}");
}
