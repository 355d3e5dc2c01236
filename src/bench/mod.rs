//! `fluksio-zygote bench`: the comparison matrix of issue 8, side by side in
//! one run, on one preload set.
//!
//! Every row is measured in this run, on this machine, by the same client:
//! this process (Rust, one thread per call in flight). The baselines run
//! from the reference files (`--reference DIR`: the directory that holds
//! `fluksio_worker/worker_main.py`, and for the pool-client rows
//! `fluksio/flow/workers.py`). The rows:
//!
//! - the reference pool: reused `python worker_main.py` processes;
//! - spawn per call: a fresh `python worker_main.py` per call (agent.py's way);
//! - ours, `--isolation call` (a forked child per call), with the default
//!   standby and with `--standby 4`; ours, `--isolation node`;
//! - the C fork floor: `fork` + `_exit` + `waitpid` of a single-threaded
//!   process holding as much touched anonymous memory, in 4 KiB pages, as
//!   our zygote ([`floor`]).
//!
//! What each scenario measures is in [`matrix`]; [`report`] writes the
//! Markdown table and the targets, [`chart`] the PNG. A row that cannot run
//! here (a feature not built yet, torch not installed) says why instead of
//! failing the run.
//!
//! `bench --workloads` is the other comparison: real nodes (scikit-learn,
//! scipy, pandas, numpy) end to end, ours against joblib, a process pool and
//! a for-loop, in [`workloads`].

pub mod chart;
pub mod driver;
pub mod floor;
pub mod matrix;
pub mod ours;
pub mod procfs;
pub mod reference;
pub mod report;
pub mod workloads;

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

/// How `bench` is run: what to compare, how many calls, where to write.
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
    /// The sizes; the whole run within ~10 minutes on 2 cores.
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
        eprintln!(
            "fluksio-zygote bench: cannot write {}: {message}",
            md.display()
        );
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
        eprintln!(
            "fluksio-zygote bench: cannot create {}: {message}",
            out.display()
        );
        return Err(ExitCode::from(2));
    }
    Scratch::new().map_err(|message| {
        eprintln!("fluksio-zygote bench: {message}");
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
    pub(crate) fn new() -> Result<Scratch, String> {
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

/// p50, p99 and mean of a set of latencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub p50: Duration,
    pub p99: Duration,
    pub mean: Duration,
    pub samples: usize,
}

impl Stats {
    /// `None` for no samples.
    pub fn of(samples: &[Duration]) -> Option<Stats> {
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        // Nearest rank: the smallest sample with at least q of them at or below it.
        let rank =
            |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        (!sorted.is_empty()).then(|| Stats {
            p50: rank(0.50),
            p99: rank(0.99),
            mean: sorted.iter().sum::<Duration>() / sorted.len() as u32,
            samples: sorted.len(),
        })
    }
}

/// Milliseconds, for tables.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// How one number compares with another, read the right way round: never
/// "0.0× faster". `ours` and `theirs` are the two values; `lower_is_better`
/// for times and memory, not for rates. Returns e.g. ("this", 24.1) when
/// ours wins by 24.1×, ("other", 3.1) when the other side wins by 3.1×.
pub fn winner(ours: f64, theirs: f64, lower_is_better: bool) -> Option<(Side, f64)> {
    if !(ours > 0.0 && theirs > 0.0 && ours.is_finite() && theirs.is_finite()) {
        return None;
    }
    let ours_better = if lower_is_better {
        ours <= theirs
    } else {
        ours >= theirs
    };
    let factor = if ours > theirs {
        ours / theirs
    } else {
        theirs / ours
    };
    Some((if ours_better { Side::This } else { Side::Other }, factor))
}

/// Which side of a comparison wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    This,
    Other,
}

/// `1.234` → "1.2", `24.4` → "24", to a sensible number of digits.
pub fn factor_text(factor: f64) -> String {
    if factor >= 10.0 {
        format!("{factor:.0}")
    } else {
        format!("{factor:.1}")
    }
}

/// The directory `--reference` defaults to: `../shared/reference` from here.
pub fn default_reference() -> PathBuf {
    Path::new("..").join("shared").join("reference")
}

/// The lanes `sweep -j jobs` forks its calls from on this machine.
pub fn lanes_for(jobs: usize) -> usize {
    crate::sweep::default_lanes(std::thread::available_parallelism().map_or(1, |n| n.get()))
        .min(jobs)
        .max(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratios_read_the_right_way_round() {
        assert_eq!(winner(1.0, 24.0, true), Some((Side::This, 24.0)));
        assert_eq!(winner(3.1, 1.0, true), Some((Side::Other, 3.1)));
        assert_eq!(winner(200.0, 100.0, false), Some((Side::This, 2.0)));
        assert_eq!(winner(0.0, 1.0, true), None);
        assert_eq!(factor_text(0.96_f64.recip()), "1.0");
        assert_eq!(factor_text(54.9), "55");
    }
}
