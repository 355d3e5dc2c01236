//! Replies of megabytes, side by side in one run: how long a call returning
//! a string of N MB takes, request written → whole reply read.
//!
//! - worker contract: `fluksio-zygote worker` against the reference
//!   `python worker_main.py`, both reused across calls, sizes 5 to 100 MB;
//! - agent: `fluksio-zygote agent` against agent.py through the test engine
//!   (`tests/common/engine.rs`), 100 MB (the time includes the engine's
//!   parsing the reply, the same for both).
//!
//! Each size is run `--runs` times, ours and the reference interleaved; the
//! table shows the best of each. Every reply is checked: its length, and
//! `"ok": true`.
//!
//!     cargo bench --bench large_replies
//!     cargo bench --bench large_replies -- --runs 5 --agent-mb 100

mod support;

use support::{ZYGOTE, flag, python};

#[path = "../tests/common/engine.rs"]
mod engine;

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

use engine::{Answer, Engine};
use serde_json::json;

const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/reference/fluksio_worker/worker_main.py"
);
const AGENT_PY: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/reference/fluksio_worker/agent.py"
);
const WAIT: Duration = Duration::from_secs(600);

/// The node: a string of `n` bytes (JSON-encoded as is: n + 2 bytes).
const SOURCE: &str = "def process(n):\n    return 'x' * n\n";

const SIZES_MB: [usize; 5] = [5, 10, 20, 40, 100];

fn main() {
    let runs = flag("--runs", 3);
    let agent_mb = flag("--agent-mb", 100);
    let python = python();
    println!("best of {runs} runs per size; python: {}", python.display());
    println!();
    println!(
        "| reply | served by | reference s | fluksio-zygote s | fluksio-zygote MB/s | ours vs reference |"
    );
    println!("| ---: | --- | ---: | ---: | ---: | --- |");
    let mut ours = Worker::spawn(Command::new(ZYGOTE).arg("worker"));
    let mut theirs = Worker::spawn(Command::new(&python).arg(REFERENCE));
    for mb in SIZES_MB {
        let n = mb << 20;
        let mut best = (Duration::MAX, Duration::MAX);
        for _ in 0..runs {
            best.0 = best.0.min(theirs.time(n));
            best.1 = best.1.min(ours.time(n));
        }
        row(mb, "worker contract", best.0, best.1);
    }
    drop(ours);
    drop(theirs);
    if agent_mb > 0 {
        let n = agent_mb << 20;
        let mut best = (Duration::MAX, Duration::MAX);
        for _ in 0..runs {
            best.0 = best.0.min(through_agent(&reference_agent(&python), n));
            best.1 = best.1.min(through_agent(&our_agent(), n));
        }
        row(agent_mb, "agent, through the test engine", best.0, best.1);
    }
}

fn row(mb: usize, mode: &str, theirs: Duration, ours: Duration) {
    let (t, o) = (theirs.as_secs_f64(), ours.as_secs_f64());
    let ratio = if o <= t {
        format!("ours is {:.2}× faster", t / o)
    } else {
        format!("ours is {:.2}× slower", o / t)
    };
    println!(
        "| {mb} MB | {mode} | {t:.3} | {o:.3} | {:.0} | {ratio} |",
        mb as f64 / o
    );
}

/// A long-lived worker process and its pipes.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
    line: Vec<u8>,
    calls: usize,
}

impl Worker {
    fn spawn(command: &mut Command) -> Worker {
        let mut child = command
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the worker starts");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::with_capacity(1 << 20, child.stdout.take().expect("stdout"));
        let mut worker = Worker {
            child,
            stdin,
            stdout,
            line: Vec::new(),
            calls: 0,
        };
        // Compiled (and started) before anything is timed.
        worker.time(1);
        worker
    }

    /// One call returning `n` bytes: request written → reply read.
    fn time(&mut self, n: usize) -> Duration {
        self.calls += 1;
        let source = serde_json::to_string(SOURCE).expect("a string");
        let request = format!(
            r#"{{"id":{},"op":"run","flow":"b","node":"big","source":{source},"kwargs":{{"n":{n}}}}}"#,
            self.calls
        );
        self.line.clear();
        let started = Instant::now();
        writeln!(self.stdin, "{request}").expect("request written");
        self.stdin.flush().expect("request flushed");
        self.stdout
            .read_until(b'\n', &mut self.line)
            .expect("reply read");
        let elapsed = started.elapsed();
        check(&self.line, n);
        elapsed
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A whole, successful reply carrying `n` bytes of result.
fn check(line: &[u8], n: usize) {
    let head = String::from_utf8_lossy(&line[..line.len().min(300)]);
    assert!(
        memchr::memmem::find(line, br#""ok": true"#).is_some(),
        "a failed call: {head}"
    );
    assert!(
        line.len() > n && line.len() < n + 300,
        "a reply of {} bytes for {n}: {head}",
        line.len()
    );
}

type Start = Box<dyn Fn(&str) -> Child>;

fn our_agent() -> Start {
    Box::new(|url| {
        Command::new(ZYGOTE)
            .args(["agent", "--url", url, "--token", "bench"])
            .env("RUST_LOG", "warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    })
}

fn reference_agent(python: &Path) -> Start {
    let python = python.to_path_buf();
    Box::new(move |url| {
        Command::new(&python)
            .args([AGENT_PY, "--url", url, "--token", "bench"])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    })
}

/// One run returning `n` bytes through an agent: request sent → reply
/// received and parsed at the engine (after a warm-up compile).
fn through_agent(start: &Start, n: usize) -> Duration {
    let engine = Engine::start(Answer::Welcome);
    let mut child = start(&engine.url);
    let connection = engine.next_connection(WAIT);
    let warm = json!({"op": "compile", "id": 0, "call_id": "warm", "flow": "b", "node": "big", "source": SOURCE});
    connection.reply_to(&warm, WAIT);
    let request = json!({"op": "run", "id": 1, "call_id": "big", "flow": "b", "node": "big", "source": SOURCE, "kwargs": {"n": n}});
    let started = Instant::now();
    let (_, reply) = connection.reply_to(&request, WAIT);
    let elapsed = started.elapsed();
    assert_eq!(reply["ok"], true, "a failed call: {}", reply["error"]);
    assert_eq!(reply["result"].as_str().map(str::len), Some(n));
    let _ = child.kill();
    let _ = child.wait();
    elapsed
}
