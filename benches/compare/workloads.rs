//! `--workloads`: real workloads, end to end, against what a user would
//! otherwise write.
//!
//! The matrix ([`super::matrix`]) times trivial calls, where the fork is the
//! whole cost. A user's question is different: "I have 1000 points of a
//! scikit-learn fit; is `fluksio-zygote sweep` faster than joblib?" So each
//! workload of `benches/workloads/` (a node file; its docstring says what it
//! does) runs the same points every way below, and each way is timed by the
//! wall clock of the whole command, start to exit: the interpreter's
//! start-up, the imports and the workers' start-up count, as the user waits
//! for them.
//!
//! - ours, as `sweep NODE --input POINTS -j 2 --preload <the node's imports>`:
//!   `--isolation call` (the default), with `--warmup first`, with
//!   `--learn-imports off`, and `--isolation node`;
//! - `python baseline.py METHOD …`: joblib.Parallel(n_jobs=2),
//!   ProcessPoolExecutor(2) with fork, and a for-loop.
//!
//! Every row's results are checked against the for-loop's, index by index
//! ([`compare`]): a row that is fast because it computed something else must
//! say so. [`runner`] runs a row, [`report`] writes the table and the
//! targets, [`chart`] the PNG.

pub mod chart;
pub mod compare;
pub mod report;
pub mod runner;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use serde_json::json;

use super::Scratch;
use runner::Measured;

/// Calls in flight in every row: `-j 2`, `n_jobs=2`, 2 pool workers.
pub const JOBS: usize = 2;
/// What `--quick` divides each workload's points by.
const QUICK_DIVISOR: usize = 5;

/// How `--workloads` is run.
#[derive(Debug, Clone)]
pub struct WorkloadOptions {
    /// The interpreter of every row: ours embeds it, the baselines run on it.
    pub python: PathBuf,
    /// Whether `--python` was given (passed on to ours then).
    pub python_given: bool,
    /// The directory of the node files and `baseline.py`.
    pub dir: PathBuf,
    pub out: PathBuf,
    pub quick: bool,
    /// Points of every workload, instead of each one's own count.
    pub points: Option<usize>,
    /// Rounds of every row; each row's median wall time is reported.
    pub repeat: usize,
    /// Only these workloads (by name); empty for all.
    pub only: Vec<String>,
    /// The command line, for the report.
    pub command_line: String,
}

/// A workload: a node file in the workloads directory and its points.
#[derive(Debug, Clone, Copy)]
pub struct Workload {
    /// The node file's stem: `logreg_cv` is `logreg_cv.py`.
    pub name: &'static str,
    /// Points of a full run: the whole run, 7 rows a workload, in about
    /// ten minutes on 2 cores.
    pub points: usize,
    /// The `i`th of `n` points, as the node's keyword arguments.
    point: fn(usize, usize) -> serde_json::Value,
}

/// Every workload, in the table's order: the longest points first.
pub const ALL: [Workload; 5] = [
    Workload {
        name: "svm_cv",
        points: 40,
        point: |i, n| {
            // A (C, gamma) grid, C the faster axis, as square as n allows.
            let columns = (n as f64).sqrt().ceil().max(1.0) as usize;
            let lines = n.div_ceil(columns);
            json!({
                "C": log_grid(-1.0, 2.0, i % columns, columns),
                "gamma": log_grid(-4.0, -2.5, i / columns, lines),
            })
        },
    },
    Workload {
        name: "logreg_cv",
        points: 150,
        point: |i, n| json!({ "C": log_grid(-3.0, 3.0, i, n) }),
    },
    Workload {
        name: "numpy_eigh",
        points: 1000,
        point: |i, _| json!({ "seed": i }),
    },
    Workload {
        name: "scipy_minimize",
        points: 1000,
        point: |i, _| json!({ "seed": i }),
    },
    Workload {
        name: "pandas_groupby",
        points: 1000,
        point: |i, _| json!({ "seed": i }),
    },
];

/// The `i`th of `n` values from 10^lo to 10^hi, evenly spaced in the
/// exponent, to 4 significant digits (readable in the output, and the same
/// double on both sides of JSON).
fn log_grid(lo: f64, hi: f64, i: usize, n: usize) -> f64 {
    let exponent = if n > 1 {
        lo + (hi - lo) * i as f64 / (n - 1) as f64
    } else {
        lo
    };
    format!("{:.3e}", 10f64.powf(exponent))
        .parse()
        .unwrap_or(f64::NAN)
}

impl Workload {
    /// The node file.
    pub fn node(&self, dir: &Path) -> PathBuf {
        dir.join(format!("{}.py", self.name))
    }

    /// How many points this run gives it.
    pub fn count(&self, options: &WorkloadOptions) -> usize {
        match options.points {
            Some(n) => n.max(1),
            None if options.quick => (self.points / QUICK_DIVISOR).max(2),
            None => self.points,
        }
    }

    /// Its `n` points, one JSON object a line.
    pub fn points_jsonl(&self, n: usize) -> String {
        (0..n)
            .map(|i| format!("{}\n", (self.point)(i, n)))
            .collect()
    }
}

/// How a row runs the points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Way {
    /// `sweep --isolation call`: a forked child per point.
    Call,
    /// The same, `--warmup first`: the first point run once in the zygote.
    CallWarmup,
    /// The same, `--learn-imports off`.
    CallNoLearn,
    /// `sweep --isolation node`: a resident child per lane.
    Node,
    /// `sweep --isolation reset`: a resident child per call in flight, put
    /// back after each point.
    Reset,
    /// The same, `--warmup first`.
    ResetWarmup,
    /// `joblib.Parallel(n_jobs=2)`, its default (loky) backend.
    Joblib,
    /// `ProcessPoolExecutor(2)`, fork start method.
    Fork,
    /// A for-loop in one process.
    Loop,
}

impl Way {
    /// Every row, in the table's order.
    pub const ALL: [Way; 9] = [
        Way::Call,
        Way::CallWarmup,
        Way::CallNoLearn,
        Way::Node,
        Way::Reset,
        Way::ResetWarmup,
        Way::Joblib,
        Way::Fork,
        Way::Loop,
    ];

    /// Its name in the table.
    pub fn label(self) -> &'static str {
        match self {
            Way::Call => "ours, `--isolation call`",
            Way::CallWarmup => "ours, `--isolation call --warmup first`",
            Way::CallNoLearn => "ours, `--isolation call --learn-imports off`",
            Way::Node => "ours, `--isolation node`",
            Way::Reset => "ours, `--isolation reset`",
            Way::ResetWarmup => "ours, `--isolation reset --warmup first`",
            Way::Joblib => "joblib.Parallel(n_jobs=2)",
            Way::Fork => "ProcessPoolExecutor(2), fork",
            Way::Loop => "for-loop",
        }
    }

    /// Its name in the chart's legend.
    pub fn short(self) -> &'static str {
        match self {
            Way::Call => "ours, call",
            Way::CallWarmup => "ours, call, --warmup first",
            Way::CallNoLearn => "ours, call, --learn-imports off",
            Way::Node => "ours, node",
            Way::Reset => "ours, reset",
            Way::ResetWarmup => "ours, reset, --warmup first",
            Way::Joblib => "joblib",
            Way::Fork => "ProcessPoolExecutor, fork",
            Way::Loop => "for-loop",
        }
    }

    /// `baseline.py`'s METHOD, for the baselines.
    pub fn method(self) -> Option<&'static str> {
        match self {
            Way::Joblib => Some("joblib"),
            Way::Fork => Some("fork"),
            Way::Loop => Some("loop"),
            _ => None,
        }
    }
}

/// One row of one workload.
#[derive(Debug, Clone)]
pub struct Row {
    pub way: Way,
    /// The wall time and what ours reported, or why the row has no number.
    pub outcome: Result<Measured, String>,
    /// Where its results first differ from the reference row's, if they do.
    pub differs: Option<String>,
}

/// One workload's rows.
#[derive(Debug, Clone)]
pub struct WorkloadResult {
    pub name: &'static str,
    pub points: usize,
    /// What ours preloads: the modules the node imports.
    pub preload: Vec<String>,
    /// A point's own time, in process (the for-loop's median), in ms.
    pub point_ms: Option<f64>,
    /// The row every other row's results were checked against.
    pub reference: Option<Way>,
    pub rows: Vec<Row>,
}

impl WorkloadResult {
    pub fn row(&self, way: Way) -> Option<&Row> {
        self.rows.iter().find(|r| r.way == way)
    }

    /// A row's wall time against joblib's, when both ran.
    pub fn ratio(&self, way: Way) -> Option<f64> {
        let wall = |way| {
            self.row(way)
                .and_then(|r| r.outcome.as_ref().ok())
                .map(|m| m.wall.as_secs_f64())
        };
        Some(wall(way)? / wall(Way::Joblib)?).filter(|r| r.is_finite())
    }
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct Results {
    pub workloads: Vec<WorkloadResult>,
    pub python_version: String,
    /// The 1-minute load average before the first row and after the last:
    /// other work on the machine slows every row, and this says if there
    /// was any.
    pub load: [Option<f64>; 2],
}

/// Runs every workload, writes the table and the chart under `--out`,
/// prints the table. Exit 0 when the report was written (rows that could
/// not run say so in it), 2 when it could not be.
pub fn run(options: &WorkloadOptions) -> ExitCode {
    let workloads: Vec<Workload> = ALL
        .into_iter()
        .filter(|w| options.only.is_empty() || options.only.iter().any(|o| o == w.name))
        .collect();
    if let Some(unknown) = options
        .only
        .iter()
        .find(|o| !ALL.iter().any(|w| w.name == o.as_str()))
    {
        let names: Vec<&str> = ALL.iter().map(|w| w.name).collect();
        eprintln!(
            "bench: no workload {unknown:?}; there are {}",
            names.join(", ")
        );
        return ExitCode::from(2);
    }
    let scratch = match super::prepare(&options.out) {
        Ok(scratch) => scratch,
        Err(code) => return code,
    };
    let runner = runner::Runner::new(options);
    let load_before = load_average();
    let workloads = workloads
        .iter()
        .map(|w| run_workload(&runner, options, &scratch, w))
        .collect();
    let results = Results {
        workloads,
        python_version: super::matrix::python_version(&options.python),
        load: [load_before, load_average()],
    };
    let png = options.out.join("workloads.png");
    let chart_note = match chart::draw(&results, &png) {
        Ok(()) => None,
        Err(message) => Some(format!("chart not drawn: {message}")),
    };
    let markdown = report::markdown(options, &results, &png, chart_note.as_deref());
    super::publish(&options.out.join("workloads.md"), &markdown, &png)
}

/// One workload, every row, then the rows' results compared.
fn run_workload(
    runner: &runner::Runner,
    options: &WorkloadOptions,
    scratch: &Scratch,
    workload: &Workload,
) -> WorkloadResult {
    let n = workload.count(options);
    let node = workload.node(&options.dir);
    let mut result = WorkloadResult {
        name: workload.name,
        points: n,
        preload: Vec::new(),
        point_ms: None,
        reference: None,
        rows: Vec::new(),
    };
    let prepared = std::fs::read_to_string(&node)
        .map_err(|e| format!("cannot read {}: {e}", node.display()))
        .and_then(|source| {
            result.preload = imports(&source);
            scratch.file(
                &format!("{}-points.jsonl", workload.name),
                &workload.points_jsonl(n),
            )
        })
        // Untimed: a module missing fails here once, not in seven rows, and
        // the first row does not pay for a cold page cache alone.
        .and_then(|points| runner.check_imports(&result.preload).map(|()| points));
    let points = match prepared {
        Ok(points) => points,
        Err(why) => {
            eprintln!("bench: {}: not run: {why}", workload.name);
            result.rows = Way::ALL
                .iter()
                .map(|&way| Row {
                    way,
                    outcome: Err(why.clone()),
                    differs: None,
                })
                .collect();
            return result;
        }
    };
    // Rounds, each row once per round: a slow spell of the machine falls on
    // every row alike, and each row's median is what it reports.
    let mut runs: Vec<Vec<Measured>> = vec![Vec::new(); Way::ALL.len()];
    let mut outcomes: Vec<Option<Result<compare::Output, String>>> =
        (0..Way::ALL.len()).map(|_| None).collect();
    for round in 0..options.repeat.max(1) {
        for (index, way) in Way::ALL.into_iter().enumerate() {
            if matches!(outcomes[index], Some(Err(_))) {
                continue;
            }
            let out = scratch.dir.join(format!("{}-{way:?}.jsonl", workload.name));
            let outcome = runner.run(way, &node, &result.preload, &points, n, &out);
            let _ = std::fs::remove_file(&out);
            match outcome {
                Ok((measured, output)) => {
                    eprintln!(
                        "bench: {} ({n} points, round {}) | {}: {:.2} s",
                        workload.name,
                        round + 1,
                        way.label(),
                        measured.wall.as_secs_f64()
                    );
                    runs[index].push(measured);
                    // The first round's results are the ones compared.
                    if outcomes[index].is_none() {
                        outcomes[index] = Some(Ok(output));
                    }
                }
                Err(why) => {
                    eprintln!(
                        "bench: {} ({n} points) | {}: not run: {why}",
                        workload.name,
                        way.label()
                    );
                    outcomes[index] = Some(Err(why));
                }
            }
        }
    }
    let mut outputs = Vec::new();
    for ((way, measured), outcome) in Way::ALL.into_iter().zip(runs).zip(outcomes) {
        let (outcome, output) = match outcome {
            Some(Ok(output)) => (Ok(median(measured)), Some(output)),
            Some(Err(why)) => (Err(why), None),
            None => (Err("not run".to_string()), None),
        };
        result.rows.push(Row {
            way,
            outcome,
            differs: None,
        });
        outputs.push((way, output));
    }
    // The for-loop is the reference: one process, nothing between the
    // node and its result. Failing that, the first row that ran.
    let reference = outputs
        .iter()
        .find(|(way, o)| *way == Way::Loop && o.is_some())
        .or_else(|| outputs.iter().find(|(_, o)| o.is_some()));
    if let Some((reference_way, Some(reference))) = reference {
        result.reference = Some(*reference_way);
        result.point_ms = outputs
            .iter()
            .find(|(way, _)| *way == Way::Loop)
            .and_then(|(_, o)| o.as_ref()?.point_ms());
        for (row, (way, output)) in result.rows.iter_mut().zip(&outputs) {
            if way == reference_way {
                continue;
            }
            if let Some(output) = output {
                row.differs = compare::first_difference(&reference.results, &output.results);
                if let Some(at) = &row.differs {
                    eprintln!(
                        "bench: {} | {}: results differ from the {}'s: {at}",
                        workload.name,
                        way.label(),
                        reference_way.label()
                    );
                }
            }
        }
    }
    result
}

/// The run of median wall time among a row's rounds.
fn median(mut runs: Vec<Measured>) -> Measured {
    runs.sort_by_key(|run| run.wall);
    runs.swap_remove(runs.len() / 2)
}

/// The 1-minute load average, from /proc/loadavg.
fn load_average() -> Option<f64> {
    std::fs::read_to_string("/proc/loadavg")
        .ok()?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

/// The modules a node imports at its top level, in order, once each:
/// `import a, b.c as d` and `from e.f import g` give a, b.c, e.f. What ours
/// preloads, as a user would pass them.
pub fn imports(source: &str) -> Vec<String> {
    let mut modules: Vec<String> = Vec::new();
    let mut add = |module: &str| {
        let module = module.trim();
        let valid = !module.is_empty()
            && !module.starts_with('.')
            && module != "__future__"
            && module.split('.').all(|part| {
                !part.is_empty() && part.chars().all(|c| c.is_alphanumeric() || c == '_')
            });
        if valid && !modules.iter().any(|m| m == module) {
            modules.push(module.to_string());
        }
    };
    for line in source.lines() {
        let line = line.split('#').next().unwrap_or("").trim_end();
        if let Some(rest) = line.strip_prefix("import ") {
            for item in rest.split(',') {
                add(item.split(" as ").next().unwrap_or(""));
            }
        } else if let Some((module, _)) = line
            .strip_prefix("from ")
            .and_then(|rest| rest.split_once(" import "))
        {
            add(module);
        }
    }
    modules
}

/// The directory `--workloads-dir` defaults to: `benches/workloads` here,
/// else this checkout's.
pub fn default_dir() -> PathBuf {
    let here = Path::new("benches").join("workloads");
    if here.join("baseline.py").is_file() {
        here
    } else {
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("benches")
            .join("workloads")
    }
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;

    #[test]
    fn a_nodes_imports_are_what_ours_preloads() {
        let source = "\"\"\"doc\"\"\"\nimport numpy as np\nimport os, json.decoder\n\
                      from scipy.optimize import minimize, rosen\nfrom . import sibling\n\
                      from __future__ import annotations\n    import lazy\nimport numpy\n";
        assert_eq!(
            imports(source),
            ["numpy", "os", "json.decoder", "scipy.optimize"]
        );
    }

    #[test]
    fn points_are_deterministic_and_on_their_grids() {
        let logreg = ALL.iter().find(|w| w.name == "logreg_cv").unwrap();
        let points = logreg.points_jsonl(3);
        assert_eq!(points, "{\"C\":0.001}\n{\"C\":1.0}\n{\"C\":1000.0}\n");
        let svm = ALL.iter().find(|w| w.name == "svm_cv").unwrap();
        let lines: Vec<String> = svm.points_jsonl(4).lines().map(String::from).collect();
        assert_eq!(lines.len(), 4);
        assert_eq!(lines[0], "{\"C\":0.1,\"gamma\":0.0001}");
        assert_eq!(lines[3], "{\"C\":100.0,\"gamma\":0.003162}");
        assert_eq!(svm.points_jsonl(4), svm.points_jsonl(4));
        assert_eq!(log_grid(-3.0, 3.0, 0, 1), 0.001);
    }
}
