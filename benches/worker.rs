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

use support::driver::LineWorker;
use support::reference::Reference;
use support::{Side, Stats, ZYGOTE, factor_text, flag, floor, ms, procfs, python, winner};

use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

/// The directory holding `fluksio_worker/worker_main.py`.
const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/reference");

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
    let reference = Reference {
        dir: PathBuf::from(REFERENCE),
        python: python.clone(),
    };
    println!(
        "calls per row: {calls} ({fresh_calls} for fresh processes); python: {}",
        python.display()
    );
    println!();
    println!("| scenario | served by | p50 ms | p99 ms | mean ms | against (c) |");
    println!("| --- | --- | ---: | ---: | ---: | ---: |");
    for scenario in &SCENARIOS {
        let worker = ours(scenario.preload, scenario.source);
        let anon_kib = procfs::anon_kib(worker.pid()).expect("RssAnon") as usize;
        let ours = measure(worker, scenario.source, calls);
        let reused = measure(
            started(reference.command().expect("the reference"), scenario.source),
            scenario.source,
            calls,
        );
        let fresh = fresh_per_call(&reference, scenario.source, fresh_calls);
        let floor = fork_floor(anon_kib, calls);
        let python_fork = python_fork(&python, scenario.preload, calls);
        // Read the right way round: "(c) is 55× faster", "(a) is 23× faster".
        let against = |label: &str, other: &Stats| {
            let tag = label.split(' ').next().unwrap_or(label);
            match winner(ms(ours.p50), ms(other.p50), true) {
                _ if tag == "(c)" => "—".to_string(),
                Some((Side::This, f)) => format!("(c) is {}× faster", factor_text(f)),
                Some((Side::Other, f)) => format!("{tag} is {}× faster", factor_text(f)),
                None => String::new(),
            }
        };
        let rows = [
            ("(a) reused `worker_main.py`", &reused),
            ("(b) fresh `worker_main.py` per call", &fresh),
            ("(c) `fluksio-zygote worker`, fork per call", &ours),
        ];
        for (label, stats) in rows {
            println!(
                "| {} | {label} | {:.3} | {:.3} | {:.3} | {} |",
                scenario.name,
                ms(stats.p50),
                ms(stats.p99),
                ms(stats.mean),
                against(label, stats)
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
    let samples: Vec<Duration> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .filter_map(|l| l.parse::<f64>().ok())
        .map(Duration::from_secs_f64)
        .collect();
    Stats::of(&samples).expect("samples")
}

/// A worker with the trivial node compiled (which also waits for its
/// preloads), the comparison bench's client: `support::driver`.
fn started(mut command: Command, source: &str) -> LineWorker {
    command.env("RUST_LOG", "warn");
    let log = std::env::temp_dir().join(format!("bench-worker-{}.log", std::process::id()));
    let mut worker = LineWorker::spawn(command, &log).expect("the worker starts");
    worker.compile("n", source).expect("the node compiles");
    worker
}

fn ours(preload: &str, source: &str) -> LineWorker {
    let mut command = Command::new(ZYGOTE);
    command.arg("worker");
    if !preload.is_empty() {
        command.args(["--preload", preload]);
    }
    started(command, source)
}

fn measure(mut worker: LineWorker, source: &str, calls: usize) -> Stats {
    let samples = worker
        .time_calls("n", source, calls, Duration::ZERO)
        .expect("the calls succeed");
    worker.close();
    Stats::of(&samples).expect("samples")
}

/// agent.py's way: a new interpreter per call, which imports everything.
fn fresh_per_call(reference: &Reference, source: &str, calls: usize) -> Stats {
    let log = std::env::temp_dir().join(format!("bench-fresh-{}.log", std::process::id()));
    let samples = reference
        .spawn_per_call(&log, source, calls)
        .expect("the calls succeed");
    Stats::of(&samples).expect("samples")
}

/// fork + `_exit` + `waitpid` of this (single-threaded) process holding
/// `anon_kib` of touched anonymous memory in 4 KiB pages: the comparison
/// bench's floor, `support::floor`.
fn fork_floor(anon_kib: usize, calls: usize) -> Stats {
    Stats::of(&floor::cycles(anon_kib, calls)).expect("samples")
}
