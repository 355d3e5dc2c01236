//! `run` and `sweep` as a person and a script use them: the grid and its
//! refusals, `--input`, the result lines, exit codes, Ctrl-C whatever the
//! node did with signals, a reader that goes away, `sys.path` beside the
//! node, generator events, live prints, and what a result JSON cannot carry.

mod common;

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use common::{ZYGOTE, children_of, scratch, wait_gone};
use serde_json::{Value, json};

/// The longest any one wait here may take before the test fails.
const PATIENCE: Duration = Duration::from_secs(60);

fn example() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/square.py")
}

fn node(dir: &Path, name: &str, source: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, source).unwrap();
    path
}

fn zygote(command: &str, node: &Path, args: &[&str]) -> Output {
    Command::new(ZYGOTE)
        .arg(command)
        .arg(node)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .output()
        .expect("the binary runs")
}

fn sweep(node: &Path, args: &[&str]) -> Output {
    zygote("sweep", node, args)
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// The result lines, sorted by index (they come in completion order).
fn lines(output: &Output) -> Vec<Value> {
    let mut lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    lines.sort_by_key(|l| l["index"].as_u64());
    lines
}

fn refused(output: &Output, words: &[&str]) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(output.stdout.is_empty(), "nothing ran: {text}");
    for word in words {
        assert!(text.contains(word), "stderr mentions {word:?}:\n{text}");
    }
}

/// Waits until `path` exists.
fn wait_for_file(path: &Path) {
    let start = std::time::Instant::now();
    while !path.exists() {
        assert!(
            start.elapsed() < PATIENCE,
            "{} never appeared",
            path.display()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits for `child` to exit; kills it and fails the test if it has not
/// within [`PATIENCE`] (a stop that is not honoured would otherwise hang).
fn exit_within(mut child: std::process::Child, what: &str) -> Output {
    let start = std::time::Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > PATIENCE {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what}: still running after {PATIENCE:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

/// Every process descended from `root` (children, their children, …).
fn descendants(root: i32) -> Vec<i32> {
    let mut found = Vec::new();
    let mut frontier = vec![root];
    while let Some(pid) = frontier.pop() {
        for (child, _) in children_of(pid) {
            found.push(child);
            frontier.push(child);
        }
    }
    found
}

#[test]
fn the_readme_sweep_runs_every_point() {
    let output = sweep(&example(), &["--grid", "x=0..999"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let lines = lines(&output);
    assert_eq!(lines.len(), 1000);
    for (x, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], x);
        assert_eq!(line["kwargs"], json!({"x": x}));
        assert_eq!(line["ok"], true);
        assert_eq!(line["result"], json!({"x": x, "square": x * x}));
        assert!(line["duration_ms"].as_f64().is_some(), "{line}");
    }
    let text = stderr(&output);
    assert!(text.contains("sweep: 1000 calls, 0 failed"), "{text}");
    assert!(!text.contains("ETA"), "no progress bar when piped: {text}");
}

#[test]
fn an_empty_range_is_refused() {
    refused(
        &sweep(&example(), &["--grid", "x=10..1"]),
        &["--grid x=10..1", "empty", "hint: write 1..10"],
    );
}

#[test]
fn a_json_list_is_an_axis_of_its_elements() {
    let output = sweep(&example(), &["--grid", "x=[1,2,3]"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let xs: Vec<Value> = lines(&output)
        .iter()
        .map(|l| l["kwargs"]["x"].clone())
        .collect();
    assert_eq!(xs, vec![json!(1), json!(2), json!(3)]);
    let dir = scratch("jsonlist");
    let echo = node(&dir, "echo.py", "def process(v):\n    return v\n");
    let output = sweep(&echo, &["--grid", r#"v=[[1, 2], "a,b", {"k": null}]"#]);
    let results: Vec<Value> = lines(&output).iter().map(|l| l["result"].clone()).collect();
    assert_eq!(
        results,
        vec![json!([1, 2]), json!("a,b"), json!({"k": null})]
    );
    refused(
        &sweep(&example(), &["--grid", "x=[1,2"]),
        &["not a JSON list"],
    );
}

#[test]
fn a_dash_range_is_refused_with_the_range_it_meant() {
    refused(
        &sweep(&example(), &["--grid", "x=0-9"]),
        &["0-9 is not a range", "hint: write 0..9"],
    );
}

#[test]
fn an_axis_may_not_override_a_fixed_argument() {
    refused(
        &sweep(&example(), &["--grid", "x=1,2", "--kwargs", r#"{"x": 5}"#]),
        &["--grid x and the fixed arguments", "both set x", "hint:"],
    );
    refused(
        &sweep(&example(), &["--grid", "x=1,2", "-k", "x=5"]),
        &["both set x"],
    );
    refused(
        &sweep(
            &example(),
            &[
                "--grid",
                "x=1",
                "-k",
                "offset=1",
                "--kwargs",
                r#"{"offset": 2}"#,
            ],
        ),
        &["offset is given twice"],
    );
}

#[test]
fn zero_jobs_is_a_usage_error() {
    refused(
        &sweep(&example(), &["--grid", "x=1", "-j", "0"]),
        &["--jobs", "0 calls in flight would run nothing"],
    );
    refused(
        &sweep(&example(), &["--grid", "x=1", "--lanes", "0"]),
        &["--lanes", "0 lanes would fork no call"],
    );
}

#[test]
fn a_name_the_function_does_not_take_fails_once_before_any_fork() {
    let dir = scratch("signature");
    let marker = dir.join("called");
    let counting = node(
        &dir,
        "counting.py",
        &format!(
            "def process(x, offset=0):\n    open({:?}, 'a').write('call\\n')\n    return x\n",
            marker.to_string_lossy()
        ),
    );
    refused(
        &sweep(&counting, &["--grid", "x=0..999", "--grid", "z=1,2"]),
        &[
            "process() takes no argument named z",
            "hint: it takes x, offset",
        ],
    );
    assert!(!marker.exists(), "no call was forked");
    refused(
        &sweep(&counting, &["--grid", "offset=0..9"]),
        &["process() needs x", "hint:"],
    );
    refused(
        &zygote("run", &counting, &["-k", "y=1", "-k", "x=1"]),
        &["no argument named y"],
    );
    assert!(!marker.exists(), "no call was forked");

    let open = node(
        &dir,
        "open.py",
        "def process(x, **rest):\n    return sorted(rest)\n",
    );
    let output = sweep(&open, &["--grid", "x=1", "--grid", "z=1", "-k", "w=2"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(lines(&output)[0]["result"], json!(["w", "z"]));
}

#[test]
fn float_steps_are_rounded_to_their_decimals() {
    let output = sweep(&example(), &["--grid", "x=0..1:0.1", "-k", "offset=0"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(!stdout.contains("0.30000000000000004"), "{stdout}");
    let xs: Vec<String> = lines(&output)
        .iter()
        .map(|l| l["kwargs"]["x"].to_string())
        .collect();
    assert_eq!(
        xs,
        [
            "0.0", "0.1", "0.2", "0.3", "0.4", "0.5", "0.6", "0.7", "0.8", "0.9", "1.0"
        ]
    );
}

#[test]
fn input_lines_are_calls_over_the_fixed_arguments() {
    let dir = scratch("input");
    let input = dir.join("calls.jsonl");
    std::fs::write(&input, "{\"x\": 2}\n\n{\"x\": 3, \"offset\": 10}\n").unwrap();
    let output = sweep(&example(), &["--input", input.to_str().unwrap(), "-j", "1"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let results: Vec<Value> = lines(&output)
        .iter()
        .map(|l| l["result"]["square"].clone())
        .collect();
    assert_eq!(results, vec![json!(4), json!(19)]);

    // From stdin, `-`.
    let mut child = Command::new(ZYGOTE)
        .args(["sweep"])
        .arg(example())
        .args(["--input", "-", "-k", "offset=1"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(b"{\"x\": 5}\n{\"x\": 6}\n")
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let lines = lines(&output);
    assert_eq!(lines[0]["kwargs"], json!({"x": 5, "offset": 1}));
    assert_eq!(lines[1]["result"]["square"], 37);

    std::fs::write(&input, "{\"x\": 1}\n[1, 2]\n").unwrap();
    refused(
        &sweep(&example(), &["--input", input.to_str().unwrap()]),
        &["line 2: expected a JSON object", "got a list", "hint:"],
    );
    std::fs::write(&input, "{\"x\": 1, \"offset\": 1}\n").unwrap();
    refused(
        &sweep(
            &example(),
            &["--input", input.to_str().unwrap(), "-k", "offset=2"],
        ),
        &["line 1 sets offset, which --kwargs or -k sets too"],
    );
    refused(
        &sweep(
            &example(),
            &["--input", input.to_str().unwrap(), "--grid", "x=1"],
        ),
        &["cannot be used with"],
    );
    refused(&sweep(&example(), &[]), &["--grid"]);
}

#[test]
fn lines_come_in_completion_order_with_their_index() {
    let dir = scratch("order");
    let gate = dir.join("five-started");
    // Call 0 holds one of two slots until call 5 starts; 1 to 4 pass
    // through the other one, each landed before the next could start.
    let slow_first = node(
        &dir,
        "gate.py",
        &format!(
            "import os, time\nGATE = {:?}\ndef process(x):\n    if x == 5:\n        open(GATE, 'w').close()\n    while x == 0 and not os.path.exists(GATE):\n        time.sleep(0.01)\n    return x\n",
            gate.to_string_lossy()
        ),
    );
    let out = dir.join("results.jsonl");
    let output = sweep(
        &slow_first,
        &[
            "--grid",
            "x=0..5",
            "-j",
            "2",
            "--output",
            out.to_str().unwrap(),
        ],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert!(output.stdout.is_empty(), "the lines went to --output");
    let text = std::fs::read_to_string(&out).unwrap();
    let order: Vec<u64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(order.len(), 6);
    assert_eq!(&order[..4], &[1, 2, 3, 4], "0 waited for 5: {order:?}");
}

#[test]
fn failures_exit_1_and_are_summarised_by_type() {
    let dir = scratch("failures");
    let odd = node(
        &dir,
        "odd.py",
        "import os\ndef process(x, y):\n    if x == 3:\n        os._exit(9)\n    if x % 2:\n        raise ValueError(f'odd {x}')\n    print('even', x)\n    return x * y\n",
    );
    let output = sweep(&odd, &["--grid", "x=0..5", "--grid", "y=1,10"]);
    assert_eq!(output.status.code(), Some(1));
    let lines = lines(&output);
    assert_eq!(lines.len(), 12);
    assert_eq!(lines[1]["kwargs"], json!({"x": 0, "y": 10}));
    assert_eq!(lines[4]["result"], 2);
    assert_eq!(lines[4]["logs"], "even 2\n");
    assert_eq!(lines[2]["ok"], false);
    assert_eq!(lines[2]["error"]["short"], "ValueError: odd 1 (line 6)");
    let text = stderr(&output);
    assert!(text.contains("sweep: 12 calls, 6 failed"), "{text}");
    assert!(
        text.contains(
            "4 × ValueError\n      #2 {\"x\":1,\"y\":1}: odd 1 (line 6)\n      #3 {\"x\":1,\"y\":10}: odd 1 (line 6)"
        ),
        "{text}"
    );
    assert!(text.contains("… and 1 more"), "{text}");
    assert!(
        text.contains(
            "2 × RemoteError\n      #6 {\"x\":3,\"y\":1}: the node process exited with code 9 before it replied"
        ),
        "{text}"
    );
}

#[test]
fn generator_yields_and_emits_are_in_the_line() {
    let dir = scratch("events");
    let generator = node(
        &dir,
        "gen.py",
        "import fluksio\ndef process(n):\n    for i in range(n):\n        yield {'i': i}\n    fluksio.emit(done=True)\n    return 'end'\n",
    );
    let output = sweep(&generator, &["--grid", "n=2"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let line = &lines(&output)[0];
    assert_eq!(line["result"], "end");
    assert_eq!(
        line["events"],
        json!([
            {"event": "yield", "outputs": {"i": 0}},
            {"event": "yield", "outputs": {"i": 1}},
            {"event": "emit", "outputs": {"done": true}},
        ])
    );

    let output = zygote("run", &generator, &["-k", "n=2"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(
        stdout,
        vec![
            json!({"event": "yield", "outputs": {"i": 0}}),
            json!({"event": "yield", "outputs": {"i": 1}}),
            json!({"event": "emit", "outputs": {"done": true}}),
            json!("end"),
        ]
    );
}

#[test]
fn a_node_imports_a_module_beside_it() {
    let dir = scratch("beside");
    node(&dir, "helper_beside.py", "VALUE = 41\n");
    let user = node(
        &dir,
        "user.py",
        "import sys, helper_beside\ndef process(x):\n    return [helper_beside.VALUE + x, sys.path[0]]\n",
    );
    // From another directory: the node's own is what counts.
    let output = Command::new(ZYGOTE)
        .args(["sweep"])
        .arg(&user)
        .args(["--grid", "x=1"])
        .current_dir("/")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let real = std::fs::canonicalize(&dir).unwrap();
    assert_eq!(
        lines(&output)[0]["result"],
        json!([42, real.to_string_lossy()])
    );
    let output = Command::new(ZYGOTE)
        .args(["run"])
        .arg(&user)
        .args(["-k", "x=1"])
        .current_dir("/")
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        serde_json::from_slice::<Value>(&output.stdout).unwrap(),
        json!([42, real.to_string_lossy()])
    );
}

#[test]
fn a_result_json_cannot_carry_is_named_down_to_the_value() {
    let dir = scratch("notjson");
    let bad = node(
        &dir,
        "bad.py",
        "def process(x):\n    if x == 1:\n        return {'loss': float('nan')}\n    return {'a': [1, 2, {3}]}\n",
    );
    let output = sweep(&bad, &["--grid", "x=0,1"]);
    assert_eq!(output.status.code(), Some(1));
    let lines = lines(&output);
    let message = lines[0]["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(
            r#"returned dict, which cannot be sent back as JSON: result["a"][2] is a set"#
        ),
        "{message}"
    );
    let message = lines[1]["error"]["message"].as_str().unwrap();
    assert!(message.contains(r#"result["loss"] is nan"#), "{message}");

    let output = zygote("run", &bad, &["-k", "x=0"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    assert!(
        stderr(&output).contains(r#"result["a"][2] is a set"#),
        "{}",
        stderr(&output)
    );
}

#[test]
fn run_prints_the_result_or_the_traceback_and_exits_by_it() {
    let output = zygote(
        "run",
        &example(),
        &["-k", "x=3", "--kwargs", r#"{"offset": 1}"#],
    );
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        serde_json::from_slice::<Value>(&output.stdout).unwrap(),
        json!({"x": 3, "square": 10})
    );
    let dir = scratch("runfail");
    let raising = node(
        &dir,
        "raising.py",
        "def process(x):\n    print('about to fail')\n    raise KeyError(x)\n",
    );
    let output = zygote("run", &raising, &["-k", "x=name"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    let text = stderr(&output);
    assert!(text.contains("about to fail\n"), "{text}");
    assert!(
        text.contains("Traceback (most recent call last):") && text.contains("KeyError: 'name'"),
        "{text}"
    );
    let crashing = node(
        &dir,
        "crashing.py",
        "import os\ndef process():\n    os._exit(3)\n",
    );
    let output = zygote("run", &crashing, &[]);
    assert_eq!(output.status.code(), Some(1));
    assert!(
        stderr(&output).contains("exited with code 3"),
        "{}",
        stderr(&output)
    );
    refused(
        &zygote("run", &example(), &["-k", "novalue"]),
        &["expected NAME=VALUE"],
    );
    let broken = node(&dir, "broken.py", "def process(:\n");
    refused(
        &zygote("run", &broken, &[]),
        &["the node does not load: SyntaxError"],
    );
}

#[test]
fn run_shows_what_the_node_prints_while_it_runs() {
    let dir = scratch("live");
    let gate = dir.join("go");
    let waiting = node(
        &dir,
        "waiting.py",
        &format!(
            "import os, time\ndef process():\n    print('waiting for the gate')\n    while not os.path.exists({:?}):\n        time.sleep(0.01)\n    return 'through'\n",
            gate.to_string_lossy()
        ),
    );
    let mut child = Command::new(ZYGOTE)
        .arg("run")
        .arg(&waiting)
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stderr = BufReader::new(child.stderr.take().unwrap());
    let mut line = String::new();
    // The print arrives while the call still waits: only then is the gate opened.
    stderr.read_line(&mut line).unwrap();
    assert_eq!(line, "waiting for the gate\n");
    std::fs::write(&gate, "").unwrap();
    let mut stdout = String::new();
    child
        .stdout
        .take()
        .unwrap()
        .read_to_string(&mut stdout)
        .unwrap();
    assert!(child.wait().unwrap().success());
    assert_eq!(stdout, "\"through\"\n");
}

#[test]
fn what_a_node_writes_to_fd_1_never_mixes_with_the_results() {
    let dir = scratch("fd1");
    let noisy = node(
        &dir,
        "noisy.py",
        "import os, subprocess\ndef process(x):\n    os.write(1, b'raw to fd 1\\n')\n    subprocess.run(['echo', 'from a subprocess'])\n    return x\n",
    );
    let output = sweep(&noisy, &["--grid", "x=0..3"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(lines(&output).len(), 4, "stdout holds only result lines");
    assert!(stderr(&output).contains("raw to fd 1"));
    let output = zygote("run", &noisy, &["-k", "x=7"]);
    assert_eq!(String::from_utf8_lossy(&output.stdout), "7\n");
    assert!(stderr(&output).contains("from a subprocess"));
}

/// A node that takes Ctrl-C for itself, in the zygote and in its calls.
const STUBBORN: &str = "import os, signal, subprocess, time
signal.signal(signal.SIGINT, lambda *a: print('the node got SIGINT'))
signal.signal(signal.SIGTERM, signal.SIG_IGN)
DIR = {dir:?}
def process(x):
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if x < 3:
        return x
    open(os.path.join(DIR, f'started-{x}'), 'w').close()
    subprocess.Popen(['sleep', '600'])
    time.sleep(600)
";

#[test]
fn ctrl_c_ends_the_calls_flushes_and_summarises_whatever_the_node_did_with_signals() {
    let dir = scratch("sigint");
    let stubborn = node(
        &dir,
        "stubborn.py",
        &STUBBORN.replace("{dir:?}", &format!("{:?}", dir.to_string_lossy())),
    );
    // Its own zygote forking the calls, then two lanes: each names the
    // points it had in flight.
    for lanes in ["1", "2"] {
        for x in [3, 4] {
            let _ = std::fs::remove_file(dir.join(format!("started-{x}")));
        }
        stop_a_sweep_with_two_points_in_flight(&dir, &stubborn, lanes);
    }
}

fn stop_a_sweep_with_two_points_in_flight(dir: &Path, stubborn: &Path, lanes: &str) {
    let child = Command::new(ZYGOTE)
        .arg("sweep")
        .arg(stubborn)
        .args(["--grid", "x=0..9", "-j", "2", "--lanes", lanes])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    // Calls 0..2 return at once; 3 and 4 then hold both slots.
    wait_for_file(&dir.join("started-3"));
    wait_for_file(&dir.join("started-4"));
    let in_flight = descendants(pid);
    assert!(!in_flight.is_empty());
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let output = exit_within(child, "SIGINT");
    assert_eq!(output.status.code(), Some(130), "{}", stderr(&output));
    let lines = lines(&output);
    let done: Vec<Value> = lines.iter().map(|l| l["result"].clone()).collect();
    assert_eq!(
        done,
        vec![json!(0), json!(1), json!(2)],
        "the results so far"
    );
    let text = stderr(&output);
    assert!(
        text.contains(
            "sweep: stopped by SIGINT after 3 of 10 calls (2 in flight ended, 5 not started)"
        ),
        "--lanes {lanes}: {text}"
    );
    assert!(
        text.contains("\n  in flight when stopped: #3 {\"x\":3}, #4 {\"x\":4}\n"),
        "--lanes {lanes}: the points in flight named: {text}"
    );
    for pid in in_flight {
        assert!(wait_gone(pid, PATIENCE), "process {pid} outlived the sweep");
    }
}

#[test]
fn ctrl_c_ends_a_run_with_130() {
    let dir = scratch("runsigint");
    let stubborn = node(
        &dir,
        "stubborn.py",
        &STUBBORN.replace("{dir:?}", &format!("{:?}", dir.to_string_lossy())),
    );
    let child = Command::new(ZYGOTE)
        .arg("run")
        .arg(&stubborn)
        .args(["-k", "x=5"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    wait_for_file(&dir.join("started-5"));
    let in_flight = descendants(pid);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGINT,
    )
    .unwrap();
    let output = exit_within(child, "SIGINT");
    assert_eq!(output.status.code(), Some(130), "{}", stderr(&output));
    assert!(
        stderr(&output).contains("stopped by SIGINT"),
        "{}",
        stderr(&output)
    );
    for pid in in_flight {
        assert!(wait_gone(pid, PATIENCE), "process {pid} outlived the run");
    }
}

#[test]
fn a_reader_that_goes_away_ends_the_sweep_quietly() {
    let mut child = Command::new(ZYGOTE)
        .arg("sweep")
        .arg(example())
        .args(["--grid", "x=0..999999", "-j", "2"])
        .env("RUST_LOG", "warn")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let pid = child.id() as i32;
    let mut stdout = BufReader::new(child.stdout.take().unwrap());
    for _ in 0..3 {
        let mut line = String::new();
        stdout.read_line(&mut line).unwrap();
        assert!(line.starts_with("{\"index\": "), "{line}");
    }
    let in_flight = descendants(pid);
    drop(stdout);
    // A million calls would take many minutes: ending at all is ending at once.
    let output = exit_within(child, "a closed stdout");
    assert_eq!(output.status.code(), Some(141));
    assert!(output.stderr.is_empty(), "quietly: {}", stderr(&output));
    for pid in in_flight {
        assert!(wait_gone(pid, PATIENCE), "process {pid} outlived the sweep");
    }
}

#[test]
fn help_shows_the_options_grouped_with_examples_and_exit_codes() {
    for command in ["run", "sweep"] {
        let output = Command::new(ZYGOTE)
            .args([command, "--help"])
            .output()
            .unwrap();
        let help = String::from_utf8_lossy(&output.stdout);
        for word in [
            "Examples:",
            "Exit codes:",
            "130",
            "Zygote:",
            "--preload",
            "-k <NAME=VALUE>",
        ] {
            assert!(
                help.contains(word),
                "{command} --help mentions {word}:\n{help}"
            );
        }
    }
    let output = Command::new(ZYGOTE)
        .args(["sweep", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for word in ["Calls:", "--grid", "--input", "--output", "--jobs"] {
        assert!(help.contains(word), "sweep --help mentions {word}:\n{help}");
    }
}

/// Who forked a call, and who forked that: (pid, parent, grandparent).
const LINEAGE: &str = "import os\ndef parent_of(pid):\n    with open(f'/proc/{pid}/stat') as f:\n        return int(f.read().rsplit(')', 1)[1].split()[1])\ndef process(x):\n    return [os.getpid(), os.getppid(), parent_of(os.getppid())]\n";

#[test]
fn lanes_each_fork_their_share_of_the_calls() {
    let dir = scratch("lanes");
    let lineage = node(&dir, "lineage.py", LINEAGE);
    let child = Command::new(ZYGOTE)
        .arg("sweep")
        .arg(&lineage)
        .args(["--grid", "x=0..199", "-j", "4", "--lanes", "2"])
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let sweep_pid = child.id() as i64;
    let output = child.wait_with_output().unwrap();
    assert!(output.status.success(), "{}", stderr(&output));
    let lines = lines(&output);
    assert_eq!(lines.len(), 200);
    let mut lanes: Vec<i64> = lines
        .iter()
        .map(|l| l["result"][1].as_i64().unwrap())
        .collect();
    lanes.sort_unstable();
    lanes.dedup();
    assert_eq!(lanes.len(), 2, "two lanes forked the calls: {lanes:?}");
    for line in &lines {
        assert_eq!(
            line["result"][2], sweep_pid,
            "each lane a fork of the sweep: {line}"
        );
    }
    // One lane: the sweep's own zygote forks every call.
    let one = sweep(&lineage, &["--grid", "x=0..19", "-j", "4", "--lanes", "1"]);
    let parents: Vec<i64> = lines_of(&one)
        .iter()
        .map(|l| l["result"][1].as_i64().unwrap())
        .collect();
    assert!(parents.windows(2).all(|w| w[0] == w[1]), "{parents:?}");
}

fn lines_of(output: &Output) -> Vec<Value> {
    assert!(output.status.success(), "{}", stderr(output));
    lines(output)
}

/// Sweeps a node that counts its calls under `--isolation node` with
/// `args`; each child's counts, by its pid, checked to be its own calls
/// 1, 2, 3…
fn counts_by_child(name: &str, points: usize, args: &[&str]) -> BTreeMap<i64, Vec<i64>> {
    let dir = scratch(name);
    let counter = node(
        &dir,
        "counter.py",
        "import os\nCALLS = []\ndef process(x):\n    CALLS.append(x)\n    return [os.getpid(), len(CALLS)]\n",
    );
    let grid = format!("x=0..{}", points - 1);
    let mut all = vec!["--grid", &grid, "-j", "2", "--isolation", "node"];
    all.extend_from_slice(args);
    let lines = lines_of(&sweep(&counter, &all));
    assert_eq!(lines.len(), points);
    let mut by_child: BTreeMap<i64, Vec<i64>> = BTreeMap::new();
    for line in &lines {
        let result = &line["result"];
        by_child
            .entry(result[0].as_i64().unwrap())
            .or_default()
            .push(result[1].as_i64().unwrap());
    }
    for counts in by_child.values_mut() {
        counts.sort_unstable();
        let expected: Vec<i64> = (1..=counts.len() as i64).collect();
        assert_eq!(*counts, expected, "each child counted its own calls");
    }
    by_child
}

#[test]
fn a_sweep_under_isolation_node_keeps_module_state_in_each_of_its_lanes() {
    let by_child = counts_by_child("sweep-in-turn", 100, &[]);
    assert_eq!(
        by_child.len(),
        2,
        "one resident child per call in flight: {by_child:?}"
    );
}

/// `--max-calls-per-child` holds in a sweep as in the worker: each resident
/// serves at most that many calls, then a fresh fork replaces it; and every
/// resident is gone when the sweep ends.
#[test]
fn a_sweep_under_isolation_node_replaces_a_resident_after_its_calls() {
    let by_child = counts_by_child("sweep-in-turn-max", 60, &["--max-calls-per-child", "7"]);
    assert!(by_child.len() >= 60 / 7, "{by_child:?}");
    for (pid, counts) in &by_child {
        assert!(counts.len() <= 7, "{pid} served {} calls", counts.len());
        assert!(common::is_gone(*pid as i32), "{pid} outlived the sweep");
    }
}

/// A node whose call `x == 2` starts `sleep 3600` (its pid written to
/// `sleeper`), prints, and hangs; every call returns `[pid, calls this
/// process served, whether the sleeper is gone]`, the last waited for
/// (it must die while the sweep still runs) where `check` and `x > 2`.
const HANGS: &str = "import os, select, subprocess, time
DIR = {dir:?}
CALLS = []
def gone(pid):
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        return bool(select.select([fd], [], [], 60)[0])
    finally:
        os.close(fd)
def process(x, check):
    CALLS.append(x)
    if x == 2:
        sleeper = subprocess.Popen(['sleep', '3600'])
        with open(os.path.join(DIR, 'sleeper.tmp'), 'w') as f:
            f.write(str(sleeper.pid))
        os.rename(os.path.join(DIR, 'sleeper.tmp'), os.path.join(DIR, 'sleeper'))
        print('hanging', flush=True)
        time.sleep(3600)
    sleeper_gone = None
    if check and x > 2:
        with open(os.path.join(DIR, 'sleeper')) as f:
            sleeper_gone = gone(int(f.read()))
    return [os.getpid(), len(CALLS), sleeper_gone]
";

fn hangs(dir: &Path) -> PathBuf {
    node(
        dir,
        "hangs.py",
        &HANGS.replace("{dir:?}", &format!("{:?}", dir.to_string_lossy())),
    )
}

/// The pid of the `sleep 3600` the hung call started.
fn sleeper(dir: &Path) -> i32 {
    std::fs::read_to_string(dir.join("sleeper"))
        .expect("the hung call started its subprocess")
        .trim()
        .parse()
        .unwrap()
}

#[test]
fn a_call_past_timeout_is_ended_with_what_it_started_and_the_sweep_goes_on() {
    // Its own zygote forking the calls, two lanes, and a resident child
    // serving them in turn; one call at a time where a later call checks,
    // while the sweep runs, that the subprocess is gone.
    let ways: [(&str, &[&str]); 3] = [
        ("here", &["-j", "1", "--lanes", "1", "-k", "check=true"]),
        ("lanes", &["-j", "2", "--lanes", "2", "-k", "check=false"]),
        (
            "in-turn",
            &["-j", "1", "--isolation", "node", "-k", "check=true"],
        ),
    ];
    for (way, args) in ways {
        let dir = scratch(&format!("timeout-{way}"));
        let node = hangs(&dir);
        let mut all = vec!["--grid", "x=0..5", "--timeout", "1"];
        all.extend_from_slice(args);
        let output = sweep(&node, &all);
        let text = stderr(&output);
        assert_eq!(output.status.code(), Some(1), "{way}: {text}");
        let lines = lines(&output);
        assert_eq!(lines.len(), 6, "{way}: every point has its line: {text}");
        for line in &lines {
            if line["index"] != 2 {
                assert_eq!(line["ok"], true, "{way}: {line}");
            }
        }
        let timed_out = &lines[2];
        assert_eq!(timed_out["ok"], false, "{way}: {timed_out}");
        let message = "the call ran past --timeout 1 s and was ended, with everything it started";
        assert_eq!(
            timed_out["error"],
            json!({
                "type": "NodeTimeout",
                "message": message,
                // As PROTOCOL.md section 2 has it for a process that ended
                // without a reply: the message alone.
                "short": message,
                "traceback": "",
            }),
            "{way}"
        );
        assert_eq!(timed_out["logs"], "hanging\n", "{way}: what it printed");
        assert!(text.contains("sweep: 6 calls, 1 failed"), "{way}: {text}");
        assert!(
            text.contains("\n  1 × NodeTimeout\n      #2 {\"check\":"),
            "{way}: {text}"
        );
        assert!(
            text.contains(&format!("x\":2}}: {message}")),
            "{way}: {text}"
        );
        let sleeper = sleeper(&dir);
        assert!(
            wait_gone(sleeper, PATIENCE),
            "{way}: the hung call's subprocess {sleeper} outlived it"
        );
        let results: Vec<&Value> = lines.iter().map(|l| &l["result"]).collect();
        if args.contains(&"check=true") {
            for result in &results[3..] {
                assert_eq!(result[2], true, "{way}: gone while the sweep ran");
            }
        }
        if way == "in-turn" {
            // The resident that hung is gone; the next call got a fresh one.
            assert_eq!(results[0][1], 1, "{results:?}");
            assert_eq!(results[1][0], results[0][0], "{results:?}");
            assert_ne!(results[3][0], results[0][0], "{results:?}");
            assert_eq!(results[3][1], 1, "a fresh resident: {results:?}");
            assert_eq!(results[5][0], results[3][0], "{results:?}");
            assert_eq!(results[5][1], 3, "{results:?}");
        }
    }
}

#[test]
fn run_ends_a_call_past_timeout() {
    let dir = scratch("run-timeout");
    let node = hangs(&dir);
    let output = zygote(
        "run",
        &node,
        &["-k", "x=2", "-k", "check=false", "--timeout", "1"],
    );
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    assert!(output.stdout.is_empty(), "no result: {text}");
    assert!(text.contains("hanging\n"), "{text}");
    assert!(
        text.contains(
            "NodeTimeout: the call ran past --timeout 1 s and was ended, with everything it started"
        ),
        "{text}"
    );
    let sleeper = sleeper(&dir);
    assert!(
        wait_gone(sleeper, PATIENCE),
        "the call's subprocess {sleeper} outlived it"
    );
    // A call within it is untouched.
    let output = zygote(
        "run",
        &node,
        &["-k", "x=0", "-k", "check=false", "--timeout", "30"],
    );
    assert!(output.status.success(), "{}", stderr(&output));
}

/// numpy values of every kind, in a result, a yield and an emit; `nan`: a
/// NaN in an array, returned; `emit-nan`: emitted.
const NUMPY: &str = "import numpy as np, fluksio
def process(kind):
    if kind == 'nan':
        return {'loss': np.array([0.5, float('nan')])}
    if kind == 'emit-nan':
        fluksio.emit(loss=np.array([float('nan')]))
        return 'emitted'
    yield {'step': np.int64(1), 'seen': np.arange(3)}
    fluksio.emit(loss=np.float32(0.5), ok=np.bool_(False))
    return {
        'i': np.int64(3),
        'f': np.float32(0.5),
        'b': np.bool_(True),
        'm': np.arange(6).reshape(2, 3),
        'nested': [{'u': np.uint8(7), 'd': [np.float64(0.25), np.array(2.5)]}],
    }
";

fn numpy_result() -> Value {
    json!({
        "i": 3,
        "f": 0.5,
        "b": true,
        "m": [[0, 1, 2], [3, 4, 5]],
        "nested": [{"u": 7, "d": [0.25, 2.5]}],
    })
}

fn numpy_events() -> Vec<Value> {
    vec![
        json!({"event": "yield", "outputs": {"step": 1, "seen": [0, 1, 2]}}),
        json!({"event": "emit", "outputs": {"loss": 0.5, "ok": false}}),
    ]
}

#[test]
fn numpy_values_are_sent_as_json_numbers_and_lists() {
    let dir = scratch("numpy");
    let numpy = node(&dir, "numpy_node.py", NUMPY);
    let output = sweep(
        &numpy,
        &["--grid", "kind=all,nan,emit-nan", "-j", "1", "--lanes", "1"],
    );
    let text = stderr(&output);
    assert_eq!(output.status.code(), Some(1), "{text}");
    let lines = lines(&output);
    assert_eq!(lines[0]["ok"], true, "{}", lines[0]);
    assert_eq!(lines[0]["result"], numpy_result());
    assert_eq!(lines[0]["events"], Value::from(numpy_events()));
    // A NaN in an array is refused as any NaN is.
    for line in &lines[1..] {
        assert_eq!(line["ok"], false, "{line}");
        assert_eq!(line["error"]["type"], "ValueError", "{line}");
        let message = line["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("a NaN or an infinity, which JSON cannot carry"),
            "{message}"
        );
    }
    assert!(
        lines[1]["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("returned a NaN or an infinity"),
        "{}",
        lines[1]
    );

    let output = zygote("run", &numpy, &["-k", "kind=all"]);
    assert!(output.status.success(), "{}", stderr(&output));
    let stdout: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut expected = numpy_events();
    expected.push(numpy_result());
    assert_eq!(stdout, expected);
    let output = zygote("run", &numpy, &["-k", "kind=nan"]);
    assert_eq!(output.status.code(), Some(1));
    assert!(output.stdout.is_empty());
    assert!(
        stderr(&output).contains("returned a NaN or an infinity"),
        "{}",
        stderr(&output)
    );
}

#[test]
fn accepting_numpy_never_imports_it_for_a_node_that_did_not() {
    let dir = scratch("no-numpy");
    let plain = node(
        &dir,
        "plain.py",
        "import sys, fluksio\ndef process(x):\n    try:\n        fluksio.emit(bad={x})\n    except TypeError as error:\n        return ['numpy' in sys.modules, str(error)]\n",
    );
    let output = sweep(&plain, &["--grid", "x=1", "--lanes", "1"]);
    assert!(output.status.success(), "{}", stderr(&output));
    assert_eq!(
        lines(&output)[0]["result"],
        json!([false, "Object of type set is not JSON serializable"])
    );
}

#[test]
fn the_worker_contract_still_refuses_numpy_as_the_reference_does() {
    let request = json!({
        "id": 1, "op": "run", "flow": "t", "node": "np",
        "source": "import numpy as np\ndef process():\n    return np.int64(3)\n",
    });
    let ours = common::Worker::zygote(&[]).call(&request).reply;
    let theirs = common::Worker::reference().call(&request).reply;
    assert_eq!(ours["ok"], false, "{ours}");
    assert_eq!(ours["error"], theirs["error"]);
    assert!(
        ours["error"]["message"]
            .as_str()
            .unwrap()
            .starts_with("returned int64, which cannot be sent back as JSON"),
        "{ours}"
    );
}

/// Events, a raised error and an `os._exit` per point.
const EVENTFUL: &str = "import os\ndef process(x):\n    yield {'half': x / 2}\n    if x % 7 == 3:\n        raise ValueError('three')\n    if x % 7 == 5:\n        os._exit(7)\n    return 'x' * (x * 1000)\n";

/// What comes back from a lane (its lines and how long each call ran,
/// sent over the link) is what the sweep's own zygote gives.
#[test]
fn results_through_lanes_are_those_of_one_zygote() {
    let dir = scratch("lanes-results");
    let eventful = node(&dir, "eventful.py", EVENTFUL);
    let results = |lanes: &str| {
        let output = sweep(
            &eventful,
            &["--grid", "x=0..39", "-j", "4", "--lanes", lanes],
        );
        // Some points fail: the sweep says so in its exit code.
        assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
        let mut lines = lines(&output);
        lines.sort_by_key(|line| line["index"].as_u64());
        for line in &mut lines {
            let took = line
                .as_object_mut()
                .unwrap()
                .remove("duration_ms")
                .unwrap_or_else(|| panic!("a duration: {line}"));
            assert!(took.as_f64().is_some_and(|ms| ms > 0.0), "{took}");
        }
        lines
    };
    let one = results("1");
    assert_eq!(one.len(), 40);
    assert_eq!(one[3]["error"]["type"], "ValueError", "{}", one[3]);
    assert_eq!(one[5]["error"]["type"], "RemoteError", "{}", one[5]);
    assert_eq!(one[5]["events"][0]["outputs"]["half"], 2.5, "{}", one[5]);
    assert_eq!(results("2"), one);
}

/// `--timeout` through lanes: the sweep ends the call past it, with what it
/// started, and says so in its reply, as its own zygote's calls.
#[test]
fn a_call_past_timeout_in_a_lane_is_ended_with_what_it_started() {
    let dir = scratch("lanes-timeout");
    let source = format!(
        "import os, subprocess, time\ndef process(x):\n    if x % 4 == 1:\n        sleeper = subprocess.Popen(['sleep', '300'])\n        with open(os.path.join({dir:?}, f'sleeper-{{x}}'), 'w') as f:\n            f.write(str(sleeper.pid))\n        time.sleep(60)\n    return x\n",
        dir = dir.to_str().unwrap()
    );
    let slow = node(&dir, "slow.py", &source);
    let output = sweep(
        &slow,
        &[
            "--grid",
            "x=0..7",
            "-j",
            "4",
            "--lanes",
            "2",
            "--timeout",
            "0.5",
        ],
    );
    assert_eq!(output.status.code(), Some(1), "{}", stderr(&output));
    let lines = lines(&output);
    assert_eq!(lines.len(), 8);
    for line in &lines {
        let x = line["kwargs"]["x"].as_i64().unwrap();
        if x % 4 == 1 {
            assert_eq!(line["error"]["type"], "NodeTimeout", "{line}");
            let pid: i32 = std::fs::read_to_string(dir.join(format!("sleeper-{x}")))
                .unwrap()
                .parse()
                .unwrap();
            assert!(
                wait_gone(pid, Duration::from_secs(10)),
                "the sleeper {pid} of call {x} outlived its call"
            );
        } else {
            assert_eq!(line["result"], x, "{line}");
        }
    }
}
