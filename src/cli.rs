//! The command line: `worker`, `sweep`, and the `worker_main.py` drop-in.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::sweep::{self, SweepOptions};
use crate::worker::{self, WorkerOptions};
use crate::zygote::ZygoteOptions;
use crate::zygote::interpreter::BUILD_PYTHON;

#[derive(Parser)]
#[command(
    name = "fluksio-zygote",
    version,
    about = "Runs the Python code of Fluksio nodes: CPython embedded, heavy modules \
             imported once in a zygote, a forked child per call.",
    after_help = "Invoked as `fluksio-zygote PATH/worker_main.py`, it is `fluksio-zygote worker`: \
                  give the binary to the engine's PythonWorkerPool as its interpreter."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve the worker contract on stdin/stdout (a drop-in for `python worker_main.py`)
    Worker(WorkerArgs),
    /// Run a node once per grid point, each call in its own child, and summarise
    Sweep(SweepArgs),
    /// Run nodes for a Fluksio engine on this machine, connecting out to it (a drop-in for fluksio-worker)
    Agent(Box<AgentArgs>),
    /// (internal) The zygote an agent starts, serving it over a Unix socket
    #[command(hide = true)]
    Zygote(ZygoteLinkArgs),
    /// (internal) Ends a dead process's calls: kills and removes these cgroups
    #[command(hide = true)]
    Warden { cgroups: Vec<PathBuf> },
    /// Print the local path of an artifact, fetching and verifying it if needed
    #[command(
        after_help = "The store is chosen as node code's is: FLUKSIO_ARTIFACT_DIR, else \
                            FLUKSIO_ARTIFACT_URL (with FLUKSIO_ARTIFACT_TOKEN, cached under \
                            FLUKSIO_ARTIFACT_CACHE)."
    )]
    Fetch(FetchArgs),
}

#[derive(Args)]
struct AgentArgs {
    /// The engine's worker endpoint: wss://…/api/v1/workers/attach
    #[arg(long)]
    url: String,

    /// Issued by POST /api/v1/workers/tokens; sent as a bearer header, never in the URL
    #[arg(
        long,
        env = "FLUKSIO_WORKER_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true
    )]
    token: String,

    /// This worker's name [default: the host name]
    #[arg(long)]
    name: Option<String>,

    /// Comma-separated, e.g. gpu,cuda12: what a node's worker matches
    #[arg(long, default_value = "", hide_default_value = true)]
    labels: String,

    /// Calls the engine may send at once
    #[arg(long, default_value_t = 1)]
    parallel: u32,

    /// The artifact store [default: beside --url: ws→http, /workers/attach → /artifacts]
    #[arg(long, default_value = "", hide_default_value = true)]
    artifact_url: String,

    /// The address the engine reaches this machine's services on
    /// [default: the address the engine sees this worker connect from]
    #[arg(long, default_value = "", hide_default_value = true)]
    service_host: String,

    /// Allow ws:// and http:// to an engine off this machine: the token and every secret a
    /// node is handed then cross the network in clear
    #[arg(long)]
    insecure: bool,

    /// Cores to advertise [default: what the job or the machine has]
    #[arg(long)]
    cpus: Option<u64>,

    /// GPUs to advertise [default: SLURM's or FLUKSIO_WORKER_GPUS, else /dev/nvidia* counted]
    #[arg(long)]
    gpus: Option<u64>,

    /// Memory in MB to advertise [default: what the job or the machine has]
    #[arg(long)]
    ram_mb: Option<u64>,

    /// Stop after this many seconds with nothing running, for a worker a batch job started
    /// [default: never]
    #[arg(long, default_value_t = 0.0, hide_default_value = true)]
    max_idle: f64,

    /// A PEM file of CA certificates to trust besides the system's, for a private engine
    #[arg(long, value_name = "PATH")]
    ca_cert: Option<PathBuf>,

    #[command(flatten)]
    zygote: ZygoteArgs,
}

#[derive(Args)]
struct ZygoteLinkArgs {
    /// The inherited Unix socket to the agent
    #[arg(long)]
    link_fd: i32,

    #[command(flatten)]
    zygote: ZygoteArgs,
}

#[derive(Args)]
struct FetchArgs {
    /// The artifact's digest: sha256: and 64 lowercase hex digits
    digest: String,
}

/// How the zygote starts: which Python, what it imports up front.
#[derive(Args, Debug, Clone)]
struct ZygoteArgs {
    /// The interpreter node code runs on; a venv's bin/python works
    /// [default: the one this binary was built against]
    #[arg(long, env = "FLUKSIO_PYTHON", value_name = "PATH")]
    python: Option<PathBuf>,

    /// Modules to import once in the zygote, before the first fork (comma-separated),
    /// e.g. numpy,pandas
    #[arg(
        long,
        env = "FLUKSIO_PRELOAD",
        value_delimiter = ',',
        value_name = "MODULES"
    )]
    preload: Vec<String>,

    /// Each call's memory limit: a call over it is killed and its reply says so
    /// (cgroup memory where it can be made, else RLIMIT_DATA)
    #[arg(long, env = "FLUKSIO_CALL_MEMORY_LIMIT_MIB", value_name = "MiB")]
    call_memory_limit: Option<u64>,

    /// Children kept forked and set up ahead of their calls: more absorbs bursts,
    /// each costs a process (its page tables); 0 forks each call on demand
    #[arg(long, env = "FLUKSIO_STANDBY", value_name = "N", default_value_t = 2)]
    standby: usize,

    /// `call`: a fresh child per call, nothing one call does is seen by the next.
    /// `node`: one child per node serving its calls in turn, module state kept as in a
    /// reused worker_main.py (replaced by a fresh fork after a crash or a source change)
    #[arg(long, env = "FLUKSIO_ISOLATION", value_enum, default_value_t = IsolationArg::Call)]
    isolation: IsolationArg,

    /// With --isolation node: calls a node's child serves before a fresh fork replaces it
    #[arg(long, env = "FLUKSIO_MAX_CALLS_PER_CHILD", value_name = "N")]
    max_calls_per_child: Option<u64>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum IsolationArg {
    Call,
    Node,
}

impl ZygoteArgs {
    fn options(&self) -> ZygoteOptions {
        ZygoteOptions {
            python: self
                .python
                .clone()
                .unwrap_or_else(|| PathBuf::from(BUILD_PYTHON)),
            preload: self
                .preload
                .iter()
                .map(|m| m.trim().to_string())
                .filter(|m| !m.is_empty())
                .collect(),
            standby: self.standby,
            isolation: match self.isolation {
                IsolationArg::Call => crate::zygote::resident::Isolation::Call,
                IsolationArg::Node => crate::zygote::resident::Isolation::Node,
            },
            max_calls_per_child: self.max_calls_per_child.filter(|&n| n > 0),
            containment: crate::containment::Options {
                memory_limit_mib: self.call_memory_limit.filter(|&mib| mib > 0),
            },
        }
    }
}

#[derive(Args)]
struct WorkerArgs {
    #[command(flatten)]
    zygote: ZygoteArgs,

    /// Refuse (and skip) a request line longer than this, in MiB
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    max_request_mb: usize,
}

#[derive(Args)]
struct SweepArgs {
    /// The node's source file: defines `process(**inputs)` or one public function
    node: PathBuf,

    /// A grid axis, NAME=VALUES: `x=0..999` (inclusive), `x=0..1:0.25` (with a step),
    /// `x=1,2,5` or `name=a,b`; repeat for a product of axes
    #[arg(long = "grid", value_name = "NAME=VALUES", required = true)]
    grids: Vec<String>,

    /// Keyword arguments every call gets besides its grid point, as a JSON object
    #[arg(long, value_name = "JSON")]
    kwargs: Option<String>,

    /// Calls in flight at once [default: the number of CPUs]
    #[arg(long, short = 'j', value_name = "N")]
    jobs: Option<usize>,

    #[command(flatten)]
    zygote: ZygoteArgs,
}

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    init_logging();
    let cli = Cli::parse_from(rewrite_worker_main(std::env::args_os().collect()));
    match cli.command {
        Command::Worker(args) => worker::run(&WorkerOptions {
            zygote: args.zygote.options(),
            max_request_bytes: args.max_request_mb.saturating_mul(1 << 20),
        }),
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
            zygote: args.zygote.options(),
            parallel: args.parallel,
            artifact_url: args.artifact_url,
            service_host: args.service_host,
            insecure: args.insecure,
            cpus: args.cpus,
            gpus: args.gpus,
            ram_mb: args.ram_mb,
            max_idle: args.max_idle,
            ca_cert: args.ca_cert,
        }),
        Command::Zygote(args) => crate::zygote::server::run(&args.zygote.options(), args.link_fd),
        Command::Warden { cgroups } => crate::containment::warden::main(&cgroups),
        Command::Sweep(args) => sweep::run(&SweepOptions {
            zygote: args.zygote.options(),
            node: args.node,
            grids: args.grids,
            kwargs: args.kwargs,
            jobs: args.jobs,
        }),
    }
}

/// `fluksio-zygote fetch DIGEST`: the path on stdout, exit 0; the reason on
/// stderr, exit 1.
fn fetch(digest: &str) -> ExitCode {
    crate::artifacts::take_token();
    let loaded = crate::artifacts::Digest::parse(digest)
        .map_err(crate::artifacts::ArtifactError::BadDigest)
        .and_then(|digest| crate::artifacts::Store::from_env().load(&digest));
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

fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_target(false)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
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
