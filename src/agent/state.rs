//! What the whole agent shares, across sessions: its flags, its zygote,
//! how many calls run and when the last one ended, why it must stop.

use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OnceCell, watch};

use super::hello;
use super::options::AgentOptions;
use super::zygote::{Launch, Zygote};

/// What the whole agent shares, across sessions.
pub struct Agent {
    pub(super) options: AgentOptions,
    pub(super) tls: Arc<rustls::ClientConfig>,
    /// Node code's environment: the host's minus credentials, plus the
    /// artifact store's URL.
    pub(super) node_env: BTreeMap<String, String>,
    /// `CUDA_VISIBLE_DEVICES` this agent runs under, to remap a call's.
    pub(super) cuda_mask: Option<String>,
    pub(super) launch: Launch,
    pub(super) zygote: tokio::sync::Mutex<Option<Arc<Zygote>>>,
    pub(super) venv_digest: OnceCell<String>,
    pub(super) heartbeat: Duration,
    pub(super) active: AtomicUsize,
    pub(super) last_done: Mutex<Instant>,
    /// Why the agent must stop (a zygote that cannot start).
    pub(super) fatal: Mutex<Option<String>>,
    pub(super) stop: watch::Sender<bool>,
}

impl Agent {
    /// The zygote, started (again) if it is not running. A zygote that
    /// fails to start stops the agent with its error.
    pub(super) async fn zygote(&self) -> Result<Arc<Zygote>, String> {
        let mut slot = self.zygote.lock().await;
        if let Some(zygote) = slot.as_ref().filter(|z| z.alive()) {
            return Ok(Arc::clone(zygote));
        }
        if slot.is_some() {
            tracing::warn!("the zygote ended; starting a new one");
        }
        match Zygote::start(&self.launch).await {
            Ok(zygote) => {
                *slot = Some(Arc::clone(&zygote));
                Ok(zygote)
            }
            Err(why) => {
                let why = format!("the zygote could not start: {why}");
                *self.fatal.lock().unwrap_or_else(|e| e.into_inner()) = Some(why.clone());
                let _ = self.stop.send(true);
                Err(why)
            }
        }
    }

    /// `pip freeze`'s digest, computed once, off the runtime.
    pub(super) async fn venv_digest(&self) -> String {
        let python = self.options.zygote.python.clone();
        self.venv_digest
            .get_or_init(|| async move {
                tokio::task::spawn_blocking(move || hello::venv_digest(&python))
                    .await
                    .unwrap_or_default()
            })
            .await
            .clone()
    }

    /// Exit 2 (a start-up failure, as in every mode), with the reason
    /// logged, if a zygote could not start: that stops the agent however the
    /// session ended.
    pub(super) fn fatal_exit(&self) -> Option<ExitCode> {
        let why = self
            .fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()?;
        tracing::error!("{why}");
        Some(ExitCode::from(2))
    }

    pub(super) fn call_started(&self) {
        self.active.fetch_add(1, Ordering::SeqCst);
    }

    pub(super) fn call_ended(&self) {
        self.active.fetch_sub(1, Ordering::SeqCst);
        self.touch();
    }

    pub(super) fn touch(&self) {
        *self.last_done.lock().unwrap_or_else(|e| e.into_inner()) = Instant::now();
    }

    /// How often to look for `--max-idle`, if it is set.
    pub(super) fn idle_tick(&self) -> Option<Duration> {
        (self.options.max_idle > 0.0)
            .then(|| Duration::from_secs_f64((self.options.max_idle / 4.0).clamp(0.25, 30.0)))
    }

    pub(super) fn idle_past_limit(&self) -> bool {
        self.options.max_idle > 0.0
            && self.active.load(Ordering::SeqCst) == 0
            && self
                .last_done
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .elapsed()
                .as_secs_f64()
                >= self.options.max_idle
    }
}
