//! The baselines, run from the reference files: `worker_main.py` reused
//! (what the engine's pool does between crashes), a fresh one per call
//! (what agent.py does), and the engine's own `PythonWorkerPool` as a
//! client (`fluksio/flow/workers.py`, where the reference directory has it).

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use super::driver::{self, LineWorker};

/// Where the reference files are, and the interpreter they run on.
#[derive(Debug, Clone)]
pub struct Reference {
    pub dir: PathBuf,
    pub python: PathBuf,
}

impl Reference {
    /// `DIR/fluksio_worker/worker_main.py`, if it is there.
    pub fn worker_main(&self) -> Result<PathBuf, String> {
        let path = self.dir.join("fluksio_worker").join("worker_main.py");
        if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "{} not found (--reference is the directory that holds fluksio_worker/worker_main.py)",
                path.display()
            ))
        }
    }

    /// `DIR/fluksio/flow/workers.py`: the engine's pool, for the pool-client
    /// rows. An installed fluksio-worker does not have it.
    pub fn pool_module(&self) -> Result<PathBuf, String> {
        let path = self.dir.join("fluksio").join("flow").join("workers.py");
        if path.is_file() {
            Ok(path)
        } else {
            Err(format!(
                "{} not found: the engine's PythonWorkerPool is not in --reference",
                path.display()
            ))
        }
    }

    /// `python worker_main.py`, as the pool starts it.
    pub fn command(&self) -> Result<Command, String> {
        let mut command = Command::new(&self.python);
        command.arg(self.worker_main()?);
        Ok(command)
    }

    /// A reused worker with `node` compiled, as the pool's `_warm` leaves it.
    pub fn reused(&self, log: &Path, node: &str, source: &str) -> Result<LineWorker, String> {
        let mut worker = LineWorker::spawn(self.command()?, log)?;
        worker.compile(node, source)?;
        Ok(worker)
    }

    /// agent.py's way: a fresh interpreter per call, request written → reply
    /// read, start-up and every import included.
    pub fn spawn_per_call(
        &self,
        log: &Path,
        source: &str,
        calls: usize,
    ) -> Result<Vec<Duration>, String> {
        let source = driver::json_string(source);
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls {
            let request = driver::run_request(1, "n", &source, &format!(r#"{{"x":{i}}}"#));
            let started = Instant::now();
            let mut worker = LineWorker::spawn(self.command()?, log)?;
            worker.call(&request)?;
            samples.push(started.elapsed());
            worker.close();
        }
        Ok(samples)
    }

    /// `fresh` spawn-per-call workers at once, `calls` in all: calls/s with
    /// that many in flight.
    pub fn spawn_rate(
        &self,
        log: &Path,
        source: &str,
        calls: usize,
        in_flight: usize,
    ) -> Result<f64, String> {
        let per = calls.div_ceil(in_flight).max(1);
        let started = Instant::now();
        std::thread::scope(|scope| {
            let handles: Vec<_> = (0..in_flight)
                .map(|k| {
                    let log = log.with_extension(format!("{k}"));
                    scope.spawn(move || self.spawn_per_call(&log, source, per))
                })
                .collect();
            for handle in handles {
                handle.join().expect("a client thread")?;
            }
            Ok::<(), String>(())
        })?;
        Ok((per * in_flight) as f64 / started.elapsed().as_secs_f64())
    }

    /// Sequential calls through the engine's own `PythonWorkerPool(interpreter,
    /// size=1)`, timed around `pool.run` in Python: the pool's client costs
    /// on both sides. `env` goes into the pool's environment (the pool passes
    /// its environment to its workers: FLUKSIO_ISOLATION for ours).
    pub fn through_pool(
        &self,
        interpreter: &Path,
        env: &[(&str, String)],
        source: &str,
        calls: usize,
        spacing: Duration,
    ) -> Result<Vec<Duration>, String> {
        self.pool_module()?;
        let mut child = Command::new(&self.python)
            .args(["-c", POOL_CLIENT])
            .arg(&self.dir)
            .arg(interpreter)
            .arg(calls.to_string())
            .arg(spacing.as_secs_f64().to_string())
            .envs(env.iter().map(|(k, v)| (k, v)))
            .env("RUST_LOG", "warn")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|e| format!("cannot start {}: {e}", self.python.display()))?;
        let mut stdin = child.stdin.take().expect("piped");
        stdin
            .write_all(source.as_bytes())
            .map_err(|e| format!("the pool client: {e}"))?;
        drop(stdin);
        let output = child
            .wait_with_output()
            .map_err(|e| format!("the pool client: {e}"))?;
        if !output.status.success() {
            let stderr = String::from_utf8_lossy(&output.stderr);
            let last = stderr
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("");
            return Err(format!(
                "the pool client failed ({}): {last}",
                output.status
            ));
        }
        let samples: Vec<Duration> = BufReader::new(&output.stdout[..])
            .lines()
            .map_while(Result::ok)
            .filter_map(|l| l.trim().parse::<f64>().ok())
            .map(Duration::from_secs_f64)
            .collect();
        if samples.len() != calls {
            return Err(format!(
                "the pool client timed {} of {calls} calls",
                samples.len()
            ));
        }
        Ok(samples)
    }
}

/// The engine's pool as a client: `python -c POOL_CLIENT REFDIR INTERPRETER
/// CALLS SPACING_S`, the node's source on stdin; one line per call, its
/// seconds. Imports `fluksio.flow.workers` from REFDIR (it needs orjson).
const POOL_CLIENT: &str = r#"
import sys, time
sys.path.insert(0, sys.argv[1])
from fluksio.flow.workers import PythonWorkerPool
interpreter, calls, spacing = sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
source = sys.stdin.read()
pool = PythonWorkerPool(interpreter, size=1)
pool.start()
problem = pool.compile("b", "n", source)
if problem:
    sys.exit(f"compile: {problem}")
pool.run("b", "n", source, {"x": 0}, node_id="b.n", timeout=60)
out = []
for i in range(calls):
    started = time.perf_counter()
    result = pool.run("b", "n", source, {"x": i}, node_id="b.n", timeout=60)
    out.append(time.perf_counter() - started)
    if result != i + 1:
        sys.exit(f"call {i} returned {result!r}")
    if spacing:
        time.sleep(spacing)
pool.stop()
print("\n".join(repr(s) for s in out))
"#;
