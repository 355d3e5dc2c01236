//! `fluksio-zygote sweep NODE.py --grid x=0..999` and `run NODE.py`: the
//! local main jobs.
//!
//! A sweep runs a node once per grid point (or per `--input` line), each
//! call in its own child forked from one zygote (the node compiled into it
//! once), several in flight at a time. It writes one JSON line per call as
//! the call ends (completion order, with the call's index):
//! `{"index", "kwargs", "ok", "result" | "error", "events"?, "logs"?,
//! "duration_ms"}`, draws a progress bar when stdout and stderr are a
//! terminal, and ends with a summary on stderr that lists the failures by
//! error type.
//!
//! Exit codes, for `run` too: 0 every call succeeded; 1 a call failed;
//! 2 it could not start (a usage error, a node that does not load, a
//! grid name the node does not take); 130 Ctrl-C (143 SIGTERM): the calls
//! in flight were ended, the results so far written; 141 the reader of
//! its output went away (`| head`), quietly.
//!
//! One file, over the usual length: the command's path from its options to
//! its exit code, whose steps all read `SweepOptions` and `Prepared`; a
//! file per step would make a circle with them.

pub mod calls;
pub mod grid;
pub mod kwargs;
mod lanes;
mod merge;
mod points;
pub use crate::zygote::app::default_lanes;
mod report;
pub mod run;
pub mod shard;
mod signals;
pub mod signature;
mod written;

use std::fs::File;
use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::sys::signal::Signal;
use pyo3::prelude::*;
use serde_json::Value;

use crate::protocol::Op;
use crate::zygote::device::{self, Gpu};
use crate::zygote::{self, Zygote, ZygoteOptions};
use calls::{Calls, Done, Node};
use kwargs::Kwargs;
use points::Points;
use report::{Reply, Summary};

/// How `sweep` is run.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    pub zygote: ZygoteOptions,
    pub node: PathBuf,
    pub grids: Vec<String>,
    /// A file of JSON-lines keyword arguments, one call each; `-` is stdin.
    pub input: Option<PathBuf>,
    /// Keyword arguments every call gets, as a JSON object.
    pub kwargs: Option<String>,
    /// Keyword arguments every call gets, each `NAME=VALUE`.
    pub pairs: Vec<String>,
    /// Calls in flight at once; `None` is one per CPU.
    pub jobs: Option<usize>,
    /// Zygotes forking them (`lanes`); `None` is one per CPU, at most `jobs`.
    pub lanes: Option<usize>,
    /// Where the result lines go instead of stdout (a shard's name tagged,
    /// see [`shard::Shard::output`]).
    pub output: Option<PathBuf>,
    /// `--shard K/N`; else SLURM's, else every point.
    pub shard: Option<shard::Shard>,
    /// `--resume` (or `--retry-failed`): what `output` holds already.
    pub resume: Resume,
    /// `--merge`: instead of running, merge the shards' files into `output`.
    pub merge: bool,
    /// A call still running after this long is ended (`NodeTimeout`).
    pub timeout: Option<std::time::Duration>,
    /// The node called once in its zygote before any call is forked.
    pub warmup: Option<Warmup>,
    /// `--gpus`: a call runs only in a free slot of a GPU, seeing it alone.
    pub gpus: Option<GpuSlots>,
}

/// `--gpus`, `--per-gpu`, `--cuda-warm`.
#[derive(Debug, Clone)]
pub struct GpuSlots {
    /// The devices, as `CUDA_VISIBLE_DEVICES` names them; `None` is `all`.
    pub ids: Option<Vec<String>>,
    /// Calls in flight on each GPU at most.
    pub per_gpu: usize,
    /// Each slot's standby children make their CUDA context ahead.
    pub warm: bool,
}

impl GpuSlots {
    /// One lane's GPU per device, checked: `all` read here, `--cuda-warm`
    /// only where a driver is loaded, and not under `--isolation node`.
    fn resolve(&self, options: &SweepOptions) -> Result<Vec<Gpu>, String> {
        if options.zygote.isolation != crate::zygote::resident::Isolation::Call {
            return Err(
                "--gpus serves each call in a fresh child of its GPU's lane; under \
                        --isolation node or reset a resident child would keep the GPU it started on\n\
                        hint: leave out --isolation, or --gpus (and set \
                        CUDA_VISIBLE_DEVICES yourself)"
                    .into(),
            );
        }
        let ids = match &self.ids {
            Some(ids) => ids.clone(),
            None => device::all_gpus()?,
        };
        if ids.is_empty() {
            return Err(
                "--gpus names no GPU\nhint: give their indices, e.g. --gpus 0,1, or \
                        --gpus all"
                    .into(),
            );
        }
        if self.warm && !device::driver_loaded() {
            return Err("--cuda-warm: no NVIDIA driver is loaded here \
                        (/proc/driver/nvidia/version is missing), so no CUDA context can be \
                        made ahead\nhint: leave out --cuda-warm"
                .into());
        }
        Ok(ids
            .into_iter()
            .map(|id| Gpu {
                id,
                warm: self.warm,
            })
            .collect())
    }
}

/// What a sweep does with the points its output file answers already.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resume {
    /// Nothing: the file is written anew.
    No,
    /// They are skipped; the rest appended.
    Missing,
    /// As `Missing`, and those that failed run again (their lines replaced).
    AndFailed,
}

/// `--warmup`: what the node is called with in its zygote, once, before
/// any call is forked (`zygote::warmup`).
#[derive(Debug, Clone, PartialEq)]
pub enum Warmup {
    /// These keyword arguments.
    Kwargs(serde_json::Map<String, Value>),
    /// The first call's.
    FirstPoint,
}

/// Exit code: 141, as a shell reports a process its closed pipe ended.
const OUTPUT_CLOSED: u8 = 141;

pub fn run(options: &SweepOptions) -> ExitCode {
    let mut prepared = match prepare(options) {
        Ok(prepared) => prepared,
        Err(message) => return fail("sweep", &message, 2),
    };
    if options.merge {
        let output = options
            .output
            .as_deref()
            .expect("--merge requires --output");
        // Exit 1 where a point is missing or failed, as a sweep's.
        return match merge::merge(output, &prepared.calls) {
            Ok(report) => {
                say(&report.to_string());
                if report.is_complete() {
                    ExitCode::SUCCESS
                } else {
                    ExitCode::FAILURE
                }
            }
            Err(message) => fail("sweep --merge", &message, 2),
        };
    }
    let gpus = match options.gpus.as_ref().map(|slots| slots.resolve(options)) {
        None => Vec::new(),
        Some(Ok(gpus)) => gpus,
        Some(Err(message)) => return fail("sweep", &message, 2),
    };
    let (output, earlier) = match plan(options, &mut prepared) {
        Ok(Planned::Run(output, earlier)) => (output, earlier),
        Ok(Planned::Nothing(code)) => return code,
        Err(message) => return fail("sweep", &message, 2),
    };
    let stdout_is_terminal = std::io::stdout().is_terminal();
    let stdout = match take_stdout(true) {
        Ok(stdout) => stdout,
        Err(e) => return fail("sweep", &format!("cannot set up its output: {e}"), 2),
    };
    let to_file = output.is_some();
    let out = Output {
        writer: std::io::BufWriter::new(output.unwrap_or(stdout)),
        to_terminal: stdout_is_terminal && !to_file,
    };
    let progress = stdout_is_terminal && std::io::stderr().is_terminal();
    signals::install();
    zygote::node::name_bad_values();
    zygote::channel::accept_numpy();
    zygote::node::set_script(&options.node);
    zygote::run(
        &options.zygote,
        zygote::print_startup_error,
        |py, zygote| {
            let warmup = options.warmup.as_ref().map(|warmup| match warmup {
                Warmup::Kwargs(kwargs) => kwargs.clone(),
                Warmup::FirstPoint => prepared.calls.get(0),
            });
            let loaded = load(
                py,
                zygote,
                &prepared.node,
                &prepared.dir,
                true,
                warmup.as_ref(),
            );
            if let Err(message) = loaded {
                return fail("sweep", &message, 2);
            }
            // Every grid point has the same names: its first one stands for all.
            let checked: Vec<Kwargs> = match &prepared.calls {
                Points::Grid(grid) => vec![grid.point(0)],
                Points::Lines(lines) => lines.clone(),
            };
            let describe = |i: usize| prepared.describe(&checked[i], i);
            if let Err(message) = check_calls(py, zygote, &prepared.node, &checked, &describe) {
                return fail("sweep", &message, 2);
            }
            signals::reinstall();
            let jobs = match &options.gpus {
                // At most one call per slot; -j may ask for fewer.
                Some(slots) => options
                    .jobs
                    .unwrap_or(usize::MAX)
                    .min(gpus.len() * slots.per_gpu),
                None => options.jobs.unwrap_or_else(zygote::threads::cpus),
            }
            .max(1);
            let shape = Shape {
                jobs,
                lanes: options.lanes,
                timeout: options.timeout,
                gpus: &gpus,
            };
            crate::metrics::name_gpus(&gpus.iter().map(|gpu| gpu.id.clone()).collect::<Vec<_>>());
            let code = sweep(py, zygote, &prepared, shape, out, progress, earlier);
            zygote.shutdown();
            code
        },
    )
}

/// The node and its calls, read and checked before anything starts.
struct Prepared {
    node: Node,
    dir: PathBuf,
    calls: Points,
    /// The indices of the points this run calls, ascending: its shard's,
    /// less those its output answers already.
    todo: Vec<usize>,
}

/// Which of the points this run calls (`prepared.todo`), and the file its
/// lines go to: the shard's, and what the file holds already where the
/// sweep resumes.
fn plan(options: &SweepOptions, prepared: &mut Prepared) -> Result<Planned, String> {
    let total = prepared.calls.len();
    let shard = match options.shard {
        Some(shard) => Some((shard, shard::Origin::Flag)),
        None => shard::Shard::from_slurm(|name| std::env::var(name).ok())?,
    };
    let (shard, origin) = shard.unwrap_or((shard::Shard::WHOLE, shard::Origin::Flag));
    let path = options.output.as_deref().map(|path| shard.output(path));
    let mut earlier = Earlier::default();
    let mut answered = vec![false; total];
    if let Some(path) = path.as_deref().filter(|_| options.resume != Resume::No) {
        let written = written::read(path, &prepared.calls, shard)?;
        let retry = options.resume == Resume::AndFailed;
        let kept: Vec<&written::Line> = written
            .lines
            .iter()
            .filter(|line| line.ok || !retry)
            .collect();
        if written.untidy || kept.len() != written.lines.len() {
            written::replace(path, kept.iter().map(|line| line.text.as_str()))?;
        }
        for line in &kept {
            answered[line.index] = true;
        }
        earlier.answered = kept.len();
        earlier.failed = kept.iter().filter(|line| !line.ok).count();
        earlier.retried = written.lines.len() - kept.len();
    }
    prepared.todo = shard.points(total).filter(|&i| !answered[i]).collect();
    if !shard.is_whole() {
        say(&format!(
            "fluksio-zygote sweep: shard {shard} (from {origin}): {} of {total} points{}",
            shard.points(total).count(),
            path.as_deref()
                .map(|p| format!(", to {}", p.display()))
                .unwrap_or_default()
        ));
    }
    if let Some(path) = path.as_deref().filter(|_| options.resume != Resume::No) {
        say(&format!(
            "fluksio-zygote sweep: resuming: {} {} in {}{}{}, {} to run",
            earlier.answered,
            if earlier.answered == 1 {
                "point is"
            } else {
                "points are"
            },
            path.display(),
            if earlier.failed > 0 {
                format!(
                    " ({} failed; --retry-failed runs them again)",
                    earlier.failed
                )
            } else {
                String::new()
            },
            if earlier.retried > 0 {
                format!(", {} failed to run again", earlier.retried)
            } else {
                String::new()
            },
            prepared.todo.len()
        ));
        if prepared.todo.is_empty() {
            if earlier.failed == 0 {
                return Ok(Planned::Nothing(ExitCode::SUCCESS));
            }
            say(&format!(
                "fluksio-zygote sweep: nothing to run; {} of the points failed\nhint: \
                 --retry-failed runs those again",
                earlier.failed
            ));
            return Ok(Planned::Nothing(ExitCode::FAILURE));
        }
    }
    let file = match path.as_deref() {
        None => None,
        Some(path) => {
            let mut open = std::fs::OpenOptions::new();
            open.create(true).write(true);
            if options.resume == Resume::No {
                open.truncate(true);
            } else {
                open.append(true);
            }
            Some(
                open.open(path)
                    .map_err(|e| format!("cannot write --output {}: {e}", path.display()))?,
            )
        }
    };
    Ok(Planned::Run(file, earlier))
}

/// What [`plan`] found to do.
enum Planned {
    /// Run `todo`, the lines to this file (else stdout).
    Run(Option<File>, Earlier),
    /// Nothing: every point is answered already; the exit code.
    Nothing(ExitCode),
}

/// What a resumed sweep's file answered before it started.
#[derive(Default)]
struct Earlier {
    answered: usize,
    failed: usize,
    /// Failed lines removed to run again (`--retry-failed`).
    retried: usize,
}

impl Prepared {
    /// Call `index`, for a message about it.
    fn describe(&self, kwargs: &Kwargs, index: usize) -> String {
        let kwargs = Value::Object(kwargs.clone());
        match self.calls {
            Points::Lines(_) => format!("--input call #{index}, {kwargs}"),
            Points::Grid(_) => format!("the call {kwargs}"),
        }
    }
}

fn prepare(options: &SweepOptions) -> Result<Prepared, String> {
    let (node, dir) = read_node(&options.node, "sweep")?;
    let base = kwargs::fixed(options.kwargs.as_deref(), &options.pairs)?;
    let calls = match &options.input {
        Some(path) => Points::Lines(kwargs::input(path, &base)?),
        None if options.grids.is_empty() => {
            return Err(
                "nothing to sweep: give --grid NAME=VALUES or --input FILE\nhint: for one call, \
                 fluksio-zygote run NODE.py -k NAME=VALUE"
                    .into(),
            );
        }
        None => {
            let axes = options
                .grids
                .iter()
                .map(|spec| grid::parse_axis(spec))
                .collect::<Result<Vec<_>, _>>()?;
            Points::Grid(grid::Grid::new(axes, base)?)
        }
    };
    Ok(Prepared {
        node,
        dir,
        calls,
        todo: Vec::new(),
    })
}

/// The node's source, named by the file's stem (`<node sweep.square>` in
/// tracebacks), and its directory (for `sys.path`).
fn read_node(path: &Path, flow: &str) -> Result<(Node, PathBuf), String> {
    let source = std::fs::read_to_string(path)
        .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
    let name = path
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "node".into());
    // As `python node.py` has it: the script's real directory.
    let dir = std::fs::canonicalize(path)
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_else(|| PathBuf::from("."));
    let node = Node {
        flow: flow.into(),
        name,
        source,
    };
    Ok((node, dir))
}

/// A message on stderr (`fluksio-zygote COMMAND: …`), and the exit code.
fn fail(command: &str, message: &str, code: u8) -> ExitCode {
    say(&format!("fluksio-zygote {command}: {message}"));
    ExitCode::from(code)
}

/// A line on stderr; a closed stderr is no reason to panic.
fn say(text: &str) {
    let _ = writeln!(std::io::stderr(), "{text}");
}

/// Moves stdout to a private fd (close-on-exec, closed in every child: only
/// this process writes results there) and points fd 1 at stderr, so what a
/// node or its subprocess writes to fd 1 can never corrupt the results.
/// With `null_stdin`, fd 0 becomes /dev/null (many calls, one terminal).
fn take_stdout(null_stdin: bool) -> std::io::Result<File> {
    let stdout = File::from(crate::fds::keep_stream(1)?);
    crate::fds::shield_standard_streams(null_stdin)?;
    Ok(stdout)
}

/// Puts the node's directory first on `sys.path`, as `python node.py`
/// does, then compiles the node into the zygote, and warms it up there
/// with `warmup` where given. `echo_logs`: print what its module level
/// printed (`run` has shown it live already).
fn load(
    py: Python<'_>,
    zygote: &mut Zygote,
    node: &Node,
    dir: &Path,
    echo_logs: bool,
    warmup: Option<&Kwargs>,
) -> Result<(), String> {
    py.import("sys")
        .and_then(|sys| sys.getattr("path"))
        .and_then(|path| path.call_method1("insert", (0, dir.to_string_lossy().as_ref())))
        .map_err(|e| format!("cannot put {} on sys.path: {e}", dir.display()))?;
    let mut request = node.request(Op::Compile, "null", None);
    request.warmup = warmup.map(|kwargs| calls::raw(&Value::Object(kwargs.clone()).to_string()));
    let mut answer = calls::Answer::default();
    if zygote.serve(py, &request, &mut answer).is_err() {
        return Err("the zygote cannot fork safely after loading the node".into());
    }
    let reply: Reply<'_> = serde_json::from_slice(&answer.reply)
        .map_err(|e| format!("the node's compile reply is not readable: {e}"))?;
    let logs = reply.logs_text();
    if echo_logs && !logs.is_empty() {
        let _ = write!(std::io::stderr(), "{logs}");
    }
    if !reply.ok {
        let error = reply.error_body();
        if !error.traceback.is_empty() {
            let _ = write!(std::io::stderr(), "{}", error.traceback);
        }
        // Our own refusals' `short` is the bare message: their type first.
        let short = if error.kind.is_empty() || error.short.starts_with(&error.kind) {
            error.short
        } else {
            format!("{}: {}", error.kind, error.short)
        };
        return Err(format!("the node does not load: {short}"));
    }
    if warmup.is_some()
        && let Some(why) = zygote.warmup_refusal(&node.flow, &node.name)
    {
        return Err(format!(
            "the warm-up was refused: {why}\nhint: fix the node, or leave out --warmup \
             (its calls then start cold)"
        ));
    }
    Ok(())
}

/// Refuses, before any call is forked, calls the node's function cannot
/// take. A node loaded in each call's child (not in the zygote) is not
/// checked here: its calls say so themselves.
fn check_calls(
    py: Python<'_>,
    zygote: &Zygote,
    node: &Node,
    calls: &[Kwargs],
    describe: &dyn Fn(usize) -> String,
) -> Result<(), String> {
    let Some(function) = zygote.compiled_function(py, &node.flow, &node.name) else {
        return Ok(());
    };
    match signature::read(py, &function) {
        Some((name, params)) => signature::check(&name, &params, calls, describe),
        None => Ok(()),
    }
}

/// Where result lines go.
struct Output {
    writer: std::io::BufWriter<File>,
    /// Lines share the terminal with the progress bar.
    to_terminal: bool,
}

/// Why the sweep stopped before its end.
enum Stop {
    Signal(i32),
    Closed,
    Failed(String),
}

/// The signals a scheduler or a terminal sends every process of a job to
/// end it: SLURM's `scancel` and preemption, a closed terminal.
const JOB_SIGNALS: [Signal; 3] = [Signal::SIGTERM, Signal::SIGINT, Signal::SIGHUP];

/// How long a call killed by one of [`JOB_SIGNALS`] waits for the sweep's
/// own: the scheduler signals the job's processes one by one.
const STOP_GRACE: Duration = Duration::from_millis(250);

/// `finished` less the calls that the signal stopping the sweep ended: a
/// scheduler that cancels a job signals every process in it, our calls'
/// children too, and such a call's end is the stop's, not its point's. Left
/// unwritten (their indices go to `cut_short`), `--resume` runs them again.
fn leave_to_the_stop(finished: Vec<Done>, cut_short: &mut Vec<usize>) -> Vec<Done> {
    let by_job_signal =
        |done: &Done| (done.answer.killed_by()).is_some_and(|signal| JOB_SIGNALS.contains(&signal));
    if !finished.iter().any(by_job_signal) {
        return finished;
    }
    let waited = Instant::now();
    while signals::received().is_none() && waited.elapsed() < STOP_GRACE {
        std::thread::sleep(Duration::from_millis(5));
    }
    if signals::received().is_none() {
        return finished;
    }
    let (theirs, kept): (Vec<Done>, Vec<Done>) = finished.into_iter().partition(by_job_signal);
    cut_short.extend(theirs.iter().map(|done| done.index));
    kept
}

/// How a sweep's calls run.
struct Shape<'a> {
    /// In flight at once.
    jobs: usize,
    /// `--lanes`.
    lanes: Option<usize>,
    /// Each ended past it.
    timeout: Option<Duration>,
    /// One lane per GPU, `jobs` shared among them.
    gpus: &'a [Gpu],
}

/// Runs every call as `shape` says; writes the lines and the summary; the
/// exit code.
fn sweep(
    py: Python<'_>,
    zygote: &mut Zygote,
    prepared: &Prepared,
    Shape {
        jobs,
        lanes,
        timeout,
        gpus,
    }: Shape<'_>,
    mut out: Output,
    progress: bool,
    earlier: Earlier,
) -> ExitCode {
    let started = Instant::now();
    let todo = &prepared.todo;
    let total = todo.len();
    // Each call's share of the CPUs: its BLAS and OpenMP threads.
    zygote::threads::set_calls_in_flight(jobs.min(total));
    let bar = progress.then(|| report::progress_bar(total));
    let mut summary = Summary::new(total, jobs);
    summary.gpus = gpus.iter().map(|gpu| (gpu.id.clone(), 0)).collect();
    // Under `--isolation node` the sweep hands each call to a resident child
    // itself: a fork per call in flight, not per call, needs no lanes.
    let in_turn = zygote.placement().resident(false);
    let (lane_count, per_lane) = if in_turn {
        (1, jobs)
    } else if !gpus.is_empty() {
        (gpus.len(), jobs.div_ceil(gpus.len()))
    } else {
        lanes::shape(jobs.min(total.max(1)), lanes)
    };
    let here = |zygote| {
        let mut calls = Calls::new(zygote, &prepared.node);
        calls.set_timeout(timeout);
        Runner::Here(calls)
    };
    let mut calls = if lane_count > 1 || !gpus.is_empty() {
        let shape = (lane_count, per_lane);
        match lanes::Lanes::start(py, zygote, &prepared.node, shape, timeout, gpus) {
            Ok(lanes) => Runner::Lanes(lanes),
            Err(message) if !gpus.is_empty() => {
                zygote.shutdown();
                return fail("sweep", &format!("{message}; no GPU slot could start"), 1);
            }
            Err(message) => {
                tracing::warn!("{message}; every call is forked from one zygote");
                here(zygote)
            }
        }
    } else {
        here(zygote)
    };
    let mut next = 0;
    // Calls ended by the signal that stops the sweep: not written.
    let mut cut_short = Vec::new();
    let stop = loop {
        if let Some(signal) = signals::received() {
            break Some(Stop::Signal(signal));
        }
        if let Err(message) = calls.fill(py, &mut next, todo, jobs, &prepared.calls) {
            break Some(Stop::Failed(message));
        }
        if calls.in_flight() == 0 && next >= todo.len() {
            break None;
        }
        let finished = match calls.step() {
            Ok(finished) => finished,
            Err(message) => break Some(Stop::Failed(message)),
        };
        let finished = leave_to_the_stop(finished, &mut cut_short);
        if finished.is_empty() {
            continue;
        }
        let mut lines = String::new();
        for done in &finished {
            let kwargs = &prepared.calls.get(done.index);
            let gpu = done.gpu.and_then(|position| gpus.get(position));
            let (line, outcome) = report::line(done, kwargs, gpu.map(|gpu| gpu.id.as_str()));
            if let Some(position) = done.gpu {
                crate::metrics::gpu_call_ended(position);
            }
            summary.record(done, kwargs, outcome);
            lines.push_str(&line);
            lines.push('\n');
        }
        let written = match (&bar, out.to_terminal) {
            (Some(bar), true) => bar.suspend(|| write_lines(&mut out, &lines)),
            _ => write_lines(&mut out, &lines),
        };
        if let Err(error) = written {
            break Some(if error.kind() == std::io::ErrorKind::BrokenPipe {
                Stop::Closed
            } else {
                Stop::Failed(format!("cannot write the results: {error}"))
            });
        }
        if let Some(bar) = &bar {
            bar.set_position(summary.done as u64);
            bar.set_message(format!("{} failed", summary.failed));
        }
    };
    let mut ended = calls.stop();
    ended.extend(cut_short);
    ended.sort_unstable();
    drop(calls);
    if let Some(bar) = &bar {
        bar.finish_and_clear();
    }
    summary.elapsed = started.elapsed();
    match stop {
        Some(Stop::Closed) => ExitCode::from(OUTPUT_CLOSED),
        Some(Stop::Failed(message)) => {
            let _ = out.writer.flush();
            say(&summary.to_string());
            fail("sweep", &message, 1)
        }
        Some(Stop::Signal(signal)) => {
            summary.stopped_by(signal, &ended, |index| prepared.calls.get(index));
            if let Err(error) = out.writer.flush()
                && error.kind() == std::io::ErrorKind::BrokenPipe
            {
                return ExitCode::from(OUTPUT_CLOSED);
            }
            say(&summary.to_string());
            ExitCode::from(signals::exit_code(signal))
        }
        None => {
            if let Err(error) = out.writer.flush() {
                if error.kind() == std::io::ErrorKind::BrokenPipe {
                    return ExitCode::from(OUTPUT_CLOSED);
                }
                say(&summary.to_string());
                return fail("sweep", &format!("cannot write the results: {error}"), 1);
            }
            say(&summary.to_string());
            // A resumed file's earlier failures count: the file is the result.
            if summary.failed + earlier.failed > 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        }
    }
}

/// Who forks a sweep's calls: its own zygote, or its lanes (`lanes`).
enum Runner<'a> {
    Here(Calls<'a>),
    Lanes(lanes::Lanes),
}

impl Runner<'_> {
    fn in_flight(&self) -> usize {
        match self {
            Runner::Here(calls) => calls.in_flight(),
            Runner::Lanes(lanes) => lanes.in_flight(),
        }
    }

    /// Starts the calls of `todo` from its `next` on, up to `jobs` in
    /// flight.
    fn fill(
        &mut self,
        py: Python<'_>,
        next: &mut usize,
        todo: &[usize],
        jobs: usize,
        source: &Points,
    ) -> Result<(), String> {
        match self {
            Runner::Here(calls) => {
                while calls.in_flight() < jobs && *next < todo.len() {
                    let index = todo[*next];
                    if !calls.try_start(py, index, &source.get(index))? {
                        break;
                    }
                    *next += 1;
                }
                if *next < todo.len() {
                    calls.replenish(py);
                }
                Ok(())
            }
            Runner::Lanes(lanes) => lanes.fill(next, todo, source),
        }
    }

    fn step(&mut self) -> Result<Vec<calls::Done>, String> {
        match self {
            Runner::Here(calls) => calls.step(),
            Runner::Lanes(lanes) => lanes.step(),
        }
    }

    /// Ends every call in flight; their indices, ascending.
    fn stop(&mut self) -> Vec<usize> {
        match self {
            Runner::Here(calls) => calls.kill_all(),
            Runner::Lanes(lanes) => lanes.stop(),
        }
    }
}

/// Writes and flushes: a reader that went away is noticed at once.
fn write_lines(out: &mut Output, lines: &str) -> std::io::Result<()> {
    out.writer.write_all(lines.as_bytes())?;
    out.writer.flush()
}
