//! The comparison bench: ways of running calls side by side in one run, on
//! one preload set, by the same client (this process, one thread per call
//! in flight), writing a Markdown table and a PNG chart.
//!
//!     cargo bench --bench compare -- --preload numpy --out bench-results
//!     cargo bench --bench compare -- --quick    # every row, fewer calls
//!     cargo bench --bench compare -- --workloads --repeat 3 --out bench-results/workloads
//!
//! The baselines run from the reference files (`--reference DIR`: the
//! directory that holds `fluksio_worker/worker_main.py`, and for the
//! pool-client rows `fluksio/flow/workers.py`). The rows:
//!
//! - the reference pool: reused `python worker_main.py` processes;
//! - spawn per call: a fresh `python worker_main.py` per call (agent.py's way);
//! - ours (the `fluksio-zygote` binary), `--isolation call` (a forked child
//!   per call), with the default standby and with `--standby 4`; ours,
//!   `--isolation node`;
//! - the C fork floor: `fork` + `_exit` + `waitpid` of a single-threaded
//!   process holding as much touched anonymous memory, in 4 KiB pages, as
//!   our zygote (`support::floor`, run in this binary again with the hidden
//!   `--floor-kib`).
//!
//! What each scenario measures is in [`matrix`]; [`report`] writes the
//! Markdown table and the targets, [`chart`] the PNG. A row that cannot run
//! here (a feature not built yet, torch not installed) says why instead of
//! failing the run.
//!
//! `--workloads` is the other comparison: real nodes (scikit-learn, scipy,
//! pandas, numpy) end to end, ours against joblib, a process pool and a
//! for-loop, in [`workloads`].

#[path = "../support/mod.rs"]
mod support;

mod chart;
mod matrix;
mod ours;
mod report;
mod workloads;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;

/// `--help`, after the options.
const AFTER_HELP: &str = "The baselines run from the reference files: --reference is the \
     directory that holds fluksio_worker/worker_main.py (and, for the rows through the engine's \
     own client, fluksio/flow/workers.py). Against an installed fluksio-worker, point it at \
     site-packages: `--reference $(python -c 'import fluksio_worker, os; \
     print(os.path.dirname(os.path.dirname(fluksio_worker.__file__)))')`.\n\n\
     Examples:\n  cargo bench --bench compare -- --preload numpy\n  \
     cargo bench --bench compare -- --preload numpy,pandas,scipy.stats --out bench-results\n  \
     cargo bench --bench compare -- --quick   # every row, fewer calls: a minute or two\n  \
     cargo bench --bench compare -- --workloads --out bench-results   # real nodes against joblib: ~10 minutes\n  \
     cargo bench --bench compare -- --workloads --quick --workload numpy_eigh,logreg_cv\n\n\
     --workloads runs each node of benches/workloads (scikit-learn, scipy, pandas, numpy) on the \
     same points through `fluksio-zygote sweep -j 2` (--isolation call, with --warmup first, \
     with --learn-imports off; --isolation node) and through benches/workloads/baseline.py \
     (joblib.Parallel(n_jobs=2), ProcessPoolExecutor(2) with fork, a for-loop), each timed \
     start to exit, every row's results checked against the for-loop's.";

/// The matrix, or (`--workloads`) real nodes end to end.
#[derive(Parser)]
#[command(
    name = "compare",
    bin_name = "cargo bench --bench compare --",
    about = "Compare ways of running calls side by side: the reference pool, spawn per call, \
             ours, the C fork floor; a Markdown table and a PNG chart",
    after_help = AFTER_HELP
)]
struct Args {
    /// Modules the node imports and ours preloads (comma-separated)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "MODULES",
        default_value = "numpy"
    )]
    preload: Vec<String>,

    /// The interpreter of both sides [default: the one fluksio-zygote was built against]
    #[arg(long, value_name = "PATH")]
    python: Option<PathBuf>,

    /// The directory holding fluksio_worker/worker_main.py
    #[arg(long, value_name = "DIR", default_value_os_t = default_reference())]
    reference: PathBuf,

    /// Where the table (bench-PRELOAD.md, or workloads.md) and the chart (.png) are written
    #[arg(long, value_name = "DIR", default_value = "bench-results")]
    out: PathBuf,

    /// Fewer calls everywhere (and a 100 MB big node): every row in a minute or two.
    /// With --workloads, a fifth of each workload's points
    #[arg(long)]
    quick: bool,

    /// Instead of the matrix, real nodes end to end: ours against joblib, a process pool
    /// and a for-loop (workloads.md and workloads.png under --out)
    #[arg(long, help_heading = "Workloads")]
    workloads: bool,

    /// Points of every workload [default: each its own, 40 to 1000; a fifth with --quick]
    #[arg(
        long,
        value_name = "N",
        requires = "workloads",
        help_heading = "Workloads"
    )]
    points: Option<usize>,

    /// Run every row this many times, in rounds (each round every row once), and report
    /// each row's median: this machine's noise moves one run by 10-40%
    #[arg(
        long,
        value_name = "N",
        default_value_t = 1,
        requires = "workloads",
        help_heading = "Workloads"
    )]
    repeat: usize,

    /// Only these workloads (comma-separated node names: svm_cv, logreg_cv, numpy_eigh,
    /// scipy_minimize, pandas_groupby)
    #[arg(
        long,
        value_delimiter = ',',
        value_name = "NAMES",
        requires = "workloads",
        help_heading = "Workloads"
    )]
    workload: Vec<String>,

    /// The directory of the workloads' node files and baseline.py
    #[arg(long, value_name = "DIR", default_value_os_t = workloads::default_dir(),
          help_heading = "Workloads")]
    workloads_dir: PathBuf,

    /// Calls of (5), the sweep [default: 10000; 1000 with --quick]
    #[arg(long, value_name = "N")]
    calls: Option<usize>,

    /// Sequential calls per row of (1) and (6) [default: 1000; 200 with --quick]
    #[arg(long, value_name = "N")]
    latency_calls: Option<usize>,

    /// Fresh processes per spawn-per-call row [default: 20; 5 with --quick]
    #[arg(long, value_name = "N")]
    spawn_calls: Option<usize>,

    /// Kills per row of (3) [default: 10; 3 with --quick]
    #[arg(long, value_name = "N")]
    kills: Option<usize>,

    /// MB of module-level Python objects of (6)'s big node [default: 400; 100 with --quick]
    #[arg(long, value_name = "MB")]
    big_mb: Option<usize>,

    /// MB of the numpy array each of (4)'s 8 calls holds
    #[arg(long, value_name = "MB", default_value_t = 50)]
    array_mb: usize,

    /// The --standby of the "more standby children" rows
    #[arg(long, value_name = "N", default_value_t = 4)]
    standby: usize,

    /// (internal) Be a fork-floor process holding this many KiB
    #[arg(long, hide = true)]
    floor_kib: Option<usize>,

    /// (internal) The fork-floor process's cycles
    #[arg(long, hide = true, default_value_t = 1000)]
    floor_calls: usize,

    /// What `cargo bench` passes to a bench without libtest's harness: ignored
    #[arg(long = "bench", hide = true)]
    _bench: bool,
}

/// Parses this process's command line and runs it.
pub fn main() -> ExitCode {
    Args::parse().run()
}

impl Args {
    fn run(self) -> ExitCode {
        if let Some(kib) = self.floor_kib {
            return support::floor::child_main(kib, self.floor_calls);
        }
        let python_given = self.python.is_some();
        let python = self
            .python
            .unwrap_or_else(|| PathBuf::from(fluksio_embed::interpreter::BUILD_PYTHON));
        if self.workloads {
            return workloads::run(&workloads::WorkloadOptions {
                python_given,
                python,
                dir: self.workloads_dir,
                out: self.out,
                quick: self.quick,
                points: self.points,
                repeat: self.repeat.max(1),
                only: self
                    .workload
                    .iter()
                    .map(|w| w.trim().trim_end_matches(".py").to_string())
                    .filter(|w| !w.is_empty())
                    .collect(),
                command_line: command_line(),
            });
        }
        let base = if self.quick {
            Counts::QUICK
        } else {
            Counts::DEFAULT
        };
        let counts = Counts {
            latency: self.latency_calls.unwrap_or(base.latency).max(1),
            spawn: self.spawn_calls.unwrap_or(base.spawn).max(1),
            kills: self.kills.unwrap_or(base.kills).max(1),
            throughput: self.latency_calls.map_or(base.throughput, |n| 2 * n).max(2),
            sweep: self.calls.unwrap_or(base.sweep).max(2),
            big_mb: self.big_mb.unwrap_or(base.big_mb).max(1),
            array_mb: self.array_mb.max(1),
        };
        run(&BenchOptions {
            preload: self
                .preload
                .iter()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
            python_given,
            python,
            reference: self.reference,
            out: self.out,
            counts,
            standby: self.standby,
            command_line: command_line(),
        })
    }
}

/// The command that runs this bench with this process's arguments, for a
/// report: `cargo bench --bench compare -- …`, without what cargo adds.
fn command_line() -> String {
    let args = std::env::args()
        .skip(1)
        .filter(|a| a != "--bench")
        .map(|a| if a.contains(' ') { format!("'{a}'") } else { a });
    ["cargo bench --bench compare --".to_string()]
        .into_iter()
        .chain(args)
        .collect::<Vec<_>>()
        .join(" ")
}

/// How the matrix is run: what to compare, how many calls, where to write.
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Modules the node imports; ours preloads them (`--preload`).
    pub preload: Vec<String>,
    /// The interpreter of both sides: ours embeds it (`--python`), the
    /// reference runs on it.
    pub python: PathBuf,
    /// Whether `--python` was given (passed on to ours then).
    pub python_given: bool,
    /// The directory holding `fluksio_worker/worker_main.py`.
    pub reference: PathBuf,
    pub out: PathBuf,
    pub counts: Counts,
    /// The `--standby` of the "ours, more standby children" rows.
    pub standby: usize,
    /// The command line, for the report.
    pub command_line: String,
}

/// How many calls each kind of row makes.
#[derive(Debug, Clone, Copy)]
pub struct Counts {
    /// Sequential calls per row in (1) and (6); half as many spaced 5 ms.
    pub latency: usize,
    /// Fresh processes per spawn-per-call row.
    pub spawn: usize,
    /// Kills per row in (3).
    pub kills: usize,
    /// Calls per row in (2), 2 in flight.
    pub throughput: usize,
    /// Calls per row in (5), the sweep.
    pub sweep: usize,
    /// MB of module-level Python objects of (6)'s big node.
    pub big_mb: usize,
    /// MB of the numpy array each of (4)'s 8 calls holds.
    pub array_mb: usize,
}

impl Counts {
    /// The full sizes; the whole run within ~10 minutes on 2 cores.
    pub const DEFAULT: Counts = Counts {
        latency: 1000,
        spawn: 20,
        kills: 10,
        throughput: 2000,
        sweep: 10_000,
        big_mb: 400,
        array_mb: 50,
    };
    /// A look in a minute or two: every row, fewer calls, a smaller big node.
    pub const QUICK: Counts = Counts {
        latency: 200,
        spawn: 5,
        kills: 3,
        throughput: 400,
        sweep: 1000,
        big_mb: 100,
        array_mb: 50,
    };
}

/// Runs the matrix, writes the table and the chart under `--out`, prints
/// the table. Exit 0 when the report was written (rows that could not run
/// say so in it), 2 when it could not be.
pub fn run(options: &BenchOptions) -> ExitCode {
    let scratch = match prepare(&options.out) {
        Ok(scratch) => scratch,
        Err(code) => return code,
    };
    let results = matrix::run(options, &scratch);
    let stem = format!("bench-{}", preload_slug(&options.preload));
    let png = options.out.join(format!("{stem}.png"));
    let chart_note = match chart::draw(&results, &png) {
        Ok(()) => None,
        Err(message) => Some(format!("chart not drawn: {message}")),
    };
    let markdown = report::markdown(options, &results, &png, chart_note.as_deref());
    publish(&options.out.join(format!("{stem}.md")), &markdown, &png)
}

/// Writes the report, prints it, and says where it and the chart are.
pub fn publish(md: &Path, markdown: &str, png: &Path) -> ExitCode {
    if let Err(message) = std::fs::write(md, markdown) {
        eprintln!("bench: cannot write {}: {message}", md.display());
        return ExitCode::from(2);
    }
    println!("{markdown}");
    eprintln!("bench: wrote {} and {}", md.display(), png.display());
    ExitCode::SUCCESS
}

/// Makes `--out` and a scratch directory for a run; what to exit with if
/// either cannot be (the reason is on stderr).
pub fn prepare(out: &Path) -> Result<Scratch, ExitCode> {
    if let Err(message) = std::fs::create_dir_all(out) {
        eprintln!("bench: cannot create {}: {message}", out.display());
        return Err(ExitCode::from(2));
    }
    Scratch::new().map_err(|message| {
        eprintln!("bench: {message}");
        ExitCode::from(2)
    })
}

/// `numpy,pandas` → `numpy+pandas`; nothing preloaded → `bare`.
pub fn preload_slug(preload: &[String]) -> String {
    if preload.is_empty() {
        "bare".into()
    } else {
        preload.join("+")
    }
}

/// A directory for the run's node files and marker files, removed after.
pub struct Scratch {
    pub dir: PathBuf,
}

impl Scratch {
    fn new() -> Result<Scratch, String> {
        let dir = std::env::temp_dir().join(format!("fluksio-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        Ok(Scratch { dir })
    }

    /// Writes `text` to a file of this name in the scratch directory.
    pub fn file(&self, name: &str, text: &str) -> Result<PathBuf, String> {
        let path = self.dir.join(name);
        std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))?;
        Ok(path)
    }

    /// A fresh empty subdirectory.
    pub fn subdir(&self, name: &str) -> Result<PathBuf, String> {
        let path = self.dir.join(name);
        let _ = std::fs::remove_dir_all(&path);
        std::fs::create_dir_all(&path)
            .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
        Ok(path)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The directory `--reference` defaults to: `../shared/reference` beside
/// this checkout.
pub fn default_reference() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join("shared")
        .join("reference")
}

/// The lanes `sweep -j jobs` forks its calls from on this machine.
pub fn lanes_for(jobs: usize) -> usize {
    fluksio_zygote::sweep::default_lanes(
        std::thread::available_parallelism().map_or(1, |n| n.get()),
    )
    .min(jobs)
    .max(1)
}
