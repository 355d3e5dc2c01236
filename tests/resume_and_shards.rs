//! Sweeps that outgrow one run: `--resume` after a kill at any moment,
//! `--retry-failed`, a changed grid refused, and `--shard K/N` (given, or
//! from SLURM's variables) whose files `--merge` makes the whole sweep.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{ZYGOTE, scratch};
use serde_json::Value;

/// What SLURM would set: a test is never a shard unless it says so.
const SLURM_VARIABLES: &[&str] = &[
    "SLURM_ARRAY_TASK_ID",
    "SLURM_ARRAY_TASK_COUNT",
    "SLURM_ARRAY_TASK_MIN",
    "SLURM_ARRAY_TASK_STEP",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_STEP_ID",
];

fn node(dir: &Path, source: &str) -> PathBuf {
    let path = dir.join("node.py");
    std::fs::write(&path, source).unwrap();
    path
}

fn command(node: &Path, args: &[&str], env: &[(&str, &str)]) -> Command {
    let mut command = Command::new(ZYGOTE);
    command
        .arg("sweep")
        .arg(node)
        .args(args)
        .env("RUST_LOG", "warn")
        .stdin(Stdio::null());
    for variable in SLURM_VARIABLES {
        command.env_remove(variable);
    }
    command.envs(env.iter().copied());
    command
}

fn sweep(node: &Path, args: &[&str]) -> Output {
    sweep_with(node, args, &[])
}

fn sweep_with(node: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    command(node, args, env).output().expect("the binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

/// A results file's lines by index; every line whole JSON, no index twice.
fn by_index(path: &Path) -> BTreeMap<u64, Value> {
    let text = std::fs::read_to_string(path).unwrap();
    assert!(
        text.is_empty() || text.ends_with('\n'),
        "{} ends in a partial line",
        path.display()
    );
    let mut lines = BTreeMap::new();
    for line in text.lines() {
        let value: Value =
            serde_json::from_str(line).unwrap_or_else(|e| panic!("not JSON ({e}): {line}"));
        let index = value["index"].as_u64().unwrap();
        assert!(
            lines.insert(index, value).is_none(),
            "point {index} twice in {}",
            path.display()
        );
    }
    lines
}

/// The parts of a line that do not depend on when or where it ran.
fn outcome(line: &Value) -> (Value, Value, Value, Value) {
    (
        line["index"].clone(),
        line["kwargs"].clone(),
        line["ok"].clone(),
        line["result"].clone(),
    )
}

/// Whether any process still runs whose command line names `dir`.
fn processes_naming(dir: &Path) -> Vec<i32> {
    let needle = dir.to_string_lossy().into_owned();
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").unwrap().flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(cmdline) = std::fs::read(entry.path().join("cmdline")) else {
            continue;
        };
        if String::from_utf8_lossy(&cmdline).contains(&needle) && !common::is_gone(pid) {
            found.push(pid);
        }
    }
    found
}

const SQUARE_SLOWLY: &str =
    "import time\ndef process(x):\n    time.sleep(0.004)\n    return {'x': x, 'square': x * x}\n";

#[test]
fn a_sweep_killed_at_random_moments_and_resumed_has_every_point_exactly_once() {
    const POINTS: u64 = 300;
    let dir = scratch("resume-kill");
    let node = node(&dir, SQUARE_SLOWLY);
    let grid = format!("x=0..{}", POINTS - 1);
    // A seed per run, printed: a failure names the moments it killed at.
    let mut seed = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64
        | 1;
    println!("seed {seed}");
    for trial in 0..20 {
        let out = dir.join(format!("results-{trial}.jsonl"));
        let args = ["--grid", &grid, "-j", "2", "-o", out.to_str().unwrap()];
        // Two kills in each trial, the second during the first resume.
        for round in 0..2 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let after = Duration::from_millis(seed % 900);
            let mut all = args.to_vec();
            if round > 0 {
                all.push("--resume");
            }
            let mut child = command(&node, &all, &[])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            std::thread::sleep(after);
            let _ = child.kill();
            let _ = child.wait();
        }
        let resumed = sweep(&node, &[&args[..], &["--resume"]].concat());
        assert!(
            resumed.status.success(),
            "trial {trial}: {}",
            stderr(&resumed)
        );
        let lines = by_index(&out);
        assert_eq!(
            lines.keys().copied().collect::<Vec<_>>(),
            (0..POINTS).collect::<Vec<_>>(),
            "trial {trial}: every point once"
        );
        for (index, line) in &lines {
            assert_eq!(line["ok"], true, "{line}");
            assert_eq!(line["result"]["square"], index * index, "{line}");
        }
    }
    // What the killed sweeps forked died with them.
    let deadline = Instant::now() + Duration::from_secs(30);
    while !processes_naming(&dir).is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
    assert_eq!(processes_naming(&dir), Vec::<i32>::new(), "left running");
}

/// `pid` and every process below it, deepest first.
fn tree_of(pid: i32) -> Vec<i32> {
    let mut tree = Vec::new();
    for (child, _) in common::children_of(pid) {
        tree.extend(tree_of(child));
    }
    tree.push(pid);
    tree
}

/// A scheduler's cancel (`scancel`, a preemption) signals every process of
/// the job, the calls' children as well as the sweep, in an order of its
/// own: a call ended by that signal is the stop's, not a failed point, and
/// `--resume` runs it again. Both orders, a few times each.
#[test]
fn a_job_signalled_whole_leaves_no_failed_point_and_resumes_to_complete() {
    let dir = scratch("resume-job-signal");
    let node = node(
        &dir,
        "import time\ndef process(x):\n    time.sleep(0.05)\n    return x * 3\n",
    );
    for trial in 0..6 {
        let calls_first = trial % 2 == 0;
        let out = dir.join(format!("results-{trial}.jsonl"));
        let args = ["--grid", "x=0..99", "-j", "2", "-o", out.to_str().unwrap()];
        let mut sweep_process = command(&node, &args, &[])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let pid = sweep_process.id() as i32;
        // Calls in flight: a few lines written.
        let deadline = Instant::now() + Duration::from_secs(30);
        while std::fs::read_to_string(&out).map_or(0, |t| t.lines().count()) < 4 {
            assert!(Instant::now() < deadline, "the sweep wrote no lines");
            std::thread::sleep(Duration::from_millis(10));
        }
        let mut tree = tree_of(pid);
        if !calls_first {
            tree.reverse();
        }
        for process in tree {
            // SAFETY: kill with a pid read from /proc.
            unsafe { libc::kill(process, libc::SIGTERM) };
        }
        let status = sweep_process.wait().unwrap();
        assert_eq!(
            std::os::unix::process::ExitStatusExt::into_raw(status) >> 8,
            128 + libc::SIGTERM,
            "trial {trial}: the sweep stops as SIGTERM asks"
        );
        let partial = by_index(&out);
        for line in partial.values() {
            assert_eq!(
                line["ok"], true,
                "trial {trial} (calls first: {calls_first}): {line}"
            );
        }
        let resumed = sweep(&node, &[&args[..], &["--resume"]].concat());
        assert!(
            resumed.status.success(),
            "trial {trial}: {}",
            stderr(&resumed)
        );
        let lines = by_index(&out);
        assert_eq!(
            lines.keys().copied().collect::<Vec<_>>(),
            (0..100).collect::<Vec<_>>()
        );
        assert!(lines.iter().all(|(i, l)| l["result"] == i * 3));
    }
}

#[test]
fn a_line_cut_by_a_kill_is_dropped_and_its_point_runs_again() {
    let dir = scratch("resume-cut");
    let node = node(&dir, SQUARE_SLOWLY);
    let out = dir.join("results.jsonl");
    let args = ["--grid", "x=0..19", "-o", out.to_str().unwrap()];
    assert!(sweep(&node, &args).status.success());
    let whole = by_index(&out);
    // The file as a kill in the middle of writing line 12 leaves it.
    let text = std::fs::read_to_string(&out).unwrap();
    let cut: usize = text.lines().take(11).map(|l| l.len() + 1).sum::<usize>() + 17;
    std::fs::write(&out, &text[..cut]).unwrap();
    let resumed = sweep(&node, &[&args[..], &["--resume"]].concat());
    assert!(resumed.status.success(), "{}", stderr(&resumed));
    assert!(
        stderr(&resumed).contains("resuming: 11 points are in"),
        "{}",
        stderr(&resumed)
    );
    let again = by_index(&out);
    assert_eq!(
        again.values().map(outcome).collect::<Vec<_>>(),
        whole.values().map(outcome).collect::<Vec<_>>()
    );
}

#[test]
fn a_resume_of_a_changed_grid_is_refused_and_the_file_left_alone() {
    let dir = scratch("resume-changed");
    let node = node(&dir, SQUARE_SLOWLY);
    let out = dir.join("results.jsonl");
    let out_arg = out.to_str().unwrap();
    assert!(
        sweep(&node, &["--grid", "x=0..9", "-o", out_arg])
            .status
            .success()
    );
    let before = std::fs::read(&out).unwrap();
    // Lines are in the order the points finished, so the line refused is
    // whichever point came first: any of them names the change.
    let shifted = |text: &str| {
        (0..10).any(|i| {
            text.contains(&format!(
                "is point #{i} with {{\"x\":{i}}}, but this sweep's point #{i} is {{\"x\":{}}}",
                i + 1
            ))
        })
    };
    let shrunk = |text: &str| text.contains("but this sweep has 5 points");
    for (grid, shrinks) in [("x=1..10", false), ("x=0..4", true)] {
        let refused = sweep(&node, &["--grid", grid, "-o", out_arg, "--resume"]);
        assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
        let text = stderr(&refused);
        let names_the_change = if shrinks {
            shrunk(&text)
        } else {
            shifted(&text)
        };
        assert!(names_the_change, "{text}");
        assert!(text.contains("the grid or --input changed"), "{text}");
        assert_eq!(std::fs::read(&out).unwrap(), before);
    }
    // Another file in -o's place is no sweep's: refused, not overwritten.
    std::fs::write(&out, "name,value\n").unwrap();
    let refused = sweep(&node, &["--grid", "x=0..9", "-o", out_arg, "--resume"]);
    assert_eq!(refused.status.code(), Some(2));
    assert!(stderr(&refused).contains("is not a result line of a sweep"));
    assert_eq!(std::fs::read_to_string(&out).unwrap(), "name,value\n");
    // And --resume without -o says what it needs.
    let usage = sweep(&node, &["--grid", "x=0..9", "--resume"]);
    assert_eq!(usage.status.code(), Some(2));
    assert!(stderr(&usage).contains("--output"), "{}", stderr(&usage));
}

#[test]
fn retry_failed_runs_again_only_the_points_that_failed() {
    let dir = scratch("retry-failed");
    let flag = dir.join("fixed");
    let node = node(
        &dir,
        &format!(
            "import os\ndef process(x):\n    if x % 4 == 0 and not os.path.exists({:?}):\n        raise ValueError('not yet')\n    return x\n",
            flag.display().to_string()
        ),
    );
    let out = dir.join("results.jsonl");
    let args = ["--grid", "x=0..19", "-o", out.to_str().unwrap()];
    let first = sweep(&node, &args);
    assert_eq!(first.status.code(), Some(1));
    std::fs::write(&flag, "").unwrap();
    // --resume alone finds every point answered, five of them failed.
    let resumed = sweep(&node, &[&args[..], &["--resume"]].concat());
    assert_eq!(resumed.status.code(), Some(1));
    assert!(
        stderr(&resumed).contains("5 of the points failed\nhint: --retry-failed"),
        "{}",
        stderr(&resumed)
    );
    let retried = sweep(&node, &[&args[..], &["--retry-failed"]].concat());
    assert!(retried.status.success(), "{}", stderr(&retried));
    assert!(
        stderr(&retried).contains("sweep: 5 calls, 0 failed"),
        "{}",
        stderr(&retried)
    );
    let lines = by_index(&out);
    assert_eq!(lines.len(), 20);
    assert!(lines.values().all(|line| line["ok"] == true));
}

#[test]
fn the_shards_merged_are_the_sweep_and_a_missing_one_is_counted() {
    let dir = scratch("shards");
    let node = node(
        &dir,
        "def process(x, y):\n    return {'x': x, 'y': y, 'square': x * x}\n",
    );
    let grid = ["--grid", "x=0..99", "--grid", "y=a,b"];
    let whole = dir.join("whole.jsonl");
    assert!(
        sweep(
            &node,
            &[&grid[..], &["-o", whole.to_str().unwrap()]].concat()
        )
        .status
        .success()
    );
    let out = dir.join("results.jsonl");
    let out_arg = out.to_str().unwrap();
    for k in 0..3 {
        let shard = format!("{k}/3");
        let ran = sweep(
            &node,
            &[&grid[..], &["-o", out_arg, "--shard", &shard]].concat(),
        );
        assert!(ran.status.success(), "{}", stderr(&ran));
        let file = dir.join(format!("results.{k}-of-3.jsonl"));
        let indices: Vec<u64> = by_index(&file).keys().copied().collect();
        assert_eq!(indices, (k..200).step_by(3).collect::<Vec<_>>());
    }
    let merged = sweep(&node, &[&grid[..], &["-o", out_arg, "--merge"]].concat());
    assert!(merged.status.success(), "{}", stderr(&merged));
    assert!(
        stderr(&merged).contains("merged 3 of 3 shard files into"),
        "{}",
        stderr(&merged)
    );
    let lines = std::fs::read_to_string(&out).unwrap();
    let indices: Vec<u64> = lines
        .lines()
        .map(|l| {
            serde_json::from_str::<Value>(l).unwrap()["index"]
                .as_u64()
                .unwrap()
        })
        .collect();
    assert_eq!(indices, (0..200).collect::<Vec<_>>(), "in index order");
    assert_eq!(
        by_index(&out).values().map(outcome).collect::<Vec<_>>(),
        by_index(&whole).values().map(outcome).collect::<Vec<_>>()
    );

    // One shard lost: counted, named, and how to finish it said.
    std::fs::remove_file(dir.join("results.1-of-3.jsonl")).unwrap();
    let short = sweep(&node, &[&grid[..], &["-o", out_arg, "--merge"]].concat());
    assert_eq!(short.status.code(), Some(1));
    let text = stderr(&short);
    assert!(
        text.contains("133 of 200 points, 0 failed, 67 missing"),
        "{text}"
    );
    assert!(text.contains("missing: #1, #4, #7"), "{text}");
    assert!(text.contains("shard 1/3 wrote no file"), "{text}");
    assert!(
        text.contains("to finish: run the sweep again with --shard 1/3 --resume, then --merge"),
        "{text}"
    );
    // Finished as it says, the merge is whole again.
    let finished = sweep(
        &node,
        &[&grid[..], &["-o", out_arg, "--shard", "1/3", "--resume"]].concat(),
    );
    assert!(finished.status.success(), "{}", stderr(&finished));
    assert!(
        sweep(&node, &[&grid[..], &["-o", out_arg, "--merge"]].concat())
            .status
            .success()
    );
    assert_eq!(by_index(&out).len(), 200);
}

#[test]
fn under_a_slurm_array_each_task_runs_its_shard_to_its_own_file() {
    let dir = scratch("slurm-env");
    let node = node(&dir, SQUARE_SLOWLY);
    let out = dir.join("out-{shard}.jsonl");
    // --array=1-4, task 3: its place is 2 of 4.
    let ran = sweep_with(
        &node,
        &["--grid", "x=0..9", "-o", out.to_str().unwrap()],
        &[
            ("SLURM_ARRAY_TASK_ID", "3"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_STEP", "1"),
        ],
    );
    assert!(ran.status.success(), "{}", stderr(&ran));
    assert!(
        stderr(&ran).contains(
            "shard 2/4 (from SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT): 2 of 10 points"
        ),
        "{}",
        stderr(&ran)
    );
    let lines = by_index(&dir.join("out-2-of-4.jsonl"));
    assert_eq!(lines.keys().copied().collect::<Vec<_>>(), [2, 6]);
    // --shard wins over SLURM's.
    let given = sweep_with(
        &node,
        &[
            "--grid",
            "x=0..9",
            "-o",
            out.to_str().unwrap(),
            "--shard",
            "0/2",
        ],
        &[
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
        ],
    );
    assert!(given.status.success(), "{}", stderr(&given));
    assert_eq!(by_index(&dir.join("out-0-of-2.jsonl")).len(), 5);
    // A batch script's own SLURM_NTASKS is no shard: it runs once.
    let batch = sweep_with(
        &node,
        &["--grid", "x=0..9"],
        &[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "4")],
    );
    assert!(batch.status.success(), "{}", stderr(&batch));
    assert_eq!(String::from_utf8_lossy(&batch.stdout).lines().count(), 10);
}
