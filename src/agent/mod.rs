//! `fluksio-zygote agent`: the remote worker, protocol 3 to the engine.
//!
//! What `fluksio-worker` (agent.py) does, with the same flags, except that
//! each call is a fork of a warm zygote instead of a fresh Python process.
//!
//! 1. Check the flags (a token; `ws://` off this machine only with
//!    `--insecure`), then start the zygote, which preloads while the socket
//!    connects; calls that arrive before it is ready wait for it.
//! 2. Connect, `hello`, `welcome`, serve (`session`). An error reconnects
//!    after 1, 2, 4 … 30 s; a clean close at once; a refusal (a first answer
//!    that is not `welcome`, an HTTP 401/403) stops the agent, exit 1.
//! 3. SIGTERM or Ctrl-C: every call ends, exit 0. `--max-idle`: the same
//!    once nothing has run for that long.
//!
//! Its files depend one way: this front starts `session`, which dispatches
//! to `call` and `service`; those send through the session's `outbox` and
//! read what the whole agent shares (`state`), none of them naming the
//! ones above it.

mod call;
mod env;
mod hello;
mod options;
mod outbox;
mod service;
mod session;
mod state;
mod tls;
mod zygote;

use std::process::ExitCode;
use std::sync::atomic::AtomicUsize;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::sync::{OnceCell, watch};

pub use options::AgentOptions;
use session::SessionEnd;
use state::Agent;
use zygote::Launch;

/// Sent while a call is running, so the engine can tell working from wedged.
const HEARTBEAT: Duration = Duration::from_secs(10);
/// For tests: a shorter heartbeat, in seconds.
const HEARTBEAT_ENV: &str = "FLUKSIO_AGENT_HEARTBEAT_S";
/// Where the worker token may come from instead of `--token`.
const WORKER_TOKEN_ENV: &str = "FLUKSIO_WORKER_TOKEN";
/// Reconnection backs off to this and no further.
const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Why the flags cannot work; printed as is, exit 2.
pub fn check(options: &AgentOptions) -> Result<(), String> {
    env::check_url("--url", &options.url, ["ws", "wss"])?;
    if !options.artifact_url.is_empty() {
        env::check_url("--artifact-url", &options.artifact_url, ["http", "https"])?;
    }
    if options.token.is_empty() {
        return Err(
            "a token is required\nhint: pass --token, or set FLUKSIO_WORKER_TOKEN; \
                    the engine issues one at POST /api/v1/workers/tokens"
                .into(),
        );
    }
    for url in [&options.url, &options.artifact_url] {
        if !url.is_empty() && !options.insecure && !env::encrypted_or_local(url) {
            return Err(format!(
                "{url} is not encrypted: use wss:// (https:// for --artifact-url), or --insecure on a network you trust"
            ));
        }
    }
    Ok(())
}

/// Runs the agent until it is stopped, idles out or is refused.
pub fn run(options: AgentOptions) -> ExitCode {
    if let Err(why) = check(&options) {
        eprintln!("fluksio-zygote agent: {why}");
        return ExitCode::from(2);
    }
    if options.zygote.isolation == crate::zygote::resident::Isolation::Node {
        tracing::warn!(
            "--isolation node is served by `worker` (the pool's drop-in) and `sweep`; the agent \
             runs every call in a fresh child (or, with --isolation reset, a resident put back \
             after each call), so that no call keeps what another left"
        );
    }
    // The token stays in this process's memory only: what node code (the
    // same user) could read of this process, its environment and its
    // command line, no longer holds it.
    crate::artifacts::hide_variable(WORKER_TOKEN_ENV);
    crate::artifacts::hide_argument("--token");
    // Nor any other credential of the host's: node code is never given
    // them, and could read them here (`/proc/<agent>/environ`) otherwise.
    crate::artifacts::hide_credentials();
    // Bound before any thread: an address in use is a start-up error.
    let metrics = match options
        .metrics
        .as_deref()
        .map(crate::metrics::prepare_for_agent)
    {
        None => None,
        Some(Ok(prepared)) => Some(prepared),
        Some(Err(why)) => {
            eprintln!("fluksio-zygote agent: {why}");
            return ExitCode::from(2);
        }
    };
    let tls = match tls::client_config(options.ca_cert.as_deref()) {
        Ok(tls) => tls,
        Err(why) => {
            eprintln!("fluksio-zygote agent: {why}");
            return ExitCode::from(2);
        }
    };
    // Services are contained as calls are (their own cgroup, a warden that
    // ends them if this process is killed); set up before any thread.
    if let Err(why) = crate::containment::establish(
        crate::containment::Role::Agent,
        &crate::containment::Options::default(),
    ) {
        eprintln!("fluksio-zygote agent: {why}");
        return ExitCode::from(2);
    }
    // One thread: enough for sockets and pipes, and what a service is
    // started from (its parent-death signal follows the starting thread).
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(runtime) => runtime,
        Err(error) => {
            eprintln!("fluksio-zygote agent: could not start: {error}");
            return ExitCode::FAILURE;
        }
    };
    runtime.block_on(async move {
        let page = metrics.map(|(listener, page)| {
            tokio::spawn(crate::metrics::serve_agent(listener));
            page
        });
        serve(options, tls, page).await
    })
}

async fn serve(
    options: AgentOptions,
    tls: Arc<rustls::ClientConfig>,
    metrics_page: Option<std::os::fd::OwnedFd>,
) -> ExitCode {
    crate::artifacts::use_token(&options.token);
    let artifact_url = if options.artifact_url.is_empty() {
        env::artifacts_from(&options.url)
    } else {
        options.artifact_url.clone()
    };
    let node_env = env::node_env(&artifact_url);
    let heartbeat = std::env::var(HEARTBEAT_ENV)
        .ok()
        .and_then(|s| s.parse::<f64>().ok())
        .filter(|s| *s > 0.0)
        .map_or(HEARTBEAT, Duration::from_secs_f64);
    let (stop, stopping) = watch::channel(false);
    let agent = Arc::new(Agent {
        launch: Launch {
            python: options.zygote.python.clone(),
            preload: options.zygote.preload.clone(),
            memory_limit_mib: options.zygote.containment.memory_limit_mib,
            standby: options.zygote.standby,
            lanes: options.zygote.node_lanes,
            env: node_env
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
            token: options.token.clone(),
            metrics_page: metrics_page.map(Arc::new),
            reset: options.zygote.isolation == crate::zygote::resident::Isolation::Reset,
            max_calls_per_child: options.zygote.max_calls_per_child,
            threads_per_call: options.zygote.threads_per_call,
            learn_imports: options.zygote.learn_imports,
        },
        cuda_mask: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        options,
        tls,
        node_env,
        zygote: tokio::sync::Mutex::new(None),
        venv_digest: OnceCell::new(),
        heartbeat,
        active: AtomicUsize::new(0),
        last_done: Mutex::new(Instant::now()),
        fatal: Mutex::new(None),
        stop,
    });
    // Preloading runs while the socket connects.
    let preloading = Arc::clone(&agent);
    tokio::spawn(async move {
        let _ = preloading.zygote().await;
    });
    let stopper = agent.stop.clone();
    tokio::spawn(async move {
        let mut terminate =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match terminate.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
        tracing::info!("stopping");
        let _ = stopper.send(true);
    });

    let mut backoff = Duration::from_secs(1);
    loop {
        let end = session::run(&agent, stopping.clone()).await;
        if let Some(code) = agent.fatal_exit() {
            return code;
        }
        match end {
            SessionEnd::Closed => {
                tracing::info!("{} closed the connection; reconnecting", agent.options.url);
                crate::metrics::reconnecting();
                backoff = Duration::from_secs(1);
            }
            SessionEnd::Failed(why) => {
                tracing::warn!("{why} — retrying in {}s", backoff.as_secs());
                crate::metrics::reconnecting();
                let mut stopping = stopping.clone();
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = stopping.wait_for(|stop| *stop) => {}
                }
                backoff = (backoff * 2).min(MAX_BACKOFF);
            }
            SessionEnd::Refused(why) => {
                tracing::error!(
                    "{} refused this worker: {why} (check --token, or ask the engine's \
                     operator)",
                    agent.options.url
                );
                return ExitCode::FAILURE;
            }
            SessionEnd::Idle => {
                tracing::info!("nothing to do for {}s — stopping", agent.options.max_idle);
                return ExitCode::SUCCESS;
            }
            SessionEnd::Stopped => return ExitCode::SUCCESS,
        }
        if *stopping.borrow() {
            return agent.fatal_exit().unwrap_or(ExitCode::SUCCESS);
        }
    }
}
