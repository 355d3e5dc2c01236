//! `worker --shared-zygote` (`FLUKSIO_SHARED_ZYGOTE=1`, for the pool): the
//! pool's slots share one zygote. A slot SIGKILLed by its pool ends exactly
//! its own call; the slot the pool starts next finds the zygote still warm;
//! the zygote ends with its last slot.
//!
//! Slots share a zygote when started alike (same binary, flags and
//! environment), so each test sets a variable of its own: tests running at
//! once never share one.

mod common;

use std::time::Duration;

use common::{Worker, is_gone, run, wait_gone};
use serde_json::{Value, json};

fn slot(scope: &str) -> Worker {
    Worker::zygote_with(
        &[],
        &[
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", scope),
            // Long enough for a respawned slot, short enough to leave
            // nothing running long after the tests.
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "2"),
        ],
    )
}

const WHO: &str = "import os\ndef process():\n    return [os.getpid(), os.getppid()]\n";

fn who(worker: &mut Worker, id: i64) -> (i32, i32) {
    let reply = worker.call(&run(id, "who", WHO, json!({}))).reply;
    let pid = |i: usize| {
        reply["result"][i]
            .as_i64()
            .unwrap_or_else(|| panic!("{reply}")) as i32
    };
    (pid(0), pid(1))
}

#[test]
fn slots_started_alike_share_one_zygote() {
    let mut a = slot("share");
    let mut b = slot("share");
    let (call_a, zygote_a) = who(&mut a, 1);
    let (call_b, zygote_b) = who(&mut b, 2);
    assert_eq!(zygote_a, zygote_b, "one zygote");
    assert_ne!(zygote_a, a.pid(), "not a slot's own");
    assert_ne!(call_a, call_b, "a child of its own per call");
    let mut other = Worker::zygote_with(
        &[],
        &[
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", "share-but-another-environment"),
        ],
    );
    assert_ne!(
        who(&mut other, 3).1,
        zygote_a,
        "started otherwise: another zygote"
    );
}

#[test]
fn a_sigkilled_slot_ends_its_own_call_and_the_next_slot_finds_the_zygote_warm() {
    let mut a = slot("kill");
    let mut b = slot("kill");
    let (_, zygote) = who(&mut b, 1);
    let source = "import fluksio, os, subprocess, time\ndef process():\n    sleeper = subprocess.Popen(['setsid', 'sleep', '3600'])\n    fluksio.emit(pids=[os.getpid(), sleeper.pid])\n    time.sleep(3600)\n";
    a.send(&run(2, "hang", source, json!({})));
    let event = a.next_line();
    let pids = common::pids_in(&event["outputs"]["pids"]);
    // The pool's timeout: SIGKILL to the pid it spawned.
    common::sigkill(a.pid());
    for pid in pids {
        assert!(
            wait_gone(pid, Duration::from_secs(15)),
            "{pid} outlived its slot"
        );
    }
    assert!(!is_gone(zygote), "the zygote serves the other slots on");
    assert_eq!(who(&mut b, 3).1, zygote, "the other slot is untouched");
    let mut respawned = slot("kill");
    assert_eq!(
        who(&mut respawned, 4).1,
        zygote,
        "the respawned slot finds it warm"
    );
}

#[test]
fn the_zygote_ends_with_its_last_slot() {
    let linger = [
        ("FLUKSIO_SHARED_ZYGOTE", "1"),
        ("FLUKSIO_TEST_SCOPE", "last"),
        ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "0.2"),
    ];
    let mut a = Worker::zygote_with(&[], &linger);
    let mut b = Worker::zygote_with(&[], &linger);
    let (_, zygote) = who(&mut a, 1);
    who(&mut b, 2);
    let (code, _) = a.finish();
    assert_eq!(code, Some(0));
    assert!(!is_gone(zygote), "one slot is left");
    let (code, _) = b.finish();
    assert_eq!(code, Some(0));
    assert!(
        wait_gone(zygote, Duration::from_secs(15)),
        "the last slot took it"
    );
}

#[test]
fn a_slot_respawned_after_the_last_was_killed_finds_the_zygote_warm() {
    let mut a = slot("respawn");
    let (_, zygote) = who(&mut a, 1);
    common::sigkill(a.pid());
    let _ = a.child.wait();
    let mut respawned = slot("respawn");
    assert_eq!(
        who(&mut respawned, 2).1,
        zygote,
        "it lingers for the next slot"
    );
}

#[test]
fn a_slot_answers_as_a_private_worker_does() {
    let mut shared = slot("answers");
    let mut private = Worker::zygote(&[]);
    let requests: Vec<Value> = vec![
        run(
            1,
            "gen",
            "import fluksio\ndef process(n):\n    for i in range(n):\n        yield {'i': i}\n    fluksio.emit(done=True)\n    print('printed')\n    return n\n",
            json!({"n": 3}),
        ),
        run(
            2,
            "err",
            "def process():\n    raise KeyError('k')\n",
            json!({}),
        ),
        run(
            3,
            "exit",
            "import os\ndef process():\n    print('before')\n    os._exit(3)\n",
            json!({}),
        ),
        run(
            4,
            "segv",
            "import ctypes\ndef process():\n    ctypes.string_at(0)\n",
            json!({}),
        ),
        json!({"id": 5, "op": "compile", "flow": "t", "node": "bad", "source": "def process(:\n"}),
        json!({"id": 6, "op": "nope"}),
    ];
    let strip = |mut answer: common::Answer| {
        for event in &mut answer.events {
            event.as_object_mut().unwrap().remove("ts");
        }
        answer
    };
    for request in &requests {
        let ours = strip(shared.call(request));
        let theirs = strip(private.call(request));
        assert_eq!(ours, theirs, "{request}");
    }
    shared.send_line(b"not json");
    assert_eq!(shared.next_line()["error"]["type"], "ProtocolError");
}

#[test]
fn one_slots_long_compile_holds_up_no_other_slots_calls() {
    let mut a = slot("long-compile");
    let mut b = slot("long-compile");
    who(&mut a, 1);
    let dir = common::scratch("slot-long-compile");
    let gate = dir.join("gate");
    a.send(&common::compile(
        2,
        "slow",
        &common::gated_source(&gate, "slow"),
    ));
    // The other slot's calls are forked and answered while it loads.
    for id in 3..8 {
        let (call, _) = who(&mut b, id);
        assert!(call > 0);
    }
    std::fs::write(&gate, "").unwrap();
    let reply = a.answer().reply;
    assert_eq!(reply["id"], 2, "{reply}");
    assert_eq!(reply["ok"], true, "{reply}");
}
