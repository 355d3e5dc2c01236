//! Replies of any size: a 100 MB reply arrives whole, in worker and in agent
//! mode; one over `--max-reply-mb` (or `FLUKSIO_MAX_REPLY_MB`) gets a clear
//! `ReplyTooLarge` error, never a hang, with the reader's memory bounded by
//! the limit, and the next call works.
//!
//! These tests hold hundreds of MB each (the node's string, its JSON, the
//! reader's buffer, the test's own copy): they take turns, so the file's
//! peak stays near one of them.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{Worker, compile, run};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

/// One test at a time in this file: each holds hundreds of MB.
static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())
}

const MB: usize = 1 << 20;

/// A node returning `n` bytes of random hex, after an event carrying their
/// SHA-256 (hashed a MiB at a time, so the check costs no second copy).
const RANDOM_HEX: &str = r#"
import hashlib, random

def process(n, seed):
    text = random.Random(seed).randbytes(n // 2).hex()
    digest = hashlib.sha256()
    for at in range(0, len(text), 1 << 20):
        digest.update(text[at:at + (1 << 20)].encode())
    yield {"sha256": digest.hexdigest(), "length": len(text)}
    return text
"#;

/// A node whose result (or, with `event`, an event) is `n` bytes of 'x'.
const BIG: &str = r#"
import fluksio

def process(n, event=False):
    if event:
        fluksio.emit(out="x" * n)
        return "not reached"
    return "x" * n
"#;

fn sha256_hex(bytes: &[u8]) -> String {
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// The result of a random-hex reply, checked against the event before it:
/// length and checksum, never printed.
fn check_random_hex(events: &[Value], reply: &Value, n: usize) {
    assert_eq!(reply["ok"], true, "the call failed: {}", reply["error"]);
    let result = reply["result"].as_str().expect("a string result");
    assert_eq!(result.len(), n, "the whole result arrived");
    let sums: Vec<&Value> = events
        .iter()
        .filter(|e| e["event"] == "yield")
        .map(|e| &e["outputs"])
        .collect();
    assert_eq!(sums.len(), 1, "one event before the reply");
    assert_eq!(sums[0]["length"], n);
    assert_eq!(
        sums[0]["sha256"].as_str(),
        Some(sha256_hex(result.as_bytes()).as_str()),
        "the result arrived unchanged"
    );
}

/// `VmHWM` (peak resident memory) of `pid`, in KiB.
fn peak_kib(pid: i32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmHWM")
}

fn check_too_large(reply: &Value, what: &str, mb: usize, limit_mb: usize) {
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["error"]["type"], "ReplyTooLarge", "{reply}");
    let message = reply["error"]["message"].as_str().expect("a message");
    for expected in [
        what.to_string(),
        format!("was {mb} MB"),
        format!("limit of {limit_mb} MB"),
        "fluksio.save_artifact".into(),
        "--max-reply-mb".into(),
    ] {
        assert!(
            message.contains(&expected),
            "{expected:?} not in the message: {message}"
        );
    }
    assert!(reply.get("result").is_none(), "{reply}");
}

#[test]
fn a_100_mb_reply_arrives_whole_in_worker_mode_with_bounded_memory() {
    let _turn = one_at_a_time();
    let mut worker = Worker::zygote(&[]);
    let warm = worker.call(&run(1, "hex", RANDOM_HEX, json!({"n": 2, "seed": 0})));
    assert_eq!(warm.reply["ok"], true, "{}", warm.reply);
    let before = peak_kib(worker.pid());
    let n = 100 * MB;
    let answer = worker.call(&run(2, "hex", RANDOM_HEX, json!({"n": n, "seed": 7})));
    check_random_hex(&answer.events, &answer.reply, n);
    let grown_mb = (peak_kib(worker.pid()) - before) / 1024;
    eprintln!("the worker's peak memory grew by {grown_mb} MB for a 100 MB reply");
    // The reply is held once, whole, on its way through (plus a read).
    assert!(
        grown_mb <= 160,
        "the worker's peak memory grew by {grown_mb} MB for a 100 MB reply"
    );
    let next = worker.call(&run(3, "hex", RANDOM_HEX, json!({"n": 64, "seed": 1})));
    check_random_hex(&next.events, &next.reply, 64);
}

#[test]
fn over_the_limit_a_clear_error_the_worker_serves_on_its_memory_bounded() {
    let _turn = one_at_a_time();
    // The pool passes no flags: the limit comes from the environment.
    let mut worker = Worker::zygote_with(&[], &[("FLUKSIO_MAX_REPLY_MB", "8")]);
    let warm = worker.call(&run(1, "big", BIG, json!({"n": 10})));
    assert_eq!(warm.reply["result"], "x".repeat(10));
    let before = peak_kib(worker.pid());

    let reply = worker
        .call(&run(2, "big", BIG, json!({"n": 64 * MB})))
        .reply;
    check_too_large(&reply, "the node's reply", 64, 8);
    assert_eq!(reply["id"], 2);

    let answer = worker.call(&run(3, "big", BIG, json!({"n": 20 * MB, "event": true})));
    assert!(
        answer.events.is_empty(),
        "the event over the limit is not sent"
    );
    check_too_large(&answer.reply, "an event the node sent", 20, 8);

    // Just under the limit (the whole line: the result and its envelope)
    // is a reply like any other.
    let under = 8 * MB - 200;
    let reply = worker.call(&run(4, "big", BIG, json!({"n": under}))).reply;
    assert_eq!(
        reply["result"].as_str().map(str::len),
        Some(under),
        "{}",
        reply["error"]
    );

    let grown_mb = (peak_kib(worker.pid()) - before) / 1024;
    eprintln!("the worker's peak memory grew by {grown_mb} MB with a limit of 8 MB");
    assert!(
        grown_mb <= 32,
        "the worker's peak memory grew by {grown_mb} MB with a limit of 8 MB"
    );
    let reply = worker.call(&run(5, "big", BIG, json!({"n": 3}))).reply;
    assert_eq!(reply["result"], "xxx");
}

#[test]
fn the_flag_sets_the_limit_and_a_bad_value_is_refused() {
    let _turn = one_at_a_time();
    let mut worker = Worker::zygote(&["--max-reply-mb", "1"]);
    let reply = worker.call(&run(1, "big", BIG, json!({"n": 2 * MB}))).reply;
    check_too_large(&reply, "the node's reply", 2, 1);
    let reply = worker.call(&run(2, "big", BIG, json!({"n": 5}))).reply;
    assert_eq!(reply["result"], "xxxxx");

    let refused = std::process::Command::new(common::ZYGOTE)
        .args(["worker", "--max-reply-mb", "lots"])
        .output()
        .expect("runs");
    assert_eq!(refused.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(stderr.contains("--max-reply-mb"), "{stderr}");
}

fn run_call(call_id: &str, source: &str, kwargs: Value) -> Value {
    json!({"op": "run", "id": call_id, "call_id": call_id, "flow": "t", "node": "n", "source": source, "kwargs": kwargs})
}

#[test]
fn a_100_mb_reply_arrives_whole_in_agent_mode() {
    let _turn = one_at_a_time();
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    let n = 100 * MB;
    let (events, reply) = connection.reply_to(
        &run_call("hex", RANDOM_HEX, json!({"n": n, "seed": 3})),
        WAIT,
    );
    check_random_hex(&events, &reply, n);
    drop(reply);
    let (events, reply) = connection.reply_to(
        &run_call("next", RANDOM_HEX, json!({"n": 8, "seed": 4})),
        WAIT,
    );
    check_random_hex(&events, &reply, 8);
}

#[test]
fn over_the_limit_in_agent_mode_a_clear_error_and_the_agent_serves_on() {
    let _turn = one_at_a_time();
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, &["--max-reply-mb", "8"], &[]);
    let connection = engine.next_connection(WAIT);
    let (_, warm) = connection.reply_to(&run_call("warm", BIG, json!({"n": 1})), WAIT);
    assert_eq!(warm["result"], "x");
    let agent_pid = agent.child.id() as i32;
    let before = peak_kib(agent_pid);

    let (_, reply) = connection.reply_to(&run_call("big", BIG, json!({"n": 64 * MB})), WAIT);
    check_too_large(&reply, "the node's reply", 64, 8);
    assert_eq!(reply["call_id"], "big");

    let (events, reply) = connection.reply_to(
        &run_call("event", BIG, json!({"n": 20 * MB, "event": true})),
        WAIT,
    );
    let sent: Vec<&Value> = events.iter().filter(|e| e["event"] == "emit").collect();
    assert!(sent.is_empty(), "the event over the limit is not sent");
    check_too_large(&reply, "an event the node sent", 20, 8);

    // Exactly one reply each: nothing more comes for them.
    let late = connection.recv(Duration::from_millis(500));
    assert!(
        late.as_ref().is_none_or(|m| m["event"] == "heartbeat"),
        "after the replies: {late:?}"
    );
    let grown_mb = (peak_kib(agent_pid) - before) / 1024;
    eprintln!("the agent's peak memory grew by {grown_mb} MB with a limit of 8 MB");
    assert!(
        grown_mb <= 32,
        "the agent's peak memory grew by {grown_mb} MB with a limit of 8 MB"
    );
    let (_, reply) = connection.reply_to(&run_call("after", BIG, json!({"n": 4})), WAIT);
    assert_eq!(reply["result"], "xxxx");
}

/// A node that says its pid, sends an event of `n` bytes, then would stay.
const BIG_THEN_STAY: &str = r#"
import os, time, fluksio
TABLE = list(range(1_000_000))

def process(n, pid_file):
    with open(pid_file, "w") as f:
        f.write(str(os.getpid()))
    fluksio.emit(out="x" * n)
    time.sleep(60)
    return "not reached"
"#;

/// Over the limit where the call's pipe is read by another process than the
/// zygote that forked it: a pool slot (its shared zygote) and a zygote
/// relaying to a node's own zygote. The call's process is ended there too,
/// the reply says why, and the next call works.
#[test]
fn over_the_limit_through_a_slot_or_a_node_zygote_the_call_is_ended() {
    let _turn = one_at_a_time();
    let dir = common::scratch("large-replies-elsewhere");
    let scope = format!("large-replies-{}", std::process::id());
    let slot_env = [
        ("FLUKSIO_MAX_REPLY_MB", "8"),
        ("FLUKSIO_SHARED_ZYGOTE", "1"),
        ("FLUKSIO_TEST_SCOPE", scope.as_str()),
        ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "0.5"),
    ];
    let workers = [
        ("a pool slot", Worker::zygote_with(&[], &slot_env)),
        (
            "a node's own zygote",
            Worker::zygote_with(
                &["--node-zygote-mib", "16"],
                &[("FLUKSIO_MAX_REPLY_MB", "8")],
            ),
        ),
    ];
    for (at, mut worker) in workers {
        let compiled = worker.call(&compile(1, "stay", BIG_THEN_STAY)).reply;
        assert_eq!(compiled["ok"], true, "{at}: {compiled}");
        let pid_file = dir.join("pid");
        let answer = worker.call(&run(
            2,
            "stay",
            BIG_THEN_STAY,
            json!({"n": 20 * MB, "pid_file": pid_file}),
        ));
        assert!(answer.events.is_empty(), "{at}: the event is not sent");
        check_too_large(&answer.reply, "an event the node sent", 20, 8);
        let pid: i32 = std::fs::read_to_string(&pid_file).unwrap().parse().unwrap();
        assert!(
            common::wait_gone(pid, Duration::from_secs(10)),
            "{at}: the call's process {pid} is still running"
        );
        let reply = worker.call(&run(3, "big", BIG, json!({"n": 3}))).reply;
        assert_eq!(reply["result"], "xxx", "{at}");
    }
}
