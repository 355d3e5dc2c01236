//! The comparison bench (`benches/compare`), quick, with tiny counts,
//! against the reference: the table and the chart are written and every
//! row of the matrix is in the table, measured or saying why not; every
//! workload runs every row to the for-loop's results. No timing is asserted.
//!
//! Its own main (`harness = false`): each test runs the bench in a child of
//! this binary, which is the bench when [`CHILD`] is set (its floor
//! processes run this binary again, and inherit it).

#[path = "../benches/compare/main.rs"]
mod compare;

use std::panic::catch_unwind;
use std::path::PathBuf;
use std::process::{Command, ExitCode};

const REFERENCE: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../shared/reference");

/// Set in a child of this binary: it is the comparison bench then.
const CHILD: &str = "FLUKSIO_BENCH_TEST_CHILD";

/// The thread variables this machine may set: every row here runs on its
/// defaults (the bench's own `-j 2` shares the CPUs).
const THREAD_VARIABLES: [&str; 3] = ["OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"];

/// The tests, by name.
const TESTS: [(&str, fn()); 2] = [
    (
        "bench_quick_writes_the_table_and_the_chart_with_every_row",
        bench_quick_writes_the_table_and_the_chart_with_every_row,
    ),
    (
        "bench_workloads_runs_every_row_to_the_same_results",
        bench_workloads_runs_every_row_to_the_same_results,
    ),
];

/// The bench in a child; else the tests whose names hold a filter given
/// (none: all), one after another, as libtest reports them.
fn main() -> ExitCode {
    if std::env::var_os(CHILD).is_some() {
        return compare::main();
    }
    let (mut filters, mut skips, mut exact, mut list) = (Vec::new(), Vec::new(), false, false);
    let mut args = std::env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--exact" => exact = true,
            "--list" => list = true,
            "--skip" => skips.extend(args.next()),
            // libtest's options with a value, which this runner ignores.
            "--test-threads" | "--color" | "--format" | "--logfile" | "-Z" => {
                args.next();
            }
            _ if arg.starts_with('-') => {}
            _ => filters.push(arg),
        }
    }
    let matches = |name: &str, pattern: &String| {
        if exact {
            name == pattern
        } else {
            name.contains(pattern.as_str())
        }
    };
    let chosen: Vec<_> = TESTS
        .iter()
        .filter(|(name, _)| filters.is_empty() || filters.iter().any(|f| matches(name, f)))
        .filter(|(name, _)| !skips.iter().any(|s| matches(name, s)))
        .collect();
    if list {
        for (name, _) in &chosen {
            println!("{name}: test");
        }
        return ExitCode::SUCCESS;
    }
    println!("\nrunning {} tests", chosen.len());
    let mut failed = Vec::new();
    for &&(name, test) in &chosen {
        let passed = catch_unwind(test).is_ok();
        println!("test {name} ... {}", if passed { "ok" } else { "FAILED" });
        if !passed {
            failed.push(name);
        }
    }
    println!(
        "\ntest result: {}. {} passed; {} failed; {} filtered out\n",
        if failed.is_empty() { "ok" } else { "FAILED" },
        chosen.len() - failed.len(),
        failed.len(),
        TESTS.len() - chosen.len()
    );
    if failed.is_empty() {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(101)
    }
}

/// Runs the bench with `args` and a fresh `--out` named after `name`; that
/// directory and what it printed, once it succeeded.
fn bench(name: &str, args: &[&str]) -> (PathBuf, String) {
    let out = std::env::temp_dir().join(format!("fluksio-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&out);
    let mut command = Command::new(std::env::current_exe().expect("this test's binary"));
    command.env(CHILD, "1");
    for variable in THREAD_VARIABLES {
        command.env_remove(variable);
    }
    let output = command
        .args(args)
        .arg("--out")
        .arg(&out)
        .output()
        .expect("bench runs");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "bench failed: {stderr}");
    (out, String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Every row the matrix has: (scenario, who serves it).
const ROWS: &[(&str, &[&str])] = &[
    (
        "(1) sequential trivial calls, back to back",
        &[
            "reference pool",
            "spawn per call",
            "ours, `--isolation call`",
            "ours, `--isolation call --standby 4`",
            "ours, `--isolation node`",
            "C fork floor",
        ],
    ),
    (
        "(1) sequential trivial calls, spaced 5 ms",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
        ],
    ),
    (
        "(1) through the engine's PythonWorkerPool (size 1), back to back",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
        ],
    ),
    (
        "(2) trivial calls, 2 in flight",
        &[
            "reference pool",
            "spawn per call",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
            "C fork floor, 2 processes",
        ],
    ),
    (
        "(3) the next call after a kill",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
            "ours, `worker` process killed and restarted",
            "ours, pool slots sharing one zygote",
            "C fork floor",
        ],
    ),
    (
        "(4) total PSS",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
            "ours, pool slots sharing one zygote",
        ],
    ),
    (
        "(5) a sweep of trivial calls",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "C fork floor, 2 processes",
        ],
    ),
    (
        "(6) a small node, before",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
            "C fork floor",
        ],
    ),
    (
        "(6) the small node, after",
        &[
            "reference pool",
            "ours, `--isolation call`",
            "ours, `--isolation node`",
            "C fork floor",
        ],
    ),
    (
        "(7) torch preloaded: a trivial call",
        &["spawn per call", "ours, `--isolation call`", "C fork floor"],
    ),
];

fn bench_quick_writes_the_table_and_the_chart_with_every_row() {
    let (out, stdout) = bench(
        "test",
        &[
            "--quick",
            "--preload=",
            "--latency-calls",
            "6",
            "--spawn-calls",
            "1",
            "--kills",
            "1",
            "--calls",
            "20",
            "--big-mb",
            "5",
            "--array-mb",
            "2",
            "--reference",
            REFERENCE,
        ],
    );

    let table = std::fs::read_to_string(out.join("bench-bare.md")).expect("the table is written");
    assert!(
        stdout.contains("| scenario | served by |"),
        "the table is printed: {stdout}"
    );
    for (scenario, servers) in ROWS {
        for server in *servers {
            let found = table.lines().any(|l| {
                l.starts_with(&format!("| {scenario}")) && l.contains(&format!("| {server}"))
            });
            assert!(found, "no row for {server} in {scenario}:\n{table}");
        }
    }
    // The reference and ours both ran: their (1) rows are measured.
    for server in ["reference pool", "ours, `--isolation call`"] {
        let row = table
            .lines()
            .find(|l| {
                l.starts_with("| (1) sequential trivial calls, back to back") && l.contains(server)
            })
            .expect("the row");
        assert!(row.contains("p50 "), "{server} did not run: {row}");
    }
    assert!(table.contains("Issue 8's targets"), "{table}");
    // "0.0×" as a word: "10.0×" is a fine ratio.
    assert!(
        !table.split_whitespace().any(|word| word == "0.0×"),
        "a ratio read the wrong way round:\n{table}"
    );

    let png = std::fs::read(out.join("bench-bare.png")).expect("the chart is written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 1000, "an empty chart");
    let _ = std::fs::remove_dir_all(&out);
}

/// The workloads of `--workloads`, and every row each one has.
const WORKLOADS: &[&str] = &[
    "svm_cv",
    "logreg_cv",
    "numpy_eigh",
    "scipy_minimize",
    "pandas_groupby",
];
const WORKLOAD_ROWS: &[&str] = &[
    "ours, `--isolation call`",
    "ours, `--isolation call --warmup first`",
    "ours, `--isolation call --learn-imports off`",
    "ours, `--isolation node`",
    "joblib.Parallel(n_jobs=2)",
    "ProcessPoolExecutor(2), fork",
    "for-loop",
];

/// `--workloads` on 4 points each: every workload has every row, each
/// measured (none failed), and every row computed what the for-loop did.
/// No timing is asserted.
fn bench_workloads_runs_every_row_to_the_same_results() {
    let python = fluksio_embed::interpreter::BUILD_PYTHON;
    let sklearn = Command::new(python)
        .args(["-c", "import sklearn"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !sklearn {
        eprintln!(
            "\n\n************************************************************\n\
             SKIPPED bench_workloads_runs_every_row_to_the_same_results:\n\
             {python} has no scikit-learn (pip install scikit-learn)\n\
             ************************************************************\n"
        );
        return;
    }
    let (out, stdout) = bench(
        "workloads-test",
        &[
            "--workloads",
            "--quick",
            "--points",
            "4",
            "--workloads-dir",
            concat!(env!("CARGO_MANIFEST_DIR"), "/benches/workloads"),
        ],
    );
    assert!(
        stdout.contains("| workload | run as | wall |"),
        "the table is printed: {stdout}"
    );

    let table = std::fs::read_to_string(out.join("workloads.md")).expect("the table is written");
    for workload in WORKLOADS {
        for way in WORKLOAD_ROWS {
            let row = table
                .lines()
                .find(|l| l.starts_with(&format!("| {workload} (4 points) | {way} |")))
                .unwrap_or_else(|| panic!("no row for {way} in {workload}:\n{table}"));
            assert!(!row.contains("failed"), "{way} failed on {workload}: {row}");
            assert!(row.contains(" s |"), "no wall time: {row}");
        }
    }
    assert!(
        !table.contains("results differ"),
        "a row computed something else:\n{table}"
    );
    assert!(table.contains("## Targets"), "{table}");

    let png = std::fs::read(out.join("workloads.png")).expect("the chart is written");
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    assert!(png.len() > 1000, "an empty chart");
    let _ = std::fs::remove_dir_all(&out);
}
