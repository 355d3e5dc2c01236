//! The agent against agent.py, side by side in one run, through the test
//! engine (`tests/common/engine.rs`): what a call costs end to end, and
//! how many events per second reach the engine.
//!
//!     cargo bench --bench agent
//!     cargo bench --bench agent -- --calls 300 --fresh-calls 10 --events 100000 --in-flight 8
//!
//! The last table: a sweep of trivial calls through the engine, `--in-flight`
//! at once (`--parallel` that many), calls/s, ours with one zygote forking
//! the node's calls and with lanes of it (`--lanes`).

mod support;

use support::{ZYGOTE, flag, python};

#[path = "../tests/common/engine.rs"]
mod engine;

use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use engine::{Answer, Connection, Engine};
use serde_json::json;

const AGENT_PY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/reference/fluksio_worker/agent.py"
);
const WAIT: Duration = Duration::from_secs(600);

struct Scenario {
    name: &'static str,
    source: String,
    preload: &'static str,
}

fn main() {
    let (calls, fresh_calls, events, in_flight) = (
        flag("--calls", 300),
        flag("--fresh-calls", 10),
        flag("--events", 100_000),
        flag("--in-flight", 8),
    );
    let python = python();
    let scenarios = [
        Scenario {
            name: "trivial node, round trip",
            source: "def process(x):\n    return x + 1\n".into(),
            preload: "",
        },
        Scenario {
            name: "node importing numpy, pandas, scipy (preloaded by ours)",
            source: "import numpy, pandas, scipy.stats\ndef process(x):\n    return x + 1\n".into(),
            preload: "numpy,pandas,scipy.stats",
        },
    ];
    println!(
        "ours: {calls} calls per row; agent.py: {fresh_calls}; {events} events for the stream row"
    );
    println!();
    println!("| scenario | agent.py p50 | fluksio-zygote agent p50 | ours faster by |");
    println!("| --- | ---: | ---: | ---: |");
    for scenario in &scenarios {
        let theirs = round_trips(&reference(&python), &scenario.source, fresh_calls);
        let ours = round_trips(&ours(scenario.preload, Vec::new()), &scenario.source, calls);
        println!(
            "| {} | {:.1} ms | {:.2} ms | {:.0}× |",
            scenario.name,
            theirs.as_secs_f64() * 1e3,
            ours.as_secs_f64() * 1e3,
            theirs.as_secs_f64() / ours.as_secs_f64()
        );
    }
    let source = "def process(n):\n    for i in range(n):\n        yield {'i': i}\n    return n\n";
    let theirs = event_rate(&reference(&python), source, events);
    let mine = event_rate(&ours("", Vec::new()), source, events);
    println!(
        "| a node yielding {events} small events: events/s reaching the engine | {:.0}/s | {:.0}/s | {:.1}× |",
        theirs,
        mine,
        mine / theirs
    );

    let source = "def process(x):\n    return x + 1\n";
    let parallel = in_flight.to_string();
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    println!();
    println!(
        "{in_flight} trivial calls in flight ({cores} CPUs): {} calls for ours, {} for agent.py",
        calls * 10,
        fresh_calls * 2
    );
    println!();
    println!("| served by | calls/s |");
    println!("| --- | ---: |");
    let laned = |lanes: usize| {
        let flags = ["--parallel", &parallel, "--lanes", &lanes.to_string()].map(String::from);
        (
            format!("ours, --parallel {in_flight} --lanes {lanes}"),
            ours("", flags.to_vec()),
            calls * 10,
        )
    };
    let rows: [(String, Start, usize); 3] = [
        (
            format!("agent.py --parallel {in_flight}"),
            reference_with(&python, vec!["--parallel".into(), parallel.clone()]),
            fresh_calls * 2,
        ),
        laned(1),
        laned(2),
    ];
    for (name, start, count) in &rows {
        let rate = throughput(start, source, *count, in_flight);
        println!("| {name} | {rate:.0} |");
    }
}

/// How to start an agent on the engine's URL.
type Start = Box<dyn Fn(&str) -> Child>;

fn ours(preload: &'static str, flags: Vec<String>) -> Start {
    Box::new(move |url| {
        let mut command = Command::new(ZYGOTE);
        command.args(["agent", "--url", url, "--token", "bench"]);
        command.args(&flags);
        if !preload.is_empty() {
            command.args(["--preload", preload]);
        }
        command
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    })
}

fn reference(python: &std::path::Path) -> Start {
    reference_with(python, Vec::new())
}

fn reference_with(python: &std::path::Path, flags: Vec<String>) -> Start {
    let python = python.to_path_buf();
    Box::new(move |url| {
        Command::new(&python)
            .args([AGENT_PY, "--url", url, "--token", "bench"])
            .args(&flags)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    })
}

/// An engine, an agent attached to it, and one warm-up call (which also
/// waits for preloading).
fn attach(start: &Start, source: &str) -> (Engine, Child, Connection) {
    let engine = Engine::start(Answer::Welcome);
    let child = start(&engine.url);
    let connection = engine.next_connection(WAIT);
    let warm = json!({"op": "compile", "id": 0, "call_id": "warm", "flow": "b", "node": "n", "source": source});
    connection.reply_to(&warm, WAIT);
    (engine, child, connection)
}

/// p50 of request sent → reply received.
fn round_trips(start: &Start, source: &str, calls: usize) -> Duration {
    let (_engine, mut child, connection) = attach(start, source);
    let mut samples: Vec<Duration> = (0..calls)
        .map(|i| {
            let request = json!({"op": "run", "id": i, "call_id": format!("c{i}"), "flow": "b", "node": "n", "source": source, "kwargs": {"x": i}});
            let started = Instant::now();
            let (_, reply) = connection.reply_to(&request, WAIT);
            assert_eq!(reply["ok"], true, "{reply}");
            started.elapsed()
        })
        .collect();
    let _ = child.kill();
    let _ = child.wait();
    samples.sort_unstable();
    samples[samples.len() / 2]
}

/// Events per second from the first event to the reply.
fn event_rate(start: &Start, source: &str, events: usize) -> f64 {
    let (_engine, mut child, connection) = attach(start, source);
    let request = json!({"op": "run", "id": 1, "call_id": "stream", "flow": "b", "node": "n", "source": source, "kwargs": {"n": events}});
    connection.send(&request);
    let first = connection.until(WAIT, |m| m["event"] == "yield");
    let started = Instant::now();
    let (seen, reply) = connection.reply("stream", WAIT);
    let elapsed = started.elapsed().as_secs_f64();
    assert_eq!(reply["result"], events, "{reply}");
    let yields = first
        .iter()
        .chain(&seen)
        .filter(|m| m["event"] == "yield")
        .count();
    assert_eq!(yields, events, "every event reached the engine");
    let _ = child.kill();
    let _ = child.wait();
    (events - 1) as f64 / elapsed
}

/// Calls per second with `in_flight` calls kept in flight, from the first
/// request sent to the last reply received.
fn throughput(start: &Start, source: &str, calls: usize, in_flight: usize) -> f64 {
    let (_engine, mut child, connection) = attach(start, source);
    let request = |i: usize| json!({"op": "run", "id": i, "call_id": format!("t{i}"), "flow": "b", "node": "n", "source": source, "kwargs": {"x": i}});
    let started = Instant::now();
    let mut sent = 0;
    while sent < in_flight.min(calls) {
        connection.send(&request(sent));
        sent += 1;
    }
    let mut done = 0;
    while done < calls {
        let message = connection.recv(WAIT).expect("a reply");
        if message.get("event").is_some() {
            continue;
        }
        assert_eq!(message["ok"], true, "{message}");
        done += 1;
        if sent < calls {
            connection.send(&request(sent));
            sent += 1;
        }
    }
    let elapsed = started.elapsed().as_secs_f64();
    let _ = child.kill();
    let _ = child.wait();
    calls as f64 / elapsed
}
