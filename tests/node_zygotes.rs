//! A node's own zygote in `worker` mode: a node whose module level leaves
//! `--node-zygote-mib` or more gets a zygote of its own, forked from the
//! worker's, so the worker stays small and every other node's calls fork
//! from it as cheaply as before. (The agent and a shared zygote give every
//! node one: `agent.rs`, `shared_zygote.rs`.)

mod common;

use std::time::Duration;

use common::{Worker, compile, run};
use serde_json::{Value, json};

const WHO: &str = "import os\ndef process():\n    return [os.getpid(), os.getppid()]\n";

/// About 40 MB of module-level Python objects, and who forked the call.
const HEAVY: &str = "import os\nprint('loading')\nTABLE = list(range(1_000_000))\ndef process():\n    return [os.getpid(), os.getppid(), len(TABLE)]\n";

fn anonymous_mib(pid: i32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("alive");
    let line = status
        .lines()
        .find(|l| l.starts_with("RssAnon:"))
        .expect("RssAnon");
    line.split_whitespace()
        .nth(1)
        .unwrap()
        .parse::<u64>()
        .unwrap()
        / 1024
}

fn parent(reply: &Value) -> i32 {
    reply["result"][1]
        .as_i64()
        .unwrap_or_else(|| panic!("{reply}")) as i32
}

#[test]
fn a_heavy_node_gets_a_zygote_of_its_own_and_the_worker_stays_small() {
    let mut worker = Worker::zygote(&["--node-zygote-mib", "16"]);
    let zygote = worker.pid();
    assert_eq!(
        parent(&worker.call(&run(1, "who", WHO, json!({}))).reply),
        zygote
    );
    let before = anonymous_mib(zygote);
    let compiled = worker.call(&compile(2, "heavy", HEAVY)).reply;
    assert_eq!(compiled["ok"], true, "{compiled}");
    assert_eq!(
        compiled["logs"], "loading\n",
        "its module level ran, and said so"
    );
    let heavy = worker.call(&run(3, "heavy", HEAVY, json!({}))).reply;
    assert_eq!(heavy["result"][2], 1_000_000, "{heavy}");
    let own = parent(&heavy);
    assert_ne!(own, zygote, "forked by the node's own zygote");
    assert_eq!(common::parent_of(own), zygote, "which the worker forked");
    assert!(
        anonymous_mib(own) >= 16,
        "the node's zygote holds its table"
    );
    assert!(
        anonymous_mib(zygote) < before + 16,
        "the worker did not grow by the node's table: {before} MiB, then {} MiB",
        anonymous_mib(zygote)
    );
    // Another node's calls still fork from the worker's own zygote.
    assert_eq!(
        parent(&worker.call(&run(4, "who", WHO, json!({}))).reply),
        zygote
    );
    assert_eq!(
        parent(&worker.call(&run(5, "heavy", HEAVY, json!({}))).reply),
        own
    );
    let (code, _) = worker.finish();
    assert_eq!(code, Some(0));
    assert!(
        common::wait_gone(own, Duration::from_secs(5)),
        "the node's zygote ends with the worker"
    );
}

#[test]
fn a_killed_node_zygote_costs_one_call_and_the_next_loads_it_again() {
    let mut worker = Worker::zygote(&["--node-zygote-mib", "16"]);
    let own = parent(&worker.call(&run(1, "heavy", HEAVY, json!({}))).reply);
    common::sigkill(own);
    assert!(common::wait_gone(own, Duration::from_secs(5)));
    let lost = worker.call(&run(2, "heavy", HEAVY, json!({}))).reply;
    assert_eq!(lost["ok"], false, "{lost}");
    let message = lost["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("zygote of node") && message.contains("loads it again"),
        "{message}"
    );
    let again = worker.call(&run(3, "heavy", HEAVY, json!({}))).reply;
    assert_eq!(again["result"][2], 1_000_000, "{again}");
    assert_ne!(parent(&again), own);
}

#[test]
fn under_isolation_node_a_heavy_node_stays_in_the_worker() {
    let mut worker = Worker::zygote(&["--node-zygote-mib", "16", "--isolation", "node"]);
    let zygote = worker.pid();
    let first = worker.call(&run(1, "heavy", HEAVY, json!({}))).reply;
    let second = worker.call(&run(2, "heavy", HEAVY, json!({}))).reply;
    assert_eq!(parent(&first), zygote, "{first}");
    assert_eq!(
        first["result"][0], second["result"][0],
        "one resident child"
    );
}
