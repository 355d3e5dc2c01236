//! Side by side, in one run: the worker contract served three ways, and the
//! physical floor under all of them.
//!
//! - (a) a reused `python worker_main.py` (what the engine's pool does
//!   between crashes), driven over its pipes;
//! - (b) a fresh `python worker_main.py` per call (what agent.py does);
//! - (c) `fluksio-zygote worker`, a forked child per call;
//! - floor: `fork` + `_exit` + `waitpid` of a process with as much
//!   anonymous memory as (c)'s zygote, in 4 KiB pages like Python's heap;
//! - for scale, CPython's own `os.fork()` + `os._exit(0)` + `os.waitpid`
//!   in the same interpreter with the same imports: what any fork of a
//!   Python process costs before it runs a line of a node.
//!
//! Each for a trivial node, bare and with numpy preloaded. Every latency is
//! request written → reply read, by this one client.
//!
//!     cargo bench --bench worker                # every row
//!     cargo bench --bench worker -- --calls 500 # fewer calls per row

mod support;

use support::{ZYGOTE, flag, python};

use std::io::{BufRead, BufReader, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/reference/fluksio_worker/worker_main.py"
);

struct Scenario {
    name: &'static str,
    source: &'static str,
    preload: &'static str,
}

const SCENARIOS: [Scenario; 2] = [
    Scenario {
        name: "trivial node",
        source: "def process(x):\n    return x + 1\n",
        preload: "",
    },
    Scenario {
        name: "trivial node, numpy preloaded",
        source: "import numpy\ndef process(x):\n    return x + 1\n",
        preload: "numpy",
    },
];

fn main() {
    let calls = flag("--calls", 2000);
    let fresh_calls = flag("--fresh-calls", 100);
    let python = python();
    println!(
        "calls per row: {calls} ({fresh_calls} for fresh processes); python: {}",
        python.display()
    );
    println!();
    println!("| scenario | served by | p50 ms | p99 ms | mean ms | (c) faster by |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    for scenario in &SCENARIOS {
        let ours = Worker::zygote(scenario.preload);
        let anon_kib = ours.anon_kib();
        let ours = ours.measure(scenario.source, calls);
        let reused = Worker::reference(&python).measure(scenario.source, calls);
        let fresh = fresh_per_call(&python, scenario.source, fresh_calls);
        let floor = fork_floor(anon_kib, calls);
        let python_fork = python_fork(&python, scenario.preload, calls);
        let ratio = |other: &Stats| other.p50.as_secs_f64() / ours.p50.as_secs_f64();
        let rows = [
            ("(a) reused `worker_main.py`", &reused),
            ("(b) fresh `worker_main.py` per call", &fresh),
            ("(c) `fluksio-zygote worker`, fork per call", &ours),
        ];
        for (label, stats) in rows {
            println!(
                "| {} | {label} | {:.3} | {:.3} | {:.3} | {:.1}× |",
                scenario.name,
                ms(stats.p50),
                ms(stats.p99),
                ms(stats.mean),
                ratio(stats)
            );
        }
        println!(
            "| {} | floor: fork+_exit+waitpid, {} MiB anonymous | {:.3} | {:.3} | {:.3} | (c) = {:.2}× floor |",
            scenario.name,
            anon_kib / 1024,
            ms(floor.p50),
            ms(floor.p99),
            ms(floor.mean),
            ours.p50.as_secs_f64() / floor.p50.as_secs_f64()
        );
        println!(
            "| {} | for scale: CPython's own os.fork()+os._exit+waitpid | {:.3} | {:.3} | {:.3} | (c) = {:.2}× it |",
            scenario.name,
            ms(python_fork.p50),
            ms(python_fork.p99),
            ms(python_fork.mean),
            ours.p50.as_secs_f64() / python_fork.p50.as_secs_f64()
        );
    }
}

/// `os.fork()` + `os._exit(0)` + `os.waitpid` timed inside `python`, with
/// `preload` imported: the cycle every forked Python child pays.
fn python_fork(python: &PathBuf, preload: &str, calls: usize) -> Stats {
    let script = format!(
        "import os, sys, time\n{imports}\nfor i in range({calls}):\n    t = time.perf_counter()\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)\n    print(time.perf_counter() - t)\n",
        imports = if preload.is_empty() {
            String::new()
        } else {
            format!("import {preload}")
        },
    );
    let output = Command::new(python)
        .args(["-c", &script])
        .output()
        .expect("python runs");
    let samples = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .collect();
    Stats::of(samples)
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

struct Stats {
    p50: Duration,
    p99: Duration,
    mean: Duration,
}

impl Stats {
    fn of(mut samples: Vec<Duration>) -> Stats {
        samples.sort_unstable();
        let at = |q: f64| {
            samples[((q * samples.len() as f64).ceil() as usize).clamp(1, samples.len()) - 1]
        };
        Stats {
            p50: at(0.5),
            p99: at(0.99),
            mean: samples.iter().sum::<Duration>() / samples.len() as u32,
        }
    }
}

/// A long-lived worker process and its pipes.
struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: BufReader<ChildStdout>,
}

impl Worker {
    fn zygote(preload: &str) -> Worker {
        let mut command = Command::new(ZYGOTE);
        command.arg("worker");
        if !preload.is_empty() {
            command.args(["--preload", preload]);
        }
        Worker::spawn(command)
    }

    fn reference(python: &PathBuf) -> Worker {
        let mut command = Command::new(python);
        command.arg(REFERENCE);
        Worker::spawn(command)
    }

    fn spawn(mut command: Command) -> Worker {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("the worker starts");
        let stdin = child.stdin.take().expect("stdin");
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        let mut worker = Worker {
            child,
            stdin,
            stdout,
        };
        // Answering one request means it has started (and preloaded).
        worker.call(r#"{"id":0,"op":"compile","flow":"b","node":"warm","source":"def process():\n    return 0\n"}"#);
        worker
    }

    fn call(&mut self, request: &str) -> String {
        writeln!(self.stdin, "{request}").expect("request written");
        let mut line = String::new();
        self.stdout.read_line(&mut line).expect("reply read");
        assert!(line.contains(r#""ok": true"#), "a failed call: {line}");
        line
    }

    /// Anonymous resident memory of the worker process, in KiB.
    fn anon_kib(&self) -> usize {
        let status =
            std::fs::read_to_string(format!("/proc/{}/status", self.child.id())).expect("status");
        status
            .lines()
            .find_map(|l| l.strip_prefix("RssAnon:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
            .expect("RssAnon")
    }

    fn measure(mut self, source: &str, calls: usize) -> Stats {
        let source = serde_json::to_string(source).expect("a string");
        self.call(&format!(
            r#"{{"id":1,"op":"compile","flow":"b","node":"n","source":{source}}}"#
        ));
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls {
            let request = format!(
                r#"{{"id":{i},"op":"run","flow":"b","node":"n","source":{source},"kwargs":{{"x":{i}}}}}"#
            );
            let start = Instant::now();
            self.call(&request);
            samples.push(start.elapsed());
        }
        drop(self.stdin);
        let _ = self.child.wait();
        Stats::of(samples)
    }
}

/// agent.py's way: a new interpreter per call, which imports everything.
fn fresh_per_call(python: &PathBuf, source: &str, calls: usize) -> Stats {
    let source = serde_json::to_string(source).expect("a string");
    let mut samples = Vec::with_capacity(calls);
    for i in 0..calls {
        let request = format!(
            r#"{{"id":{i},"op":"run","flow":"b","node":"n","source":{source},"kwargs":{{"x":{i}}}}}"#
        );
        let start = Instant::now();
        let mut child = Command::new(python)
            .arg(REFERENCE)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("python starts");
        let mut stdin = child.stdin.take().expect("stdin");
        writeln!(stdin, "{request}").expect("request written");
        let mut line = String::new();
        BufReader::new(child.stdout.take().expect("stdout"))
            .read_line(&mut line)
            .expect("reply read");
        samples.push(start.elapsed());
        assert!(line.contains(r#""ok": true"#), "a failed call: {line}");
        drop(stdin);
        let _ = child.wait();
    }
    Stats::of(samples)
}

/// fork + `_exit` + `waitpid` of this process holding `anon_kib` of touched
/// anonymous memory in 4 KiB pages (`MADV_NOHUGEPAGE`: pymalloc's arenas
/// are too small for huge pages, so the zygote's heap is 4 KiB pages too).
fn fork_floor(anon_kib: usize, calls: usize) -> Stats {
    let bytes = anon_kib * 1024;
    // SAFETY: a fresh private anonymous mapping, touched, then forked; the
    // child only calls _exit.
    unsafe {
        let memory = libc::mmap(
            std::ptr::null_mut(),
            bytes,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        assert_ne!(memory, libc::MAP_FAILED);
        libc::madvise(memory, bytes, libc::MADV_NOHUGEPAGE);
        std::ptr::write_bytes(memory.cast::<u8>(), 1, bytes);
        let mut samples = Vec::with_capacity(calls);
        for _ in 0..calls {
            let start = Instant::now();
            let pid = libc::fork();
            if pid == 0 {
                libc::_exit(0);
            }
            let mut status = 0;
            libc::waitpid(pid, &mut status, 0);
            samples.push(start.elapsed());
        }
        // Keep the memory observably used until after the loop.
        std::hint::black_box(memory);
        libc::munmap(memory, bytes);
        Stats::of(samples)
    }
}
