//! `sweep --gpus`: GPU slots, checked without a GPU. The runtime is told
//! which devices to use; each call's child must see exactly one, no GPU may
//! have more calls in flight than `--per-gpu`, and the summary and
//! `--metrics` count calls per GPU. Also what keeps a zygote forkable for
//! GPU work: torch's availability check answered from NVML, and a node
//! whose load opens the driver (a CUDA context) kept out of the zygote.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use common::{Worker, ZYGOTE, scratch};
use serde_json::{Value, json};

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
        .env_remove("CUDA_VISIBLE_DEVICES")
        .env_remove("PYTORCH_NVML_BASED_CUDA_CHECK")
        .env_remove("FLUKSIO_ISOLATION")
        .stdin(Stdio::null());
    command.envs(env.iter().copied());
    command
}

fn sweep(node: &Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    command(node, args, env).output().expect("the binary runs")
}

fn stderr(output: &Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn lines(output: &Output) -> Vec<Value> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect()
}

/// A call that marks itself running on its GPU, counts the calls running
/// there with it, and returns what it saw.
fn counting_node(dir: &Path) -> PathBuf {
    let marks = dir.join("marks");
    std::fs::create_dir_all(&marks).unwrap();
    node(
        dir,
        &format!(
            "import os, time\nMARKS = {marks:?}\ndef process(x):\n    gpu = os.environ.get('CUDA_VISIBLE_DEVICES')\n    mark = os.path.join(MARKS, f'{{gpu}}-{{os.getpid()}}')\n    open(mark, 'w').close()\n    time.sleep(0.03)\n    here = sum(1 for name in os.listdir(MARKS) if name.split('-')[0] == gpu)\n    running = len(os.listdir(MARKS))\n    os.remove(mark)\n    return [gpu, here, running]\n",
            marks = marks.display().to_string()
        ),
    )
}

#[test]
fn each_call_sees_one_gpu_and_no_gpu_runs_more_than_its_slots() {
    let dir = scratch("gpu-slots");
    let node = counting_node(&dir);
    let ran = sweep(
        &node,
        &["--grid", "x=0..59", "--gpus", "0,1,2", "--per-gpu", "2"],
        &[],
    );
    assert!(ran.status.success(), "{}", stderr(&ran));
    let results = lines(&ran);
    assert_eq!(results.len(), 60);
    let mut per_gpu: BTreeMap<String, usize> = BTreeMap::new();
    for line in &results {
        let result = &line["result"];
        let gpu = result[0]
            .as_str()
            .expect("CUDA_VISIBLE_DEVICES is set")
            .to_string();
        assert_eq!(
            line["gpu"],
            gpu.as_str(),
            "the line names the GPU it ran on"
        );
        assert!(result[1].as_u64().unwrap() <= 2, "over --per-gpu: {line}");
        assert!(result[2].as_u64().unwrap() <= 6, "over the slots: {line}");
        *per_gpu.entry(gpu).or_default() += 1;
    }
    assert_eq!(
        per_gpu.keys().cloned().collect::<Vec<_>>(),
        ["0", "1", "2"],
        "every GPU served calls"
    );
    let text = stderr(&ran);
    let counted = format!(
        "calls per GPU: GPU 0 {}, GPU 1 {}, GPU 2 {}",
        per_gpu["0"], per_gpu["1"], per_gpu["2"]
    );
    assert!(text.contains(&counted), "{text}");

    // -j below the slots caps them all.
    let capped = sweep(
        &node,
        &[
            "--grid",
            "x=0..19",
            "--gpus",
            "0,1",
            "--per-gpu",
            "4",
            "-j",
            "2",
        ],
        &[],
    );
    assert!(capped.status.success(), "{}", stderr(&capped));
    assert!(
        lines(&capped)
            .iter()
            .all(|l| l["result"][2].as_u64().unwrap() <= 2)
    );
}

#[test]
fn gpus_all_takes_the_jobs_devices_and_says_so_where_there_are_none() {
    let dir = scratch("gpu-all");
    let node = counting_node(&dir);
    let ran = sweep(
        &node,
        &["--grid", "x=0..9", "--gpus", "all"],
        &[("CUDA_VISIBLE_DEVICES", "3,5")],
    );
    assert!(ran.status.success(), "{}", stderr(&ran));
    let seen: BTreeSet<String> = lines(&ran)
        .iter()
        .map(|l| l["result"][0].as_str().unwrap().to_string())
        .collect();
    assert_eq!(seen, BTreeSet::from(["3".to_string(), "5".to_string()]));
    if Path::new("/proc/driver/nvidia/gpus").exists() {
        println!("skipped the no-GPU half: this machine has an NVIDIA driver");
        return;
    }
    let none = sweep(&node, &["--grid", "x=0..9", "--gpus", "all"], &[]);
    assert_eq!(none.status.code(), Some(2));
    assert!(
        stderr(&none).contains("--gpus all: no GPU here"),
        "{}",
        stderr(&none)
    );
    let cold = sweep(
        &node,
        &["--grid", "x=0..9", "--gpus", "0", "--cuda-warm"],
        &[],
    );
    assert_eq!(cold.status.code(), Some(2));
    assert!(
        stderr(&cold).contains("--cuda-warm: no NVIDIA driver is loaded here"),
        "{}",
        stderr(&cold)
    );
}

#[test]
fn gpu_flags_that_cannot_hold_are_refused_before_any_call() {
    let dir = scratch("gpu-refused");
    let node = counting_node(&dir);
    for (args, why) in [
        (
            &["--gpus", "0", "--isolation", "node"][..],
            "a resident child would keep the GPU",
        ),
        (
            &["--gpus", "0", "--isolation", "reset"][..],
            "a resident child would keep the GPU",
        ),
        (&["--gpus", " , "][..], "--gpus names no GPU"),
        (&["--per-gpu", "2"][..], "--gpus"),
        (&["--gpus", "0", "--per-gpu", "0"][..], "0 calls per GPU"),
    ] {
        let refused = sweep(&node, &[&["--grid", "x=0..3"][..], args].concat(), &[]);
        assert_eq!(
            refused.status.code(),
            Some(2),
            "{args:?}: {}",
            stderr(&refused)
        );
        assert!(
            stderr(&refused).contains(why),
            "{args:?}: {}",
            stderr(&refused)
        );
        assert!(refused.stdout.is_empty());
    }
}

#[test]
fn metrics_count_a_sweeps_calls_per_gpu() {
    let dir = scratch("gpu-metrics");
    let node = node(
        &dir,
        "import time\ndef process(x):\n    time.sleep(0.05)\n    return x\n",
    );
    let port = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        listener.local_addr().unwrap().port()
    };
    let addr = format!("127.0.0.1:{port}");
    let mut child = command(
        &node,
        &["--grid", "x=0..199", "--gpus", "0,1", "--metrics", &addr],
        &[],
    )
    .stdout(Stdio::null())
    .stderr(Stdio::null())
    .spawn()
    .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut counted = BTreeMap::new();
    while Instant::now() < deadline && counted.values().filter(|&&n| n > 0.0).count() < 2 {
        std::thread::sleep(Duration::from_millis(200));
        let Ok(mut stream) = std::net::TcpStream::connect(&addr) else {
            continue;
        };
        let _ = write!(stream, "GET /metrics HTTP/1.1\r\nHost: {addr}\r\n\r\n");
        let mut response = String::new();
        let _ = stream.read_to_string(&mut response);
        counted = response
            .lines()
            .filter_map(|line| line.strip_prefix("fluksio_sweep_gpu_calls_total{gpu=\""))
            .filter_map(|rest| rest.split_once("\"} "))
            .map(|(gpu, n)| (gpu.to_string(), n.trim().parse::<f64>().unwrap()))
            .collect();
    }
    let _ = child.kill();
    let _ = child.wait();
    assert_eq!(
        counted.keys().cloned().collect::<Vec<_>>(),
        ["0", "1"],
        "{counted:?}"
    );
    assert!(counted.values().all(|&n| n > 0.0), "{counted:?}");
}

#[test]
fn torchs_availability_check_asks_nvml_unless_the_user_chose() {
    let dir = scratch("gpu-nvml");
    let node = node(
        &dir,
        "import os\ndef process():\n    return os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK')\n",
    );
    let run = |env: &[(&str, &str)]| {
        let mut command = Command::new(ZYGOTE);
        command
            .arg("run")
            .arg(&node)
            .env_remove("PYTORCH_NVML_BASED_CUDA_CHECK")
            .envs(env.iter().copied())
            .stdin(Stdio::null());
        String::from_utf8_lossy(&command.output().unwrap().stdout)
            .trim()
            .to_string()
    };
    assert_eq!(run(&[]), "\"1\"");
    assert_eq!(run(&[("PYTORCH_NVML_BASED_CUDA_CHECK", "0")]), "\"0\"");
}

/// A stand-in for the NVIDIA driver's device, which a CUDA context keeps
/// open: a file whose path starts as theirs do, removed when dropped.
struct FakeDriverDevice(PathBuf);

impl FakeDriverDevice {
    fn make() -> Option<FakeDriverDevice> {
        let path = PathBuf::from(format!("/dev/nvidia-fluksio-test-{}", std::process::id()));
        std::fs::write(&path, "").ok()?;
        Some(FakeDriverDevice(path))
    }
}

impl Drop for FakeDriverDevice {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn a_node_whose_load_opens_the_gpu_driver_is_refused_a_fresh_child_per_call_and_served_resident() {
    let Some(device) = FakeDriverDevice::make() else {
        println!("SKIPPED: /dev is not writable here, so no stand-in driver device can be made");
        return;
    };
    let dir = scratch("gpu-cuda-at-load");
    // As a CUDA context does: the driver's device held open from the load on.
    let source = format!(
        "import os\nCONTEXT = open({:?})\nCALLS = []\ndef process(x):\n    CALLS.append(x)\n    return [x, len(CALLS)]\n",
        device.0.display().to_string()
    );
    let node = node(&dir, &source);
    let refused = sweep(&node, &["--grid", "x=0..3"], &[]);
    assert_eq!(refused.status.code(), Some(2), "{}", stderr(&refused));
    let text = stderr(&refused);
    assert!(text.contains("NodeInitialisesCuda"), "{text}");
    assert!(text.contains("--isolation node"), "{text}");

    let mut worker = Worker::zygote_with(&[], &[]);
    let reply = worker.call(&common::compile(1, "gpu", &source)).reply;
    assert_eq!(reply["ok"], false, "{reply}");
    assert_eq!(reply["error"]["type"], "NodeInitialisesCuda", "{reply}");
    // The worker serves on.
    let other = worker
        .call(&common::run(
            2,
            "other",
            "def process():\n    return 7\n",
            json!({}),
        ))
        .reply;
    assert_eq!(other["result"], 7, "{other}");

    // Under --isolation node each resident loads it once and keeps it.
    let served = sweep(
        &node,
        &["--grid", "x=0..9", "-j", "1", "--isolation", "node"],
        &[],
    );
    assert!(served.status.success(), "{}", stderr(&served));
    let mut counts: Vec<u64> = lines(&served)
        .iter()
        .map(|l| l["result"][1].as_u64().unwrap())
        .collect();
    counts.sort_unstable();
    assert_eq!(counts, (1..=10).collect::<Vec<_>>());
    assert!(
        stderr(&served).contains("initialises CUDA while it loads"),
        "{}",
        stderr(&served)
    );
}
