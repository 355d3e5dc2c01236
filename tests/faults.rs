//! Where `fluksio-zygote worker` deliberately does better than the
//! reference (PROTOCOL.md, "ours"): bad input gets a clear error and the
//! worker keeps serving; a node that exits, crashes or raises past
//! `Exception` costs its own child, and the reply says how it ended.

mod common;

use common::{Worker, compile, run};
use serde_json::{Value, json};

/// The worker still serves after whatever came before.
fn still_serves(worker: &mut Worker) {
    let answer = worker.call(&run(
        99,
        "alive",
        "def process():\n    return 'alive'\n",
        json!({}),
    ));
    assert_eq!(answer.reply["result"], "alive", "{:?}", answer.reply);
}

fn protocol_error(reply: &Value) -> String {
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["error"]["type"], "ProtocolError", "{reply}");
    assert_eq!(reply["error"]["traceback"], "", "{reply}");
    assert_eq!(reply["logs"], "", "{reply}");
    let message = reply["error"]["message"]
        .as_str()
        .expect("a message")
        .to_string();
    assert_eq!(reply["error"]["short"], format!("ProtocolError: {message}"));
    message
}

#[test]
fn malformed_lines_are_refused_and_the_worker_keeps_serving() {
    let mut worker = Worker::zygote(&[]);
    let cases: &[(&[u8], &str)] = &[
        (b"{not json", "not JSON"),
        (b"[1, 2, 3]", "must be a JSON object, not an array"),
        (b"\"a string\"", "must be a JSON object, not a string"),
        (
            b"{\"op\": \"run\", \"flow\": \"f\xff\", \"node\": \"n\"}",
            "not UTF-8",
        ),
        (b"{\"id\": 1, \"op\": \"run\"} trailing", "not JSON"),
    ];
    for (line, expected) in cases {
        worker.send_line(line);
        let reply = worker.answer().reply;
        assert!(protocol_error(&reply).contains(expected), "{reply}");
        assert_eq!(reply["id"], Value::Null);
        still_serves(&mut worker);
    }
}

#[test]
fn unknown_or_missing_fields_are_named_and_nothing_runs() {
    let mut worker = Worker::zygote(&[]);
    let marker = std::env::temp_dir().join(format!("fz-marker-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let ran = format!(
        "open({:?}, 'w').write('ran')\ndef process():\n    return 1\n",
        marker.display().to_string()
    );
    let ran = ran.as_str();
    let cases = [
        (
            json!({"id": 7, "op": "explode", "flow": "f", "node": "n", "source": ran}),
            r#"unknown op "explode""#,
        ),
        (
            json!({"id": 8, "flow": "f", "node": "n", "source": ran}),
            r#"no "op""#,
        ),
        (
            json!({"id": 9, "op": "run", "node": "n", "source": ran}),
            r#"no "flow""#,
        ),
        (
            json!({"id": 10, "op": "compile", "flow": "f", "source": ran}),
            r#"no "node""#,
        ),
        (
            json!({"id": 11, "op": "run", "flow": 3, "node": "n", "source": ran}),
            r#""flow" must be a string, not a number"#,
        ),
        (
            json!({"id": 12, "op": "run", "flow": "f", "node": "n", "source": ["x"]}),
            r#""source" must be a string, not an array"#,
        ),
    ];
    for (request, expected) in cases {
        let reply = worker.call(&request).reply;
        let message = protocol_error(&reply);
        assert!(message.contains(expected), "{message}");
        assert_eq!(reply["id"], request["id"], "the id is echoed");
    }
    assert!(!marker.exists(), "a refused request ran node code");
    still_serves(&mut worker);
}

#[test]
fn a_line_over_the_limit_is_refused_and_skipped_whole() {
    let mut worker = Worker::zygote(&["--max-request-mb", "1"]);
    let blob = "x".repeat(3 * 1024 * 1024);
    worker.send(&run(
        1,
        "big",
        "def process(b):\n    return len(b)\n",
        json!({"b": blob}),
    ));
    let message = protocol_error(&worker.answer().reply);
    assert!(
        message.contains("over the limit of 1 MiB") && message.contains("artifact"),
        "{message}"
    );
    still_serves(&mut worker);
    let fits = worker.call(&run(
        2,
        "fits",
        "def process(b):\n    return len(b)\n",
        json!({"b": "y".repeat(500_000)}),
    ));
    assert_eq!(fits.reply["result"], 500_000);
}

/// A node that ends its own process: the reply says how, the logs it
/// printed first are kept, and the next call works.
fn ended(source: &str) -> (String, Value) {
    let mut worker = Worker::zygote(&[]);
    let answer = worker.call(&run(5, "end", source, json!({})));
    let reply = answer.reply;
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["id"], 5);
    assert_eq!(reply["call_id"], "");
    let message = reply["error"]["message"]
        .as_str()
        .expect("message")
        .to_string();
    still_serves(&mut worker);
    (message, reply)
}

#[test]
fn os_exit_costs_one_child_and_says_the_code() {
    let (message, reply) =
        ended("import os\ndef process():\n    print('about to leave')\n    os._exit(3)\n");
    assert!(message.contains("exited with code 3"), "{message}");
    assert_eq!(reply["error"]["type"], "RemoteError");
    assert_eq!(
        reply["logs"], "about to leave\n",
        "what it printed first is kept"
    );
}

#[test]
fn sys_exit_costs_one_child_and_says_the_code() {
    let (message, _) = ended("import sys\ndef process():\n    sys.exit(3)\n");
    assert!(message.contains("exited with code 3"), "{message}");
    let (message, _) = ended("import sys\ndef process():\n    sys.exit()\n");
    assert!(message.contains("exited with code 0"), "{message}");
    let (message, reply) = ended("import sys\ndef process():\n    sys.exit('giving up')\n");
    assert!(message.contains("exited with code 1"), "{message}");
    assert_eq!(reply["logs"], "giving up\n");
}

#[test]
fn a_segfault_costs_one_child_and_names_the_signal() {
    let (message, _) = ended("import ctypes\ndef process():\n    ctypes.string_at(0)\n");
    assert!(message.contains("killed by SIGSEGV"), "{message}");
    let (message, _) = ended("import os\ndef process():\n    os.abort()\n");
    assert!(message.contains("killed by SIGABRT"), "{message}");
}

#[test]
fn a_base_exception_is_the_call_error_not_the_worker_death() {
    let mut worker = Worker::zygote(&[]);
    let reply = worker
        .call(&run(
            1,
            "kbi",
            "def process():\n    print('x')\n    raise KeyboardInterrupt('stop')\n",
            json!({}),
        ))
        .reply;
    assert_eq!(reply["ok"], false);
    assert_eq!(reply["error"]["type"], "KeyboardInterrupt");
    assert_eq!(reply["error"]["short"], "KeyboardInterrupt: stop (line 3)");
    assert_eq!(reply["logs"], "x\n");
    let reply = worker
        .call(&run(
            2,
            "gexit",
            "def process():\n    raise GeneratorExit\n",
            json!({}),
        ))
        .reply;
    assert_eq!(reply["error"]["type"], "GeneratorExit");
    still_serves(&mut worker);
}

#[test]
fn module_level_crashes_on_compile_cost_only_the_trial() {
    let mut worker = Worker::zygote(&[]);
    let reply = worker
        .call(&compile(
            1,
            "crash",
            "import os\nprint('loading')\nos._exit(4)\n",
        ))
        .reply;
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exited with code 4"),
        "{reply}"
    );
    assert_eq!(reply["logs"], "loading\n");
    let reply = worker
        .call(&compile(2, "segv", "import ctypes\nctypes.string_at(0)\n"))
        .reply;
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("killed by SIGSEGV"),
        "{reply}"
    );
    let reply = worker
        .call(&compile(3, "exit", "raise SystemExit(2)\n"))
        .reply;
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exited with code 2"),
        "{reply}"
    );
    still_serves(&mut worker);
}

#[test]
fn a_nan_in_emit_or_yield_is_refused_like_a_nan_result() {
    let mut worker = Worker::zygote(&[]);
    let answer = worker.call(&run(
        1,
        "emitnan",
        "import fluksio\ndef process():\n    fluksio.emit(loss=0.5)\n    fluksio.emit(loss=float('nan'))\n    return 1\n",
        json!({}),
    ));
    assert_eq!(
        answer.events.len(),
        1,
        "the finite emit went out, the NaN did not"
    );
    let error = &answer.reply["error"];
    assert_eq!(error["type"], "ValueError");
    assert!(
        error["message"]
            .as_str()
            .unwrap()
            .starts_with("emit() got a NaN or an infinity, which JSON cannot carry")
    );
    assert!(
        error["short"].as_str().unwrap().ends_with("(line 4)"),
        "{error}"
    );

    let answer = worker.call(&run(
        2,
        "yieldinf",
        "def process():\n    yield {'a': 1}\n    yield {'a': float('inf')}\n    return 1\n",
        json!({}),
    ));
    assert_eq!(answer.events.len(), 1);
    assert_eq!(answer.reply["ok"], false);
    assert!(
        answer.reply["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("yielded a NaN or an infinity")
    );

    // An emit the node catches does not fail the call.
    let answer = worker.call(&run(
        3,
        "caught",
        "import fluksio\ndef process():\n    try:\n        fluksio.emit(x=float('nan'))\n    except ValueError:\n        return 'recovered'\n",
        json!({}),
    ));
    assert_eq!(answer.reply["result"], "recovered");
}

#[test]
fn a_node_reading_stdin_cannot_swallow_requests() {
    let mut worker = Worker::zygote(&[]);
    let source =
        "import sys\ndef process():\n    return [sys.stdin.read(), sys.stdin.readline()]\n";
    worker.send(&run(1, "stdin", source, json!({})));
    worker.send(&run(
        2,
        "after",
        "def process():\n    return 'next'\n",
        json!({}),
    ));
    assert_eq!(worker.answer().reply["result"], json!(["", ""]));
    assert_eq!(worker.answer().reply["result"], "next");
}

#[test]
fn a_thread_started_while_loading_keeps_the_node_out_of_the_zygote() {
    let mut worker = Worker::zygote(&[]);
    let source = "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\nprint('loaded')\ndef process(x):\n    return [x, threading.active_count()]\n";
    let reply = worker.call(&compile(1, "threads", source)).reply;
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["logs"], "loaded\n");
    for x in 0..5 {
        let reply = worker
            .call(&run(2 + x, "threads", source, json!({"x": x})))
            .reply;
        // Loaded in the call's own child, so its thread is there too.
        assert_eq!(reply["result"], json!([x, 2]), "{reply}");
        assert_eq!(reply["logs"], "", "its load was reported at compile");
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
    assert!(
        status.contains("Threads:\t1\n"),
        "the zygote stayed single-threaded:\n{status}"
    );
    let (code, stderr) = worker.finish();
    assert_eq!(code, Some(0));
    assert!(
        stderr.contains("node t.threads starts a thread while it loads")
            && stderr.contains("each call's child"),
        "the log says so: {stderr}"
    );
}

#[test]
fn a_module_level_emit_on_run_goes_out_before_the_run_events() {
    let mut worker = Worker::zygote(&[]);
    let source = "import fluksio\nfluksio.emit(stage='load')\ndef process():\n    yield {'stage': 'run'}\n    return 'done'\n";
    let answer = worker.call(&run(1, "order", source, json!({})));
    let stages: Vec<_> = answer
        .events
        .iter()
        .map(|e| e["outputs"]["stage"].clone())
        .collect();
    assert_eq!(stages, vec![json!("load"), json!("run")]);
    assert_eq!(answer.reply["result"], "done");
}

#[test]
fn a_zygote_tainted_by_a_load_restarts_itself_and_keeps_serving() {
    // The node starts a thread only on its second load: its trial (the
    // first) is clean, its load into the zygote is not. The zygote must
    // notice, restart itself under the same pid, and serve on.
    let counter = std::env::temp_dir().join(format!("fz-loads-{}", std::process::id()));
    std::fs::write(&counter, "0").unwrap();
    let source = format!(
        "import threading, time\npath = {path:?}\nloads = int(open(path).read()) + 1\nopen(path, 'w').write(str(loads))\nif loads == 2:\n    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\ndef process(x):\n    return x + 1\n",
        path = counter.display().to_string()
    );
    let mut worker = Worker::zygote(&[]);
    let pid = worker.pid();
    let reply = worker.call(&compile(1, "sneaky", &source)).reply;
    assert_eq!(reply["ok"], true, "{reply}");
    // Requests sent before the restart are served after it.
    worker.send(&run(2, "sneaky", &source, json!({"x": 1})));
    worker.send(&run(
        3,
        "other",
        "def process():\n    return 'other'\n",
        json!({}),
    ));
    assert_eq!(worker.answer().reply["result"], 2);
    assert_eq!(worker.answer().reply["result"], "other");
    assert_eq!(worker.pid(), pid);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    assert!(
        status.contains("Threads:\t1\n"),
        "the restarted zygote is single-threaded:\n{status}"
    );
    let (code, stderr) = worker.finish();
    assert_eq!(code, Some(0));
    assert!(
        stderr.contains("restarting the zygote"),
        "the log says so: {stderr}"
    );
}
