//! On a real SLURM (Debian's slurmctld, slurmd and munge, one node, started
//! by `.ci/slurm`): a sweep over an array of shards merged back into the
//! local sweep, an array task cancelled mid-run leaving nothing behind and
//! completed by `--resume`, and `examples/agent.sbatch` run as written.
//!
//! Each job's `sacct` lines are printed and appended to
//! `target/slurm-runs.log`, which CI prints. Where SLURM cannot start here,
//! each test says so loudly and does nothing else.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::{Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use common::agent::WAIT;
use common::engine::{Answer, Engine};
use common::{ZYGOTE, scratch};
use serde_json::{Value, json};

fn repository() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// SLURM up (started here once if it is not), and this test alone on it:
/// one node of few CPUs, and timings that other jobs would stretch.
/// `None`, said loudly, where it cannot start.
fn slurm() -> Option<MutexGuard<'static, ()>> {
    static STARTED: OnceLock<Result<(), String>> = OnceLock::new();
    static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());
    let started = STARTED.get_or_init(|| {
        let output = Command::new(repository().join(".ci/slurm"))
            .output()
            .map_err(|e| format!(".ci/slurm did not run: {e}"))?;
        if output.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&output.stderr).into_owned())
        }
    });
    match started {
        Ok(()) => Some(ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner())),
        Err(why) => {
            println!("SKIPPED: SLURM could not start here: {why}");
            eprintln!("SKIPPED: SLURM could not start here: {why}");
            None
        }
    }
}

/// A job submitted here, cancelled if the test ends before it does.
struct Job(String);

impl Drop for Job {
    fn drop(&mut self) {
        let _ = Command::new("scancel").arg(&self.0).status();
    }
}

/// `sbatch --parsable ARGS` in `dir`, the built binary first on PATH (sbatch
/// exports the submitting environment to the job).
fn sbatch(dir: &Path, args: &[&str], env: &[(&str, &str)]) -> (Job, Output) {
    let bin = Path::new(ZYGOTE).parent().unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new("sbatch")
        .arg("--parsable")
        .arg(format!("--chdir={}", dir.display()))
        .args(args)
        .current_dir(dir)
        .env("PATH", path)
        .env("RUST_LOG", "warn")
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .output()
        .expect("sbatch runs");
    let id = String::from_utf8_lossy(&output.stdout)
        .trim()
        .split(';')
        .next()
        .unwrap_or("")
        .to_string();
    assert!(
        output.status.success() || !id.is_empty(),
        "sbatch failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    (Job(id), output)
}

/// Whether any task of `job` is still queued or running.
fn running(job: &str) -> bool {
    let out = Command::new("squeue")
        .args(["-h", "-j", job])
        .output()
        .unwrap();
    !String::from_utf8_lossy(&out.stdout).trim().is_empty()
}

fn wait_done(job: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while running(job) {
        assert!(
            Instant::now() < deadline,
            "job {job} still runs after {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

/// The job completion log's entries of `job` (an array's tasks too), by
/// array task: each entry's fields.
fn completions(job: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    let config = Command::new("scontrol")
        .args(["show", "config"])
        .output()
        .unwrap();
    let config = String::from_utf8_lossy(&config.stdout);
    let Some(log) = config
        .lines()
        .find_map(|line| line.strip_prefix("JobCompLoc"))
        .and_then(|rest| rest.split('=').nth(1))
    else {
        return BTreeMap::new();
    };
    let text = std::fs::read_to_string(log.trim()).unwrap_or_default();
    let mut entries = BTreeMap::new();
    for line in text.lines() {
        let fields: BTreeMap<String, String> = line
            .split_whitespace()
            .filter_map(|field| field.split_once('='))
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        let ours = fields.get("ArrayJobId").map(String::as_str) == Some(job)
            || fields.get("JobId").map(String::as_str) == Some(job);
        if ours {
            let task = fields.get("ArrayTaskId").cloned().unwrap_or_default();
            entries.insert(task, fields);
        }
    }
    entries
}

/// `sacct`'s lines of `job`'s tasks, printed and kept for CI's log.
fn record_sacct(what: &str, job: &str) -> BTreeMap<String, BTreeMap<String, String>> {
    // Entries are written as each task ends.
    std::thread::sleep(Duration::from_secs(1));
    let entries = completions(job);
    let ids: Vec<&str> = entries
        .values()
        .filter_map(|e| e.get("JobId"))
        .map(String::as_str)
        .collect();
    let sacct = Command::new("sacct")
        .args([
            "--completion",
            "-o",
            "JobID,JobName%20,State,ExitCode,Elapsed,NodeList",
            "-j",
        ])
        .arg(ids.join(","))
        .stderr(Stdio::null())
        .output()
        .map(|out| String::from_utf8_lossy(&out.stdout).into_owned())
        .unwrap_or_else(|e| format!("sacct did not run: {e}\n"));
    let tasks: Vec<String> = entries
        .iter()
        .map(|(task, e)| format!("  task {task}: JobId={} {}", e["JobId"], e["JobState"]))
        .collect();
    let text = format!("== {what}: job {job}\n{}\n{sacct}", tasks.join("\n"));
    println!("{text}");
    let log = repository().join("target/slurm-runs.log");
    if let Ok(mut file) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log)
    {
        let _ = writeln!(file, "{text}");
    }
    entries
}

fn sweep(args: &[&str]) -> Output {
    let mut command = Command::new(ZYGOTE);
    command
        .arg("sweep")
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    for name in [
        "SLURM_ARRAY_TASK_ID",
        "SLURM_ARRAY_TASK_COUNT",
        "SLURM_PROCID",
        "SLURM_STEP_ID",
    ] {
        command.env_remove(name);
    }
    command.output().expect("the binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A results file's lines by index, each index once.
fn by_index(path: &Path) -> BTreeMap<u64, Value> {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut lines = BTreeMap::new();
    for line in text.lines() {
        let value: Value = serde_json::from_str(line).unwrap();
        let index = value["index"].as_u64().unwrap();
        assert!(lines.insert(index, value).is_none(), "point {index} twice");
    }
    lines
}

fn outcomes(lines: &BTreeMap<u64, Value>) -> Vec<(Value, Value, Value, Value)> {
    lines
        .values()
        .map(|l| {
            (
                l["index"].clone(),
                l["kwargs"].clone(),
                l["ok"].clone(),
                l["result"].clone(),
            )
        })
        .collect()
}

#[test]
fn an_array_of_4_shards_merged_equals_a_local_sweep() {
    let Some(_slurm) = slurm() else { return };
    let dir = scratch("slurm-array");
    let example = repository().join("examples/square.py");
    let example = example.to_str().unwrap();
    let results = dir.join("results.jsonl");
    let results = results.to_str().unwrap();
    let sbatch_script = repository().join("examples/sweep.sbatch");
    let (job, submitted) = sbatch(
        &dir,
        &[
            "--wait",
            "--array=0-3",
            sbatch_script.to_str().unwrap(),
            example,
            "--grid",
            "x=0..9999",
            "-o",
            results,
        ],
        &[],
    );
    assert!(
        submitted.status.success(),
        "the array failed: {}",
        stderr(&submitted)
    );
    let entries = record_sacct("4 shards of 10,000 points", &job.0);
    assert_eq!(entries.len(), 4, "{entries:?}");
    assert!(
        entries.values().all(|e| e["JobState"] == "COMPLETED"),
        "{entries:?}"
    );
    for k in 0..4u64 {
        let shard = by_index(&dir.join(format!("results.{k}-of-4.jsonl")));
        assert_eq!(
            shard.keys().copied().collect::<Vec<_>>(),
            (k..10_000).step_by(4).collect::<Vec<_>>(),
            "shard {k} holds its points"
        );
    }
    let merged = sweep(&[example, "--grid", "x=0..9999", "-o", results, "--merge"]);
    assert!(merged.status.success(), "{}", stderr(&merged));
    assert!(
        stderr(&merged).contains("10000 of 10000 points, 0 failed, 0 missing"),
        "{}",
        stderr(&merged)
    );
    let local = dir.join("local.jsonl");
    let ran = sweep(&[
        example,
        "--grid",
        "x=0..9999",
        "-o",
        local.to_str().unwrap(),
    ]);
    assert!(ran.status.success(), "{}", stderr(&ran));
    assert_eq!(
        outcomes(&by_index(Path::new(results))),
        outcomes(&by_index(&local))
    );
}

/// Processes whose command line names `dir` and whose environment says
/// they are task `task` of array `job`.
fn processes_of_task(dir: &Path, job: &str, task: &str) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    let (job, task) = (
        format!("SLURM_ARRAY_JOB_ID={job}"),
        format!("SLURM_ARRAY_TASK_ID={task}"),
    );
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let read = |name: &str| std::fs::read(entry.path().join(name)).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&read("cmdline")).into_owned();
        if !cmdline.contains(&needle) || common::is_gone(pid) {
            continue;
        }
        let environ = read("environ");
        let vars: Vec<&[u8]> = environ.split(|&b| b == 0).collect();
        if vars.contains(&job.as_bytes()) && vars.contains(&task.as_bytes()) {
            found.push(pid);
        }
    }
    found
}

#[test]
fn a_cancelled_array_task_leaves_nothing_and_resume_completes_it() {
    let Some(_slurm) = slurm() else { return };
    let dir = scratch("slurm-cancel");
    let node = dir.join("slow.py");
    std::fs::write(
        &node,
        "import subprocess, time\ndef process(x):\n    if x % 100 == 1:\n        # Something of its own that outlives nothing.\n        subprocess.Popen(['sleep', '300'])\n    time.sleep(0.02)\n    return x * 3\n",
    )
    .unwrap();
    let node = node.to_str().unwrap();
    let results = dir.join("results.jsonl");
    let results = results.to_str().unwrap();
    let sbatch_script = repository().join("examples/sweep.sbatch");
    let (job, submitted) = sbatch(
        &dir,
        &[
            "--array=0-1",
            sbatch_script.to_str().unwrap(),
            node,
            "--grid",
            "x=0..1999",
            "-o",
            results,
        ],
        &[],
    );
    assert!(submitted.status.success(), "{}", stderr(&submitted));
    let shard = dir.join("results.1-of-2.jsonl");
    let deadline = Instant::now() + Duration::from_secs(120);
    while std::fs::read_to_string(&shard).map_or(0, |t| t.lines().count()) < 20 {
        assert!(
            Instant::now() < deadline,
            "task 1 wrote nothing within 120 s"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    assert!(
        !processes_of_task(&dir, &job.0, "1").is_empty(),
        "task 1 runs"
    );
    let cancelled = Command::new("scancel")
        .arg(format!("{}_1", job.0))
        .status()
        .unwrap();
    assert!(cancelled.success());
    let deadline = Instant::now() + Duration::from_secs(60);
    while !processes_of_task(&dir, &job.0, "1").is_empty() {
        assert!(
            Instant::now() < deadline,
            "left running a minute after scancel: {:?}",
            processes_of_task(&dir, &job.0, "1")
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    wait_done(&job.0, Duration::from_secs(300));
    let entries = record_sacct("2 shards, task 1 cancelled", &job.0);
    assert_eq!(
        entries.get("1").map(|e| e["JobState"].as_str()),
        Some("CANCELLED"),
        "{entries:?}"
    );
    assert_eq!(
        entries.get("0").map(|e| e["JobState"].as_str()),
        Some("COMPLETED"),
        "{entries:?}"
    );
    // Nothing of task 0's is left either, its sleeps included.
    assert!(processes_of_task(&dir, &job.0, "0").is_empty());
    let written = by_index(&shard);
    // A call the cancel's SIGTERM ended is the stop's, not a failed point.
    assert!(
        written.values().all(|line| line["ok"] == true),
        "{:?}",
        written.values().find(|line| line["ok"] != true)
    );
    let partial = written.len();
    assert!(
        partial < 1000,
        "task 1 was cancelled before its end ({partial} points)"
    );

    let resumed = sweep(&[
        node,
        "--grid",
        "x=0..1999",
        "-o",
        results,
        "--shard",
        "1/2",
        "--resume",
    ]);
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(
        stderr(&resumed).contains(&format!("resuming: {partial} points are in")),
        "{}",
        stderr(&resumed)
    );
    let merged = sweep(&[node, "--grid", "x=0..1999", "-o", results, "--merge"]);
    assert!(merged.status.success(), "{}", stderr(&merged));
    let lines = by_index(Path::new(results));
    assert_eq!(
        lines.keys().copied().collect::<Vec<_>>(),
        (0..2000).collect::<Vec<_>>()
    );
    assert!(lines.iter().all(|(i, l)| l["result"] == i * 3));
}

/// A fake HOME as `examples/agent.sbatch` expects one: a venv with
/// fluksio-zygote in it (numpy and torch reached through a `.pth` to the
/// torch venv), and the token file.
fn agent_home(dir: &Path, torch_python: &Path) -> PathBuf {
    let home = dir.join("home");
    let venv = home.join("fluksio/venv");
    let made = Command::new(common::python())
        .args(["-m", "venv", "--without-pip"])
        .arg(&venv)
        .status()
        .unwrap();
    assert!(made.success());
    let site = |python: &Path| {
        let out = Command::new(python)
            .args([
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['purelib'])",
            ])
            .output()
            .unwrap();
        PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
    };
    let torch_site = site(torch_python);
    std::fs::write(
        site(&venv.join("bin/python")).join("torch-venv.pth"),
        format!("{}\n", torch_site.display()),
    )
    .unwrap();
    std::os::unix::fs::symlink(ZYGOTE, venv.join("bin/fluksio-zygote")).unwrap();
    std::fs::create_dir_all(home.join(".config/fluksio")).unwrap();
    std::fs::write(home.join(".config/fluksio/token"), common::agent::TOKEN).unwrap();
    home
}

#[test]
fn the_agent_sbatch_example_serves_a_call_and_leaves_when_idle() {
    let Some(_slurm) = slurm() else { return };
    let Some(torch_python) = std::env::var_os("FLUKSIO_TEST_TORCH_PYTHON").map(PathBuf::from)
    else {
        println!("SKIPPED: FLUKSIO_TEST_TORCH_PYTHON is not set (the example preloads torch)");
        return;
    };
    let dir = scratch("slurm-agent");
    let home = agent_home(&dir, &torch_python);
    let engine = Engine::start(Answer::Welcome);
    let script = repository().join("examples/agent.sbatch");
    let (job, submitted) = sbatch(
        &dir,
        &[script.to_str().unwrap()],
        &[
            ("HOME", home.to_str().unwrap()),
            ("FLUKSIO_ENGINE_URL", engine.url.as_str()),
            ("FLUKSIO_MAX_IDLE", "5"),
        ],
    );
    assert!(submitted.status.success(), "{}", stderr(&submitted));
    let log = || {
        std::fs::read_to_string(dir.join(format!("fluksio-worker-{}.log", job.0)))
            .unwrap_or_default()
    };
    let Some(connection) = engine.try_next_connection(Duration::from_secs(120)) else {
        panic!("the agent did not attach within 120 s; its log:\n{}", log());
    };
    assert_eq!(connection.hello["name"], format!("slurm-{}", job.0));
    let call = json!({"op": "run", "id": 1, "call_id": "s1", "flow": "f", "node": "n",
        "source": "import numpy, torch\ndef process(n):\n    return int(torch.arange(n).sum())\n",
        "kwargs": {"n": 5}});
    let (_, reply) = connection.reply_to(&call, WAIT);
    assert_eq!(reply["ok"], true, "{reply}");
    assert_eq!(reply["result"], 10, "{reply}");
    // Then nothing runs: it leaves at --max-idle, the job done.
    wait_done(&job.0, Duration::from_secs(120));
    let entries = record_sacct("examples/agent.sbatch", &job.0);
    let entry = entries
        .values()
        .next()
        .unwrap_or_else(|| panic!("no sacct entry; log:\n{}", log()));
    assert_eq!(entry["JobState"], "COMPLETED", "{entry:?}\n{}", log());
    assert_eq!(entry["ExitCode"], "0:0", "{entry:?}");
}
