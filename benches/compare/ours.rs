//! Our side of the matrix: the `fluksio-zygote` binary, as `worker` (one
//! call at a time, the pool drop-in) and as `sweep` (several calls in
//! flight from one zygote).

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::support::driver::LineWorker;

/// How our rows run their zygote.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Variant {
    /// `--isolation call`, the default standby.
    Call,
    /// `--isolation call --standby N`.
    Standby(usize),
    /// `--isolation node`: one resident child per node.
    Node,
    /// `--isolation reset`: one resident child per node, put back after
    /// each call.
    Reset,
}

/// The `fluksio-zygote` binary, with the zygote flags every row shares.
#[derive(Debug, Clone)]
pub struct Ours {
    pub exe: PathBuf,
    pub preload: Vec<String>,
    /// `--python`, when the bench was given one.
    pub python: Option<PathBuf>,
}

impl Ours {
    fn command(&self, subcommand: &str, variant: Variant) -> Command {
        let mut command = Command::new(&self.exe);
        command.arg(subcommand).env("RUST_LOG", "warn");
        if !self.preload.is_empty() {
            command.args(["--preload", &self.preload.join(",")]);
        }
        if let Some(python) = &self.python {
            command.arg("--python").arg(python);
        }
        match variant {
            Variant::Call => {
                command.args(["--isolation", "call"]);
            }
            Variant::Standby(n) => {
                command.args(["--isolation", "call", "--standby", &n.to_string()]);
            }
            Variant::Node => {
                command.args(["--isolation", "node"]);
            }
            Variant::Reset => {
                command.args(["--isolation", "reset"]);
            }
        }
        command
    }

    /// The environment that gives the pool drop-in the same flags (the pool
    /// passes none).
    pub fn pool_env(&self, variant: Variant) -> Vec<(&'static str, String)> {
        let mut env = vec![("FLUKSIO_PRELOAD", self.preload.join(","))];
        if let Some(python) = &self.python {
            env.push(("FLUKSIO_PYTHON", python.display().to_string()));
        }
        match variant {
            Variant::Call => env.push(("FLUKSIO_ISOLATION", "call".into())),
            Variant::Standby(n) => {
                env.push(("FLUKSIO_ISOLATION", "call".into()));
                env.push(("FLUKSIO_STANDBY", n.to_string()));
            }
            Variant::Node => env.push(("FLUKSIO_ISOLATION", "node".into())),
            Variant::Reset => env.push(("FLUKSIO_ISOLATION", "reset".into())),
        }
        env
    }

    /// `fluksio-zygote worker` with `node` compiled (which also waits for
    /// the preloads).
    pub fn worker(
        &self,
        variant: Variant,
        log: &Path,
        node: &str,
        source: &str,
    ) -> Result<LineWorker, String> {
        let mut worker = LineWorker::spawn(self.command("worker", variant), log)?;
        worker.compile(node, source)?;
        Ok(worker)
    }

    /// `fluksio-zygote worker --shared-zygote`: a pool slot of the zygote
    /// shared by every slot started alike, `node` compiled.
    pub fn slot(&self, log: &Path, node: &str, source: &str) -> Result<LineWorker, String> {
        let mut command = self.command("worker", Variant::Call);
        command.arg("--shared-zygote");
        let mut worker = LineWorker::spawn(command, log)?;
        worker.compile(node, source)?;
        Ok(worker)
    }

    /// The shared zygotes (`zygote --listen …`) of this binary running now;
    /// not their children, which fork with the same command line.
    pub fn shared_zygotes(&self) -> Vec<u32> {
        let all = self.listening();
        let parent = |pid: &u32| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                })
        };
        all.iter()
            .copied()
            .filter(|pid| !parent(pid).is_some_and(|p| all.contains(&p)))
            .collect()
    }

    fn listening(&self) -> Vec<u32> {
        let exe = std::fs::canonicalize(&self.exe).unwrap_or_else(|_| self.exe.clone());
        let Ok(entries) = std::fs::read_dir("/proc") else {
            return Vec::new();
        };
        entries
            .flatten()
            .filter_map(|e| e.file_name().to_str()?.parse::<u32>().ok())
            .filter(|pid| {
                let same_exe =
                    std::fs::read_link(format!("/proc/{pid}/exe")).is_ok_and(|p| p == exe);
                let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
                let args: Vec<&[u8]> = cmdline.split(|&b| b == 0).collect();
                same_exe
                    && args.get(1).is_some_and(|a| *a == b"zygote")
                    && args.iter().any(|a| *a == b"--listen")
            })
            .collect()
    }

    /// `fluksio-zygote sweep NODE --grid x=0..calls-1 -j jobs`, started.
    pub fn start_sweep(
        &self,
        variant: Variant,
        node: &Path,
        (calls, jobs): (usize, usize),
        kwargs: Option<&str>,
        extra: &[&str],
    ) -> Result<Child, String> {
        let mut command = self.command("sweep", variant);
        command
            .arg(node)
            .args(["--grid", &format!("x=0..{}", calls.max(1) - 1)])
            .args(["-j", &jobs.to_string()])
            .args(extra);
        if let Some(kwargs) = kwargs {
            command.args(["--kwargs", kwargs]);
        }
        command
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.exe.display()))
    }

    /// Runs a sweep to its end: calls/s as its summary line says (from its
    /// first call to its last reply, start-up and compile excluded).
    pub fn sweep_rate(
        &self,
        variant: Variant,
        node: &Path,
        (calls, jobs): (usize, usize),
        extra: &[&str],
    ) -> Result<f64, String> {
        let child = self.start_sweep(variant, node, (calls, jobs), None, extra)?;
        finish_sweep(child)
    }
}

/// Waits for a sweep and reads its rate from the summary line
/// `sweep: N calls, F failed, in S s: …`.
pub fn finish_sweep(mut child: Child) -> Result<f64, String> {
    let mut stderr = String::new();
    if let Some(mut pipe) = child.stderr.take() {
        let _ = pipe.read_to_string(&mut stderr);
    }
    let status = child.wait().map_err(|e| format!("the sweep: {e}"))?;
    let summary = stderr
        .lines()
        .rev()
        .find(|l| l.starts_with("sweep: "))
        .ok_or_else(|| {
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            format!("the sweep printed no summary ({status}): {last}")
        })?;
    let number_before = |suffix: &str| -> Option<f64> {
        let head = summary.split(suffix).next()?;
        head.rsplit([' ', ','])
            .find(|w| !w.is_empty())?
            .parse()
            .ok()
    };
    let unreadable = || format!("unreadable: {summary}");
    let calls = number_before(" calls,").ok_or_else(unreadable)?;
    let failed = number_before(" failed,").unwrap_or(0.0);
    let seconds = number_before(" s:").ok_or_else(unreadable)?;
    let printed_rate = number_before(" calls/s").ok_or_else(unreadable)?;
    if failed > 0.0 {
        return Err(format!("calls failed: {summary}"));
    }
    // The seconds are printed to 0.01 s, the rate to 1 call/s: the finer of
    // the two.
    Ok(if seconds >= 1.0 {
        calls / seconds
    } else {
        printed_rate
    })
}
