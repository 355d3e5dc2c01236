//! The agent's zygote: launched as `fluksio-zygote zygote --link-fd 3`,
//! driven over the link, restarted when it dies.
//!
//! The agent is a tokio program with threads, so it never forks user code:
//! the zygote does, in a process of its own (its own session, dead with the
//! agent), with node code's environment. Frames from it are routed to the
//! call they belong to by ticket.

use std::collections::HashMap;
use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use tokio::io::unix::AsyncFd;
use tokio::sync::mpsc;

use crate::link::{Frame, NotReady, Received, Receiver};

/// How to launch a zygote.
#[derive(Debug, Clone)]
pub struct Launch {
    pub python: PathBuf,
    pub preload: Vec<String>,
    /// Each call's memory limit, MiB.
    pub memory_limit_mib: Option<u64>,
    /// Children the zygote forks ahead of their calls.
    pub standby: usize,
    /// The most zygotes forking one node's calls (`--lanes`).
    pub lanes: Option<usize>,
    /// Node code's environment (the host's, credentials taken out).
    pub env: Vec<(String, String)>,
    /// The worker's token, for the artifact store; the zygote takes it out
    /// of its environment before any node code runs.
    pub token: String,
    /// `--metrics`: the page the zygote writes its numbers into.
    pub metrics_page: Option<Arc<OwnedFd>>,
    /// `--isolation reset` (the agent serves no other resident), and
    /// `--max-calls-per-child`.
    pub reset: bool,
    pub max_calls_per_child: Option<u64>,
    /// `--threads-per-call`, `--learn-imports`.
    pub threads_per_call: Option<usize>,
    pub learn_imports: bool,
}

/// What a call hears from the zygote.
#[derive(Debug)]
pub enum Event {
    Frame(Frame),
    /// The zygote ended (crashed, killed): the call cannot go on.
    Gone(String),
}

/// A running zygote.
pub struct Zygote {
    link: AsyncFd<OwnedFd>,
    writing: tokio::sync::Mutex<()>,
    calls: Mutex<HashMap<u64, mpsc::UnboundedSender<Event>>>,
    next_ticket: AtomicU64,
    gone: Mutex<Option<String>>,
    pid: u32,
}

impl Zygote {
    /// Launches one and waits until its preloads are imported. `Err` says
    /// why it did not start: its own words when it could say them.
    pub async fn start(launch: &Launch) -> Result<Arc<Zygote>, String> {
        let (ours, theirs) = std::os::unix::net::UnixStream::pair().map_err(|e| e.to_string())?;
        let theirs: OwnedFd = theirs.into();
        let theirs_fd = theirs.as_raw_fd();
        let mut command =
            std::process::Command::new(std::env::current_exe().map_err(|e| e.to_string())?);
        command
            .args(["zygote", "--link-fd", "3", "--python"])
            .arg(&launch.python);
        if !launch.preload.is_empty() {
            command.arg("--preload").arg(launch.preload.join(","));
        }
        command.arg("--standby").arg(launch.standby.to_string());
        if let Some(lanes) = launch.lanes {
            command.arg("--lanes").arg(lanes.to_string());
        }
        // The agent's own limit, for the lines the zygote reads (compiles).
        command
            .arg("--max-reply-mb")
            .arg(crate::lines::max_reply_mb().to_string());
        if let Some(mib) = launch.memory_limit_mib {
            command.arg("--call-memory-limit").arg(mib.to_string());
        }
        if launch.reset {
            command.args(["--isolation", "reset"]);
        }
        if let Some(calls) = launch.max_calls_per_child {
            command.arg("--max-calls-per-child").arg(calls.to_string());
        }
        if let Some(threads) = launch.threads_per_call {
            command.arg("--threads-per-call").arg(threads.to_string());
        }
        if !launch.learn_imports {
            command.args(["--learn-imports", "off"]);
        }
        let page_fd = launch.metrics_page.as_ref().map(|page| page.as_raw_fd());
        if page_fd.is_some() {
            command.args(["--metrics-fd", "4"]);
        }
        command
            .env_clear()
            .envs(launch.env.iter().map(|(k, v)| (k, v)))
            .env(crate::artifacts::TOKEN_ENV, &launch.token)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::from(
                std::io::stderr()
                    .as_fd()
                    .try_clone_to_owned()
                    .map_err(|e| e.to_string())?,
            ));
        // Its link at 3 (and the metrics page at 4); in a session of its
        // own, dead with the agent, and with it every call it forked.
        let mut fds = vec![(theirs_fd, 3)];
        fds.extend(page_fd.map(|page| (page, 4)));
        crate::process::Start {
            fds,
            own_session: true,
            dies_with_parent: true,
            ..Default::default()
        }
        .on(&mut command);
        let mut child = tokio::process::Command::from(command)
            .kill_on_drop(false)
            .spawn()
            .map_err(|e| format!("could not start the zygote: {e}"))?;
        drop(theirs);
        let pid = child.id().unwrap_or(0);
        ours.set_nonblocking(true).map_err(|e| e.to_string())?;
        let zygote = Arc::new(Zygote {
            // SAFETY: an OwnedFd's fd stays open and the same until it drops,
            // which is when the AsyncFd drops.
            link: unsafe { AsyncFd::register(OwnedFd::from(ours)) }.map_err(|e| e.to_string())?,
            writing: tokio::sync::Mutex::new(()),
            calls: Mutex::new(HashMap::new()),
            next_ticket: AtomicU64::new(1),
            gone: Mutex::new(None),
            pid,
        });
        let mut receiver = Receiver::default();
        let started = zygote.first_frame(&mut receiver).await;
        match started {
            Ok(()) => {}
            Err(why) => {
                // It may still be running (it said something else first).
                let _ = child.start_kill();
                let status = child.wait().await.ok();
                return Err(match status {
                    Some(status) if why.is_empty() => {
                        format!("the zygote ended as it started ({status})")
                    }
                    _ => why,
                });
            }
        }
        tokio::spawn(reap(child));
        tokio::spawn(Arc::clone(&zygote).route(receiver));
        Ok(zygote)
    }

    async fn first_frame(&self, receiver: &mut Receiver) -> Result<(), String> {
        loop {
            match receiver.ready() {
                Some(Ok(())) => return Ok(()),
                Some(Err(NotReady::Failed(message))) => return Err(message),
                Some(Err(NotReady::Said(other))) => {
                    return Err(format!("the zygote said {other:?} before it was ready"));
                }
                Some(Err(NotReady::Closed)) => return Err(String::new()),
                None => {}
            }
            match self.receive(receiver).await {
                Ok(true) => {}
                Ok(false) => return Err(String::new()),
                Err(error) => return Err(error.to_string()),
            }
        }
    }

    /// One read from the link; false once it closed.
    async fn receive(&self, receiver: &mut Receiver) -> std::io::Result<bool> {
        loop {
            let mut guard = self.link.readable().await?;
            match receiver.receive(self.link.get_ref().as_fd())? {
                Received::Data => return Ok(true),
                Received::Closed => return Ok(false),
                Received::WouldBlock => guard.clear_ready(),
            }
        }
    }

    /// Routes every frame to its call until the link closes.
    async fn route(self: Arc<Self>, mut receiver: Receiver) {
        let why = loop {
            loop {
                match receiver.next_frame() {
                    Ok(Some(frame)) => self.deliver(frame),
                    Ok(None) => break,
                    Err(error) => {
                        self.end(format!("the zygote sent an unreadable frame: {error}"));
                        return;
                    }
                }
            }
            match self.receive(&mut receiver).await {
                Ok(true) => {}
                Ok(false) => break "the zygote ended".to_string(),
                Err(error) => break format!("the link to the zygote failed: {error}"),
            }
        };
        self.end(why);
    }

    fn deliver(&self, frame: Frame) {
        let ticket = match &frame {
            Frame::Started { ticket, .. }
            | Frame::Pipe { ticket, .. }
            | Frame::Line { ticket, .. }
            | Frame::Ended { ticket, .. }
            | Frame::Done { ticket }
            | Frame::Lost { ticket, .. } => *ticket,
            other => {
                tracing::warn!("the zygote said {other:?} out of turn");
                return;
            }
        };
        let calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(call) = calls.get(&ticket) {
            let _ = call.send(Event::Frame(frame));
        }
    }

    fn end(&self, why: String) {
        tracing::warn!("{why} (pid {})", self.pid);
        *self.gone.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
        for (_, call) in self.calls.lock().unwrap_or_else(|e| e.into_inner()).drain() {
            let _ = call.send(Event::Gone(why.clone()));
        }
    }

    /// Whether it still serves.
    pub fn alive(&self) -> bool {
        self.gone
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .is_none()
    }

    /// Sends a request; its frames come on the receiver, with its ticket.
    pub async fn call(
        &self,
        request: Vec<u8>,
    ) -> Result<(u64, mpsc::UnboundedReceiver<Event>), String> {
        let ticket = self.next_ticket.fetch_add(1, Ordering::Relaxed);
        let (sender, receiver) = mpsc::unbounded_channel();
        {
            let mut calls = self.calls.lock().unwrap_or_else(|e| e.into_inner());
            if let Some(why) = self.gone.lock().unwrap_or_else(|e| e.into_inner()).clone() {
                return Err(why);
            }
            calls.insert(ticket, sender);
        }
        if let Err(error) = self.send(&Frame::Call { ticket, request }).await {
            self.done(ticket);
            return Err(format!("the zygote did not take the call: {error}"));
        }
        Ok((ticket, receiver))
    }

    /// Forgets a call that ended.
    pub fn done(&self, ticket: u64) {
        self.calls
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&ticket);
    }

    /// Writes a frame without blocking the runtime: a zygote busy loading
    /// a node reads nothing for a while, and a large request must wait for
    /// it without stopping heartbeats and other calls.
    async fn send(&self, frame: &Frame) -> std::io::Result<()> {
        let bytes = frame.bytes();
        let mut sent = 0;
        let _one_at_a_time = self.writing.lock().await;
        while sent < bytes.len() {
            let mut guard = self.link.writable().await?;
            match guard.try_io(|fd| {
                nix::sys::socket::send(
                    fd.get_ref().as_raw_fd(),
                    &bytes[sent..],
                    nix::sys::socket::MsgFlags::MSG_NOSIGNAL,
                )
                .map_err(std::io::Error::from)
            }) {
                Ok(Ok(n)) => sent += n,
                Ok(Err(error)) if error.kind() == std::io::ErrorKind::Interrupted => {}
                Ok(Err(error)) => return Err(error),
                Err(_would_block) => {}
            }
        }
        Ok(())
    }
}

async fn reap(mut child: tokio::process::Child) {
    if let Ok(status) = child.wait().await
        && !status.success()
    {
        tracing::warn!("the zygote exited: {status}");
    }
}
