//! A node runs CPython's own regression suites and numpy's tests, and so
//! does plain `python3`: every test must end the same way in both.
//!
//! The node is `tests/fidelity/suites.py`, run with `fluksio-zygote run`
//! (its `__main__` block under `python3`). The selection runs in about a
//! minute on two cores; `FLUKSIO_FIDELITY_FULL=1` adds suites that take
//! several more (test_logging, test_threading, test_subprocess, numpy's
//! umath and linalg).

mod common;

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// Tests whose outcome differs here on purpose, with the reason. Each is
/// also in PROTOCOL-NOTES ("Node code and python3").
const KNOWN_DIFFERENCES: &[(&str, &str)] = &[];

fn selection() -> Value {
    let mut suites = vec![
        "test.test_json",
        "test.test_signal",
        "test.test_atexit",
        "test.test_resource",
        "test.test_argparse",
        "test.test_tempfile",
        "test.test_fileio",
        "test.test_os",
    ];
    let mut numpy = vec!["random/tests/test_random.py", "_core/tests/test_numeric.py"];
    if std::env::var_os("FLUKSIO_FIDELITY_FULL").is_some() {
        suites.extend([
            "test.test_logging",
            "test.test_threading",
            "test.test_subprocess",
        ]);
        numpy.extend(["_core/tests/test_umath.py", "linalg/tests/test_linalg.py"]);
    }
    serde_json::json!({"suites": suites, "numpy": numpy})
}

fn outcomes(mut command: Command, what: &str) -> BTreeMap<String, String> {
    let output = command.output().expect("the suites start");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last = stdout.lines().last().unwrap_or_else(|| {
        panic!(
            "{what} printed nothing; stderr: {}",
            String::from_utf8_lossy(&output.stderr)
        )
    });
    serde_json::from_str(last)
        .unwrap_or_else(|e| panic!("{what}'s last line is not the outcomes ({e}): {last}"))
}

#[test]
fn cpython_and_numpy_suites_end_the_same_in_a_node_as_under_python3() {
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fidelity/suites.py");
    let args = selection().to_string();
    // Each run in a directory of its own: some suites make fixed names in
    // the working directory (test_os's `base`), and the two run at once.
    let dir = common::scratch("fidelity-node");
    let mut command = Command::new(common::ZYGOTE);
    command.arg("run").arg(&node).arg("--kwargs").arg(&args);
    command.current_dir(&dir);
    compare_with_python3(&node, &args, "node", || outcomes(command, "the node"));
}

/// Under `--isolation reset`, in a child put back after an earlier call
/// of the node: the same outcomes.
#[test]
fn the_suites_end_the_same_in_a_child_put_back_after_an_earlier_call() {
    let node = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fidelity/suites.py");
    let args = selection().to_string();
    let dir = common::scratch("fidelity-reset");
    let input = dir.join("points.jsonl");
    let earlier = serde_json::json!({"suites": [], "numpy": []});
    std::fs::write(&input, format!("{earlier}\n{args}\n")).unwrap();
    let ours = || {
        let output = Command::new(common::ZYGOTE)
            .args(["sweep", node.to_str().unwrap(), "--input"])
            .arg(&input)
            .current_dir(&dir)
            .args(["-j", "1", "--isolation", "reset"])
            .env("RUST_LOG", "info")
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the sweep runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !stderr.contains("could not be put back"),
            "the earlier call's child was retired, not put back: {stderr}"
        );
        let stdout = String::from_utf8_lossy(&output.stdout);
        let lines: Vec<Value> = stdout
            .lines()
            .map(|l| serde_json::from_str(l).expect("a result line"))
            .collect();
        let second = lines
            .iter()
            .find(|l| l["index"] == 1)
            .unwrap_or_else(|| panic!("no second point: {stdout}\n{stderr}"));
        serde_json::from_value(second["result"].clone()).expect("the outcomes")
    };
    compare_with_python3(&node, &args, "reset", ours);
}

/// Runs the suites under python3 beside `ours`, and compares test for test.
/// python3 runs in a directory of its own, named for `test` (the tests of
/// this file may run at once, in one process).
fn compare_with_python3(
    node: &Path,
    args: &str,
    test: &str,
    ours: impl FnOnce() -> BTreeMap<String, String>,
) {
    let python = common::python();
    let dir = common::scratch(&format!("fidelity-python3-{test}"));
    let (reference, ours) = std::thread::scope(|scope| {
        let reference = scope.spawn(|| {
            let mut command = Command::new(&python);
            command.arg(node).arg(args).current_dir(&dir);
            outcomes(command, "python3")
        });
        let ours = ours();
        (reference.join().expect("the reference thread"), ours)
    });
    assert!(
        reference.len() > 3000,
        "the selection ran only {} tests under python3",
        reference.len()
    );
    let known: BTreeMap<&str, &str> = KNOWN_DIFFERENCES.iter().copied().collect();
    let mut differences = Vec::new();
    for test in reference.keys().chain(ours.keys()) {
        let (theirs, mine) = (reference.get(test), ours.get(test));
        if theirs != mine && !known.contains_key(test.as_str()) {
            differences.push(format!("{test}: python3 {theirs:?}, node {mine:?}"));
        }
    }
    differences.dedup();
    assert!(
        differences.is_empty(),
        "{} tests end differently in a node:\n{}",
        differences.len(),
        differences.join("\n")
    );
}
