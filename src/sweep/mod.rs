//! `fluksio-zygote sweep NODE.py --grid x=0..999`: the local main job.
//!
//! Runs a node once per grid point, each call in its own child forked from
//! one zygote (the node compiled into it once), several in flight at a
//! time. Prints one JSON line per point on stdout, in grid order:
//! `{"point": {...}, "ok": true, "result": ...}` (or `"error"`, and `"logs"`
//! when the call printed), then a one-line summary on stderr.

pub mod grid;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use nix::poll::{PollFd, PollTimeout, poll};
use pyo3::prelude::*;
use serde::Deserialize;
use serde_json::value::RawValue;
use serde_json::{Map, Value};

use crate::protocol::{self, Op, Request};
use crate::zygote::flight::{CallOutput, FALLBACK_POLL_MS, Flight};
use crate::zygote::{self, SpawnError, Zygote, ZygoteOptions};

/// How `sweep` is run.
#[derive(Debug, Clone)]
pub struct SweepOptions {
    pub zygote: ZygoteOptions,
    pub node: PathBuf,
    pub grids: Vec<String>,
    /// Keyword arguments every call gets, as a JSON object.
    pub kwargs: Option<String>,
    /// Calls in flight at once; `None` is one per CPU.
    pub jobs: Option<usize>,
}

/// Exit code: 0 when every call succeeded, 1 when some failed, 2 when the
/// sweep could not start.
pub fn run(options: &SweepOptions) -> ExitCode {
    let prepared = match prepare(options) {
        Ok(prepared) => prepared,
        Err(message) => {
            eprintln!("fluksio-zygote sweep: {message}");
            return ExitCode::from(2);
        }
    };
    zygote::run(
        &options.zygote,
        zygote::print_startup_error,
        |py, zygote| {
            if let Err(message) = compile(py, zygote, &prepared) {
                eprintln!("fluksio-zygote sweep: {message}");
                return ExitCode::from(2);
            }
            let jobs = options
                .jobs
                .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
                .max(1);
            let summary = match sweep(py, zygote, &prepared, jobs) {
                Ok(summary) => summary,
                Err(message) => {
                    eprintln!("fluksio-zygote sweep: {message}");
                    return ExitCode::FAILURE;
                }
            };
            eprintln!("{summary}");
            if summary.failed > 0 {
                ExitCode::FAILURE
            } else {
                ExitCode::SUCCESS
            }
        },
    )
}

/// The node and its points, read and checked before anything starts.
struct Prepared {
    flow: String,
    node: String,
    source: String,
    points: Vec<Map<String, Value>>,
}

fn prepare(options: &SweepOptions) -> Result<Prepared, String> {
    let source = std::fs::read_to_string(&options.node)
        .map_err(|e| format!("cannot read {}: {e}", options.node.display()))?;
    let axes = options
        .grids
        .iter()
        .map(|spec| grid::parse_axis(spec))
        .collect::<Result<Vec<_>, _>>()?;
    let base = match &options.kwargs {
        None => Map::new(),
        Some(text) => serde_json::from_str::<Map<String, Value>>(text)
            .map_err(|e| format!("--kwargs must be a JSON object ({e}), e.g. '{{\"seed\": 1}}'"))?,
    };
    Ok(Prepared {
        flow: "sweep".into(),
        node: node_name(&options.node),
        source,
        points: grid::points(&axes, &base)?,
    })
}

/// The node's name in tracebacks (`<node sweep.square>`): the file's stem.
fn node_name(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|| "node".into())
}

fn compile(py: Python<'_>, zygote: &mut Zygote, prepared: &Prepared) -> Result<(), String> {
    let request = Request {
        op: Op::Compile,
        id: raw("null"),
        call_id: String::new(),
        flow: prepared.flow.clone(),
        node: prepared.node.clone(),
        source: prepared.source.clone(),
        keep: true,
        kwargs: None,
        env: Vec::new(),
    };
    let mut answer = Answer::default();
    if zygote.serve(py, &request, &mut answer).is_err() {
        return Err("the zygote cannot fork safely after loading the node".into());
    }
    let reply: Reply<'_> = serde_json::from_slice(&answer.reply)
        .map_err(|e| format!("the node's compile reply is not readable: {e}"))?;
    let logs = reply.logs_text();
    if !logs.is_empty() {
        eprint!("{logs}");
    }
    if !reply.ok {
        let short = reply
            .error
            .and_then(|e| serde_json::from_str::<ErrorShort>(e.get()).ok())
            .map(|e| e.short)
            .unwrap_or_default();
        return Err(format!("the node does not load: {short}"));
    }
    Ok(())
}

/// The parts of a reply the sweep prints, kept as the JSON they came as.
#[derive(Deserialize)]
struct Reply<'a> {
    ok: bool,
    #[serde(borrow, default)]
    result: Option<&'a RawValue>,
    #[serde(borrow, default)]
    error: Option<&'a RawValue>,
    #[serde(borrow, default)]
    logs: Option<&'a RawValue>,
}

impl Reply<'_> {
    fn logs_text(&self) -> String {
        self.logs
            .and_then(|raw| serde_json::from_str::<String>(raw.get()).ok())
            .unwrap_or_default()
    }
}

#[derive(Deserialize)]
struct ErrorShort {
    short: String,
}

fn raw(text: &str) -> Box<RawValue> {
    RawValue::from_string(text.to_string()).expect("valid JSON")
}

/// One call's lines: events counted, the reply kept, its arrival timed.
#[derive(Default)]
struct Answer {
    reply: Vec<u8>,
    replied_at: Option<Instant>,
}

impl CallOutput for Answer {
    fn event(&mut self, _line: &[u8]) {}

    fn reply(&mut self, line: &[u8]) {
        self.reply = line.to_vec();
        self.replied_at = Some(Instant::now());
    }
}

/// What a sweep did, as the one line it ends with.
pub struct Summary {
    calls: usize,
    failed: usize,
    elapsed: Duration,
    latencies: Vec<Duration>,
    jobs: usize,
}

impl std::fmt::Display for Summary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let seconds = self.elapsed.as_secs_f64();
        let rate = if seconds > 0.0 {
            self.calls as f64 / seconds
        } else {
            0.0
        };
        write!(
            f,
            "sweep: {} calls, {} failed, in {:.2} s: {:.0} calls/s, latency p50 {:.2} ms, p99 {:.2} ms ({} in flight)",
            self.calls,
            self.failed,
            seconds,
            rate,
            millis(percentile(&self.latencies, 0.50)),
            millis(percentile(&self.latencies, 0.99)),
            self.jobs
        )
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// The `q` quantile of `samples` (nearest rank); zero when empty.
pub fn percentile(samples: &[Duration], q: f64) -> Duration {
    if samples.is_empty() {
        return Duration::ZERO;
    }
    let mut sorted = samples.to_vec();
    sorted.sort_unstable();
    let rank = ((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len());
    sorted[rank - 1]
}

/// A call in flight and what it has said so far.
struct Running {
    index: usize,
    flight: Flight,
    answer: Answer,
}

fn sweep(
    py: Python<'_>,
    zygote: &mut Zygote,
    prepared: &Prepared,
    jobs: usize,
) -> Result<Summary, String> {
    let started = Instant::now();
    let stdout = std::io::stdout();
    let mut stdout = stdout.lock();
    let mut printer = InOrder::default();
    let mut next = 0;
    let mut running: Vec<Running> = Vec::with_capacity(jobs);
    let mut latencies = Vec::with_capacity(prepared.points.len());
    let mut failed = 0;

    while next < prepared.points.len() || !running.is_empty() {
        while running.len() < jobs && next < prepared.points.len() {
            let request = run_request(prepared, next);
            let flight = match zygote.start_run(py, &request) {
                Ok(flight) => flight,
                Err(SpawnError::Io(error)) => {
                    return Err(format!("could not fork a call: {error}"));
                }
                Err(SpawnError::Unsafe | SpawnError::NotCompiled) => {
                    return Err("the zygote can no longer fork safely".into());
                }
            };
            running.push(Running {
                index: next,
                flight,
                answer: Answer::default(),
            });
            next += 1;
        }

        let (readable, exited) = wait_for_any(&running)?;
        for &i in &readable {
            let call = &mut running[i];
            call.flight.read(&mut call.answer);
        }
        // Land from the back, so the indices still to visit stay valid.
        for &i in exited.iter().rev() {
            let Running {
                index,
                flight,
                mut answer,
            } = running.swap_remove(i);
            let start = flight.started;
            let landed = flight
                .land(&mut answer)
                .map_err(|e| format!("lost track of a call: {e}"))?;
            let id = raw(&index.to_string());
            if !landed.replied {
                answer.reply(&protocol::ended_without_reply(
                    &id,
                    "",
                    landed.reaped.end,
                    &landed.logs.text_lossy(),
                ));
            }
            zygote.recycle(landed.logs);
            latencies.push(answer.replied_at.unwrap_or_else(Instant::now) - start);
            let (line, ok) = result_line(&prepared.points[index], &answer.reply);
            if !ok {
                failed += 1;
            }
            printer.push(index, line, &mut stdout);
        }
    }
    stdout.flush().ok();
    Ok(Summary {
        calls: prepared.points.len(),
        failed,
        elapsed: started.elapsed(),
        latencies,
        jobs,
    })
}

/// Waits until some call has something to read or has exited; returns the
/// indices of each, ascending.
fn wait_for_any(running: &[Running]) -> Result<(Vec<usize>, Vec<usize>), String> {
    let mut fds: Vec<PollFd<'_>> = Vec::new();
    // (call index, whether the fd is its exit watch) for each polled fd.
    let mut owners = Vec::new();
    let mut all_have_pidfds = true;
    for (i, call) in running.iter().enumerate() {
        if let Some(pipe) = call.flight.pipe_poll() {
            fds.push(pipe);
            owners.push((i, false));
        }
        match call.flight.exit_poll() {
            Some(exit) => {
                fds.push(exit);
                owners.push((i, true));
            }
            None => all_have_pidfds = false,
        }
    }
    let timeout = if all_have_pidfds {
        PollTimeout::NONE
    } else {
        PollTimeout::from(FALLBACK_POLL_MS)
    };
    match poll(&mut fds, timeout) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => {}
        Err(e) => return Err(format!("poll failed: {e}")),
    }
    let mut readable = Vec::new();
    let mut exited = Vec::new();
    for (fd, &(i, is_exit)) in fds.iter().zip(&owners) {
        if fd.revents().is_some_and(|r| !r.is_empty()) {
            if is_exit {
                exited.push(i)
            } else {
                readable.push(i)
            }
        }
    }
    if !all_have_pidfds {
        exited.extend((0..running.len()).filter(|&i| {
            running[i].flight.exit_poll().is_none() && running[i].flight.has_exited()
        }));
    }
    exited.sort_unstable();
    exited.dedup();
    Ok((readable, exited))
}

fn run_request(prepared: &Prepared, index: usize) -> Request {
    Request {
        op: Op::Run,
        id: raw(&index.to_string()),
        call_id: String::new(),
        flow: prepared.flow.clone(),
        node: prepared.node.clone(),
        source: prepared.source.clone(),
        keep: true,
        kwargs: Some(raw(
            &Value::Object(prepared.points[index].clone()).to_string()
        )),
        env: Vec::new(),
    }
}

/// `{"point", "ok", "result" | "error", "logs"?}`, the reply's own JSON
/// spliced in unparsed (a big int stays exact).
fn result_line(point: &Map<String, Value>, reply: &[u8]) -> (String, bool) {
    let point = Value::Object(point.clone()).to_string();
    let Ok(reply) = serde_json::from_slice::<Reply<'_>>(reply) else {
        let text = String::from_utf8_lossy(reply);
        let error = serde_json::json!({"type": "RemoteError", "message": format!("unreadable reply: {}", text.trim())});
        return (
            format!(r#"{{"point": {point}, "ok": false, "error": {error}}}"#),
            false,
        );
    };
    let mut line = format!(r#"{{"point": {point}, "ok": {}"#, reply.ok);
    match (reply.ok, reply.result, reply.error) {
        (true, Some(result), _) => line += &format!(r#", "result": {}"#, result.get()),
        (true, None, _) => line += r#", "result": null"#,
        (false, _, Some(error)) => line += &format!(r#", "error": {}"#, error.get()),
        (false, _, None) => {}
    }
    if let Some(logs) = reply.logs.filter(|l| l.get() != r#""""#) {
        line += &format!(r#", "logs": {}"#, logs.get());
    }
    line.push('}');
    (line, reply.ok)
}

/// Prints lines in index order though calls finish in any order.
#[derive(Default)]
struct InOrder {
    next: usize,
    waiting: BTreeMap<usize, String>,
}

impl InOrder {
    fn push(&mut self, index: usize, line: String, out: &mut impl Write) {
        self.waiting.insert(index, line);
        while let Some(line) = self.waiting.remove(&self.next) {
            let _ = writeln!(out, "{line}");
            self.next += 1;
        }
    }
}
