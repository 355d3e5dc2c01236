//! `serve`: a service node's command (a model server, say), kept running
//! until it exits or the engine ends the call.
//!
//! Not Python and not the zygote's: an `argv` run in its own session, with
//! node code's environment, what it prints going to this agent's log (the
//! last of it kept, to say why it ended). `{weights}` in the argv becomes the
//! local path of an artifact, fetched and verified before the start.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::value::RawValue;
use tokio::io::AsyncReadExt;
use tokio::sync::oneshot;

use super::outbox::Outbox;
use super::state::Agent;
use crate::artifacts::Digest;
use crate::artifacts::store::Store;
use crate::python_str::{python_str, python_str_or_empty};

/// How long a stopped service gets to shut down before its group is killed.
const STOP_GRACE: Duration = Duration::from_secs(3);
/// How much of what a service printed last is kept, to say why it ended.
const TAIL_BYTES: usize = 4096;

/// Runs one service to its end, then says why it ended.
pub async fn serve(
    agent: Arc<Agent>,
    outbox: Arc<Outbox>,
    key: u64,
    request: BTreeMap<String, Box<RawValue>>,
    stop: oneshot::Receiver<()>,
) {
    let started = Instant::now();
    let call_id = python_str_or_empty(request.get("call_id").map(|r| &**r));
    tracing::info!(call = %call_id, "serve started");
    let heartbeat = outbox.heartbeat(&call_id);
    let reason = run(&agent, &request, stop).await;
    heartbeat.abort();
    outbox.leave_service(key);
    agent.call_ended();
    tracing::info!(call = %call_id, seconds = started.elapsed().as_secs_f64(), "serve ended: {reason}");
    let reply = serde_json::json!({
        "call_id": call_id,
        "ok": false,
        "error": {"type": "ServiceStopped", "message": reason, "short": reason, "traceback": ""},
    });
    outbox.send_raw(reply.to_string().as_bytes()).await;
}

async fn run(
    agent: &Agent,
    request: &BTreeMap<String, Box<RawValue>>,
    mut stop: oneshot::Receiver<()>,
) -> String {
    let argv: Vec<String> = match request
        .get("argv")
        .map(|raw| serde_json::from_str::<Vec<Box<RawValue>>>(raw.get()))
    {
        Some(Ok(parts)) if !parts.is_empty() => parts.iter().map(|p| python_str(p)).collect(),
        _ => return "ValueError: a serve call needs a non-empty argv".into(),
    };
    let mut env: BTreeMap<String, String> = agent.node_env.clone();
    if let Some(Ok(extra)) = request
        .get("env")
        .map(|raw| serde_json::from_str::<BTreeMap<String, Box<RawValue>>>(raw.get()))
    {
        for (key, value) in extra {
            env.insert(key, python_str(&value));
        }
    }
    let weights = python_str_or_empty(request.get("weights").map(|r| &**r));
    let argv = if weights.is_empty() {
        argv
    } else {
        let fetched = match Digest::parse(&weights) {
            Ok(digest) => {
                let store = Store::from_vars(|name| env.get(name).cloned());
                tokio::task::spawn_blocking(move || store.load(&digest).map_err(|e| e.to_string()))
                    .await
                    .unwrap_or_else(|e| Err(e.to_string()))
            }
            Err(why) => Err(why),
        };
        match fetched {
            Ok(path) => {
                let path = path.display().to_string();
                argv.into_iter()
                    .map(|part| part.replace("{weights}", &path))
                    .collect()
            }
            Err(why) => return format!("RuntimeError: could not fetch {weights}: {why}"),
        }
    };

    // One pipe for stdout and stderr, as agent.py has it: the last line is
    // the last one written, whichever stream it went to.
    let (output, output_write) = match nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC) {
        Ok(pipe) => pipe,
        Err(error) => return format!("OSError: could not make a pipe: {error}"),
    };
    let stderr_write = match output_write.try_clone() {
        Ok(fd) => fd,
        Err(error) => return format!("OSError: could not make a pipe: {error}"),
    };
    let mut command = std::process::Command::new(&argv[0]);
    command
        .args(&argv[1..])
        .env_clear()
        .envs(&env)
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::from(output_write))
        .stderr(std::process::Stdio::from(stderr_write));
    // Everything the service starts stays in its cell, whatever session it
    // makes: ended with it, or by the warden if the agent is killed.
    let mut cell = match crate::containment::Cell::new() {
        Ok(cell) => cell,
        Err(error) => return format!("OSError: could not make the service's cgroup: {error}"),
    };
    let (procs, _) = cell.procs_fds();
    crate::process::Start {
        join_cell: procs,
        own_session: true,
        dies_with_parent: true,
        ..Default::default()
    }
    .on(&mut command);
    let spawned = tokio::process::Command::from(command).spawn();
    cell.forked();
    let mut child = match spawned {
        Ok(child) => child,
        Err(error) => return format!("{}: {error}", io_kind_name(&error)),
    };
    let pid = child.id().unwrap_or(0) as i32;
    let mut exit = Exit::watch(pid);
    let Ok(mut output) = tokio::net::unix::pipe::Receiver::from_owned_fd(output) else {
        stop_group(pid, &mut exit, &mut child).await;
        return "OSError: could not read the service's output".into();
    };
    let mut tail: Vec<u8> = Vec::new();
    let mut open = true;
    let mut buffer = vec![0u8; 65536];
    loop {
        tokio::select! {
            read = output.read(&mut buffer), if open => match read {
                Ok(0) | Err(_) => open = false,
                Ok(n) => keep(&mut tail, &buffer[..n]),
            },
            () = exit.exited(), if !open => break,
            _ = &mut stop => {
                stop_group(pid, &mut exit, &mut child).await;
                cell.kill();
                return "the service was stopped".into();
            }
        }
    }
    // Whatever it left running in its session goes with it, killed while
    // the leader is not yet reaped (its pid still names the group).
    let _ = nix::sys::signal::killpg(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    );
    cell.kill();
    let status = child.wait().await.ok();
    let code = status.and_then(|s| {
        s.code()
            .or_else(|| std::os::unix::process::ExitStatusExt::signal(&s).map(|s| 128 + s))
    });
    let mut reason = format!(
        "the service exited with code {}",
        code.map_or("?".into(), |c| c.to_string())
    );
    let text = String::from_utf8_lossy(&tail);
    if let Some(last) = text.trim().lines().last() {
        reason.push_str(": ");
        reason.extend(last.chars().take(300));
    }
    reason
}

/// Echoes a service's output to the agent's log and keeps its tail.
fn keep(tail: &mut Vec<u8>, chunk: &[u8]) {
    use std::io::Write;
    let _ = std::io::stderr().write_all(chunk);
    tail.extend_from_slice(chunk);
    if tail.len() > TAIL_BYTES {
        tail.drain(..tail.len() - TAIL_BYTES);
    }
}

/// SIGTERM to the group, a moment to shut down, then SIGKILL to the rest;
/// reaped only then, so the group is never signalled by a pid reused.
async fn stop_group(pid: i32, exit: &mut Exit, child: &mut tokio::process::Child) {
    let group = nix::unistd::Pid::from_raw(pid);
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
    let _ = tokio::time::timeout(STOP_GRACE, exit.exited()).await;
    crate::process::kill_group(group, nix::sys::signal::Signal::SIGKILL);
    let _ = child.wait().await;
}

/// A service leader's exit, seen without reaping it (its pidfd).
struct Exit {
    pid: nix::unistd::Pid,
    pidfd: Option<tokio::io::unix::AsyncFd<std::os::fd::OwnedFd>>,
}

impl Exit {
    fn watch(pid: i32) -> Exit {
        let pid = nix::unistd::Pid::from_raw(pid);
        let fd = crate::process::ExitWatch::new(pid).into_fd();
        // SAFETY: an OwnedFd stays open and the same until the AsyncFd drops.
        let pidfd = fd.and_then(|fd| unsafe { tokio::io::unix::AsyncFd::register(fd) }.ok());
        Exit { pid, pidfd }
    }

    /// Resolves once the leader has exited (it is left for `wait` to reap).
    async fn exited(&mut self) {
        match &self.pidfd {
            Some(pidfd) => {
                let _ = pidfd.readable().await;
            }
            // No pidfd on this kernel: ask as often as `PollSet` does.
            None => {
                let every = crate::poll_set::FALLBACK_POLL_MS.into();
                while !crate::process::has_exited(self.pid) {
                    tokio::time::sleep(std::time::Duration::from_millis(every)).await;
                }
            }
        }
    }
}

fn io_kind_name(error: &std::io::Error) -> &'static str {
    match error.kind() {
        std::io::ErrorKind::NotFound => "FileNotFoundError",
        std::io::ErrorKind::PermissionDenied => "PermissionError",
        _ => "OSError",
    }
}
