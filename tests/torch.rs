//! torch, the heavy import the project is for: preloaded in the zygote
//! (`--python VENV/bin/python --preload torch`) without touching CUDA, each
//! call's child free to initialise it, a crash costing one child.
//!
//! torch is ~5 GB: `.ci/run` installs it into a venv of its own and names
//! its interpreter in `FLUKSIO_TEST_TORCH_PYTHON`.

mod common;

use common::{Worker, run};
use serde_json::json;

fn torch_python() -> String {
    match std::env::var("FLUKSIO_TEST_TORCH_PYTHON") {
        Ok(python) if !python.is_empty() => python,
        _ => panic!(
            "FLUKSIO_TEST_TORCH_PYTHON names no interpreter with torch: run .ci/run, which \
             installs torch into a venv and sets it, or set it to a venv's bin/python that has \
             torch (python3 -m venv V && V/bin/pip install torch)"
        ),
    }
}

fn torch_worker() -> Worker {
    let python = torch_python();
    Worker::zygote(&["--python", &python, "--preload", "torch"])
}

#[test]
fn torch_is_preloaded_without_cuda_and_each_child_may_initialise_it() {
    let mut worker = torch_worker();
    let source = "import sys, torch\ndef process(n):\n    at_start = torch.cuda.is_initialized()\n    total = float(torch.ones(n).sum())\n    available = torch.cuda.is_available()\n    return {'preloaded': 'torch' in sys.modules, 'cuda_at_start': at_start, 'sum': total, 'available': available}\n";
    for id in 0..3 {
        let reply = worker.call(&run(id, "t", source, json!({"n": 8}))).reply;
        let result = &reply["result"];
        assert_eq!(result["preloaded"], true, "{reply}");
        assert_eq!(
            result["cuda_at_start"], false,
            "the zygote never initialises CUDA: {reply}"
        );
        assert_eq!(result["sum"], 8.0, "{reply}");
        assert!(result["available"].is_boolean(), "{reply}");
    }
    let zygote_threads = std::fs::read_to_string(format!("/proc/{}/status", worker.pid()))
        .unwrap()
        .lines()
        .find_map(|l| l.strip_prefix("Threads:").map(|t| t.trim().to_string()))
        .unwrap();
    assert_eq!(zygote_threads, "1", "the zygote forks with one thread");
}

#[test]
fn a_crash_in_a_torch_call_costs_one_child_not_a_reimport() {
    let mut worker = torch_worker();
    let crash = "import os, torch\ndef process():\n    torch.ones(4)\n    os._exit(3)\n";
    let reply = worker.call(&run(1, "crash", crash, json!({}))).reply;
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exited with code 3"),
        "{reply}"
    );
    let pid_before = worker.pid();
    let after = worker
        .call(&run(
            2,
            "ok",
            "import torch\ndef process():\n    return float(torch.arange(4).sum())\n",
            json!({}),
        ))
        .reply;
    assert_eq!(after["result"], 6.0, "{after}");
    assert_eq!(worker.pid(), pid_before, "the same zygote, still warm");
}
