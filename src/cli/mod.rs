//! The command line: each subcommand (`worker`, `agent`, `run`, `sweep`,
//! `fetch`, and the internal `zygote`, `warden`, `metrics-server`) started
//! with the options its flags give, and the `worker_main.py` drop-in. The
//! flags themselves are in `args`.

mod args;

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;

use args::{Cli, Command, ZygoteArgs};

use crate::sweep::run::RunOptions;
use crate::sweep::{self, SweepOptions};
use crate::telemetry::{LOG_FORMAT_ENV, LogFormat};
use crate::worker::{self, WorkerOptions};
use crate::zygote::ZygoteOptions;

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    crate::zygote::signals::note_ignored_at_start();
    let cli = Cli::parse_from(rewrite_worker_main(std::env::args_os().collect()));
    if cli.command.forks_calls() {
        crate::bind_now::ensure();
    }
    if cli.log_format != LogFormat::Text {
        // The processes this one starts (an agent's zygote) log alike.
        // SAFETY: no thread has started yet.
        unsafe { std::env::set_var(LOG_FORMAT_ENV, "json") };
    }
    let quiet = matches!(cli.command, Command::Sweep(_) | Command::Run(_));
    crate::telemetry::init(cli.log_format, if quiet { "warn" } else { "info" });
    if let Some(code) = start_metrics(&cli.command) {
        return code;
    }
    if let Some(zygote) = cli.command.zygote_args() {
        crate::lines::set_max_reply_mb(zygote.max_reply_mb);
    }
    match cli.command {
        Command::Worker(args) => {
            let options = WorkerOptions {
                zygote: ZygoteOptions {
                    node_zygote_mib: Some(args.node_zygote_mib),
                    ..args.zygote.options()
                },
                max_request_bytes: args.max_request_mb.saturating_mul(1 << 20),
            };
            if args.shared_zygote {
                crate::slot::run(&options, &args.zygote.as_flags())
            } else {
                worker::run(&options)
            }
        }
        Command::Fetch(args) => fetch(&args.digest),
        Command::Agent(args) => crate::agent::run(crate::agent::AgentOptions {
            url: args.url,
            token: args.token,
            name: args.name.unwrap_or_else(|| {
                nix::unistd::gethostname()
                    .map(|h| h.to_string_lossy().into_owned())
                    .unwrap_or_default()
            }),
            labels: args
                .labels
                .split(',')
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .map(str::to_string)
                .collect(),
            zygote: ZygoteOptions {
                node_lanes: args.lanes,
                ..args.zygote.options()
            },
            parallel: args.parallel,
            artifact_url: args.artifact_url,
            service_host: args.service_host,
            insecure: args.insecure,
            cpus: args.cpus,
            gpus: args.gpus,
            ram_mb: args.ram_mb,
            max_idle: args.max_idle,
            ca_cert: args.ca_cert,
            metrics: args.zygote.metrics.clone(),
        }),
        Command::Zygote(args) => {
            let options = ZygoteOptions {
                node_lanes: args.lanes,
                ..args.zygote.options()
            };
            match (&args.listen, args.link_fd) {
                (Some(path), _) => {
                    crate::zygote::server::listen(&options, path, crate::slot::report_status)
                }
                (None, Some(fd)) => crate::zygote::server::run(&options, fd),
                (None, None) => ExitCode::from(2),
            }
        }
        Command::Warden { cgroups } => crate::containment::warden::main(&cgroups),
        Command::MetricsServer => crate::metrics::server_main(),
        Command::Sweep(args) => sweep::run(&SweepOptions {
            zygote: args.zygote.options(),
            node: args.node,
            grids: args.grids,
            input: args.input,
            kwargs: args.kwargs,
            pairs: args.pairs,
            jobs: args.jobs,
            lanes: args.lanes,
            output: args.output,
            shard: args.shard,
            resume: match (args.retry_failed, args.resume) {
                (true, _) => sweep::Resume::AndFailed,
                (false, true) => sweep::Resume::Missing,
                (false, false) => sweep::Resume::No,
            },
            merge: args.merge,
            timeout: args.timeout,
            warmup: args.warmup.warmup,
            gpus: args.gpus.map(|ids| sweep::GpuSlots {
                ids: (ids.trim() != "all").then(|| crate::zygote::device::parse_list(&ids)),
                per_gpu: args.per_gpu,
                warm: args.cuda_warm,
            }),
        }),
        Command::Run(args) => sweep::run::run(&RunOptions {
            zygote: args.zygote.options(),
            node: args.node,
            kwargs: args.kwargs,
            pairs: args.pairs,
            timeout: args.timeout,
            warmup: args.warmup.warmup,
        }),
    }
}

impl Command {
    /// The zygote's flags of a command that runs calls.
    /// Whether this process is a zygote that forks calls (a pool slot's
    /// worker hands its calls to a shared one; `fetch`, the warden and the
    /// metrics server fork none).
    fn forks_calls(&self) -> bool {
        match self {
            Command::Worker(args) => !args.shared_zygote,
            command => command.zygote_args().is_some(),
        }
    }

    fn zygote_args(&self) -> Option<&ZygoteArgs> {
        match self {
            Command::Worker(args) => Some(&args.zygote),
            Command::Sweep(args) => Some(&args.zygote),
            Command::Run(args) => Some(&args.zygote),
            Command::Agent(args) => Some(&args.zygote),
            Command::Zygote(args) => Some(&args.zygote),
            Command::Warden { .. } | Command::Fetch(_) | Command::MetricsServer => None,
        }
    }
}

/// `fluksio-zygote fetch DIGEST`: the path on stdout, exit 0; the reason on
/// stderr, exit 1.
fn fetch(digest: &str) -> ExitCode {
    crate::artifacts::take_token();
    let loaded = crate::artifacts::Digest::parse(digest)
        .map_err(crate::artifacts::ArtifactError::BadDigest)
        .and_then(|digest| crate::artifacts::store::Store::from_env().load(&digest));
    match loaded {
        Ok(path) => {
            println!("{}", path.display());
            ExitCode::SUCCESS
        }
        Err(error) => {
            eprintln!("fluksio-zygote fetch: {error}");
            ExitCode::FAILURE
        }
    }
}

/// `fluksio-zygote PATH/worker_main.py …` is `fluksio-zygote worker …`: the
/// pool starts `[interpreter, worker_main.py]`, and the binary is the
/// interpreter. agent.py's `worker_main.py --fetch DIGEST` is `fetch DIGEST`.
fn rewrite_worker_main(mut args: Vec<OsString>) -> Vec<OsString> {
    let is_worker_main = args.get(1).map(PathBuf::from).is_some_and(|path| {
        path.file_name()
            .is_some_and(|name| name == "worker_main.py")
    });
    if is_worker_main {
        if args.get(2).is_some_and(|a| a == "--fetch") {
            args.remove(2);
            args[1] = "fetch".into();
        } else {
            args[1] = "worker".into();
        }
    }
    args
}

/// `--metrics`: bound now, while this process has one thread, so an address
/// in use is a start-up error (exit 2). `Some` exit code if it failed.
fn start_metrics(command: &Command) -> Option<ExitCode> {
    if let Command::Zygote(args) = command
        && let Some(fd) = args.metrics_fd
    {
        crate::metrics::attach_zygote(fd);
    }
    let addr = match command {
        Command::Worker(_) | Command::Sweep(_) | Command::Run(_) => {
            command.zygote_args()?.metrics.as_deref()?
        }
        // The agent binds its own, in `agent::run`.
        _ => return None,
    };
    match crate::metrics::serve_for_zygote(addr) {
        Ok(()) => None,
        Err(why) => {
            eprintln!("fluksio-zygote: {why}");
            Some(ExitCode::from(2))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_main_path_means_worker() {
        let args =
            rewrite_worker_main(vec!["fz".into(), "/x/fluksio_worker/worker_main.py".into()]);
        assert_eq!(args, vec![OsString::from("fz"), OsString::from("worker")]);
        let args = rewrite_worker_main(vec![
            "fz".into(),
            "w/worker_main.py".into(),
            "--fetch".into(),
            "sha256:x".into(),
        ]);
        assert_eq!(
            args,
            vec![
                OsString::from("fz"),
                OsString::from("fetch"),
                OsString::from("sha256:x")
            ]
        );
        let args = rewrite_worker_main(vec!["fz".into(), "sweep".into()]);
        assert_eq!(args[1], OsString::from("sweep"));
    }
}
