//! `--metrics ADDR`: the endpoint scraped, and its text parsed by the
//! Prometheus project's own Python parser (`prometheus_client`, installed by
//! .ci/run) rather than by anything of ours.

mod common;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{Worker, ZYGOTE, run};
use serde_json::{Value, json};

/// `GET /metrics` on `addr`: the status line and the body.
fn scrape(addr: &str) -> (String, String) {
    let mut stream = std::net::TcpStream::connect(addr).expect("the endpoint answers");
    stream
        .set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n").unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).unwrap();
    let (head, body) = response.split_once("\r\n\r\n").expect("an HTTP response");
    assert!(
        head.contains("Content-Type: text/plain; version=0.0.4"),
        "{head}"
    );
    (head.lines().next().unwrap().to_string(), body.to_string())
}

/// Every sample, by `name{label="value",…}` (labels sorted), as the
/// Prometheus parser reads the text; each family's type beside.
fn parse(text: &str) -> (HashMap<String, f64>, HashMap<String, String>) {
    let script = "import sys, json\n\
        from prometheus_client.parser import text_string_to_metric_families as parse\n\
        samples, types = {}, {}\n\
        for family in parse(sys.stdin.read()):\n\
        \x20   types[family.name] = family.type\n\
        \x20   for s in family.samples:\n\
        \x20       labels = ','.join('%s=\"%s\"' % kv for kv in sorted(s.labels.items()))\n\
        \x20       samples[s.name + ('{' + labels + '}' if labels else '')] = s.value\n\
        print(json.dumps([samples, types]))\n";
    let mut child = Command::new(common::python())
        .args(["-c", script])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let output = child.wait_with_output().unwrap();
    assert!(
        output.status.success(),
        "the Prometheus parser reads it (pip install prometheus_client):\n{}\n{text}",
        String::from_utf8_lossy(&output.stderr)
    );
    let parsed: (HashMap<String, f64>, HashMap<String, String>) =
        serde_json::from_slice(&output.stdout).unwrap();
    parsed
}

/// Where the log says the endpoint is (`--metrics 127.0.0.1:0` picks a port).
fn endpoint_in(log: &str) -> Option<String> {
    let at = log.find("metrics on http://")? + "metrics on http://".len();
    Some(log[at..].split('/').next()?.to_string())
}

#[test]
fn a_worker_serves_its_calls_forks_memory_and_children() {
    let mut worker = Worker::zygote(&["--metrics", "127.0.0.1:0"]);
    let answers = [
        run(1, "ok", "def process():\n    return 1\n", json!({})),
        run(2, "ok", "def process():\n    return 2\n", json!({})),
        run(
            3,
            "raises",
            "def process():\n    raise ValueError('no')\n",
            json!({}),
        ),
        run(
            4,
            "dies",
            "import os\ndef process():\n    os._exit(3)\n",
            json!({}),
        ),
    ]
    .map(|request| worker.call(&request).reply);
    assert_eq!(answers[0]["ok"], true, "{}", answers[0]);
    let log = worker.stderr_so_far();
    let addr = endpoint_in(&log).unwrap_or_else(|| panic!("the log names the endpoint:\n{log}"));
    let (status, body) = scrape(&addr);
    assert_eq!(status, "HTTP/1.1 200 OK");
    let (samples, types) = parse(&body);
    let value = |key: &str| {
        *samples
            .get(key)
            .unwrap_or_else(|| panic!("{key} in:\n{body}"))
    };
    assert_eq!(value("fluksio_calls_total{outcome=\"ok\"}"), 2.0);
    assert_eq!(value("fluksio_calls_total{outcome=\"error\"}"), 1.0);
    assert_eq!(value("fluksio_calls_total{outcome=\"crashed\"}"), 1.0);
    assert_eq!(value("fluksio_calls_total{outcome=\"cancelled\"}"), 0.0);
    assert_eq!(value("fluksio_call_duration_seconds_count"), 4.0);
    assert_eq!(
        value("fluksio_call_duration_seconds_bucket{le=\"+Inf\"}"),
        4.0
    );
    assert!(value("fluksio_call_duration_seconds_sum") > 0.0);
    assert!(value("fluksio_fork_duration_seconds_count") >= 4.0);
    assert!(value("fluksio_zygote_resident_bytes") > 4.0 * 1024.0 * 1024.0);
    // Two standby children wait between calls (--standby 2).
    assert!(value("fluksio_children") >= 1.0, "{body}");
    assert_eq!(value("fluksio_reconnects_total"), 0.0);
    assert_eq!(types["fluksio_calls"], "counter");
    assert_eq!(types["fluksio_call_duration_seconds"], "histogram");
    assert_eq!(types["fluksio_fork_duration_seconds"], "histogram");
    assert_eq!(types["fluksio_zygote_resident_bytes"], "gauge");

    // The server goes with its zygote: the port is free again.
    let (code, _) = worker.finish();
    assert_eq!(code, Some(0));
    let start = Instant::now();
    while std::net::TcpStream::connect(&addr).is_ok() {
        assert!(
            start.elapsed() < Duration::from_secs(10),
            "the metrics server outlived its worker"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn an_address_in_use_is_a_start_up_error() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    for mode in [
        vec!["worker"],
        vec!["sweep", "examples/square.py", "--grid", "x=1"],
        vec![
            "agent",
            "--url",
            "ws://127.0.0.1:9/api/v1/workers/attach",
            "--token",
            "t",
        ],
    ] {
        let output = Command::new(ZYGOTE)
            .args(&mode)
            .args(["--metrics", &addr])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stdin(Stdio::null())
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(2), "{mode:?}: {stderr}");
        assert!(
            stderr.contains(&format!("could not listen on {addr} for --metrics"))
                && stderr.contains("hint:"),
            "{mode:?}: {stderr}"
        );
        assert!(stderr.lines().count() <= 2, "{stderr}");
    }
}

#[test]
fn an_agent_serves_its_calls_and_its_zygote_s_numbers() {
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, &["--metrics", "127.0.0.1:0"], &[]);
    let connection = engine.next_connection(WAIT);
    for (call_id, source) in [
        ("m1", "def process():\n    return 1\n"),
        ("m2", "def process():\n    raise KeyError('k')\n"),
    ] {
        let request: Value = json!({"op": "run", "call_id": call_id, "id": 1, "flow": "f", "node": "n", "source": source, "kwargs": {}});
        connection.send(&request);
        connection.reply(call_id, WAIT);
    }
    // The engine drops the socket: the agent reconnects.
    connection.drop_socket();
    let _again = engine.next_connection(WAIT);
    let mut log = String::new();
    let start = Instant::now();
    let addr = loop {
        log.push_str(&agent.log());
        if let Some(addr) = endpoint_in(&log) {
            break addr;
        }
        assert!(start.elapsed() < WAIT, "the log names the endpoint:\n{log}");
        std::thread::sleep(Duration::from_millis(50));
    };
    let (status, body) = scrape(&addr);
    assert_eq!(status, "HTTP/1.1 200 OK");
    let (samples, _) = parse(&body);
    let value = |key: &str| {
        *samples
            .get(key)
            .unwrap_or_else(|| panic!("{key} in:\n{body}"))
    };
    assert_eq!(value("fluksio_calls_total{outcome=\"ok\"}"), 1.0);
    assert_eq!(value("fluksio_calls_total{outcome=\"error\"}"), 1.0);
    assert_eq!(value("fluksio_call_duration_seconds_count"), 2.0);
    assert!(value("fluksio_reconnects_total") >= 1.0, "{body}");
    // From the zygote, a process of its own: its forks, memory, children.
    assert!(
        value("fluksio_fork_duration_seconds_count") >= 1.0,
        "{body}"
    );
    assert!(value("fluksio_zygote_resident_bytes") > 4.0 * 1024.0 * 1024.0);
    assert!(value("fluksio_children") >= 1.0, "{body}");
}
