//! The reply for a call whose process ended without one reads the same on
//! every path: `error.short` is `error.message` (PROTOCOL.md, section 2:
//! there is no node frame to point at), whether the worker, a pool slot,
//! a node's own zygote, the agent or `sweep` answers for it, and whether a
//! fresh child or a resident served it.

mod common;

use std::time::Duration;

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{Worker, ZYGOTE, compile, run, scratch};
use serde_json::{Value, json};

const EXITS: &str = "import os\ndef process():\n    print('bye')\n    os._exit(3)\n";
const CRASHES: &str = "import ctypes\ndef process():\n    ctypes.string_at(0)\n";
const SLEEPS: &str =
    "import fluksio, time\ndef process():\n    fluksio.emit(up=True)\n    time.sleep(3600)\n";

fn agent_run(call_id: &str, source: &str, kwargs: Value) -> Value {
    json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": call_id, "source": source, "kwargs": kwargs})
}

fn agent_compile(call_id: &str, source: &str) -> Value {
    json!({"op": "compile", "id": "c", "call_id": call_id, "flow": "f", "node": call_id, "source": source})
}

/// `reply` says its process ended: type, message and short agree.
fn says_it_ended(reply: &Value, kind: &str, how: &str, way: &str) {
    let error = &reply["error"];
    assert_eq!(reply["ok"], false, "{way}: {reply}");
    assert_eq!(error["type"], kind, "{way}: {reply}");
    let message = error["message"].as_str().unwrap_or_default();
    assert!(message.contains(how), "{way}: {reply}");
    assert_eq!(error["short"], error["message"], "{way}: {reply}");
    assert_eq!(error["traceback"], "", "{way}: {reply}");
}

/// The worker's ways of serving a call: a fresh child, a resident, a node's
/// own zygote forking it, and a pool slot of a shared zygote (each in both
/// isolations).
fn worker_ways() -> Vec<(&'static str, Vec<(&'static str, &'static str)>)> {
    let shared = |scope| {
        vec![
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", scope),
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "2"),
        ]
    };
    let mut slot_resident = shared("ended-replies-node");
    slot_resident.push(("FLUKSIO_ISOLATION", "node"));
    vec![
        ("fresh child", vec![("FLUKSIO_ISOLATION", "call")]),
        ("resident", vec![("FLUKSIO_ISOLATION", "node")]),
        (
            "node zygote",
            vec![
                ("FLUKSIO_ISOLATION", "call"),
                ("FLUKSIO_NODE_ZYGOTE_MIB", "0"),
            ],
        ),
        ("pool slot", shared("ended-replies-call")),
        ("pool slot, resident", slot_resident),
    ]
}

#[test]
fn a_call_whose_process_ended_has_short_equal_to_message_in_the_worker() {
    for (way, env) in worker_ways() {
        let mut worker = Worker::zygote_with(&[], &env);
        // First run (the node not yet loaded), then again (compiled).
        for (id, node) in [(1, "exits"), (2, "exits")] {
            let reply = worker.call(&run(id, node, EXITS, json!({}))).reply;
            says_it_ended(&reply, "RemoteError", "exited with code 3", way);
            assert_eq!(reply["logs"], "bye\n", "{way}: {reply}");
        }
        let reply = worker.call(&run(3, "crashes", CRASHES, json!({}))).reply;
        says_it_ended(&reply, "RemoteError", "killed by SIGSEGV", way);
        let reply = worker
            .call(&run(4, "ok", "def process():\n    return 1\n", json!({})))
            .reply;
        assert_eq!(reply["result"], 1, "{way}: still serving: {reply}");
    }
}

#[test]
fn a_cancelled_or_crashed_call_has_short_equal_to_message_in_the_agent() {
    for isolation in ["call", "node"] {
        let engine = Engine::start(Answer::Welcome);
        let _agent = Agent::start(&engine.url, &["--isolation", isolation], &[]);
        let connection = engine.next_connection(WAIT);
        let way = format!("agent, --isolation {isolation}");

        connection.send(&agent_run("e1", EXITS, json!({})));
        let (_, reply) = connection.reply("e1", WAIT);
        says_it_ended(&reply, "RemoteError", "exited with code 3", &way);

        // A run cancelled while its process runs.
        connection.send(&agent_run("s1", SLEEPS, json!({})));
        connection.until(WAIT, |m| m["event"] == "emit");
        connection.send(&json!({"op": "cancel", "call_id": "s1"}));
        let (_, reply) = connection.reply("s1", WAIT);
        says_it_ended(&reply, "NodeCancelled", "was cancelled", &way);

        // A compile cancelled while its module level runs.
        connection.send(&agent_compile(
            "c1",
            "import time\ntime.sleep(3600)\ndef process():\n    return 1\n",
        ));
        std::thread::sleep(Duration::from_millis(500));
        connection.send(&json!({"op": "cancel", "call_id": "c1"}));
        let (_, reply) = connection.reply("c1", WAIT);
        says_it_ended(&reply, "NodeCancelled", "was cancelled", &way);

        connection.send(&agent_run(
            "after",
            "def process():\n    return 'served'\n",
            json!({}),
        ));
        assert_eq!(connection.reply("after", WAIT).1["result"], "served");
    }
}

#[test]
fn a_point_whose_process_ended_has_short_equal_to_message_in_a_sweep() {
    let dir = scratch("ended-replies-sweep");
    let node = dir.join("node.py");
    std::fs::write(
        &node,
        "import os, time\ndef process(x):\n    if x == 1:\n        os._exit(3)\n    if x == 2:\n        time.sleep(3600)\n    return x\n",
    )
    .unwrap();
    for isolation in ["call", "node"] {
        let output = std::process::Command::new(ZYGOTE)
            .arg("sweep")
            .arg(&node)
            .args(["--grid", "x=0..3", "--timeout", "1", "-j", "1"])
            .args(["--isolation", isolation])
            .output()
            .unwrap();
        let mut lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect();
        lines.sort_by_key(|line| line["index"].as_u64());
        let way = format!("sweep, --isolation {isolation}");
        assert_eq!(lines.len(), 4, "{way}: {lines:?}");
        says_it_ended(&lines[1], "RemoteError", "exited with code 3", &way);
        says_it_ended(&lines[2], "NodeTimeout", "--timeout 1 s", &way);
    }
}

#[test]
fn a_compile_whose_process_ended_has_short_equal_to_message() {
    let mut worker = Worker::zygote_with(&[], &[("FLUKSIO_ISOLATION", "call")]);
    let reply = worker
        .call(&compile(1, "leaves", "import os\nos._exit(4)\n"))
        .reply;
    says_it_ended(&reply, "RemoteError", "exited with code 4", "compile");
}
