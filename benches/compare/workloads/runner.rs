//! A row, run: one command, timed from its start to its exit by this
//! process's clock, its results read back from the file it wrote.
//!
//! The command is the whole of what a user runs, in a process group of its
//! own (so that a row that hangs past [`ROW_LIMIT`] can be ended with
//! everything it started). stdout is dropped (results go to a file), stderr
//! kept: ours' summary line has the per-call p50, and a failed row's last
//! lines say why it failed.

use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use super::super::support::{ZYGOTE, floor::rusage};
use super::compare::{self, Output};
use super::{JOBS, Way, WorkloadOptions};

/// The longest a row may run before it is ended and marked as timed out:
/// far beyond any row of a default run (tens of seconds), short of a hang
/// holding the bench for ever.
const ROW_LIMIT: Duration = Duration::from_secs(900);
/// How long a timed-out row has to end on SIGTERM before SIGKILL.
const TERM_GRACE: Duration = Duration::from_secs(5);
/// The longest a reason for a failed row is kept in the table.
const WHY_CHARS: usize = 300;

/// What a row measured.
#[derive(Debug, Clone, Copy)]
pub struct Measured {
    /// The whole command, start to exit.
    pub wall: Duration,
    /// The CPU time (user and system) of the command and of every process
    /// under it that was waited for: what the row cost the machine.
    pub cpu: Duration,
    /// The CPU time everything else on the machine took meanwhile (other
    /// processes, and time the hypervisor gave away): a row with much of it
    /// was slowed by them. `None` without /proc/stat.
    pub others_cpu: Option<Duration>,
    /// Ours: the sweep's per-call latency p50 (fork to reply), in ms.
    pub p50_ms: Option<f64>,
}

/// Runs rows: `fluksio-zygote sweep`, or `baseline.py` on `--python`.
pub struct Runner {
    exe: PathBuf,
    python: PathBuf,
    python_given: bool,
    baseline: PathBuf,
}

impl Runner {
    pub fn new(options: &WorkloadOptions) -> Runner {
        Runner {
            exe: PathBuf::from(ZYGOTE),
            python: options.python.clone(),
            python_given: options.python_given,
            baseline: options.dir.join("baseline.py"),
        }
    }

    /// `python -c 'import …'`: whether every module the node imports is
    /// there, and, as a side effect, their files in the page cache before
    /// the first timed row.
    pub fn check_imports(&self, modules: &[String]) -> Result<(), String> {
        if modules.is_empty() {
            return Ok(());
        }
        let statement = format!("import {}", modules.join(", "));
        let output = Command::new(&self.python)
            .args(["-c", &statement])
            .stdin(Stdio::null())
            .output()
            .map_err(|e| format!("cannot start {}: {e}", self.python.display()))?;
        if output.status.success() {
            return Ok(());
        }
        let stderr = String::from_utf8_lossy(&output.stderr);
        Err(format!(
            "`{} -c '{statement}'` failed: {}",
            self.python.display(),
            last_line(&stderr)
        ))
    }

    /// The command line of a row, as the report shows it.
    pub fn command(
        &self,
        way: Way,
        node: &Path,
        preload: &[String],
        points: &Path,
        out: &Path,
    ) -> Command {
        if let Some(method) = way.method() {
            let mut command = Command::new(&self.python);
            command
                .arg(&self.baseline)
                .arg(method)
                .arg(node)
                .arg(points)
                .arg(out)
                .arg(JOBS.to_string());
            return command;
        }
        let mut command = Command::new(&self.exe);
        command
            .arg("sweep")
            .arg(node)
            .arg("--input")
            .arg(points)
            .args(["-j", &JOBS.to_string()]);
        if !preload.is_empty() {
            command.args(["--preload", &preload.join(",")]);
        }
        if self.python_given {
            command.arg("--python").arg(&self.python);
        }
        match way {
            Way::Node => command.args(["--isolation", "node"]),
            Way::Reset => command.args(["--isolation", "reset"]),
            Way::ResetWarmup => command.args(["--isolation", "reset", "--warmup", "first"]),
            Way::CallWarmup => command.args(["--isolation", "call", "--warmup", "first"]),
            Way::CallNoLearn => command.args(["--isolation", "call", "--learn-imports", "off"]),
            _ => command.args(["--isolation", "call"]),
        };
        command.arg("-o").arg(out);
        // Warnings only: the default level logs a line per call.
        command.env("RUST_LOG", "warn");
        command
    }

    /// Runs a row to its end: its wall time and its results, or why it has
    /// none.
    pub fn run(
        &self,
        way: Way,
        node: &Path,
        preload: &[String],
        points: &Path,
        n: usize,
        out: &Path,
    ) -> Result<(Measured, Output), String> {
        let _ = std::fs::remove_file(out);
        let command = self.command(way, node, preload, points, out);
        let finished = timed(command)?;
        if !finished.status.success() {
            return Err(why(finished.status, &finished.stderr));
        }
        let text = std::fs::read_to_string(out)
            .map_err(|e| format!("exited 0 but wrote no results ({e})"))?;
        let output = compare::parse(&text, n)?;
        Ok((
            Measured {
                wall: finished.wall,
                cpu: finished.cpu,
                others_cpu: finished.others_cpu,
                p50_ms: way
                    .method()
                    .is_none()
                    .then(|| p50_ms(&finished.stderr))
                    .flatten(),
            },
            output,
        ))
    }
}

/// A command that ran to its end.
struct Finished {
    wall: Duration,
    cpu: Duration,
    others_cpu: Option<Duration>,
    status: ExitStatus,
    stderr: String,
}

/// Runs `command` to its exit, timing it from just before the spawn to the
/// moment `wait` returns. Rows run one at a time, so the growth of this
/// process's children's CPU time over the run is this command's.
fn timed(mut command: Command) -> Result<Finished, String> {
    let program = command.get_program().to_string_lossy().into_owned();
    command
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .process_group(0);
    let cpu_before = rusage(libc::RUSAGE_CHILDREN).0;
    let busy_before = machine_busy();
    let start = Instant::now();
    let mut child = command
        .spawn()
        .map_err(|e| format!("cannot start {program}: {e}"))?;
    let pid = child.id() as libc::pid_t;
    let mut pipe = child.stderr.take();
    let reader = std::thread::spawn(move || {
        let mut text = String::new();
        if let Some(pipe) = pipe.as_mut() {
            let mut bytes = Vec::new();
            let _ = pipe.read_to_end(&mut bytes);
            text = String::from_utf8_lossy(&bytes).into_owned();
        }
        text
    });
    let (sender, receiver) = mpsc::channel();
    std::thread::spawn(move || {
        let status = child.wait();
        let _ = sender.send((status, Instant::now()));
    });
    let waited = match receiver.recv_timeout(ROW_LIMIT) {
        Ok(waited) => Ok(waited),
        Err(_) => {
            // The whole group: a pool's workers with their parent.
            // SAFETY: kill(2) on the process group this function started.
            unsafe { libc::kill(-pid, libc::SIGTERM) };
            if receiver.recv_timeout(TERM_GRACE).is_err() {
                // SAFETY: as above.
                unsafe { libc::kill(-pid, libc::SIGKILL) };
                let _ = receiver.recv();
            }
            Err(format!("timed out after {} s", ROW_LIMIT.as_secs()))
        }
    };
    let stderr = reader.join().unwrap_or_default();
    let (status, end) = waited?;
    let status = status.map_err(|e| format!("waiting for {program}: {e}"))?;
    let cpu_micros = rusage(libc::RUSAGE_CHILDREN).0.saturating_sub(cpu_before);
    let cpu = Duration::from_micros(cpu_micros);
    let others_cpu = busy_before
        .zip(machine_busy())
        .map(|(before, after)| (after.saturating_sub(before)).saturating_sub(cpu));
    Ok(Finished {
        wall: end - start,
        cpu,
        others_cpu,
        status,
        stderr,
    })
}

/// The CPU time the whole machine has been busy (every CPU, since boot):
/// /proc/stat's first line, all but idle and iowait; steal counts, as time
/// a CPU could not give to the row.
fn machine_busy() -> Option<Duration> {
    let stat = std::fs::read_to_string("/proc/stat").ok()?;
    let ticks: Vec<u64> = stat
        .lines()
        .next()?
        .strip_prefix("cpu ")?
        .split_whitespace()
        .map(|t| t.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal (guest is in user).
    let busy: u64 = ticks
        .iter()
        .take(8)
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4)
        .map(|(_, t)| t)
        .sum();
    // SAFETY: sysconf reads a constant.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    (hz > 0).then(|| Duration::from_secs_f64(busy as f64 / hz as f64))
}

/// Why a row failed, from its exit status and stderr: ours' count of
/// failures and its first when it has one (`sweep: 40 calls, 3 failed`,
/// `#7 {…}: …`), else the last line (a Python traceback's exception, our
/// error).
fn why(status: ExitStatus, stderr: &str) -> String {
    use std::os::unix::process::ExitStatusExt;
    let how = match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    };
    let lines: Vec<&str> = stderr.lines().collect();
    let said = match lines.iter().rposition(|l| l.starts_with("sweep: ")) {
        Some(at) => {
            // `sweep: 40 calls, 3 failed`, without the rates.
            let summary = lines[at].split(", in ").next().unwrap_or(lines[at]);
            let first = lines[at + 1..]
                .iter()
                .map(|l| l.trim())
                .find(|l| l.starts_with('#'));
            match first {
                Some(first) => format!("{summary}; {first}"),
                None => summary.to_string(),
            }
        }
        None => last_line(stderr).to_string(),
    };
    let mut text = format!("{how}: {said}");
    if text.chars().count() > WHY_CHARS {
        text = text.chars().take(WHY_CHARS).collect::<String>() + "…";
    }
    text
}

/// The last line with something on it.
fn last_line(text: &str) -> &str {
    text.lines()
        .rev()
        .map(str::trim)
        .find(|l| !l.is_empty())
        .unwrap_or("(nothing on stderr)")
}

/// The p50 of ours' summary line: `sweep: … latency p50 34.10 ms, …`.
fn p50_ms(stderr: &str) -> Option<f64> {
    let summary = stderr.lines().rev().find(|l| l.starts_with("sweep: "))?;
    let (_, after) = summary.split_once("p50 ")?;
    after.split_whitespace().next()?.parse().ok()
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;
    use std::os::unix::process::ExitStatusExt;

    #[test]
    fn the_summary_gives_the_p50() {
        let stderr = "warn: something\nsweep: 600 calls, 0 failed, in 5.68 s: 106 calls/s, \
                      latency p50 34.10 ms, p99 57.09 ms (2 in flight)\n";
        assert_eq!(p50_ms(stderr), Some(34.10));
        assert_eq!(p50_ms("no summary\n"), None);
    }

    #[test]
    fn a_failed_row_says_why() {
        let stderr = "sweep: 40 calls, 3 failed, in 1.00 s: 40 calls/s, latency p50 1.00 ms, \
                      p99 2.00 ms (2 in flight)\n  3 × ValueError\n      #7 {\"x\":7}: bad (line 6)\n";
        assert_eq!(
            why(ExitStatus::from_raw(1 << 8), stderr),
            "exit 1: sweep: 40 calls, 3 failed; #7 {\"x\":7}: bad (line 6)"
        );
        let traceback = "Traceback (most recent call last):\n  File …\n\
                         ModuleNotFoundError: No module named 'sklearn'\n\n";
        assert_eq!(
            why(ExitStatus::from_raw(1 << 8), traceback),
            "exit 1: ModuleNotFoundError: No module named 'sklearn'"
        );
        assert_eq!(
            why(ExitStatus::from_raw(9), ""),
            "killed by signal 9: (nothing on stderr)"
        );
    }
}
