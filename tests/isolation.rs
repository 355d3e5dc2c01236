//! Each call starts from the zygote's state, in a session of its own, and
//! ends with everything it started: nothing outlives a call or its zygote.
//! Each holds under `--isolation call` and `reset` (where a node's calls
//! share its resident's session, and end what they started all the same).

mod common;

use std::time::Duration;

use common::{Worker, children_of, compile, run, wait_gone};
use serde_json::json;

const ISOLATIONS: [&str; 2] = ["call", "reset"];

#[test]
fn module_state_set_by_one_call_is_not_seen_by_the_next() {
    for isolation in ISOLATIONS {
        module_state_is_not_seen_by_the_next_call(isolation);
    }
}

fn module_state_is_not_seen_by_the_next_call(isolation: &str) {
    let mut worker = Worker::zygote(&["--isolation", isolation]);
    let source = "seen = []\ndef process(x):\n    seen.append(x)\n    return list(seen)\n";
    worker.call(&compile(1, "state", source));
    for x in 0..4 {
        let reply = worker
            .call(&run(2 + x, "state", source, json!({"x": x})))
            .reply;
        assert_eq!(
            reply["result"],
            json!([x]),
            "{isolation}: each call sees the zygote's state only"
        );
    }
}

#[test]
fn each_call_runs_in_its_own_session() {
    let mut worker = Worker::zygote(&[]);
    let source = "import os\ndef process():\n    return [os.getpid(), os.getsid(0), os.getpgrp(), os.getppid()]\n";
    let mut pids = Vec::new();
    for id in 0..3 {
        let result = worker.call(&run(id, "session", source, json!({}))).reply["result"].clone();
        let [pid, sid, pgrp, ppid] = [0, 1, 2, 3].map(|i| result[i].as_i64().unwrap());
        assert_eq!(sid, pid, "the call leads its own session");
        assert_eq!(pgrp, pid, "and its own process group");
        assert_eq!(ppid, worker.pid() as i64, "the zygote is its parent");
        pids.push(pid);
    }
    pids.dedup();
    assert_eq!(pids.len(), 3, "a new process for every call");
    // Under reset a node's residents lead the sessions their calls share.
    let mut worker = Worker::zygote(&["--isolation", "reset"]);
    let mut pids = Vec::new();
    for id in 0..3 {
        let result = worker.call(&run(id, "session", source, json!({}))).reply["result"].clone();
        let [pid, sid, pgrp, ppid] = [0, 1, 2, 3].map(|i| result[i].as_i64().unwrap());
        assert_eq!([sid, pgrp, ppid], [pid, pid, worker.pid() as i64]);
        pids.push(pid);
    }
    pids.sort_unstable();
    pids.dedup();
    // The second call comes while the first's resident is put back: a
    // second serves it, and from then on the two take turns.
    assert!(pids.len() <= 2, "a node's residents served them: {pids:?}");
}

#[test]
fn killing_the_zygote_kills_a_running_call_and_what_it_started() {
    for isolation in ISOLATIONS {
        killing_the_zygote_kills_what_runs(isolation);
    }
}

fn killing_the_zygote_kills_what_runs(isolation: &str) {
    let mut worker = Worker::zygote(&["--isolation", isolation]);
    let source = "import fluksio, os, subprocess, time\ndef process():\n    sleeper = subprocess.Popen(['sleep', '3600'])\n    fluksio.emit(pids=[os.getpid(), sleeper.pid])\n    time.sleep(3600)\n";
    worker.send(&run(1, "hang", source, json!({})));
    let event = worker.next_line();
    let pids = common::pids_in(&event["outputs"]["pids"]);
    common::sigkill(worker.pid());
    for pid in pids {
        assert!(
            wait_gone(pid, Duration::from_secs(10)),
            "{isolation}: process {pid} outlived its zygote"
        );
    }
}

#[test]
fn a_call_that_replied_takes_what_it_started_with_it() {
    for isolation in ISOLATIONS {
        let mut worker = Worker::zygote(&["--isolation", isolation]);
        let source = "import subprocess\ndef process():\n    return subprocess.Popen(['sleep', '3600']).pid\n";
        let reply = worker.call(&run(1, "leak", source, json!({}))).reply;
        let leaked = reply["result"].as_i64().expect("a pid") as i32;
        assert!(
            wait_gone(leaked, Duration::from_secs(10)),
            "{isolation}: the call's subprocess outlived it"
        );
    }
}

#[test]
fn a_thousand_calls_leave_no_zombie() {
    for isolation in ISOLATIONS {
        a_thousand_calls_leave_no_zombie_under(isolation);
    }
}

fn a_thousand_calls_leave_no_zombie_under(isolation: &str) {
    // The two standby children, and under reset the node's residents (one
    // put back while the other serves).
    let left = if isolation == "reset" { 4 } else { 2 };
    let mut worker = Worker::zygote(&["--isolation", isolation]);
    let source = "def process(x):\n    return x\n";
    for x in 0..1000 {
        worker.send(&run(x, "many", source, json!({"x": x})));
    }
    for x in 0..1000 {
        assert_eq!(worker.answer().reply["result"], x);
    }
    // Children are reaped as they exit, off the calls' clock: give the last
    // ones the moment their teardown takes.
    let mut children = children_of(worker.pid());
    for _ in 0..100 {
        if children.iter().all(|&(_, state)| state != 'Z') && children.len() <= left {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
        children = children_of(worker.pid());
    }
    let zombies: Vec<_> = children
        .iter()
        .filter(|&&(_, state)| state == 'Z')
        .collect();
    assert!(
        zombies.is_empty(),
        "{isolation}: zombies after 1000 calls: {zombies:?}"
    );
    assert!(
        children.len() <= left,
        "{isolation}: only the standby children (and a resident) are left: {children:?}"
    );
    let (code, _) = worker.finish();
    assert_eq!(code, Some(0));
}

#[test]
fn stdin_closing_ends_the_worker_and_every_child() {
    for isolation in ISOLATIONS {
        stdin_closing_ends_everything(isolation);
    }
}

fn stdin_closing_ends_everything(isolation: &str) {
    let mut worker = Worker::zygote(&["--isolation", isolation]);
    worker.call(&run(1, "x", "def process():\n    return 1\n", json!({})));
    let zygote = worker.pid();
    // The next standby is forked once the reply is out.
    let start = std::time::Instant::now();
    let children: Vec<i32> = loop {
        let children: Vec<i32> = children_of(zygote)
            .into_iter()
            .map(|(pid, _)| pid)
            .collect();
        if !children.is_empty() || start.elapsed() > Duration::from_secs(5) {
            break children;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    assert!(
        !children.is_empty(),
        "a standby child waits for the next call"
    );
    let (code, _) = worker.finish();
    assert_eq!(code, Some(0));
    for pid in children {
        assert!(
            wait_gone(pid, Duration::from_secs(10)),
            "{isolation}: child {pid} outlived the worker"
        );
    }
}

#[test]
fn each_call_gets_the_gc_back_and_the_zygote_heap_stays_frozen() {
    let mut worker = Worker::zygote(&[]);
    let source =
        "import gc\ndef process():\n    return [gc.isenabled(), gc.get_freeze_count() > 0]\n";
    let reply = worker.call(&run(1, "gc", source, json!({}))).reply;
    // The zygote keeps its cyclic GC off and its objects frozen (shared
    // pages stay shared); a call collects its own garbage as usual.
    assert_eq!(reply["result"], json!([true, true]), "{reply}");
}

/// `--isolation node`: the calls of a node share one child, in turn, as a
/// reused `worker_main.py` does; a crash, a source change or
/// `--max-calls-per-child` costs a fork, never a cold start.
mod a_child_per_node {
    use super::*;

    const COUNTER: &str = "import os\nseen = []\ndef process(x):\n    seen.append(x)\n    return [os.getpid(), list(seen)]\n";

    fn call(worker: &mut Worker, id: i64, source: &str, x: i64) -> serde_json::Value {
        worker
            .call(&run(id, "counter", source, json!({"x": x})))
            .reply
    }

    #[test]
    fn keeps_module_state_between_the_calls_of_a_node() {
        let mut worker = Worker::zygote(&["--isolation", "node"]);
        let first = call(&mut worker, 1, COUNTER, 1);
        let second = call(&mut worker, 2, COUNTER, 2);
        assert_eq!(first["result"][1], json!([1]));
        assert_eq!(second["result"][1], json!([1, 2]), "{second}");
        assert_eq!(first["result"][0], second["result"][0], "one child");
        let other = worker
            .call(&run(
                3,
                "other",
                "seen = []\ndef process():\n    seen.append(0)\n    return len(seen)\n",
                json!({}),
            ))
            .reply;
        assert_eq!(other["result"], 1, "each node has its own child: {other}");
    }

    #[test]
    fn replaces_a_crashed_child_with_a_fresh_fork() {
        let mut worker = Worker::zygote(&["--isolation", "node"]);
        let source = "import os\nseen = []\ndef process(x):\n    seen.append(x)\n    if x == 'crash':\n        os._exit(3)\n    return [os.getpid(), len(seen)]\n";
        let before = worker.call(&run(1, "c", source, json!({"x": 1}))).reply;
        let crashed = worker
            .call(&run(2, "c", source, json!({"x": "crash"})))
            .reply;
        assert!(
            crashed["error"]["message"]
                .as_str()
                .unwrap()
                .contains("exited with code 3"),
            "{crashed}"
        );
        let after = worker.call(&run(3, "c", source, json!({"x": 3}))).reply;
        assert_eq!(
            after["result"][1], 1,
            "a fresh child, from the zygote's state: {after}"
        );
        assert_ne!(before["result"][0], after["result"][0]);
    }

    #[test]
    fn a_new_source_gets_a_new_child() {
        let mut worker = Worker::zygote(&["--isolation", "node"]);
        call(&mut worker, 1, COUNTER, 1);
        let changed = COUNTER.replace("return [", "return ['v2', ");
        let reply = call(&mut worker, 2, &changed, 2);
        assert_eq!(reply["result"][0], "v2");
        assert_eq!(reply["result"][2], json!([2]), "{reply}");
    }

    #[test]
    fn max_calls_per_child_retires_a_child_after_that_many_calls() {
        let mut worker = Worker::zygote(&["--isolation", "node", "--max-calls-per-child", "2"]);
        let pids: Vec<_> = (0..4)
            .map(|x| call(&mut worker, x, COUNTER, x)["result"][0].clone())
            .collect();
        assert_eq!(pids[0], pids[1]);
        assert_ne!(pids[1], pids[2]);
        assert_eq!(pids[2], pids[3]);
    }

    #[test]
    fn is_chosen_by_the_environment_for_the_pool() {
        let mut worker = Worker::zygote_with(&[], &[("FLUKSIO_ISOLATION", "node")]);
        call(&mut worker, 1, COUNTER, 1);
        assert_eq!(call(&mut worker, 2, COUNTER, 2)["result"][1], json!([1, 2]));
    }

    #[test]
    fn what_a_call_left_running_ends_with_its_child() {
        let mut worker = Worker::zygote(&["--isolation", "node"]);
        let source = "import subprocess\ndef process():\n    return subprocess.Popen(['sleep', '3600']).pid\n";
        let leaked = worker.call(&run(1, "leak", source, json!({}))).reply["result"]
            .as_i64()
            .unwrap() as i32;
        let (code, _) = worker.finish();
        assert_eq!(code, Some(0));
        assert!(
            wait_gone(leaked, Duration::from_secs(10)),
            "{leaked} outlived the worker"
        );
    }
}

/// The runtime starts itself again with every function bound
/// (`LD_BIND_NOW`: the loader's lazy binding saves the vector registers,
/// a request's bytes, on the zygote's stack): a call finds the variable as
/// the user set it, or not at all, and the runtime's own marker never; the
/// process keeps its name (`ps` shows it as before).
#[test]
fn a_call_finds_ld_bind_now_as_the_user_left_it() {
    let source = "import os\ndef process():\n    return [os.environ.get('LD_BIND_NOW'), sorted(k for k in os.environ if 'BIND_NOW' in k)]\n";
    // The last: a marker like the runtime's own, inherited from elsewhere,
    // does not stop the start again.
    for (given, marker) in [
        (None, false),
        (Some(""), false),
        (Some("1"), false),
        (None, true),
    ] {
        let mut command = std::process::Command::new(common::ZYGOTE);
        command.arg("worker").env_remove("LD_BIND_NOW");
        if let Some(value) = given {
            command.env("LD_BIND_NOW", value);
        }
        if marker {
            command.env("FLUKSIO_ADDED_LD_BIND_NOW", "absent");
        }
        let mut worker = common::Worker::spawn(command);
        let reply = worker.call(&run(1, "bind", source, json!({}))).reply;
        assert_eq!(reply["ok"], true, "{reply}");
        let expected_keys: Vec<&str> = given.iter().map(|_| "LD_BIND_NOW").collect();
        assert_eq!(
            reply["result"],
            json!([given, expected_keys]),
            "given {given:?}, marker {marker}"
        );
        // Started with every function bound, under its own name.
        let proc = |file: &str| std::fs::read(format!("/proc/{}/{file}", worker.pid())).unwrap();
        let environ = proc("environ");
        assert!(
            environ
                .split(|&b| b == 0)
                .any(|var| var == b"LD_BIND_NOW=1"),
            "given {given:?}, marker {marker}: {}",
            String::from_utf8_lossy(&environ)
        );
        assert_eq!(
            String::from_utf8_lossy(&proc("comm")).trim(),
            "fluksio-zygote"
        );
    }
}
