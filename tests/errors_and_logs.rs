//! Start-up failures a person can act on (one or two lines, exit 2 in every
//! mode), which Python `--python` picks, and the log lines: one per call
//! start and end, as text or JSON.

mod common;

use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ZYGOTE, run, scratch};
use serde_json::{Value, json};

/// Runs the binary with `args` and these requests on stdin; waits at most a
/// minute.
fn with_requests(command: &mut Command, requests: &[Value]) -> Output {
    let mut child = command
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the binary starts");
    {
        use std::io::Write;
        let mut stdin = child.stdin.take().expect("stdin");
        for request in requests {
            let _ = writeln!(stdin, "{request}");
        }
    }
    wait_for(child, Duration::from_secs(60))
}

fn wait_for(mut child: std::process::Child, limit: Duration) -> Output {
    let start = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if start.elapsed() > limit {
            let _ = child.kill();
            let output = child.wait_with_output().unwrap();
            panic!(
                "still running after {limit:?}:\n{}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().unwrap()
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn replies(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect()
}

/// A start-up failure as a person reads it: exit 2, at most two lines
/// (what failed, and what to do), no Rust panic or backtrace.
fn assert_usage_error(output: &Output, says: &str) {
    let text = stderr(output);
    assert_eq!(output.status.code(), Some(2), "exit 2:\n{text}");
    assert!(text.contains(says), "says {says:?}:\n{text}");
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    assert!(lines.len() <= 2, "one or two lines:\n{text}");
    assert!(
        !text.contains("panicked") && !text.contains("backtrace"),
        "{text}"
    );
}

fn probe() -> Value {
    run(
        1,
        "probe",
        "import sys, math\ndef process():\n    import fz_probe_module\n    return {'prefix': sys.prefix, 'where': fz_probe_module.WHERE, 'pi': math.pi}\n",
        json!({}),
    )
}

/// A venv made from the embedded interpreter, with a module of its own.
fn venv(name: &str) -> common::Scratch {
    let venv = scratch(name);
    let made = Command::new(common::python())
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .expect("venv runs");
    assert!(made.success());
    let site = venv.join(format!(
        "lib/python{}/site-packages",
        python_version(&common::python())
    ));
    std::fs::create_dir_all(&site).unwrap();
    std::fs::write(site.join("fz_probe_module.py"), "WHERE = 'venv'\n").unwrap();
    venv
}

fn python_version(python: &Path) -> String {
    let out = Command::new(python)
        .args(["-c", "import sys; print('%d.%d' % sys.version_info[:2])"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout).trim().to_string()
}

#[test]
fn another_build_of_the_same_version_is_refused_with_the_fix() {
    // Debian's /usr/bin/python3 beside the embedded pyenv build.
    let debian = Path::new("/usr/bin/python3");
    let ours = common::python();
    if !debian.exists() || python_version(debian) != python_version(&ours) {
        eprintln!("skipped: no other build of the embedded version at /usr/bin/python3");
        return;
    }
    let same_build = Command::new(debian)
        .args(["-c", "import sys; print(sys.version)"])
        .output()
        .unwrap()
        .stdout
        == Command::new(&ours)
            .args(["-c", "import sys; print(sys.version)"])
            .output()
            .unwrap()
            .stdout;
    if same_build {
        eprintln!("skipped: /usr/bin/python3 is the embedded build");
        return;
    }
    for mode in [
        &["worker"][..],
        &["sweep", "examples/square.py", "--grid", "x=1"],
    ] {
        let output = with_requests(
            Command::new(ZYGOTE)
                .args(mode)
                .args(["--python", "/usr/bin/python3"])
                .current_dir(env!("CARGO_MANIFEST_DIR")),
            &[],
        );
        assert_usage_error(&output, "/usr/bin/python3 is another build of Python");
        let text = stderr(&output);
        assert!(
            text.contains("hint: use --python") && text.contains("-m venv"),
            "{text}"
        );
    }
}

#[test]
fn a_venv_of_the_embedded_python_is_accepted_and_nodes_import_from_it() {
    let venv = venv("errors-venv");
    let output = with_requests(
        Command::new(ZYGOTE)
            .args(["worker", "--python"])
            .arg(venv.join("bin/python")),
        &[probe()],
    );
    let reply = &replies(&output)[0];
    assert_eq!(reply["ok"], true, "{reply}\n{}", stderr(&output));
    assert_eq!(reply["result"]["where"], "venv");
    assert_eq!(reply["result"]["prefix"], venv.to_string_lossy().as_ref());
}

#[test]
fn python_by_name_is_looked_up_on_path() {
    let venv = venv("errors-by-name");
    let path = format!("{}:/usr/bin:/bin", venv.join("bin").display());
    let output = with_requests(
        Command::new(ZYGOTE)
            .args(["worker", "--python", "python3"])
            .env("PATH", &path),
        &[probe()],
    );
    let reply = &replies(&output)[0];
    assert_eq!(reply["ok"], true, "{reply}\n{}", stderr(&output));
    assert_eq!(reply["result"]["prefix"], venv.to_string_lossy().as_ref());

    let output = with_requests(
        Command::new(ZYGOTE).args(["worker", "--python", "no-such-python-here"]),
        &[],
    );
    assert_usage_error(
        &output,
        "--python no-such-python-here: no such command on PATH",
    );
}

#[test]
fn an_activated_venv_is_the_default_python() {
    let venv = venv("errors-virtual-env");
    let output = with_requests(
        Command::new(ZYGOTE)
            .arg("worker")
            .env("VIRTUAL_ENV", &venv)
            .env_remove("FLUKSIO_PYTHON"),
        &[probe()],
    );
    let reply = &replies(&output)[0];
    assert_eq!(reply["ok"], true, "{reply}\n{}", stderr(&output));
    assert_eq!(reply["result"]["prefix"], venv.to_string_lossy().as_ref());

    // --python (or FLUKSIO_PYTHON) still decides.
    let probe_prefix = run(
        2,
        "prefix",
        "import sys\ndef process():\n    return sys.prefix\n",
        json!({}),
    );
    let output = with_requests(
        Command::new(ZYGOTE)
            .args(["worker", "--python"])
            .arg(common::python())
            .env("VIRTUAL_ENV", &venv),
        &[probe_prefix],
    );
    let reply = &replies(&output)[0];
    assert_ne!(reply["result"], venv.to_string_lossy().as_ref(), "{reply}");
}

#[test]
fn a_bad_preload_exits_2_in_every_mode() {
    let root = env!("CARGO_MANIFEST_DIR");
    let preload = ["--preload", "json,no_such_module_here"];
    let mut modes: Vec<Vec<&str>> = vec![
        vec!["worker"],
        vec!["sweep", "examples/square.py", "--grid", "x=1,2"],
    ];
    let has_run = Command::new(ZYGOTE)
        .args(["run", "--help"])
        .output()
        .unwrap()
        .status
        .success();
    if has_run {
        modes.push(vec!["run", "examples/square.py", "-k", "x=2"]);
    }
    for mode in &modes {
        let output = with_requests(
            Command::new(ZYGOTE)
                .args(mode)
                .args(preload)
                .current_dir(root),
            &[],
        );
        assert_eq!(
            output.status.code(),
            Some(2),
            "{mode:?}:\n{}",
            stderr(&output)
        );
        assert!(
            stderr(&output).contains("could not preload no_such_module_here"),
            "{mode:?}: {}",
            stderr(&output)
        );
    }
    // The agent, with nowhere to connect to: the zygote's failure stops it.
    let port = closed_port();
    let child = Command::new(ZYGOTE)
        .args([
            "agent",
            "--url",
            &format!("ws://127.0.0.1:{port}/api/v1/workers/attach"),
        ])
        .args(["--token", "t"])
        .args(preload)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let output = wait_for(child, Duration::from_secs(60));
    assert_eq!(output.status.code(), Some(2), "agent:\n{}", stderr(&output));
    assert!(stderr(&output).contains("could not preload no_such_module_here"));
}

/// A port nothing listens on.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

#[test]
fn an_agent_url_that_cannot_work_is_a_usage_error() {
    for (url, says) in [
        (
            "ftp://engine.example/api/v1/workers/attach",
            "ftp:// is not a WebSocket URL",
        ),
        (
            "ws://127.0.0.1:99999/api/v1/workers/attach",
            "port 99999 is out of range",
        ),
        ("notaurl", "\"notaurl\" is not a URL"),
        ("wss:///api/v1/workers/attach", "names no host"),
    ] {
        let child = Command::new(ZYGOTE)
            .args(["agent", "--url", url, "--token", "t"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let output = wait_for(child, Duration::from_secs(10));
        assert_usage_error(&output, says);
        assert!(
            stderr(&output).contains("hint:") || says.contains("port"),
            "{}",
            stderr(&output)
        );
    }
    let output = Command::new(ZYGOTE)
        .args(["agent", "--url", "ws://127.0.0.1:9/a"])
        .env_remove("FLUKSIO_WORKER_TOKEN")
        .output()
        .unwrap();
    assert_usage_error(&output, "a token is required");
}

#[test]
fn a_refused_connection_names_the_url() {
    let port = closed_port();
    let url = format!("ws://127.0.0.1:{port}/api/v1/workers/attach");
    let mut child = Command::new(ZYGOTE)
        .args(["agent", "--url", &url, "--token", "t"])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    let _ = child.kill();
    let output = child.wait_with_output().unwrap();
    let text = stderr(&output);
    assert!(
        text.contains(&format!("could not connect to {url}")) && text.contains("retrying in"),
        "{text}"
    );
}

#[test]
fn a_call_is_logged_when_it_starts_and_ends() {
    let requests = [
        run(1, "fine", "def process():\n    return 1\n", json!({})),
        run(
            2,
            "bad",
            "def process():\n    raise ValueError('no')\n",
            json!({}),
        ),
        run(
            3,
            "dies",
            "import os\ndef process():\n    os._exit(3)\n",
            json!({}),
        ),
    ];
    let output = with_requests(
        Command::new(ZYGOTE).arg("worker").env("RUST_LOG", "info"),
        &requests,
    );
    let text = stderr(&output);
    for (call, outcome) in [("1", "ok"), ("2", "ValueError"), ("3", "RemoteError")] {
        let started = text
            .lines()
            .find(|l| l.contains("run started") && l.contains(&format!("call={call} ")));
        assert!(started.is_some(), "call {call} started:\n{text}");
        let ended = text
            .lines()
            .find(|l| l.contains("run ended") && l.contains(&format!("call={call} ")))
            .unwrap_or_else(|| panic!("call {call} ended:\n{text}"));
        assert!(
            ended.contains(&format!("outcome={outcome}")) && ended.contains("seconds="),
            "{ended}"
        );
        assert!(ended.contains("node=t/"), "{ended}");
    }

    // A sweep's calls too, once RUST_LOG asks for them (its default is a
    // quiet terminal).
    let output = Command::new(ZYGOTE)
        .args(["sweep", "examples/square.py", "--grid", "x=1,2"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .env("RUST_LOG", "info")
        .output()
        .unwrap();
    let text = stderr(&output);
    for call in ["0", "1"] {
        assert!(
            text.lines().any(|l| l.contains("run ended")
                && l.contains(&format!("call={call} "))
                && l.contains("outcome=ok")),
            "sweep call {call}:\n{text}"
        );
    }
}

#[test]
fn json_logs_are_one_object_a_line() {
    let requests = [
        run(1, "fine", "def process():\n    return 1\n", json!({})),
        run(
            2,
            "bad",
            "def process():\n    raise KeyError('k')\n",
            json!({}),
        ),
    ];
    for command in [
        Command::new(ZYGOTE).args(["--log-format", "json", "worker"]),
        Command::new(ZYGOTE)
            .arg("worker")
            .env("FLUKSIO_LOG_FORMAT", "json"),
    ] {
        let output = with_requests(command.env("RUST_LOG", "info"), &requests);
        let text = stderr(&output);
        let lines: Vec<Value> = text
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l:?}")))
            .collect();
        let ends: Vec<&Value> = lines
            .iter()
            .filter(|l| l["message"] == "run ended")
            .collect();
        assert_eq!(ends.len(), 2, "{text}");
        for (end, call, outcome) in [(ends[0], "1", "ok"), (ends[1], "2", "KeyError")] {
            assert_eq!(end["level"], "INFO", "{end}");
            assert!(end["timestamp"].is_string(), "{end}");
            assert_eq!(end["call"], call, "{end}");
            assert_eq!(end["outcome"], outcome, "{end}");
            assert!(end["node"].as_str().unwrap().starts_with("t/"), "{end}");
            assert!(end["seconds"].as_f64().is_some_and(|s| s > 0.0), "{end}");
        }
        assert!(
            lines
                .iter()
                .any(|l| l["message"] == "run started" && l["call"] == "1"),
            "{text}"
        );
    }
}

#[test]
fn help_is_grouped_with_examples_and_the_environment() {
    for (command, words) in [
        (
            "worker",
            &[
                "Zygote:",
                "Examples:",
                "FLUKSIO_PRELOAD",
                "Exit codes:",
                "--log-format",
            ][..],
        ),
        (
            "agent",
            &[
                "Engine:",
                "Inventory:",
                "Zygote:",
                "Examples:",
                "FLUKSIO_WORKER_TOKEN",
                "SLURM",
                "Exit codes:",
            ][..],
        ),
    ] {
        let output = Command::new(ZYGOTE)
            .args([command, "--help"])
            .output()
            .unwrap();
        assert!(output.status.success());
        let help = String::from_utf8_lossy(&output.stdout);
        for word in words {
            assert!(help.contains(word), "{command} --help has {word}:\n{help}");
        }
    }
}
