//! What the calls and services of one session share: the way out to the
//! engine's socket, and the tables a cancel finds them in.
//!
//! The session owns it and hands it to each call and service it starts;
//! they send through it and leave its tables when they end.

use std::collections::HashMap;
use std::os::fd::OwnedFd;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::sync::{mpsc, oneshot};
use tokio_tungstenite::tungstenite::Message;

/// A call in flight, as a cancel finds it.
#[derive(Default)]
struct Running {
    /// The call's current child (a trial, then the run).
    pidfd: Option<OwnedFd>,
    cancelled: bool,
}

impl Running {
    /// SIGKILL to the call's child, now: its pidfd names exactly it, so no
    /// reused pid is ever hit. The zygote kills the rest of its session when
    /// it reaps it.
    fn kill(&mut self) {
        self.cancelled = true;
        self.kill_child();
    }

    /// SIGKILL to the call's child, not as a cancel (its reply says why).
    fn kill_child(&self) {
        if let Some(pidfd) = &self.pidfd {
            crate::process::pidfd_kill(std::os::fd::AsFd::as_fd(pidfd));
        }
    }
}

/// One session's way out, and its running calls and services.
pub struct Outbox {
    out: mpsc::Sender<Message>,
    /// Runs and compiles by a key of this session's, with their call id: a
    /// call id is the engine's, and nothing stops two calls sharing one.
    running: Mutex<HashMap<u64, (String, Running)>>,
    /// Services, the same way: sending stops one.
    services: Mutex<HashMap<u64, (String, oneshot::Sender<()>)>>,
    next_key: AtomicU64,
    heartbeat: Duration,
}

impl Outbox {
    /// Frames go to `out`; heartbeats every `heartbeat`.
    pub fn new(out: mpsc::Sender<Message>, heartbeat: Duration) -> Outbox {
        Outbox {
            out,
            running: Mutex::new(HashMap::new()),
            services: Mutex::new(HashMap::new()),
            next_key: AtomicU64::new(1),
            heartbeat,
        }
    }

    /// Sends one line (a JSON object) to the engine as a text frame. A
    /// session that has ended takes nothing; the call ends with it.
    pub async fn send_raw(&self, line: &[u8]) {
        let text = String::from_utf8_lossy(line).into_owned();
        let _ = self.out.send(Message::text(text)).await;
    }

    /// Says the call is alive every heartbeat interval, until aborted.
    pub fn heartbeat(&self, call_id: &str) -> tokio::task::JoinHandle<()> {
        let out = self.out.clone();
        let beat = serde_json::json!({"call_id": call_id, "event": "heartbeat"}).to_string();
        let every = self.heartbeat;
        tokio::spawn(async move {
            let mut ticks = tokio::time::interval_at(tokio::time::Instant::now() + every, every);
            loop {
                ticks.tick().await;
                if out.send(Message::text(beat.clone())).await.is_err() {
                    return;
                }
            }
        })
    }

    /// A run or compile, entered before its task first runs (a cancel right
    /// behind it, or the socket dropping, must find it); its key.
    pub fn enter_call(&self, call_id: String) -> u64 {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        lock(&self.running).insert(key, (call_id, Running::default()));
        key
    }

    /// A service, the same way; `stop` ends it.
    pub fn enter_service(&self, call_id: String, stop: oneshot::Sender<()>) -> u64 {
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        lock(&self.services).insert(key, (call_id, stop));
        key
    }

    /// The call is over: no cancel finds it any more.
    pub fn leave_call(&self, key: u64) {
        lock(&self.running).remove(&key);
    }

    /// The service is over.
    pub fn leave_service(&self, key: u64) {
        lock(&self.services).remove(&key);
    }

    /// The child now running for call `key`; killed at once if cancelled.
    pub fn started(&self, key: u64, pidfd: OwnedFd) {
        if let Some((_, running)) = lock(&self.running).get_mut(&key) {
            running.pidfd = Some(pidfd);
            if running.cancelled {
                running.kill();
            }
        }
    }

    /// Call `key` has its reply: its child is no longer its own to kill.
    pub fn replied(&self, key: u64) {
        if let Some((_, running)) = lock(&self.running).get_mut(&key) {
            running.pidfd = None;
        }
    }

    /// Whether the engine cancelled call `key`.
    pub fn cancelled(&self, key: u64) -> bool {
        lock(&self.running)
            .get(&key)
            .is_some_and(|(_, r)| r.cancelled)
    }

    /// A run or compile: SIGKILL now. A service: SIGTERM, grace, SIGKILL.
    /// An unknown id is ignored.
    pub fn cancel(&self, call_id: &str) {
        for (id, running) in lock(&self.running).values_mut() {
            if id == call_id {
                tracing::info!(call = %call_id, "cancelling");
                running.kill();
            }
        }
        let mut services = lock(&self.services);
        let stopping: Vec<u64> = services
            .iter()
            .filter(|(_, (id, _))| id == call_id)
            .map(|(k, _)| *k)
            .collect();
        for key in stopping {
            if let Some((_, stop)) = services.remove(&key) {
                tracing::info!(call = %call_id, "stopping");
                let _ = stop.send(());
            }
        }
    }

    /// Ends every call and service of this session.
    pub fn end_everything(&self) {
        for (_, running) in lock(&self.running).values_mut() {
            running.kill();
        }
        for (_, (_, stop)) in lock(&self.services).drain() {
            let _ = stop.send(());
        }
    }
}

/// A table, even after a panic while it was held: each change to one is a
/// single insert or remove, so it is never left half made.
fn lock<T>(table: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    table.lock().unwrap_or_else(|e| e.into_inner())
}
