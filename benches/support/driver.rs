//! A worker of the JSON-line contract over its pipes, whichever side serves
//! it: `python worker_main.py` or `fluksio-zygote worker`. The one client
//! every worker row is measured with, so both sides pay the same client.

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::time::{Duration, Instant};

/// A running worker process and its pipes.
pub struct LineWorker {
    child: Child,
    stdin: Option<ChildStdin>,
    stdout: BufReader<ChildStdout>,
    /// Where its stderr goes, read back to say why it failed.
    stderr: PathBuf,
    requests: u64,
}

/// A run request line for node `node` of flow `b`.
pub fn run_request(id: u64, node: &str, source_json: &str, kwargs_json: &str) -> String {
    format!(
        r#"{{"id":{id},"op":"run","flow":"b","node":"{node}","source":{source_json},"kwargs":{kwargs_json}}}"#
    )
}

/// A compile request line.
pub fn compile_request(id: u64, node: &str, source_json: &str) -> String {
    format!(r#"{{"id":{id},"op":"compile","flow":"b","node":"{node}","source":{source_json}}}"#)
}

/// A node's source as a JSON string.
pub fn json_string(text: &str) -> String {
    serde_json::to_string(text).expect("a string encodes")
}

/// Whether a reply line says `ok` (either side's spacing).
pub fn is_ok(line: &str) -> bool {
    line.contains(r#""ok": true"#) || line.contains(r#""ok":true"#)
}

/// Whether a line is an event rather than the reply (both sides put
/// `event` first).
pub fn is_event(line: &str) -> bool {
    line.starts_with(r#"{"event""#)
}

impl LineWorker {
    /// Starts `command` with piped stdin/stdout and stderr to `stderr`.
    pub fn spawn(mut command: Command, stderr: &Path) -> Result<LineWorker, String> {
        let log = std::fs::File::create(stderr)
            .map_err(|e| format!("cannot create {}: {e}", stderr.display()))?;
        let mut child = command
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(log)
            .spawn()
            .map_err(|e| format!("cannot start {:?}: {e}", command.get_program()))?;
        let stdin = child.stdin.take();
        let stdout = BufReader::new(child.stdout.take().expect("piped"));
        Ok(LineWorker {
            child,
            stdin,
            stdout,
            stderr: stderr.to_path_buf(),
            requests: 0,
        })
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// The next request id.
    pub fn next_id(&mut self) -> u64 {
        self.requests += 1;
        self.requests
    }

    /// Writes one request line.
    pub fn send(&mut self, request: &str) -> Result<(), String> {
        let stdin = self.stdin.as_mut().ok_or("the worker's stdin is closed")?;
        writeln!(stdin, "{request}")
            .and_then(|()| stdin.flush())
            .map_err(|e| self.failure(&format!("writing a request: {e}")))
    }

    /// The next line, event or reply.
    pub fn line(&mut self) -> Result<String, String> {
        let mut line = String::new();
        match self.stdout.read_line(&mut line) {
            Ok(0) => Err(self.failure("the worker closed its stdout")),
            Ok(_) => Ok(line),
            Err(e) => Err(self.failure(&format!("reading a reply: {e}"))),
        }
    }

    /// The reply to the request just sent, skipping events.
    pub fn reply(&mut self) -> Result<String, String> {
        loop {
            let line = self.line()?;
            if !is_event(&line) {
                return Ok(line);
            }
        }
    }

    /// Sends a request and reads its reply, which must be `ok`.
    pub fn call(&mut self, request: &str) -> Result<String, String> {
        self.send(request)?;
        let reply = self.reply()?;
        if is_ok(&reply) {
            Ok(reply)
        } else {
            Err(format!("a call failed: {}", reply.trim()))
        }
    }

    /// Compiles `source` as node `node`.
    pub fn compile(&mut self, node: &str, source: &str) -> Result<(), String> {
        let id = self.next_id();
        self.call(&compile_request(id, node, &json_string(source)))
            .map(drop)
    }

    /// `calls` sequential runs of `node` with `{"x": i}`, each timed from
    /// request written to reply read; `spacing` slept between them.
    pub fn time_calls(
        &mut self,
        node: &str,
        source: &str,
        calls: usize,
        spacing: Duration,
    ) -> Result<Vec<Duration>, String> {
        let source = json_string(source);
        let mut samples = Vec::with_capacity(calls);
        for i in 0..calls {
            let id = self.next_id();
            let request = run_request(id, node, &source, &format!(r#"{{"x":{i}}}"#));
            let started = Instant::now();
            self.call(&request)?;
            samples.push(started.elapsed());
            if !spacing.is_zero() {
                std::thread::sleep(spacing);
            }
        }
        Ok(samples)
    }

    /// SIGKILL, as the pool's `kill()` does, and reap.
    pub fn kill(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }

    /// Closes stdin (the worker's end of input) and waits for it.
    pub fn close(mut self) {
        drop(self.stdin.take());
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        self.kill();
    }

    /// `what`, with the end of the worker's stderr.
    fn failure(&mut self, what: &str) -> String {
        let status = match self.child.try_wait() {
            Ok(Some(status)) => format!(" (the worker {status})"),
            _ => String::new(),
        };
        format!("{what}{status}{}", tail(&self.stderr))
    }
}

impl Drop for LineWorker {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The last line of a log file, as `: …`, or nothing.
pub fn tail(path: &Path) -> String {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    match text.lines().rev().find(|l| !l.trim().is_empty()) {
        Some(line) => format!(": {}", line.trim()),
        None => String::new(),
    }
}
