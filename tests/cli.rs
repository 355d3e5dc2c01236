//! The binary as a person starts it: which Python, what it preloads, the
//! `worker_main.py` drop-in, `sweep`, and the errors that say what to do.

mod common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Command, Output, Stdio};

use common::{Worker, ZYGOTE, run, scratch};
use serde_json::{Value, json};

/// Runs the binary with `args`, one request on stdin, and waits.
fn once(command: &mut Command, request: Option<&Value>) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        if let Some(request) = request {
            let _ = writeln!(stdin, "{request}");
        }
    }
    child.wait_with_output().expect("it exits")
}

fn reply_of(output: &Output) -> Value {
    let text = String::from_utf8_lossy(&output.stdout);
    let line = text.lines().last().unwrap_or_else(|| {
        panic!(
            "no reply; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    serde_json::from_str(line).expect("a JSON reply")
}

fn probe() -> Value {
    run(
        1,
        "probe",
        "import sys\ndef process():\n    return {'prefix': sys.prefix, 'executable': sys.executable, 'path': sys.path}\n",
        json!({}),
    )
}

#[test]
fn runs_from_a_clean_environment_on_the_python_it_was_built_against() {
    let output = once(
        Command::new(ZYGOTE)
            .arg("worker")
            .env_clear()
            .env("PATH", "/usr/bin:/bin"),
        Some(&probe()),
    );
    let reply = reply_of(&output);
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(
        reply["result"]["executable"],
        common::python().to_string_lossy().as_ref()
    );
    assert!(!String::from_utf8_lossy(&output.stderr).contains("error"));
}

#[test]
fn a_venv_python_gives_nodes_the_venv_site_packages() {
    let dir = scratch("venv");
    let venv = dir.join("venv");
    let made = Command::new(common::python())
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .expect("venv runs");
    assert!(made.success());
    let site = venv.join("lib/python3.11/site-packages");
    std::fs::create_dir_all(&site).unwrap();
    std::fs::write(site.join("only_in_this_venv.py"), "WHERE = 'venv'\n").unwrap();
    let request = run(
        1,
        "venv",
        "import sys, only_in_this_venv\ndef process():\n    return {'prefix': sys.prefix, 'where': only_in_this_venv.WHERE, 'site': [p for p in sys.path if p.endswith('site-packages')]}\n",
        json!({}),
    );
    let output = once(
        Command::new(ZYGOTE)
            .args(["worker", "--python"])
            .arg(venv.join("bin/python"))
            .env_clear()
            .env("PATH", "/usr/bin:/bin"),
        Some(&request),
    );
    let reply = reply_of(&output);
    assert_eq!(
        reply["ok"],
        true,
        "{reply}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert_eq!(reply["result"]["prefix"], venv.to_string_lossy().as_ref());
    assert_eq!(reply["result"]["where"], "venv");
    assert_eq!(
        reply["result"]["site"],
        json!([site.to_string_lossy()]),
        "the base's site-packages are not seen"
    );
}

#[test]
fn another_python_version_is_refused_with_the_fix() {
    let dir = scratch("version");
    let fake = dir.join("python3.12");
    std::fs::write(&fake, "#!/bin/sh\necho 3.12\n").unwrap();
    std::fs::set_permissions(&fake, std::fs::Permissions::from_mode(0o755)).unwrap();
    let output = once(
        Command::new(ZYGOTE).args(["worker", "--python"]).arg(&fake),
        None,
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("is Python 3.12, but this fluksio-zygote embeds Python 3.11"),
        "{stderr}"
    );
    assert!(
        stderr.contains("hint:") && stderr.contains("PYO3_PYTHON="),
        "{stderr}"
    );
}

#[test]
fn a_missing_python_is_named() {
    let output = once(
        Command::new(ZYGOTE).args(["worker", "--python", "/nowhere/bin/python"]),
        None,
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nowhere/bin/python does not exist") && stderr.contains("hint:"),
        "{stderr}"
    );
}

#[test]
fn a_preload_that_fails_stops_start_up_with_its_own_error() {
    let output = once(
        Command::new(ZYGOTE).args(["worker", "--preload", "json,no_such_module_here"]),
        None,
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("could not preload no_such_module_here: ModuleNotFoundError: No module named 'no_such_module_here'"),
        "{stderr}"
    );
    assert!(stderr.contains("hint:"), "{stderr}");

    let dir = scratch("preload");
    std::fs::write(
        dir.join("explodes.py"),
        "raise RuntimeError('boom at import')\n",
    )
    .unwrap();
    let output = once(
        Command::new(ZYGOTE)
            .args(["worker", "--preload", "explodes"])
            .env("PYTHONPATH", &dir),
        None,
    );
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("could not preload explodes: RuntimeError: boom at import"),
        "{stderr}"
    );
}

#[test]
fn preloads_come_from_the_flag_or_the_environment() {
    let request = run(
        1,
        "pre",
        "import sys\ndef process():\n    return ['decimal' in sys.modules, 'fractions' in sys.modules]\n",
        json!({}),
    );
    let output = once(
        Command::new(ZYGOTE).args(["worker", "--preload", "decimal"]),
        Some(&request),
    );
    assert_eq!(reply_of(&output)["result"], json!([true, false]));
    let output = once(
        Command::new(ZYGOTE)
            .arg("worker")
            .env("FLUKSIO_PRELOAD", "fractions,decimal"),
        Some(&request),
    );
    assert_eq!(reply_of(&output)["result"], json!([true, true]));
}

#[test]
fn numpy_preloaded_keeps_the_zygote_single_threaded() {
    let mut worker = Worker::zygote(&["--preload", "numpy"]);
    let source = "import numpy as np\ndef process(n):\n    a = np.ones((n, n))\n    return float(a.dot(a).sum())\n";
    for id in 0..3 {
        let reply = worker
            .call(&run(id, "blas", source, json!({"n": 300})))
            .reply;
        assert_eq!(reply["result"], json!(27000000.0), "{reply}");
    }
    let status = std::fs::read_to_string(format!("/proc/{}/status", worker.pid())).unwrap();
    assert!(
        status.contains("Threads:\t1\n"),
        "OpenBLAS parked its pool at fork:\n{status}"
    );
    let (code, stderr) = worker.finish();
    assert_eq!(code, Some(0));
    assert!(
        !stderr.contains("WARN"),
        "no warning about threads: {stderr}"
    );
}

#[test]
fn invoked_as_worker_main_py_it_is_the_worker() {
    let output = once(
        Command::new(ZYGOTE).arg("/anywhere/fluksio_worker/worker_main.py"),
        Some(&probe()),
    );
    assert_eq!(reply_of(&output)["ok"], true);
}

#[test]
fn help_names_the_commands() {
    let output = Command::new(ZYGOTE).arg("--help").output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for word in ["worker", "sweep", "worker_main.py", "PythonWorkerPool"] {
        assert!(help.contains(word), "--help mentions {word}:\n{help}");
    }
    let output = Command::new(ZYGOTE)
        .args(["worker", "--help"])
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&output.stdout);
    for word in [
        "--python",
        "--preload",
        "FLUKSIO_PRELOAD",
        "--max-request-mb",
    ] {
        assert!(
            help.contains(word),
            "worker --help mentions {word}:\n{help}"
        );
    }
}

fn sweep(args: &[&str], node: &Path) -> Output {
    Command::new(ZYGOTE)
        .arg("sweep")
        .arg(node)
        .args(args)
        .output()
        .expect("sweep runs")
}

/// A sweep's result lines, by index (they come in completion order).
fn sweep_lines(output: &Output) -> Vec<Value> {
    let mut lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("JSON"))
        .collect();
    lines.sort_by_key(|l| l["index"].as_u64());
    lines
}

#[test]
fn sweep_runs_the_node_once_per_point() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/square.py");
    let output = sweep(
        &[
            "--grid",
            "x=0..99",
            "--kwargs",
            r#"{"offset": 1}"#,
            "-j",
            "2",
        ],
        &example,
    );
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let lines = sweep_lines(&output);
    assert_eq!(lines.len(), 100);
    for (x, line) in lines.iter().enumerate() {
        assert_eq!(line["index"], x);
        assert_eq!(line["kwargs"], json!({"x": x, "offset": 1}));
        assert_eq!(line["ok"], true);
        assert_eq!(line["result"], json!({"x": x, "square": x * x + 1}));
    }
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("sweep: 100 calls, 0 failed")
            && stderr.contains("calls/s")
            && stderr.contains("p50")
            && stderr.contains("p99"),
        "{stderr}"
    );
}

#[test]
fn sweep_counts_failures_and_keeps_going() {
    let dir = scratch("sweep");
    let node = dir.join("odd.py");
    std::fs::write(&node, "import os\ndef process(x, y):\n    if x == 3:\n        os._exit(9)\n    if x % 2:\n        raise ValueError(f'odd {x}')\n    print('even', x)\n    return x * y\n").unwrap();
    let output = sweep(&["--grid", "x=0..5", "--grid", "y=1,10"], &node);
    assert_eq!(output.status.code(), Some(1));
    let lines = sweep_lines(&output);
    assert_eq!(lines.len(), 12);
    assert_eq!(lines[1]["kwargs"], json!({"x": 0, "y": 10}));
    assert_eq!(lines[4]["result"], 2);
    assert_eq!(lines[4]["logs"], "even 2\n");
    assert_eq!(lines[2]["error"]["short"], "ValueError: odd 1 (line 6)");
    assert!(
        lines[6]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exited with code 9"),
        "{}",
        lines[6]
    );
    assert!(String::from_utf8_lossy(&output.stderr).contains("12 calls, 6 failed"));
}

#[test]
fn sweep_refuses_what_it_cannot_run() {
    let example = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/square.py");
    let output = sweep(&["--grid", "x"], &example);
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("expected NAME=VALUES"));
    let output = sweep(&["--grid", "x=1,2"], Path::new("/nowhere/node.py"));
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("cannot read /nowhere/node.py"));
    let dir = scratch("sweepbad");
    let node = dir.join("broken.py");
    std::fs::write(&node, "def process(:\n").unwrap();
    let output = sweep(&["--grid", "x=1,2"], &node);
    assert_eq!(output.status.code(), Some(2));
    assert!(
        String::from_utf8_lossy(&output.stderr)
            .contains("the node does not load: SyntaxError: invalid syntax (line 1)"),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
}
