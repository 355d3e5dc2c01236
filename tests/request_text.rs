//! Text taken off a request reads as the references read it. A `call_id`
//! that is not a string is `str(request.get("call_id") or "")`: `true`
//! comes back as `"True"`, `7` as `"7"`, on every line of the call, the
//! node's (its events, its reply) and the agent's own (heartbeats, the
//! reply to a cancel). An `env` value is agent.py's `str(v)`: `true` is
//! `"True"`, `0` is `"0"`, `null` is `"None"`.

mod common;

use common::Worker;
use common::agent::{WAIT, attached};
use serde_json::{Value, json};

/// `(call_id as the engine sends it, as Python's str(call_id or "") shows it)`.
const CALL_IDS: &[(&str, &str)] = &[
    ("true", "True"),
    ("7", "7"),
    ("1E2", "100.0"),
    (r#"[1, "a", null]"#, "[1, 'a', None]"),
    ("0", ""),
];

/// An event, then long enough asleep for heartbeats.
const YIELDS: &str =
    "import time\ndef process():\n    yield {'step': 1}\n    time.sleep(0.8)\n    return 'done'\n";

fn run(call_id: &str, source: &str) -> Value {
    // Parsed, not built: the numbers keep the text they were written as.
    let call_id: Value = serde_json::from_str(call_id).unwrap();
    json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": "n", "source": source})
}

#[test]
fn the_agent_shows_a_call_id_as_python_does() {
    let (_engine, _agent, connection) = attached();
    for (call_id, shown) in CALL_IDS {
        connection.send(&run(call_id, YIELDS));
        let (events, reply) = connection.reply(shown, WAIT);
        assert_eq!(reply["result"], "done", "{call_id}: {reply}");
        assert!(
            events.iter().any(|e| e["event"] == "heartbeat"),
            "{call_id}: {events:?}"
        );
        assert!(
            events.iter().all(|e| e["call_id"] == *shown),
            "{call_id}: {events:?}"
        );
    }
}

#[test]
fn a_cancel_names_its_call_as_python_shows_it() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run(
        "true",
        "import time\ndef process():\n    yield {'up': 1}\n    time.sleep(3600)\n",
    ));
    connection.until(WAIT, |m| m["event"] == "yield");
    connection.send(&json!({"op": "cancel", "call_id": true}));
    let (_, reply) = connection.reply("True", WAIT);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
}

#[test]
fn the_worker_shows_a_call_id_as_the_reference_does() {
    let mut ours = Worker::zygote(&[]);
    let mut reference = Worker::reference();
    for (call_id, shown) in CALL_IDS {
        let line = format!(
            r#"{{"op": "run", "id": 1, "call_id": {call_id}, "flow": "f", "node": "n", "source": "def process():\n    yield {{'step': 1}}\n    return 'done'\n"}}"#
        );
        for (worker, who) in [(&mut ours, "ours"), (&mut reference, "reference")] {
            worker.send_line(line.as_bytes());
            let answer = worker.answer();
            assert_eq!(answer.reply["result"], "done", "{who}, {call_id}");
            assert_eq!(answer.reply["call_id"], *shown, "{who}, {call_id}");
            assert_eq!(answer.events.len(), 1, "{who}, {call_id}");
            assert_eq!(answer.events[0]["call_id"], *shown, "{who}, {call_id}");
        }
    }
}

#[test]
fn an_env_value_reads_as_agent_py_reads_it() {
    let (_engine, _agent, connection) = attached();
    connection.send(&json!({
        "op": "run", "id": 1, "call_id": "env", "flow": "f", "node": "env",
        "source": "import os\ndef process():\n    return [os.environ[k] for k in 'ABCDE']\n",
        "env": {"A": true, "B": 0, "C": null, "D": 1.5, "E": "text"},
    }));
    let (_, reply) = connection.reply("env", WAIT);
    assert_eq!(
        reply["result"],
        json!(["True", "0", "None", "1.5", "text"]),
        "{reply}"
    );
}
