//! The matrix: scenarios (1)–(7), each served by every row that can serve
//! it, one after another in this run.
//!
//! Every node imports the preload set (the reference imports it at its
//! compile, a fresh process at every call, ours once, in the zygote). Every
//! latency is request written → reply read by this process; a worker is
//! warmed with a few calls before its calls are timed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use super::ours::{self, Ours, Variant};
use super::support::driver::{self, LineWorker};
use super::support::reference::Reference;
use super::support::{Stats, ZYGOTE, floor, procfs};
use super::{BenchOptions, Scratch};

/// Calls each worker gets before its calls are timed.
const WARM_CALLS: usize = 20;
/// The spacing of the "spaced" rows: long enough for a standby to be ready.
const SPACING: Duration = Duration::from_millis(5);
/// How long the call of (3) runs before it is killed, as a cancel would
/// find it: long enough for the worker to have relayed its first event.
const RUN_BEFORE_KILL: Duration = Duration::from_millis(10);
/// Calls at once in (4).
const HOLDERS: usize = 8;
/// Calls in flight in (2) and (5).
const IN_FLIGHT: usize = 2;
/// Bytes a module-level `int` in a list costs: the object (pymalloc's
/// 32-byte class) and its slot in the list.
const BYTES_PER_INT: usize = 40;

/// What a scenario measures.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scenario {
    BackToBack,
    Spaced,
    PoolBackToBack,
    PoolSpaced,
    Throughput,
    AfterKill,
    Pss,
    PssWeights,
    Sweep,
    SmallBefore,
    SmallAfter,
    Torch,
    TorchAfterKill,
}

impl Scenario {
    pub const ALL: [Scenario; 13] = [
        Scenario::BackToBack,
        Scenario::Spaced,
        Scenario::PoolBackToBack,
        Scenario::PoolSpaced,
        Scenario::Throughput,
        Scenario::AfterKill,
        Scenario::Pss,
        Scenario::PssWeights,
        Scenario::Sweep,
        Scenario::SmallBefore,
        Scenario::SmallAfter,
        Scenario::Torch,
        Scenario::TorchAfterKill,
    ];

    /// Its name in the table.
    pub fn title(self) -> &'static str {
        match self {
            Scenario::BackToBack => "(1) sequential trivial calls, back to back",
            Scenario::Spaced => "(1) sequential trivial calls, spaced 5 ms",
            Scenario::PoolBackToBack => {
                "(1) through the engine's PythonWorkerPool (size 1), back to back"
            }
            Scenario::PoolSpaced => {
                "(1) through the engine's PythonWorkerPool (size 1), spaced 5 ms"
            }
            Scenario::Throughput => "(2) trivial calls, 2 in flight",
            Scenario::AfterKill => "(3) the next call after a kill",
            Scenario::Pss => "(4) total PSS, 8 calls at once each holding a numpy array",
            Scenario::PssWeights => {
                "(4) total PSS, 8 calls at once of a node holding a numpy array at module level (its weights)"
            }
            Scenario::Sweep => "(5) a sweep of trivial calls, 2 in flight",
            Scenario::SmallBefore => "(6) a small node, before the big node is compiled",
            Scenario::SmallAfter => "(6) the small node, after the big node is compiled",
            Scenario::Torch => "(7) torch preloaded: a trivial call",
            Scenario::TorchAfterKill => "(7) torch preloaded: the next call after a kill",
        }
    }

    /// A short name, for the chart.
    pub fn short(self) -> &'static str {
        match self {
            Scenario::BackToBack => "(1) back to back: p50 ms",
            Scenario::Spaced => "(1) spaced 5 ms: p50 ms",
            Scenario::PoolBackToBack => "(1) via PythonWorkerPool: p50 ms",
            Scenario::PoolSpaced => "(1) via PythonWorkerPool, spaced: p50 ms",
            Scenario::Throughput => "(2) 2 in flight: calls/s",
            Scenario::AfterKill => "(3) after a kill: p50 ms",
            Scenario::Pss => "(4) 8 calls at once: PSS MiB",
            Scenario::PssWeights => "(4) 8 calls, module-level array: PSS MiB",
            Scenario::Sweep => "(5) sweep: calls/s",
            Scenario::SmallBefore => "(6) small node before: p50 ms",
            Scenario::SmallAfter => "(6) small node after big: p50 ms",
            Scenario::Torch => "(7) torch call: p50 ms",
            Scenario::TorchAfterKill => "(7) torch after a kill: p50 ms",
        }
    }
}

/// Who serves a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Server {
    /// The reference pool: reused `worker_main.py` processes.
    Pool,
    /// A fresh `python worker_main.py` per call.
    Spawn,
    Ours(Variant),
    /// Ours as the pool sees it today: the `worker` process killed, a new
    /// one started (its preloads again).
    OursRestarted,
    /// Many pool slots sharing one zygote.
    SharedZygote,
    /// The C fork floor, with this many forking processes.
    Floor {
        anon_kib: u64,
        processes: usize,
    },
}

impl Server {
    pub fn label(self) -> String {
        match self {
            Server::Pool => "reference pool (reused `worker_main.py`)".into(),
            Server::Spawn => "spawn per call (fresh `worker_main.py`)".into(),
            Server::Ours(Variant::Call) => "ours, `--isolation call`".into(),
            Server::Ours(Variant::Standby(n)) => format!("ours, `--isolation call --standby {n}`"),
            Server::Ours(Variant::Node) => "ours, `--isolation node`".into(),
            Server::Ours(Variant::Reset) => "ours, `--isolation reset`".into(),
            Server::OursRestarted => "ours, `worker` process killed and restarted".into(),
            Server::SharedZygote => "ours, pool slots sharing one zygote".into(),
            Server::Floor {
                anon_kib,
                processes,
            } => {
                let mib = anon_kib as f64 / 1024.0;
                if anon_kib == 0 {
                    "C fork floor".into()
                } else if processes > 1 {
                    format!("C fork floor, {processes} processes, {mib:.0} MiB anonymous each")
                } else {
                    format!("C fork floor, {mib:.0} MiB anonymous")
                }
            }
        }
    }

    /// Whether it is the `fluksio-zygote` binary.
    pub fn is_ours(self) -> bool {
        matches!(
            self,
            Server::Ours(_) | Server::OursRestarted | Server::SharedZygote
        )
    }

    /// A short name, for the chart.
    pub fn short(self) -> String {
        match self {
            Server::Pool => "reference pool".into(),
            Server::Spawn => "spawn per call".into(),
            Server::Ours(Variant::Call) => "ours, call".into(),
            Server::Ours(Variant::Standby(n)) => format!("ours, call, standby {n}"),
            Server::Ours(Variant::Node) => "ours, node".into(),
            Server::Ours(Variant::Reset) => "ours, reset".into(),
            Server::OursRestarted => "ours, worker restarted".into(),
            Server::SharedZygote => "ours, shared zygote".into(),
            Server::Floor { .. } => "C fork floor".into(),
        }
    }
}

/// A measured value.
#[derive(Debug, Clone, Copy)]
pub enum Metric {
    Latency(Stats),
    /// Calls per second.
    Rate(f64),
    /// Total PSS in KiB, of this many processes.
    Pss {
        kib: u64,
        processes: usize,
    },
}

impl Metric {
    /// The number compared across rows: p50 ms, calls/s or MiB.
    pub fn value(&self) -> f64 {
        match *self {
            Metric::Latency(stats) => super::support::ms(stats.p50),
            Metric::Rate(rate) => rate,
            Metric::Pss { kib, .. } => kib as f64 / 1024.0,
        }
    }

    pub fn lower_is_better(&self) -> bool {
        !matches!(self, Metric::Rate(_))
    }
}

/// One row: who served which scenario, and what came of it.
#[derive(Debug, Clone)]
pub struct Row {
    pub scenario: Scenario,
    pub server: Server,
    pub outcome: Result<Metric, String>,
    /// How it was run, where that is not obvious, and its profile.
    pub note: String,
}

/// Everything the run measured.
pub struct Results {
    pub rows: Vec<Row>,
    /// Our `worker`'s anonymous RSS with the trivial node compiled: the
    /// fork floor's size.
    pub anon_kib: Option<u64>,
    pub python_version: String,
}

impl Results {
    /// The row of `server` in `scenario`, if measured.
    pub fn metric(&self, scenario: Scenario, server: Server) -> Option<Metric> {
        self.rows
            .iter()
            .find(|r| r.scenario == scenario && same_server(r.server, server))
            .and_then(|r| r.outcome.as_ref().ok().copied())
    }

    /// The floor row of `scenario` (whatever its size), if measured.
    pub fn floor(&self, scenario: Scenario) -> Option<Metric> {
        self.rows
            .iter()
            .find(|r| r.scenario == scenario && matches!(r.server, Server::Floor { .. }))
            .and_then(|r| r.outcome.as_ref().ok().copied())
    }
}

/// Floors compare by kind, whatever their size.
fn same_server(a: Server, b: Server) -> bool {
    match (a, b) {
        (Server::Floor { .. }, Server::Floor { .. }) => true,
        _ => a == b,
    }
}

/// What every scenario needs.
struct Context<'a> {
    options: &'a BenchOptions,
    scratch: &'a Scratch,
    ours: Ours,
    reference: Reference,
    /// This binary, run again as a floor process (`--floor-kib`).
    exe: PathBuf,
    /// `import numpy, pandas` for the preload set, or nothing.
    imports: String,
    rows: Vec<Row>,
    anon_kib: Option<u64>,
    /// (1)'s spawn-per-call figure, which is also (3)'s.
    spawn: Option<Metric>,
}

/// Runs every scenario, in order, printing progress on stderr.
pub fn run(options: &BenchOptions, scratch: &Scratch) -> Results {
    let exe = std::env::current_exe().unwrap_or_else(|_| PathBuf::from("compare"));
    let imports = if options.preload.is_empty() {
        String::new()
    } else {
        format!("import {}\n", options.preload.join(", "))
    };
    let mut context = Context {
        options,
        scratch,
        ours: Ours {
            exe: PathBuf::from(ZYGOTE),
            preload: options.preload.clone(),
            python: options.python_given.then(|| options.python.clone()),
        },
        reference: Reference {
            dir: options.reference.clone(),
            python: options.python.clone(),
        },
        exe,
        imports,
        rows: Vec::new(),
        anon_kib: None,
        spawn: None,
    };
    let python_version = python_version(&options.python);
    context.sequential();
    context.through_pool();
    context.throughput(Scenario::Throughput, options.counts.throughput);
    context.after_kill();
    context.pss();
    context.throughput(Scenario::Sweep, options.counts.sweep);
    context.big_node();
    context.torch();
    Results {
        rows: context.rows,
        anon_kib: context.anon_kib,
        python_version,
    }
}

pub fn python_version(python: &Path) -> String {
    Command::new(python)
        .args(["-c", "import sys; print(sys.version.split()[0])"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

fn latency(samples: Result<Vec<Duration>, String>) -> Result<Metric, String> {
    let samples = samples?;
    Stats::of(&samples)
        .map(Metric::Latency)
        .ok_or_else(|| "no samples".into())
}

impl Context<'_> {
    fn push(
        &mut self,
        scenario: Scenario,
        server: Server,
        outcome: Result<Metric, String>,
        note: impl Into<String>,
    ) {
        let row = Row {
            scenario,
            server,
            outcome,
            note: note.into(),
        };
        match &row.outcome {
            Ok(metric) => eprintln!(
                "bench: {} | {}: {:.3}",
                scenario.title(),
                server.label(),
                metric.value()
            ),
            Err(why) => eprintln!(
                "bench: {} | {}: not run: {why}",
                scenario.title(),
                server.label()
            ),
        }
        self.rows.push(row);
    }

    fn log(&self, name: &str) -> PathBuf {
        self.scratch.dir.join(format!("{name}.log"))
    }

    fn trivial(&self) -> String {
        format!("{}def process(x):\n    return x + 1\n", self.imports)
    }

    fn our_variants(&self) -> [Variant; 4] {
        [
            Variant::Call,
            Variant::Standby(self.options.standby),
            Variant::Node,
            Variant::Reset,
        ]
    }

    /// The floor at our zygote's size, or why not.
    fn floor(&self, calls: usize, processes: usize) -> (Server, Result<floor::FloorRun, String>) {
        let kib = self.anon_kib.unwrap_or(0);
        let server = Server::Floor {
            anon_kib: kib,
            processes,
        };
        if self.anon_kib.is_none() {
            return (
                server,
                Err("our zygote's size is unknown: its row did not run".into()),
            );
        }
        (
            server,
            floor::run(&self.exe, kib as usize, calls, processes),
        )
    }

    /// (1): back to back and spaced 5 ms, through this process's client.
    fn sequential(&mut self) {
        let calls = self.options.counts.latency;
        let spaced = (calls / 2).max(1);
        let source = self.trivial();
        let mut later = Vec::new();
        // The reference pool: one reused worker.
        let measured = self
            .reference
            .reused(&self.log("pool"), "n", &source)
            .and_then(|mut worker| {
                worker.time_calls("n", &source, WARM_CALLS, Duration::ZERO)?;
                let before = procfs::Usage::of(worker.pid())?;
                let back_to_back = latency(worker.time_calls("n", &source, calls, Duration::ZERO));
                let profile = procfs::Usage::of(worker.pid())
                    .map(|after| before.per_call(&after, calls))
                    .unwrap_or_default();
                let spaced = latency(worker.time_calls("n", &source, spaced, SPACING));
                worker.close();
                Ok((back_to_back, profile, spaced))
            });
        match measured {
            Ok((back_to_back, profile, spaced)) => {
                self.push(Scenario::BackToBack, Server::Pool, back_to_back, profile);
                later.push((Server::Pool, spaced));
            }
            Err(why) => {
                self.push(Scenario::BackToBack, Server::Pool, Err(why.clone()), "");
                later.push((Server::Pool, Err(why)));
            }
        }
        let spawn = latency(self.reference.spawn_per_call(
            &self.log("spawn"),
            &source,
            self.options.counts.spawn,
        ));
        self.spawn = spawn.as_ref().ok().copied();
        self.push(
            Scenario::BackToBack,
            Server::Spawn,
            spawn,
            format!("{} fresh processes", self.options.counts.spawn),
        );
        for variant in self.our_variants() {
            let measured = self
                .ours
                .worker(variant, &self.log("ours"), "n", &source)
                .and_then(|mut worker| {
                    worker.time_calls("n", &source, WARM_CALLS, Duration::ZERO)?;
                    let anon = procfs::anon_kib(worker.pid())?;
                    let before = procfs::Usage::of(worker.pid())?;
                    let back_to_back =
                        latency(worker.time_calls("n", &source, calls, Duration::ZERO));
                    let profile = procfs::Usage::of(worker.pid())
                        .map(|after| before.per_call(&after, calls))
                        .unwrap_or_default();
                    let spaced = latency(worker.time_calls("n", &source, spaced, SPACING));
                    worker.close();
                    Ok((anon, back_to_back, profile, spaced))
                });
            let server = Server::Ours(variant);
            match measured {
                Ok((anon, back_to_back, profile, spaced)) => {
                    if variant == Variant::Call {
                        self.anon_kib = Some(anon);
                    }
                    let note = format!("the worker's anonymous RSS {} MiB; {profile}", anon / 1024);
                    self.push(Scenario::BackToBack, server, back_to_back, note);
                    later.push((server, spaced));
                }
                Err(why) => {
                    self.push(Scenario::BackToBack, server, Err(why.clone()), "");
                    later.push((server, Err(why)));
                }
            }
        }
        let (server, run) = self.floor(calls, 1);
        let note = run.as_ref().map(|r| r.profile.clone()).unwrap_or_default();
        self.push(
            Scenario::BackToBack,
            server,
            run.and_then(|r| latency(Ok(r.samples))),
            format!("at the RssAnon of ours, `--isolation call`; {note}"),
        );
        for (server, outcome) in later {
            self.push(Scenario::Spaced, server, outcome, format!("{spaced} calls"));
        }
    }

    /// (1) again through the engine's own PythonWorkerPool: the target for
    /// `--isolation node` is set against the pool through its own client.
    fn through_pool(&mut self) {
        let calls = self.options.counts.latency;
        let source = self.trivial();
        let python = self.options.python.clone();
        let servers = [
            (Server::Pool, python, Vec::new()),
            (
                Server::Ours(Variant::Call),
                self.ours.exe.clone(),
                self.ours.pool_env(Variant::Call),
            ),
            (
                Server::Ours(Variant::Node),
                self.ours.exe.clone(),
                self.ours.pool_env(Variant::Node),
            ),
        ];
        for (scenario, count, spacing) in [
            (Scenario::PoolBackToBack, calls, Duration::ZERO),
            (Scenario::PoolSpaced, (calls / 2).max(1), SPACING),
        ] {
            for (server, interpreter, env) in &servers {
                let outcome =
                    latency(
                        self.reference
                            .through_pool(interpreter, env, &source, count, spacing),
                    );
                let note = match server {
                    Server::Pool => "PythonWorkerPool(python)".to_string(),
                    _ => "PythonWorkerPool(fluksio-zygote), flags from the environment".to_string(),
                };
                self.push(scenario, *server, outcome, note);
            }
        }
    }

    /// (2) and (5): `calls` trivial calls, 2 in flight.
    fn throughput(&mut self, scenario: Scenario, calls: usize) {
        let source = self.trivial();
        let pool = self.pool_rate(Server::Pool, &source, calls);
        self.push(
            scenario,
            Server::Pool,
            pool,
            "2 reused workers, one client thread each",
        );
        if scenario == Scenario::Throughput {
            let fresh = (self.options.counts.spawn).max(IN_FLIGHT);
            let rate = self
                .reference
                .spawn_rate(&self.log("spawn2"), &source, fresh, IN_FLIGHT)
                .map(Metric::Rate);
            self.push(
                scenario,
                Server::Spawn,
                rate,
                format!("{fresh} fresh processes, 2 at a time"),
            );
        } else {
            self.push(
                scenario,
                Server::Spawn,
                Err(format!(
                    "{calls} fresh interpreters; (2) has spawn per call's rate with 2 in flight"
                )),
                "",
            );
        }
        let node = self.scratch.file("trivial.py", &source);
        let lanes = super::lanes_for(IN_FLIGHT);
        for variant in [Variant::Call, Variant::Standby(self.options.standby)] {
            let rate = node.clone().and_then(|node| {
                self.ours
                    .sweep_rate(variant, &node, (calls, IN_FLIGHT), &[])
            });
            // The same sweep with the other number of lanes (a zygote
            // each forking its calls): one, or one per call in flight.
            let other = if lanes == 1 { IN_FLIGHT } else { 1 };
            let other_rate = node.clone().and_then(|node| {
                self.ours.sweep_rate(
                    variant,
                    &node,
                    (calls, IN_FLIGHT),
                    &["--lanes", &other.to_string()],
                )
            });
            let shape = |n: usize| {
                if n == 1 {
                    "1 lane (the zygote that loaded the node forks every call)".to_string()
                } else {
                    format!("{n} lanes (a zygote each forking its calls)")
                }
            };
            let note = match other_rate {
                Ok(rate) => format!(
                    "`sweep -j 2`: {}; with `--lanes {other}`: {rate:.0} calls/s",
                    shape(lanes)
                ),
                Err(_) => format!("`sweep -j 2`: {}", shape(lanes)),
            };
            self.push(
                scenario,
                Server::Ours(variant),
                rate.map(Metric::Rate),
                note,
            );
        }
        let rate = node.clone().and_then(|node| {
            self.ours
                .sweep_rate(Variant::Node, &node, (calls, IN_FLIGHT), &[])
        });
        self.push(
            scenario,
            Server::Ours(Variant::Node),
            rate.map(Metric::Rate),
            "`sweep -j 2 --isolation node`: a resident child per call in flight, serving its calls in turn",
        );
        let rate = node.and_then(|node| {
            self.ours
                .sweep_rate(Variant::Reset, &node, (calls, IN_FLIGHT), &[])
        });
        self.push(
            scenario,
            Server::Ours(Variant::Reset),
            rate.map(Metric::Rate),
            "`sweep -j 2 --isolation reset`: a resident child per call in flight, put back after each call",
        );
        let (server, run) = self.floor(calls, IN_FLIGHT);
        let note = run.as_ref().map(|r| r.profile.clone()).unwrap_or_default();
        self.push(scenario, server, run.map(|r| Metric::Rate(r.rate)), note);
    }

    /// 2 workers of `server`'s kind, one client thread each, `calls` in all.
    fn pool_rate(&self, server: Server, source: &str, calls: usize) -> Result<Metric, String> {
        let mut workers = Vec::new();
        for k in 0..IN_FLIGHT {
            let log = self.log(&format!("rate{k}"));
            let worker = match server {
                Server::Ours(variant) => self.ours.worker(variant, &log, "n", source)?,
                _ => self.reference.reused(&log, "n", source)?,
            };
            workers.push(worker);
        }
        for worker in &mut workers {
            worker.time_calls("n", source, WARM_CALLS, Duration::ZERO)?;
        }
        let per = calls.div_ceil(IN_FLIGHT);
        let started = Instant::now();
        std::thread::scope(|scope| {
            let handles: Vec<_> = workers
                .iter_mut()
                .map(|worker| {
                    scope.spawn(move || worker.time_calls("n", source, per, Duration::ZERO))
                })
                .collect();
            for handle in handles {
                handle.join().expect("a client thread")?;
            }
            Ok::<(), String>(())
        })?;
        let rate = (per * IN_FLIGHT) as f64 / started.elapsed().as_secs_f64();
        for worker in workers {
            worker.close();
        }
        Ok(Metric::Rate(rate))
    }

    fn killable(&self) -> String {
        format!(
            "{}import os, time, fluksio\ndef process(x, hang=False):\n    if hang:\n        fluksio.emit(pid=os.getpid())\n        time.sleep(600)\n    return x + 1\n",
            self.imports
        )
    }

    /// (3): a call running, SIGKILLed; time from the kill to the next
    /// call's reply.
    fn after_kill(&mut self) {
        self.after_kill_of(Scenario::AfterKill, self.spawn);
    }

    /// `spawn`: the spawn-per-call figure of the same preloads, which is
    /// also its figure after a kill.
    fn after_kill_of(&mut self, scenario: Scenario, spawn: Option<Metric>) {
        let kills = self.options.counts.kills;
        let source = self.killable();
        let json = driver::json_string(&source);
        // The pool: the worker is the call's process; its kill() is a
        // SIGKILL, and the next call on the slot spawns a new one, which
        // `_warm` compiles before the run.
        let pool = self.restarts(kills, &source, |log| {
            self.reference.reused(log, "k", &source)
        });
        self.push(
            scenario,
            Server::Pool,
            pool,
            "SIGKILL of worker_main.py; spawn, compile, run: the next reply",
        );
        match spawn {
            Some(spawn) => self.push(
                scenario,
                Server::Spawn,
                Ok(spawn),
                "every call is a fresh process: the spawn-per-call row's figure",
            ),
            None => self.push(
                scenario,
                Server::Spawn,
                Err("its spawn-per-call row did not run".into()),
                "",
            ),
        }
        for variant in self.our_variants() {
            let outcome = self
                .ours
                .worker(variant, &self.log("kill"), "k", &source)
                .and_then(|mut worker| {
                    worker.time_calls("k", &source, WARM_CALLS, Duration::ZERO)?;
                    let mut samples = Vec::new();
                    for i in 0..kills {
                        let pid = hang(&mut worker, &json)?;
                        std::thread::sleep(RUN_BEFORE_KILL);
                        let started = Instant::now();
                        // SAFETY: kill(2) of the call's child, as the agent's
                        // cancel does (through a pidfd there).
                        unsafe {
                            libc::kill(pid, libc::SIGKILL);
                        }
                        let reply = worker.reply()?;
                        if driver::is_ok(&reply) {
                            return Err(format!("the killed call replied ok: {reply}"));
                        }
                        let id = worker.next_id();
                        worker.call(&driver::run_request(
                            id,
                            "k",
                            &json,
                            &format!(r#"{{"x":{i}}}"#),
                        ))?;
                        samples.push(started.elapsed());
                    }
                    worker.close();
                    latency(Ok(samples))
                });
            self.push(
                scenario,
                Server::Ours(variant),
                outcome,
                "SIGKILL of the call's child, as the agent's cancel does; the next call's reply",
            );
        }
        let restarted = self.restarts(kills, &source, |log| {
            self.ours.worker(Variant::Call, log, "k", &source)
        });
        self.push(
            scenario,
            Server::OursRestarted,
            restarted,
            "what the pool does with ours today: SIGKILL of the `worker` it spawned; spawn, compile, run",
        );
        let slot = self.restarts(kills, &source, |log| self.ours.slot(log, "k", &source));
        self.push(
            scenario,
            Server::SharedZygote,
            slot,
            "SIGKILL of the `worker --shared-zygote` slot the pool spawned; a new slot, compile, run",
        );
        let (server, run) = self.floor(200, 1);
        self.push(
            scenario,
            server,
            run.and_then(|r| latency(Ok(r.samples))),
            "one fork cycle at our zygote's size",
        );
    }

    /// `kills` times: a hanging call on a fresh worker from `start`, the
    /// worker SIGKILLed, a new one started and its first call's reply.
    fn restarts(
        &self,
        kills: usize,
        source: &str,
        start: impl Fn(&Path) -> Result<LineWorker, String>,
    ) -> Result<Metric, String> {
        let json = driver::json_string(source);
        let log = self.log("restart");
        let mut worker = start(&log)?;
        worker.time_calls("k", source, WARM_CALLS, Duration::ZERO)?;
        let mut samples = Vec::new();
        for i in 0..kills {
            hang(&mut worker, &json)?;
            std::thread::sleep(RUN_BEFORE_KILL);
            let started = Instant::now();
            worker.kill();
            worker = start(&log)?;
            let id = worker.next_id();
            worker.call(&driver::run_request(
                id,
                "k",
                &json,
                &format!(r#"{{"x":{i}}}"#),
            ))?;
            samples.push(started.elapsed());
        }
        worker.close();
        latency(Ok(samples))
    }

    /// (4): 8 calls at once, each holding an array of its own; then 8 calls
    /// of a node whose module level holds the array (a model's weights,
    /// read once). Total PSS of what serves them, measured once all 8 are
    /// in their call.
    fn pss(&mut self) {
        let mb = self.options.counts.array_mb;
        let wait = "    open(os.path.join(dir, 'ready-%d' % x), 'w').close()\n    go = os.path.join(dir, 'go')\n    for _ in range(120000):\n        if os.path.exists(go):\n            break\n        time.sleep(0.005)\n    return float(a[-1])\n";
        let own = format!(
            "{}import os, time, numpy\ndef process(x, dir, mb):\n    a = numpy.ones(mb * 1048576 // 8)\n{wait}",
            self.imports
        );
        self.pss_of(Scenario::Pss, &own);
        let weights = format!(
            "{}import os, time, numpy\nWEIGHTS = numpy.ones({mb} * 1048576 // 8)\ndef process(x, dir, mb):\n    a = WEIGHTS\n{wait}",
            self.imports
        );
        self.pss_of(Scenario::PssWeights, &weights);
    }

    fn pss_of(&mut self, scenario: Scenario, source: &str) {
        let mb = self.options.counts.array_mb;
        let source = source.to_string();
        let holding = if scenario == Scenario::PssWeights {
            format!("the node holding {mb} MB at module level")
        } else {
            format!("each call holding {mb} MB of its own")
        };
        let note = |what: &str, processes: Option<usize>| match processes {
            Some(n) => format!("{what}; {n} processes, {holding}"),
            None => what.to_string(),
        };
        let pool = self.pss_of_workers(Server::Pool, &source, mb);
        let processes = pool.as_ref().ok().and_then(pss_processes);
        self.push(
            scenario,
            Server::Pool,
            pool,
            note("8 reused workers, a call each", processes),
        );
        self.push(
            scenario,
            Server::Spawn,
            Err("eight fresh worker_main.py hold what the pool's eight do (the row above)".into()),
            "",
        );
        for variant in [Variant::Call, Variant::Standby(self.options.standby)] {
            let outcome = self.pss_of_sweep(variant, &source, mb);
            let processes = outcome.as_ref().ok().and_then(pss_processes);
            self.push(
                scenario,
                Server::Ours(variant),
                outcome,
                note(
                    "`sweep -j 8`: the zygote, its lanes and the 8 calls' children",
                    processes,
                ),
            );
        }
        let node = self.pss_of_workers(Server::Ours(Variant::Node), &source, mb);
        let processes = node.as_ref().ok().and_then(pss_processes);
        self.push(
            scenario,
            Server::Ours(Variant::Node),
            node,
            note(
                "8 `worker --isolation node` processes, as a pool of 8 runs them: a zygote each",
                processes,
            ),
        );
        let shared = self.pss_of_workers(Server::SharedZygote, &source, mb);
        let processes = shared.as_ref().ok().and_then(pss_processes);
        self.push(
            scenario,
            Server::SharedZygote,
            shared,
            note(
                "8 `worker --shared-zygote` slots, as a pool of 8 runs them, and the zygote they share",
                processes,
            ),
        );
    }

    fn pss_of_workers(&self, server: Server, source: &str, mb: usize) -> Result<Metric, String> {
        let dir = self.scratch.subdir("pss")?;
        let mut workers = Vec::new();
        for k in 0..HOLDERS {
            let log = self.log(&format!("pss{k}"));
            workers.push(match server {
                Server::Ours(variant) => self.ours.worker(variant, &log, "h", source)?,
                Server::SharedZygote => self.ours.slot(&log, "h", source)?,
                _ => self.reference.reused(&log, "h", source)?,
            });
        }
        let json = driver::json_string(source);
        for (x, worker) in workers.iter_mut().enumerate() {
            let kwargs = serde_json::json!({"x": x, "dir": dir, "mb": mb}).to_string();
            let id = worker.next_id();
            worker.send(&driver::run_request(id, "h", &json, &kwargs))?;
        }
        wait_ready(&dir)?;
        let mut roots: Vec<u32> = workers.iter().map(LineWorker::pid).collect();
        if server == Server::SharedZygote {
            // The shared zygote serving these calls: the one whose tree
            // holds them (an earlier one may linger a moment after its
            // last slot).
            let zygotes: Vec<u32> = self
                .ours
                .shared_zygotes()
                .into_iter()
                .filter(|&pid| procfs::tree(&[pid]).len() > HOLDERS)
                .collect();
            if zygotes.len() != 1 {
                return Err(format!(
                    "{} shared zygotes hold the calls, not one",
                    zygotes.len()
                ));
            }
            roots.extend(zygotes);
        }
        // A worker forks its standby children once its call has begun: a
        // tree sampled before they exist counts fewer processes (about 16
        // MiB each here) than it holds a moment later.
        settle(&roots);
        let (kib, processes) = procfs::tree_pss_kib(&roots);
        std::fs::write(dir.join("go"), "").map_err(|e| format!("cannot write go: {e}"))?;
        for worker in &mut workers {
            let reply = worker.reply()?;
            if !driver::is_ok(&reply) {
                return Err(format!("a holder failed: {}", reply.trim()));
            }
        }
        for worker in workers {
            worker.close();
        }
        Ok(Metric::Pss { kib, processes })
    }

    fn pss_of_sweep(&self, variant: Variant, source: &str, mb: usize) -> Result<Metric, String> {
        let dir = self.scratch.subdir("pss")?;
        let node = self.scratch.file("holder.py", source)?;
        let kwargs = serde_json::json!({"dir": dir, "mb": mb}).to_string();
        let mut child =
            self.ours
                .start_sweep(variant, &node, (HOLDERS, HOLDERS), Some(&kwargs), &[])?;
        if let Err(why) = wait_ready(&dir) {
            let _ = child.kill();
            return Err(format!(
                "{why}: {}",
                ours::finish_sweep(child).err().unwrap_or_default()
            ));
        }
        let (kib, processes) = procfs::tree_pss_kib(&[child.id()]);
        std::fs::write(dir.join("go"), "").map_err(|e| format!("cannot write go: {e}"))?;
        ours::finish_sweep(child)?;
        Ok(Metric::Pss { kib, processes })
    }

    /// (6): the small node's calls before and after a node holding
    /// `big_mb` MB of module-level Python objects is compiled into the same
    /// worker. One worker at a time: never more than ~3× `big_mb` at once.
    fn big_node(&mut self) {
        let calls = self.options.counts.latency;
        let small = self.trivial();
        let ints = self.options.counts.big_mb * 1_000_000 / BYTES_PER_INT;
        let big = format!("BIG = list(range({ints}))\ndef process():\n    return len(BIG)\n");
        let mut after_rows = Vec::new();
        let mut sizes = None;
        let servers = [Server::Pool]
            .into_iter()
            .chain(self.our_variants().map(Server::Ours));
        for server in servers {
            let measured = match server {
                Server::Ours(variant) => self.ours.worker(variant, &self.log("big"), "n", &small),
                _ => self.reference.reused(&self.log("big"), "n", &small),
            }
            .and_then(|mut worker| {
                worker.time_calls("n", &small, WARM_CALLS, Duration::ZERO)?;
                let anon_before = procfs::anon_kib(worker.pid())?;
                let before = latency(worker.time_calls("n", &small, calls, Duration::ZERO));
                worker.compile("big", &big)?;
                worker.time_calls("n", &small, WARM_CALLS, Duration::ZERO)?;
                let anon_after = procfs::anon_kib(worker.pid())?;
                let after = latency(worker.time_calls("n", &small, calls, Duration::ZERO));
                worker.close();
                Ok((before, after, anon_before, anon_after))
            });
            match measured {
                Ok((before, after, anon_before, anon_after)) => {
                    if server == Server::Ours(Variant::Call) {
                        sizes = Some((anon_before, anon_after));
                    }
                    let note = format!(
                        "the worker's anonymous RSS {} → {} MiB",
                        anon_before / 1024,
                        anon_after / 1024
                    );
                    let ratio = match (&before, &after) {
                        (Ok(b), Ok(a)) => format!("; {:.2}× its p50 before", a.value() / b.value()),
                        _ => String::new(),
                    };
                    self.push(Scenario::SmallBefore, server, before, note.clone());
                    after_rows.push((server, after, format!("{note}{ratio}")));
                }
                Err(why) => {
                    self.push(Scenario::SmallBefore, server, Err(why.clone()), "");
                    after_rows.push((server, Err(why), String::new()));
                }
            }
        }
        let floors = match sizes {
            Some((before, after)) => [
                (before, Scenario::SmallBefore),
                (after, Scenario::SmallAfter),
            ]
            .map(|(kib, scenario)| {
                let run = floor::run(&self.exe, kib as usize, calls, 1)
                    .and_then(|r| latency(Ok(r.samples)));
                (scenario, kib, run)
            })
            .to_vec(),
            None => vec![
                (
                    Scenario::SmallBefore,
                    0,
                    Err("our row did not run".to_string()),
                ),
                (
                    Scenario::SmallAfter,
                    0,
                    Err("our row did not run".to_string()),
                ),
            ],
        };
        let mut floors = floors.into_iter();
        if let Some((scenario, kib, run)) = floors.next() {
            let server = Server::Floor {
                anon_kib: kib,
                processes: 1,
            };
            self.push(
                scenario,
                server,
                run,
                "at the RssAnon of ours, `--isolation call`",
            );
        }
        for (server, outcome, note) in after_rows {
            self.push(Scenario::SmallAfter, server, outcome, note);
        }
        if let Some((scenario, kib, run)) = floors.next() {
            let server = Server::Floor {
                anon_kib: kib,
                processes: 1,
            };
            self.push(
                scenario,
                server,
                run,
                "at the RssAnon of ours, `--isolation call`, after",
            );
        }
    }

    /// (7): torch preloaded, where the interpreter has it.
    fn torch(&mut self) {
        let python = self.options.python.clone();
        let importable = Command::new(&python)
            .args(["-c", "import torch"])
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !importable {
            let why = format!("torch is not importable in {}", python.display());
            for scenario in [Scenario::Torch, Scenario::TorchAfterKill] {
                for server in [
                    Server::Spawn,
                    Server::Ours(Variant::Call),
                    Server::Floor {
                        anon_kib: 0,
                        processes: 1,
                    },
                ] {
                    self.push(scenario, server, Err(why.clone()), "");
                }
            }
            return;
        }
        let calls = self.options.counts.latency;
        let source = "import torch\ndef process(x):\n    return x + 1\n";
        let spawn = latency(self.reference.spawn_per_call(
            &self.log("torch"),
            source,
            self.options.counts.spawn,
        ));
        let torch_spawn = spawn.as_ref().ok().copied();
        self.push(
            Scenario::Torch,
            Server::Spawn,
            spawn,
            "cold python + import torch + the call",
        );
        let torch = Ours {
            preload: vec!["torch".into()],
            ..self.ours.clone()
        };
        let measured = torch
            .worker(Variant::Call, &self.log("torch"), "n", source)
            .and_then(|mut worker| {
                worker.time_calls("n", source, WARM_CALLS, Duration::ZERO)?;
                let anon = procfs::anon_kib(worker.pid())?;
                let samples = worker.time_calls("n", source, calls, Duration::ZERO);
                worker.close();
                Ok((anon, latency(samples)))
            });
        let torch_anon = measured.as_ref().ok().map(|(anon, _)| *anon);
        match measured {
            Ok((anon, outcome)) => {
                self.push(
                    Scenario::Torch,
                    Server::Ours(Variant::Call),
                    outcome,
                    "`--preload torch`",
                );
                let server = Server::Floor {
                    anon_kib: anon,
                    processes: 1,
                };
                let run = floor::run(&self.exe, anon as usize, calls, 1)
                    .and_then(|r| latency(Ok(r.samples)));
                self.push(
                    Scenario::Torch,
                    server,
                    run,
                    "at the torch zygote's RssAnon",
                );
            }
            Err(why) => self.push(Scenario::Torch, Server::Ours(Variant::Call), Err(why), ""),
        }
        // The kill rows, with torch as the preload set.
        let saved = (self.ours.clone(), self.imports.clone(), self.anon_kib);
        self.ours = torch;
        self.imports = "import torch\n".into();
        self.anon_kib = torch_anon;
        self.after_kill_of(Scenario::TorchAfterKill, torch_spawn);
        (self.ours, self.imports, self.anon_kib) = saved;
    }
}

fn pss_processes(metric: &Metric) -> Option<usize> {
    match metric {
        Metric::Pss { processes, .. } => Some(*processes),
        _ => None,
    }
}

/// A hanging call sent; the pid its first event names.
fn hang(worker: &mut LineWorker, source_json: &str) -> Result<i32, String> {
    let id = worker.next_id();
    worker.send(&driver::run_request(
        id,
        "k",
        source_json,
        r#"{"x":0,"hang":true}"#,
    ))?;
    let line = worker.line()?;
    let event: serde_json::Value =
        serde_json::from_str(&line).map_err(|e| format!("not an event ({e}): {line}"))?;
    event["outputs"]["pid"]
        .as_i64()
        .map(|pid| pid as i32)
        .ok_or_else(|| format!("no pid in {line}"))
}

/// Until `dir` holds `HOLDERS` ready files.
/// Waits until the process trees under `roots` have kept one size for
/// half a second (at most ten seconds).
fn settle(roots: &[u32]) {
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut size = procfs::tree(roots).len();
    let mut since = Instant::now();
    while Instant::now() < deadline && since.elapsed() < Duration::from_millis(500) {
        std::thread::sleep(Duration::from_millis(50));
        let now = procfs::tree(roots).len();
        if now != size {
            size = now;
            since = Instant::now();
        }
    }
}

fn wait_ready(dir: &Path) -> Result<(), String> {
    let deadline = Instant::now() + Duration::from_secs(300);
    loop {
        let ready = std::fs::read_dir(dir)
            .map(|d| {
                d.flatten()
                    .filter(|e| e.file_name().to_string_lossy().starts_with("ready-"))
                    .count()
            })
            .unwrap_or(0);
        if ready >= HOLDERS {
            return Ok(());
        }
        if Instant::now() > deadline {
            return Err(format!("only {ready} of {HOLDERS} calls started"));
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
