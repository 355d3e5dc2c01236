//! What a call starts with beyond the zygote's preloads: its share of the
//! CPUs for its BLAS and OpenMP pools, the modules earlier calls of its node
//! imported, and what a warm-up built.
//!
//! Every test sets the thread variables it depends on itself (this machine
//! may set `OPENBLAS_*`), and the cases that depend on them run both ways.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{THREAD_VARIABLES, Worker, ZYGOTE, scratch};
use serde_json::{Value, json};

/// A command of ours with no thread variable inherited, plus `env`.
fn ours(env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(ZYGOTE);
    for name in THREAD_VARIABLES {
        command.env_remove(name);
    }
    command
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null());
    command
}

/// `fluksio-zygote worker` under [`ours`]' environment.
fn start_worker(env: &[(&str, &str)]) -> Worker {
    let mut command = ours(env);
    command.arg("worker");
    Worker::spawn(command)
}

fn cpus() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// max(1, CPUs ÷ calls), as a call's share.
fn share(calls: usize) -> usize {
    (cpus() / calls).max(1)
}

fn has_module(module: &str) -> bool {
    Command::new(common::python())
        .args(["-c", &format!("import {module}")])
        .status()
        .is_ok_and(|s| s.success())
}

/// numpy's OpenBLAS always; scikit-learn's OpenMP runtime where installed.
fn preload() -> &'static str {
    if has_module("sklearn") {
        "numpy,sklearn,threadpoolctl"
    } else {
        eprintln!("scikit-learn is not installed: the OpenMP pool goes unchecked");
        "numpy,threadpoolctl"
    }
}

/// A node that reports its thread variables and the pools threadpoolctl
/// sees; with `wait`, only once `gate` exists (a call kept in flight).
fn budget_node(gate: &Path) -> String {
    format!(
        "import os, time\n\
         from threadpoolctl import threadpool_info\n\
         VARIABLES = ['OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'MKL_NUM_THREADS']\n\
         import fluksio\n\
         def process(x=0, wait=False):\n\
         \x20   pools = {{p['internal_api']: p['num_threads'] for p in threadpool_info()}}\n\
         \x20   view = {{'env': {{v: os.environ.get(v) for v in VARIABLES}}, 'pools': sorted(pools.items())}}\n\
         \x20   if wait:\n\
         \x20       fluksio.emit(started=True)\n\
         \x20   for _ in range(6000 if wait else 0):\n\
         \x20       if os.path.exists({gate:?}):\n\
         \x20           break\n\
         \x20       time.sleep(0.01)\n\
         \x20   return view\n"
    )
}

/// Checks a call's view: every variable and every pool at `threads`, but
/// OpenBLAS's variable and pool where the user set `openblas`.
fn assert_budget(view: &Value, threads: usize, openblas: Option<usize>) {
    let text = threads.to_string();
    assert_eq!(view["env"]["OMP_NUM_THREADS"], text.as_str(), "{view}");
    assert_eq!(view["env"]["MKL_NUM_THREADS"], text.as_str(), "{view}");
    let blas = openblas.unwrap_or(threads);
    assert_eq!(
        view["env"]["OPENBLAS_NUM_THREADS"],
        blas.to_string().as_str(),
        "{view}"
    );
    let pools = view["pools"].as_array().expect("pools");
    assert!(!pools.is_empty(), "threadpoolctl sees pools: {view}");
    for pool in pools {
        let want = if pool[0] == "openblas" { blas } else { threads };
        assert_eq!(pool[1], want, "{} in {view}", pool[0]);
    }
}

fn write_node(dir: &Path, name: &str, source: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, source).unwrap();
    path
}

fn sweep(node: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    ours(env)
        .arg("sweep")
        .arg(node)
        .args(args)
        .output()
        .expect("sweep runs")
}

/// The results of a sweep, by index.
fn results(output: &Output) -> Vec<Value> {
    let text = String::from_utf8_lossy(&output.stdout);
    let mut lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{e}: {l}")))
        .collect();
    lines.sort_by_key(|l| l["index"].as_u64());
    assert!(
        lines.iter().all(|l| l["ok"] == true),
        "every call succeeded: {text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    lines.into_iter().map(|l| l["result"].clone()).collect()
}

#[test]
fn a_sweeps_calls_share_the_cpus_among_those_in_flight() {
    let dir = scratch("budget-sweep");
    let node = write_node(&dir, "budget.py", &budget_node(&dir.join("gate")));
    for jobs in [1, 2] {
        for user_openblas in [None, Some(1)] {
            let mut env = vec![];
            if let Some(threads) = user_openblas {
                env.push(("OPENBLAS_NUM_THREADS", if threads == 1 { "1" } else { "2" }));
            }
            let output = sweep(
                &node,
                &[
                    "--grid",
                    "x=1..4",
                    "-j",
                    &jobs.to_string(),
                    "--preload",
                    preload(),
                ],
                &env,
            );
            for view in results(&output) {
                assert_budget(&view, share(jobs), user_openblas);
            }
        }
    }
}

#[test]
fn threads_per_call_overrides_the_share_and_the_users_variables() {
    let dir = scratch("budget-given");
    let node = write_node(&dir, "budget.py", &budget_node(&dir.join("gate")));
    for user in [None, Some("1")] {
        let env: Vec<(&str, &str)> = user
            .map(|n| vec![("OPENBLAS_NUM_THREADS", n), ("OMP_NUM_THREADS", n)])
            .unwrap_or_default();
        let output = sweep(
            &node,
            &[
                "--grid",
                "x=1..2",
                "-j",
                "2",
                "--threads-per-call",
                "3",
                "--preload",
                preload(),
            ],
            &env,
        );
        for view in results(&output) {
            assert_budget(&view, 3, None);
        }
    }
}

#[test]
fn a_worker_gives_its_one_call_every_cpu_unless_told_otherwise() {
    let source = budget_node(Path::new("/nonexistent"));
    let request = common::run(1, "budget", &source, json!({}));
    let mut worker = start_worker(&[("FLUKSIO_PRELOAD", preload())]);
    assert_budget(&worker.call(&request).reply["result"], share(1), None);
    // The pool drop-in, whose size the worker cannot see, says it.
    let mut worker = start_worker(&[
        ("FLUKSIO_PRELOAD", preload()),
        ("FLUKSIO_THREADS_PER_CALL", "1"),
    ]);
    assert_budget(&worker.call(&request).reply["result"], 1, None);
    // A variable the user set is theirs.
    let mut worker = start_worker(&[
        ("FLUKSIO_PRELOAD", preload()),
        ("OPENBLAS_NUM_THREADS", "1"),
    ]);
    assert_budget(&worker.call(&request).reply["result"], share(1), Some(1));
}

#[test]
fn pool_slots_sharing_a_zygote_share_the_cpus_among_their_calls_in_flight() {
    let dir = scratch("budget-slots");
    let gate = dir.join("gate");
    let source = budget_node(&gate);
    let slot = || {
        start_worker(&[
            ("FLUKSIO_PRELOAD", preload()),
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", "budget-slots"),
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "1"),
        ])
    };
    let (mut first, mut second) = (slot(), slot());
    // The first call, started (its event says so), stays in flight until
    // the second has answered.
    first.send(&common::run(1, "budget", &source, json!({"wait": true})));
    assert_eq!(first.next_line()["outputs"]["started"], true);
    let view = second
        .call(&common::run(2, "budget", &source, json!({})))
        .reply["result"]
        .clone();
    std::fs::write(&gate, "").unwrap();
    let alone = first.answer().reply["result"].clone();
    assert_budget(&alone, share(1), None);
    assert_budget(&view, share(2), None);
}

#[test]
fn an_agents_calls_share_the_cpus_among_those_in_flight() {
    let dir = scratch("budget-agent");
    let gate = dir.join("gate");
    let source = budget_node(&gate);
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start_without(
        &engine.url,
        &["--parallel", "2", "--preload", preload()],
        &THREAD_VARIABLES,
    );
    let connection = engine.next_connection(WAIT);
    let run = |call_id: &str, kwargs: Value| {
        json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": "budget",
               "source": source, "kwargs": kwargs})
    };
    connection.send(&run("alone", json!({"wait": true})));
    // Started (its event says so) before the second is sent.
    connection.until(WAIT, |message| message["outputs"]["started"] == true);
    connection.send(&run("beside", json!({})));
    let (_, beside) = connection.reply("beside", WAIT);
    std::fs::write(&gate, "").unwrap();
    let (_, alone) = connection.reply("alone", WAIT);
    assert_budget(&alone["result"], share(1), None);
    assert_budget(&beside["result"], share(2), None);
}

/// A node that says whether `colorsys` (which nothing here imports) was
/// loaded when its call started, then imports it.
const IMPORTER: &str = "import sys\ndef process(x=0):\n    had = 'colorsys' in sys.modules\n    import colorsys\n    return had\n";

#[test]
fn a_module_earlier_calls_imported_is_loaded_when_a_later_calls_child_starts() {
    let dir = scratch("learned");
    let node = write_node(&dir, "importer.py", IMPORTER);
    let output = sweep(&node, &["--grid", "x=1..8", "-j", "1"], &[]);
    let had = results(&output);
    assert_eq!(had[0], false, "the first call imports it itself");
    assert_eq!(had[7], true, "a later call starts with it: {had:?}");
    let output = sweep(
        &node,
        &["--grid", "x=1..8", "-j", "1", "--learn-imports", "off"],
        &[],
    );
    assert!(
        results(&output).iter().all(|had| had == false),
        "off: every call imports it"
    );
    // The same under the worker contract.
    assert_a_later_call_has_it(start_worker(&[]), std::time::Duration::ZERO);
}

/// Under `--isolation reset` a call's import is put back with the rest of
/// its memory, so a resident would import it again on every call: what the
/// zygote learned reaches the calls through residents forked after it.
#[test]
fn a_module_earlier_calls_imported_is_loaded_when_a_later_reset_call_starts() {
    let dir = scratch("learned-reset");
    let node = write_node(&dir, "importer.py", IMPORTER);
    for jobs in ["1", "2"] {
        let output = sweep(
            &node,
            &["--grid", "x=1..12", "-j", jobs, "--isolation", "reset"],
            &[],
        );
        let had = results(&output);
        assert_eq!(had[0], false, "-j {jobs}: the first call imports it itself");
        assert_eq!(
            had[11], true,
            "-j {jobs}: a later call starts with it: {had:?}"
        );
    }
    let output = sweep(
        &node,
        &[
            "--grid",
            "x=1..8",
            "-j",
            "1",
            "--isolation",
            "reset",
            "--learn-imports",
            "off",
        ],
        &[],
    );
    assert!(
        results(&output).iter().all(|had| had == false),
        "off: every call imports it, and none sees an earlier call's import"
    );
    // Calls apart, each resident put back before the next call comes: no
    // second resident is forked, and nothing else has the zygote learn.
    let apart = std::time::Duration::from_millis(300);
    let mut command = ours(&[]);
    command.args(["worker", "--isolation", "reset"]);
    assert_a_later_call_has_it(Worker::spawn(command), apart);
    // And through a pool slot, whose zygote is shared and serves its calls
    // over a link.
    assert_a_later_call_has_it(
        start_worker(&[
            ("FLUKSIO_ISOLATION", "reset"),
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", "learned-reset-slot"),
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "1"),
        ]),
        apart,
    );
}

/// Eight [`IMPORTER`] calls through `worker`, `pause` before each: the
/// first imports it itself, the last finds it imported.
fn assert_a_later_call_has_it(mut worker: Worker, pause: std::time::Duration) {
    let had: Vec<Value> = (0..8)
        .map(|i| {
            std::thread::sleep(pause);
            worker
                .call(&common::run(i, "importer", IMPORTER, json!({})))
                .reply["result"]
                .clone()
        })
        .collect();
    assert_eq!(had[0], false, "{had:?}");
    assert_eq!(had[7], true, "{had:?}");
}

#[test]
fn a_module_a_call_wrote_is_never_learned_into_the_zygote() {
    let dir = scratch("learned-written");
    let source = "import importlib, os, sys\ndef process(x=0):\n    had = 'planted' in sys.modules\n    here = sys.path[0]\n    with open(os.path.join(here, 'planted.py'), 'w') as f:\n        f.write('X = 1\\n')\n    importlib.invalidate_caches()\n    import planted\n    return had\n";
    let node = write_node(&dir, "planter.py", source);
    let output = sweep(&node, &["--grid", "x=1..8", "-j", "1"], &[]);
    assert!(
        results(&output).iter().all(|had| had == false),
        "a module beside the node, written by a call, stays out of the zygote"
    );
}

/// A node whose calls see a module-level cache: what the warm-up put in it
/// is there in every call; what a call puts in it is not in the next.
const CACHED: &str = "CACHE = {}\ndef process(x):\n    seen = sorted(CACHE)\n    CACHE[x] = x * x\n    return seen\n";

#[test]
fn a_cache_a_warm_up_filled_is_seen_by_every_call() {
    let dir = scratch("warmup");
    let node = write_node(&dir, "cached.py", CACHED);
    let output = sweep(
        &node,
        &["--grid", "x=1..6", "-j", "2", "--warmup", r#"{"x": -1}"#],
        &[],
    );
    for seen in results(&output) {
        assert_eq!(seen, json!([-1]), "the warm-up's entry, no other call's");
    }
    let output = sweep(
        &node,
        &["--grid", "x=5..9", "-j", "2", "--warmup", "first"],
        &[],
    );
    for seen in results(&output) {
        assert_eq!(seen, json!([5]), "the first point's entry");
    }
    let output = sweep(&node, &["--grid", "x=1..3", "-j", "2"], &[]);
    for seen in results(&output) {
        assert_eq!(seen, json!([]), "no warm-up, a cold cache");
    }
}

#[test]
fn a_node_asks_for_its_own_warm_up_in_the_worker_and_the_agent() {
    let source = format!("__fluksio_warmup__ = {{'x': 0}}\n{CACHED}");
    let mut worker = start_worker(&[]);
    for id in 1..4 {
        let reply = worker.call(&common::run(id, "cached", &source, json!({"x": id})));
        assert_eq!(reply.reply["result"], json!([0]), "{:?}", reply);
    }
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start_without(&engine.url, &[], &THREAD_VARIABLES);
    let connection = engine.next_connection(WAIT);
    for id in 1..4 {
        let call_id = format!("c{id}");
        connection.send(
            &json!({"op": "run", "id": id, "call_id": call_id, "flow": "f",
                                "node": "cached", "source": source, "kwargs": {"x": id}}),
        );
        let (_, reply) = connection.reply(&call_id, WAIT);
        assert_eq!(reply["result"], json!([0]), "{reply}");
    }
}

/// A node whose calls wake numpy's OpenBLAS pool (a product large enough
/// to be split) and, where scikit-learn is installed, an OpenMP pool
/// (k-means): its pid, the threads it ran on, and its answer.
const POOLED: &str = "import os\nimport numpy as np\ndef process(x):\n    a = np.random.default_rng(x).normal(size=(300, 300))\n    total = float((a @ a.T).trace())\n    try:\n        from sklearn.cluster import KMeans\n        KMeans(n_clusters=2, n_init=1, random_state=x).fit(a[:, :4])\n    except ImportError:\n        pass\n    return [os.getpid(), len(os.listdir('/proc/self/task')), total > 0]\n";

#[test]
fn a_reset_resident_ends_the_pools_its_calls_woke_and_serves_on() {
    // Two threads a call: every call wakes its pools, whose threads would
    // otherwise retire the resident after every call.
    let env = [
        ("FLUKSIO_PRELOAD", preload()),
        ("FLUKSIO_THREADS_PER_CALL", "2"),
        ("RUST_LOG", "info"),
    ];
    let mut command = ours(&env);
    command.args(["worker", "--isolation", "reset"]);
    let mut worker = Worker::spawn(command);
    let answers: Vec<Value> = (0..8)
        .map(|x| {
            let reply = worker.call(&common::run(x, "pooled", POOLED, json!({"x": x})));
            assert_eq!(reply.reply["ok"], true, "{:?}", reply);
            reply.reply["result"].clone()
        })
        .collect();
    let (_, log) = worker.finish();
    assert!(answers.iter().all(|r| r[2] == true), "{answers:?}");
    if cpus() >= 2 {
        assert!(
            answers.iter().all(|r| r[1].as_u64() > Some(1)),
            "each call ran its pools' threads: {answers:?}"
        );
    }
    assert!(!log.contains("could not be put back"), "{log}");
    // The calls after the first two (whose imports the zygote learns, and
    // whose residents it replaces) were served by residents, in turn.
    let mut pids: Vec<i64> = answers[2..].iter().filter_map(|r| r[0].as_i64()).collect();
    let calls = pids.len();
    pids.sort_unstable();
    pids.dedup();
    assert!(pids.len() <= 2 && pids.len() < calls, "{answers:?}");
    if cpus() <= 2 {
        // Their two threads take every CPU: no second resident is put
        // back beside a call, and the last calls all had the same one.
        let last: Vec<&Value> = answers[5..].iter().map(|r| &r[0]).collect();
        assert!(last.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
    }

    // A sweep at -j 1 alike.
    let dir = scratch("pools-reset");
    let node = write_node(&dir, "pooled.py", POOLED);
    let output = sweep(
        &node,
        &["--grid", "x=1..8", "-j", "1", "--isolation", "reset"],
        &env,
    );
    let swept = results(&output);
    assert!(swept.iter().all(|r| r[2] == true), "{swept:?}");
    let text = String::from_utf8_lossy(&output.stderr);
    assert!(!text.contains("could not be put back"), "{text}");
}

/// A node whose warm-up leaves a thread running (as an OpenMP pool would).
const THREADED: &str = "import threading, time\nSTATE = []\n__fluksio_warmup__ = {'x': 0}\ndef process(x):\n    seen = list(STATE)\n    STATE.append(x)\n    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n    return seen\n";

#[test]
fn a_warm_up_that_leaves_a_thread_is_refused_and_the_zygote_serves_on() {
    let mut worker = start_worker(&[]);
    let compiled = worker.call(&common::compile(1, "threaded", THREADED));
    assert_eq!(compiled.reply["ok"], true, "the node itself loads");
    for id in 2..5 {
        let reply = worker.call(&common::run(id, "threaded", THREADED, json!({"x": id})));
        assert_eq!(
            reply.reply["result"],
            json!([]),
            "served cold, nothing of the warm-up: {:?}",
            reply
        );
    }
    let (_, log) = worker.finish();
    assert!(log.contains("warm-up was refused"), "{log}");
    assert!(log.contains("thread"), "{log}");

    let dir = scratch("warmup-thread");
    let node = write_node(&dir, "threaded.py", THREADED);
    let output = sweep(&node, &["--grid", "x=1..2", "--warmup", "first"], &[]);
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("warm-up was refused"), "{text}");
    assert!(text.contains("does not stop at fork"), "{text}");
    assert!(output.stdout.is_empty(), "no call ran: {text}");
}

#[test]
fn a_warm_up_that_raises_is_refused_with_its_error() {
    let dir = scratch("warmup-raises");
    let node = write_node(&dir, "divide.py", "def process(x):\n    return 1 / x\n");
    let output = sweep(&node, &["--grid", "x=1..2", "--warmup", r#"{"x": 0}"#], &[]);
    let text = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(2), "{text}");
    assert!(text.contains("ZeroDivisionError"), "{text}");
    // A generator's warm-up is drained, and what it yields or emits is no
    // call's event.
    let node = write_node(
        &dir,
        "chatty.py",
        "import fluksio\ndef process(x):\n    fluksio.emit(at=x)\n    yield {'x': x}\n    return x\n",
    );
    let output = sweep(
        &node,
        &["--grid", "x=1..3", "--warmup", r#"{"x": -5}"#],
        &[],
    );
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        !text.contains("-5"),
        "the warm-up's events went nowhere: {text}"
    );
    assert_eq!(output.status.code(), Some(0), "{text}");
}

/// numexpr (which pandas imports where it is installed) starts its pool
/// when it is imported: the zygote ends it (numexpr joins its threads when
/// set to one) rather than load such a node in every call's child, and
/// each call's child sizes it to the call's share, as a fresh process
/// with the call's `NUMEXPR_NUM_THREADS` would be; a reset resident so too,
/// its pool ended again after each call.
#[test]
fn a_node_that_imports_numexpr_is_loaded_once_and_each_call_gets_its_share() {
    assert!(
        has_module("numexpr"),
        "numexpr is not installed: run .ci/run, which installs it, or pip install numexpr"
    );
    let dir = scratch("numexpr");
    let node = write_node(
        &dir,
        "numexpr_node.py",
        "import os, numexpr\n\
         LOADED_BY = os.getpid()\n\
         def process(x):\n\
         \x20   tasks = len(os.listdir('/proc/self/task'))\n\
         \x20   return [LOADED_BY, os.getpid(), numexpr.get_num_threads(), tasks]\n",
    );
    // Each isolation, each number in flight, and the user's own variable,
    // which is kept (as joblib keeps it) over the share.
    let users = [("NUMEXPR_NUM_THREADS", "1")];
    let cases: [(usize, &[(&str, &str)]); 3] = [(1, &[]), (2, &[]), (1, &users)];
    for isolation in ["call", "reset"] {
        for (jobs, env) in cases {
            let output = sweep(
                &node,
                &[
                    "--grid",
                    "x=0..5",
                    "-j",
                    &jobs.to_string(),
                    "--isolation",
                    isolation,
                ],
                env,
            );
            let results = results(&output);
            let threads = if env.is_empty() {
                share(jobs) as u64
            } else {
                1
            };
            let mut served_by = Vec::new();
            for result in &results {
                let (loaded_by, pid) = (result[0].as_u64(), result[1].as_u64());
                assert_ne!(
                    loaded_by, pid,
                    "{isolation} -j {jobs}: the node was loaded in the zygote, once: {results:?}"
                );
                assert_eq!(result[2], threads, "{isolation} -j {jobs}: {results:?}");
                let tasks = if threads > 1 { 1 + threads } else { 1 };
                assert_eq!(result[3], tasks, "{isolation} -j {jobs}: {results:?}");
                served_by.push(pid);
            }
            if isolation == "reset" {
                served_by.sort_unstable();
                served_by.dedup();
                assert!(
                    served_by.len() < results.len(),
                    "-j {jobs}: residents served more than one call: {results:?}"
                );
            }
        }
    }
}
