//! What the integration tests share: the binary, the reference, and a
//! client for the JSON-line worker contract with a timeout on every read.

#![allow(dead_code)]

pub mod agent;
pub mod artifact_server;
pub mod engine;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::Duration;

use serde_json::Value;

/// The binary under test.
pub const ZYGOTE: &str = env!("CARGO_BIN_EXE_fluksio-zygote");

/// The builds of the binary that tests of leaks run on: this one, and the
/// release build CI names in `FLUKSIO_TEST_RELEASE_BINARY`. An optimiser
/// drops what a debug build does (a memset before a free is a dead store
/// to it), so what a call can find in memory is checked in both.
pub fn builds() -> Vec<PathBuf> {
    let mut builds = vec![PathBuf::from(ZYGOTE)];
    match std::env::var_os("FLUKSIO_TEST_RELEASE_BINARY") {
        Some(release) => builds.push(PathBuf::from(release)),
        None => eprintln!(
            "FLUKSIO_TEST_RELEASE_BINARY is not set: this build only, not a release build \
             (.ci/run sets it to the one `pip install .` built)"
        ),
    }
    builds
}

/// The shared reference reconstructions, beside the project.
pub fn reference_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../shared/reference")
}

pub fn worker_main() -> PathBuf {
    reference_dir().join("fluksio_worker/worker_main.py")
}

/// The interpreter the binary embeds (and the reference runs on).
pub fn python() -> PathBuf {
    let mut worker = Worker::zygote(&[]);
    let reply = worker.call(&serde_json::json!({
        "id": 0, "op": "run", "flow": "t", "node": "py",
        "source": "import sys\ndef process():\n    return sys.executable\n",
    }));
    PathBuf::from(reply.reply["result"].as_str().expect("sys.executable"))
}

/// How long any one line may take to arrive before a test fails.
pub const LINE_TIMEOUT: Duration = Duration::from_secs(60);

/// A worker process (ours or the reference) and its two streams.
pub struct Worker {
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: Receiver<String>,
    stderr: Receiver<String>,
}

/// Everything one request produced: events in order, then the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct Answer {
    pub events: Vec<Value>,
    pub reply: Value,
}

impl Worker {
    pub fn zygote(args: &[&str]) -> Worker {
        Worker::zygote_of(Path::new(ZYGOTE), args)
    }

    /// `worker` of the build at `binary` (see [`builds`]).
    pub fn zygote_of(binary: &Path, args: &[&str]) -> Worker {
        let mut command = Command::new(binary);
        command.arg("worker").args(args);
        Worker::spawn(command)
    }

    pub fn reference() -> Worker {
        Worker::reference_with(&[])
    }

    /// Ours, with these environment variables set.
    pub fn zygote_with(args: &[&str], env: &[(&str, &str)]) -> Worker {
        let mut command = Command::new(ZYGOTE);
        command.arg("worker").args(args).envs(env.iter().copied());
        Worker::spawn(command)
    }

    /// The reference, with these environment variables set.
    pub fn reference_with(env: &[(&str, &str)]) -> Worker {
        let mut command = Command::new(python());
        command.arg(worker_main()).envs(env.iter().copied());
        Worker::spawn(command)
    }

    pub fn spawn(mut command: Command) -> Worker {
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the worker starts");
        let stdin = child.stdin.take();
        let lines = pump(child.stdout.take().expect("stdout"));
        let stderr = pump(child.stderr.take().expect("stderr"));
        Worker {
            child,
            stdin,
            lines,
            stderr,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn send_line(&mut self, line: &[u8]) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        stdin.write_all(line).expect("request written");
        stdin.write_all(b"\n").expect("request written");
        stdin.flush().expect("request flushed");
    }

    pub fn send(&mut self, request: &Value) {
        self.send_line(request.to_string().as_bytes());
    }

    /// The next line on stdout, parsed.
    pub fn next_line(&mut self) -> Value {
        let line = match self.lines.recv_timeout(LINE_TIMEOUT) {
            Ok(line) => line,
            Err(RecvTimeoutError::Timeout) => panic!("no line within {LINE_TIMEOUT:?}"),
            Err(RecvTimeoutError::Disconnected) => {
                panic!("stdout closed; stderr: {}", self.stderr_so_far())
            }
        };
        serde_json::from_str(&line).unwrap_or_else(|e| panic!("not JSON ({e}): {line:?}"))
    }

    /// Reads lines up to and including the reply.
    pub fn answer(&mut self) -> Answer {
        let mut events = Vec::new();
        loop {
            let line = self.next_line();
            if line
                .get("event")
                .is_some_and(|e| !e.is_null() && e != false && e != "")
            {
                events.push(line);
            } else {
                return Answer {
                    events,
                    reply: line,
                };
            }
        }
    }

    pub fn call(&mut self, request: &Value) -> Answer {
        self.send(request);
        self.answer()
    }

    /// Closes stdin and waits for the exit; returns the code and stderr.
    pub fn finish(mut self) -> (Option<i32>, String) {
        drop(self.stdin.take());
        let status = self.child.wait().expect("the worker exits");
        let stderr = self.stderr_so_far_blocking();
        (status.code(), stderr)
    }

    pub fn stderr_so_far(&self) -> String {
        let mut text = String::new();
        while let Ok(line) = self.stderr.try_recv() {
            text.push_str(&line);
            text.push('\n');
        }
        text
    }

    fn stderr_so_far_blocking(&self) -> String {
        let mut text = String::new();
        while let Ok(line) = self.stderr.recv_timeout(Duration::from_secs(5)) {
            text.push_str(&line);
            text.push('\n');
        }
        text
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Lines of `stream`, read on a thread so every read can time out.
fn pump(stream: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (send, receive) = channel();
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        loop {
            let mut line = Vec::new();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    let text = String::from_utf8_lossy(&line)
                        .trim_end_matches('\n')
                        .to_string();
                    if send.send(text).is_err() {
                        return;
                    }
                }
            }
        }
    });
    receive
}

/// A run request for `source` with `kwargs`.
/// The variables that size thread pools, which no test inherits where it
/// depends on them (this machine may set `OPENBLAS_*`).
pub const THREAD_VARIABLES: [&str; 9] = [
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "GOTO_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "FLUKSIO_THREADS_PER_CALL",
];

pub fn run(id: i64, node: &str, source: &str, kwargs: Value) -> Value {
    serde_json::json!({"id": id, "op": "run", "flow": "t", "node": node, "source": source, "kwargs": kwargs})
}

pub fn compile(id: i64, node: &str, source: &str) -> Value {
    serde_json::json!({"id": id, "op": "compile", "flow": "t", "node": node, "source": source})
}

/// A node whose module level waits for `gate` to exist (a minute at most):
/// ten seconds of reading a checkpoint, as long as a test needs.
pub fn gated_source(gate: &std::path::Path, result: &str) -> String {
    format!(
        "import os, time\nfor _ in range(6000):\n    if os.path.exists({gate:?}):\n        break\n    time.sleep(0.01)\ndef process():\n    return {result:?}\n"
    )
}

/// A fresh, empty directory for one test, removed with all it holds when the
/// test ends, a failed one too: some tests write gigabytes, on a disk that
/// other runs share.
pub fn scratch(name: &str) -> Scratch {
    let dir = std::env::temp_dir().join(format!("fz-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("a scratch directory");
    Scratch(dir)
}

/// A test's directory; see [`scratch`]. Bind it for as long as the test
/// uses it: a temporary one is gone at the end of its statement.
pub struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<Path> for Scratch {
    fn as_ref(&self) -> &Path {
        &self.0
    }
}

impl AsRef<std::ffi::OsStr> for Scratch {
    fn as_ref(&self) -> &std::ffi::OsStr {
        self.0.as_os_str()
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Whether `pid` is gone: no such process, or a zombie nobody reaped yet.
pub fn is_gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(stat) => stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().next())
            .is_some_and(|state| state == "Z" || state == "X"),
    }
}

/// Waits until `pid` is gone; false if it still runs after `limit`.
pub fn wait_gone(pid: i32, limit: Duration) -> bool {
    let start = std::time::Instant::now();
    while start.elapsed() < limit {
        if is_gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    is_gone(pid)
}

/// The parent of a live process.
pub fn parent_of(pid: i32) -> i32 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).expect("alive");
    let (_, rest) = stat.rsplit_once(')').expect("a stat line");
    rest.split_whitespace()
        .nth(1)
        .and_then(|ppid| ppid.parse().ok())
        .expect("a parent pid")
}

/// The pids whose parent is `parent`, with their state letter.
pub fn children_of(parent: i32) -> Vec<(i32, char)> {
    let mut found = Vec::new();
    for entry in std::fs::read_dir("/proc").expect("/proc") {
        let Ok(entry) = entry else { continue };
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
            continue;
        };
        let Some((_, rest)) = stat.rsplit_once(')') else {
            continue;
        };
        let fields: Vec<&str> = rest.split_whitespace().collect();
        if fields.get(1).and_then(|p| p.parse::<i32>().ok()) == Some(parent) {
            found.push((pid, fields[0].chars().next().unwrap_or('?')));
        }
    }
    found
}

/// The pids in a JSON array (an emit's `outputs.pids`, a result).
pub fn pids_in(value: &Value) -> Vec<i32> {
    value
        .as_array()
        .unwrap_or_else(|| panic!("not a list of pids: {value}"))
        .iter()
        .map(|p| p.as_i64().expect("a pid") as i32)
        .collect()
}

/// SIGKILL to `pid`, as the engine's pool ends a worker.
pub fn sigkill(pid: i32) {
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("the process is there to kill");
}

/// Searches every readable page of its own memory for `needle` (sent
/// masked, so the only copy the scan makes itself is skipped by address),
/// and names the mappings it was found in.
pub const MEMORY_SCAN: &str = r#"import ctypes
def process(masked):
    needle = bytes(b ^ 0x5A for b in bytes.fromhex(masked))
    own = id(needle) + 32  # a bytes object's data follows its 32-byte header
    buf = bytearray(1 << 20)
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    hits = []
    with open("/proc/self/mem", "rb", buffering=0) as mem:
        for line in open("/proc/self/maps"):
            fields = line.split()
            if "r" not in fields[1] or fields[-1] in ("[vvar]", "[vsyscall]"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            at = start
            while at < end:
                want = min(len(buf), end - at)
                try:
                    mem.seek(at)
                    got = mem.readinto(memoryview(buf)[:want])
                except OSError:
                    break
                i = buf.find(needle, 0, got)
                while i >= 0:
                    if at + i != own and not base <= at + i < base + len(buf):
                        hits.append(fields[-1] if len(fields) > 5 else "anonymous")
                    i = buf.find(needle, i + 1, got)
                # Overlap the chunks, so a needle across a boundary is found.
                at += max(got - len(needle), 1) if got == want else want
    return hits
"#;

pub fn masked(secret: &str) -> String {
    secret
        .bytes()
        .map(|b| format!("{:02x}", b ^ 0x5A))
        .collect()
}
