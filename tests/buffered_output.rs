//! What a node writes to `sys.__stdout__` (fd 1, the worker's stderr) is
//! written out as `python3` would at exit, whether or not
//! `PYTHONUNBUFFERED` is set: each test runs both ways and sets it itself
//! (the development machines set it, which hid the loss).
//!
//! The loss was the end-of-call flush closing the zygote's own files
//! (among them the buffer under `sys.__stdout__`) before it flushed the
//! standard streams: the text still pending in them was dropped.

mod common;

use std::process::{Command, Stdio};

use common::{Worker, ZYGOTE, compile, run, scratch};
use serde_json::json;

const NODE: &str = "import sys\nsys.__stdout__.write('loaded\\n')\ndef process(n):\n    sys.__stdout__.write(f'call {n}\\n')\n    print('captured')\n    return n\n";

/// `PYTHONUNBUFFERED` set to 1, and removed.
const BUFFERING: [Option<&str>; 2] = [Some("1"), None];

fn worker(buffering: Option<&str>, env: &[(&str, &str)]) -> Worker {
    let mut command = Command::new(ZYGOTE);
    command.arg("worker").envs(env.iter().copied());
    match buffering {
        Some(value) => command.env("PYTHONUNBUFFERED", value),
        None => command.env_remove("PYTHONUNBUFFERED"),
    };
    Worker::spawn(command)
}

fn count(text: &str, line: &str) -> usize {
    text.lines().filter(|l| *l == line).count()
}

#[test]
fn sys_stdout_writes_reach_the_workers_stderr_with_and_without_pythonunbuffered() {
    let ways: [(&str, &[(&str, &str)]); 3] = [
        ("fresh child", &[("FLUKSIO_ISOLATION", "call")]),
        ("resident", &[("FLUKSIO_ISOLATION", "node")]),
        (
            "node zygote",
            &[
                ("FLUKSIO_ISOLATION", "call"),
                ("FLUKSIO_NODE_ZYGOTE_MIB", "0"),
            ],
        ),
    ];
    for buffering in BUFFERING {
        for (way, env) in ways {
            let way = format!("{way}, PYTHONUNBUFFERED={buffering:?}");
            let mut worker = worker(buffering, env);
            // A compile, then runs: the first loads the node, the rest find
            // it loaded.
            let reply = worker.call(&compile(1, "n", NODE)).reply;
            assert_eq!(reply["ok"], true, "{way}: {reply}");
            for n in 1..=3 {
                let reply = worker.call(&run(n, "n", NODE, json!({"n": n}))).reply;
                assert_eq!(reply["result"], n, "{way}: {reply}");
                assert_eq!(reply["logs"], "captured\n", "{way}: {reply}");
            }
            let (code, stderr) = worker.finish();
            assert_eq!(code, Some(0), "{way}: {stderr}");
            for n in 1..=3 {
                assert_eq!(count(&stderr, &format!("call {n}")), 1, "{way}: {stderr}");
            }
            // The module level ran where the node was loaded: once per load
            // that the worker kept (a trial's own copy is never written).
            assert!(count(&stderr, "loaded") >= 1, "{way}: {stderr}");
        }
    }
}

#[test]
fn a_call_that_ends_its_process_still_writes_what_it_buffered() {
    let source =
        "import sys\ndef process():\n    sys.__stdout__.write('before exit\\n')\n    sys.exit(3)\n";
    for buffering in BUFFERING {
        for isolation in ["call", "node"] {
            let way = format!("--isolation {isolation}, PYTHONUNBUFFERED={buffering:?}");
            let mut worker = worker(buffering, &[("FLUKSIO_ISOLATION", isolation)]);
            let reply = worker.call(&run(1, "leaves", source, json!({}))).reply;
            assert_eq!(reply["ok"], false, "{way}: {reply}");
            let (_, stderr) = worker.finish();
            assert_eq!(count(&stderr, "before exit"), 1, "{way}: {stderr}");
        }
    }
}

#[test]
fn a_sweeps_sys_stdout_writes_go_to_stderr_and_the_results_stay_clean() {
    let dir = scratch("buffered-output-sweep");
    let node = dir.join("node.py");
    std::fs::write(
        &node,
        "import sys\ndef process(x):\n    sys.__stdout__.write(f'point {x}\\n')\n    return x\n",
    )
    .unwrap();
    for buffering in BUFFERING {
        for isolation in ["call", "node"] {
            let way = format!("--isolation {isolation}, PYTHONUNBUFFERED={buffering:?}");
            let mut command = Command::new(ZYGOTE);
            command
                .arg("sweep")
                .arg(&node)
                .args(["--grid", "x=0..3", "--isolation", isolation])
                .stdin(Stdio::null());
            match buffering {
                Some(value) => command.env("PYTHONUNBUFFERED", value),
                None => command.env_remove("PYTHONUNBUFFERED"),
            };
            let output = command.output().unwrap();
            assert!(output.status.success(), "{way}: {output:?}");
            let stdout = String::from_utf8_lossy(&output.stdout);
            let stderr = String::from_utf8_lossy(&output.stderr);
            assert_eq!(stdout.lines().count(), 4, "{way}: {stdout}");
            for line in stdout.lines() {
                serde_json::from_str::<serde_json::Value>(line)
                    .unwrap_or_else(|e| panic!("{way}: {e}: {line}"));
            }
            for x in 0..=3 {
                assert_eq!(count(&stderr, &format!("point {x}")), 1, "{way}: {stderr}");
            }
        }
    }
}
