//! The command line: `worker`, `sweep`, and the `worker_main.py` drop-in.

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand};

use crate::sweep::run::RunOptions;
use crate::sweep::{self, SweepOptions};
use crate::telemetry::{LOG_FORMAT_ENV, LogFormat};
use crate::worker::{self, WorkerOptions};
use crate::zygote::ZygoteOptions;

#[derive(Parser)]
#[command(
    name = "fluksio-zygote",
    version,
    about = "Runs the Python code of Fluksio nodes: CPython embedded, heavy modules \
             imported once in a zygote, a forked child per call.",
    after_help = MAIN_AFTER_HELP
)]
struct Cli {
    #[command(subcommand)]
    command: Command,

    /// How log lines on stderr are written: `text`, or `json` (one object a line)
    #[arg(long, global = true, env = LOG_FORMAT_ENV, value_enum, default_value_t = LogFormat::Text,
          help_heading = "Logs")]
    log_format: LogFormat,
}

/// `--help`, after the commands.
const MAIN_AFTER_HELP: &str = "Invoked as `fluksio-zygote PATH/worker_main.py`, it is \
     `fluksio-zygote worker`: give the binary to the engine's PythonWorkerPool as its \
     interpreter.\n\n\
     Logs go to stderr; RUST_LOG sets their level (default info: a line per call start and \
     end), --log-format json makes them JSON lines.\n\n\
     Exit codes: 0 done; 1 a call failed (run, sweep), a refusal by the engine (agent) or an \
     error while serving; 2 it could not start (a usage error, a --python it cannot embed, a \
     --preload that fails, an address in use), with what to do on stderr; 130/143 stopped by \
     SIGINT/SIGTERM (run, sweep).";

#[derive(Subcommand)]
enum Command {
    /// Serve the worker contract on stdin/stdout (a drop-in for `python worker_main.py`)
    Worker(WorkerArgs),
    /// Run a node once, here: its events and result on stdout, its prints on stderr
    Run(RunArgs),
    /// Run a node once per grid point (or --input line), calls in parallel, and summarise
    Sweep(SweepArgs),
    /// Run nodes for a Fluksio engine on this machine, connecting out to it (a drop-in for fluksio-worker)
    #[command(after_help = AGENT_AFTER_HELP)]
    Agent(Box<AgentArgs>),
    /// (internal) The zygote an agent starts, serving it over a Unix socket
    #[command(hide = true)]
    Zygote(ZygoteLinkArgs),
    /// (internal) Ends a dead process's calls: kills and removes these cgroups
    #[command(hide = true)]
    Warden { cgroups: Vec<PathBuf> },
    /// (internal) Serves --metrics for a zygote, from the page it shares
    #[command(hide = true)]
    MetricsServer,
    /// Print the local path of an artifact, fetching and verifying it if needed
    #[command(
        after_help = "The store is chosen as node code's is: FLUKSIO_ARTIFACT_DIR, else \
                            FLUKSIO_ARTIFACT_URL (with FLUKSIO_ARTIFACT_TOKEN, cached under \
                            FLUKSIO_ARTIFACT_CACHE)."
    )]
    Fetch(FetchArgs),
}

/// `agent --help`, after the options.
const AGENT_AFTER_HELP: &str = "Examples:\n  \
     FLUKSIO_WORKER_TOKEN=fwt_... fluksio-zygote agent --url wss://engine.example/api/v1/workers/attach --labels gpu --preload numpy,torch\n  \
     fluksio-zygote agent --url ws://127.0.0.1:8000/api/v1/workers/attach --token \"$T\" --max-idle 600   # in a batch job\n\n\
     Environment: FLUKSIO_WORKER_TOKEN (--token), FLUKSIO_PYTHON, FLUKSIO_PRELOAD, \
     FLUKSIO_STANDBY, FLUKSIO_CALL_MEMORY_LIMIT_MIB, FLUKSIO_CONTAINMENT (cgroup|session), \
     FLUKSIO_WORKER_GPUS, SLURM_* (what the job was given, advertised in hello), RUST_LOG, \
     FLUKSIO_LOG_FORMAT.\n\n\
     Exit codes: 0 stopped (SIGTERM, Ctrl-C, --max-idle); 1 the engine refused this worker \
     (a bad token: HTTP 401/403, or a refusal instead of welcome); 2 it could not start (a \
     usage error, a bad --url, no token, a --python it cannot embed, a --preload that fails, \
     a --metrics address in use). Other connection errors are retried after 1, 2, 4 ... 30 s.";

#[derive(Args)]
struct AgentArgs {
    /// The engine's worker endpoint: wss://…/api/v1/workers/attach
    #[arg(long, help_heading = "Engine")]
    url: String,

    /// Issued by POST /api/v1/workers/tokens; sent as a bearer header, never in the URL
    #[arg(
        long,
        env = "FLUKSIO_WORKER_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    token: String,

    /// This worker's name [default: the host name]
    #[arg(long, help_heading = "Engine")]
    name: Option<String>,

    /// Comma-separated, e.g. gpu,cuda12: what a node's worker matches
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    labels: String,

    /// Calls the engine may send at once
    #[arg(long, default_value_t = 1, help_heading = "Engine")]
    parallel: u32,

    /// Zygotes forking one node's calls: its own, and lanes forked from it as its calls
    /// in flight grow (each with the node loaded as there). One zygote feeds the calls
    /// of about three cores, so many cores need several [default: one per 3 CPUs]
    #[arg(long, value_name = "N", value_parser = parse_lanes, help_heading = "Zygote")]
    lanes: Option<usize>,

    /// The artifact store [default: beside --url: ws→http, /workers/attach → /artifacts]
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    artifact_url: String,

    /// The address the engine reaches this machine's services on
    /// [default: the address the engine sees this worker connect from]
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    service_host: String,

    /// Allow ws:// and http:// to an engine off this machine: the token and every secret a
    /// node is handed then cross the network in clear
    #[arg(long, help_heading = "Engine")]
    insecure: bool,

    /// Cores to advertise [default: what the job or the machine has]
    #[arg(long, help_heading = "Inventory")]
    cpus: Option<u64>,

    /// GPUs to advertise [default: SLURM's or FLUKSIO_WORKER_GPUS, else /dev/nvidia* counted]
    #[arg(long, help_heading = "Inventory")]
    gpus: Option<u64>,

    /// Memory in MB to advertise [default: what the job or the machine has]
    #[arg(long, help_heading = "Inventory")]
    ram_mb: Option<u64>,

    /// Stop after this many seconds with nothing running, for a worker a batch job started
    /// [default: never]
    #[arg(
        long,
        default_value_t = 0.0,
        hide_default_value = true,
        value_name = "SECONDS",
        help_heading = "Engine"
    )]
    max_idle: f64,

    /// A PEM file of CA certificates to trust besides the system's, for a private engine
    #[arg(long, value_name = "PATH", help_heading = "Engine")]
    ca_cert: Option<PathBuf>,

    #[command(flatten, next_help_heading = "Zygote")]
    zygote: ZygoteArgs,
}

#[derive(Args)]
struct ZygoteLinkArgs {
    /// The inherited Unix socket to the agent
    #[arg(long, required_unless_present = "listen")]
    link_fd: Option<i32>,

    /// Serve pool slots (`worker --shared-zygote`) on a Unix socket at PATH
    #[arg(long, value_name = "PATH", conflicts_with = "link_fd")]
    listen: Option<PathBuf>,

    /// The inherited metrics page of the agent (`crate::metrics`)
    #[arg(long)]
    metrics_fd: Option<i32>,

    /// The most zygotes forking one node's calls (the agent's --lanes)
    #[arg(long, value_name = "N", value_parser = parse_lanes)]
    lanes: Option<usize>,

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
    /// The interpreter node code runs on: a path or a name on PATH (python3); a venv's
    /// bin/python works. It must be the embedded Python's build or a venv made from it
    /// [default: the activated venv ($VIRTUAL_ENV), else the venv this binary is installed
    /// in, else the interpreter it was built against]
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

    /// The largest reply (or event) a call may send, in MiB: one over it ends the call
    /// with a ReplyTooLarge error (its process killed) and the worker serves on. Default
    /// 1024: the engine parses a reply into several times its size; beyond that, return
    /// an artifact (fluksio.save_artifact)
    #[arg(long, env = crate::lines::MAX_REPLY_ENV, value_name = "MIB",
          default_value_t = crate::lines::DEFAULT_MAX_REPLY_MB)]
    max_reply_mb: usize,

    /// Threads each call's BLAS and OpenMP pools get (OpenBLAS, MKL, BLIS, OpenMP: those
    /// loaded, and OMP_NUM_THREADS and its kin for those loaded later). Default: the CPUs
    /// shared among the calls in flight, at least 1 each, so that -j 4 on 8 CPUs gives
    /// each call 2; a thread variable set in this environment is respected
    #[arg(long, env = crate::zygote::threads::THREADS_PER_CALL_ENV, value_name = "N",
          value_parser = parse_threads)]
    threads_per_call: Option<usize>,

    /// `on`: a module a node's calls import (from the Python installation: the standard
    /// library, site-packages) is imported into the zygote too, tried in a child first,
    /// so later calls start with it loaded. `off`: every call imports for itself
    #[arg(long, env = "FLUKSIO_LEARN_IMPORTS", value_enum, value_name = "WHEN",
          default_value_t = Switch::On)]
    learn_imports: Switch,

    /// Serve Prometheus metrics on http://ADDR/metrics (calls by outcome, call and fork
    /// durations, the zygote's memory, its children, the agent's reconnects), e.g.
    /// 127.0.0.1:9464
    #[arg(long, value_name = "ADDR", help_heading = "Logs")]
    metrics: Option<String>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Switch {
    On,
    Off,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug)]
enum IsolationArg {
    Call,
    Node,
}

impl ZygoteArgs {
    /// The flags that start a zygote the way these do (a shared zygote is
    /// started with its first slot's).
    fn as_flags(&self) -> Vec<String> {
        let options = self.options();
        let mut flags = vec![
            "--python".to_string(),
            options.python.display().to_string(),
            "--standby".to_string(),
            options.standby.to_string(),
            "--max-reply-mb".to_string(),
            self.max_reply_mb.to_string(),
        ];
        if !options.preload.is_empty() {
            flags.extend(["--preload".to_string(), options.preload.join(",")]);
        }
        if let Some(mib) = options.containment.memory_limit_mib {
            flags.extend(["--call-memory-limit".to_string(), mib.to_string()]);
        }
        if let Some(threads) = options.threads_per_call {
            flags.extend(["--threads-per-call".to_string(), threads.to_string()]);
        }
        if !options.learn_imports {
            flags.extend(["--learn-imports".to_string(), "off".to_string()]);
        }
        flags
    }

    fn options(&self) -> ZygoteOptions {
        ZygoteOptions {
            python: fluksio_embed::interpreter::resolve(self.python.as_deref()).0,
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
            node_zygote_mib: None,
            node_lanes: None,
            threads_per_call: self.threads_per_call,
            learn_imports: self.learn_imports == Switch::On,
            containment: crate::containment::Options {
                memory_limit_mib: self.call_memory_limit.filter(|&mib| mib > 0),
            },
        }
    }
}

#[derive(Args)]
#[command(after_help = WORKER_AFTER_HELP)]
struct WorkerArgs {
    #[command(flatten, next_help_heading = "Zygote")]
    zygote: ZygoteArgs,

    /// Refuse (and skip) a request line longer than this, in MiB
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    max_request_mb: usize,

    /// A node whose module level leaves this much memory or more (a model, a big table)
    /// gets a zygote of its own, forked from this one: every other node's calls keep
    /// forking from a small process. 0: every node gets one. With --isolation node, nodes
    /// stay in this zygote
    #[arg(
        long,
        env = "FLUKSIO_NODE_ZYGOTE_MIB",
        value_name = "MIB",
        default_value_t = 64,
        help_heading = "Zygote"
    )]
    node_zygote_mib: u64,

    /// Share one zygote with every worker started alike on this machine (the pool's
    /// slots): one copy of the preloads, and a killed worker costs its call's child,
    /// not a cold start. The zygote starts with the first and ends with the last
    #[arg(long, env = crate::slot::SHARED_ZYGOTE_ENV, value_parser = clap::builder::FalseyValueParser::new())]
    shared_zygote: bool,
}

#[derive(Args)]
#[command(after_help = RUN_AFTER_HELP)]
struct RunArgs {
    /// The node's source file: defines `process(**inputs)` or one public function.
    /// Its directory is first on sys.path, as under `python NODE.py`
    node: PathBuf,

    /// A keyword argument, NAME=VALUE; the value is JSON where it parses (-k n=3 is an
    /// int, -k 'xs=[1, 2]' a list), else a string (-k opt=adam). Repeat it
    #[arg(short = 'k', value_name = "NAME=VALUE", help_heading = "Arguments")]
    pairs: Vec<String>,

    /// Keyword arguments as one JSON object, e.g. '{"x": 1, "opt": "adam"}'
    #[arg(long, value_name = "JSON", help_heading = "Arguments")]
    kwargs: Option<String>,

    /// End the call if it is still running after SECONDS (NodeTimeout), with everything
    /// it started
    #[arg(long, value_name = "SECONDS", value_parser = parse_timeout)]
    timeout: Option<std::time::Duration>,

    #[command(flatten)]
    warmup: WarmupArgs,

    #[command(flatten, next_help_heading = "Zygote")]
    zygote: ZygoteArgs,
}

/// `--warmup`, for `run` and `sweep`.
#[derive(Args)]
struct WarmupArgs {
    /// Call the node once in its zygote before any call is forked, with these keyword
    /// arguments (a JSON object) or `first` (the first point's): what a library builds on
    /// its first call (caches, lazy imports, BLAS buffers) is then built once and every
    /// call starts with it. Whatever the warm-up leaves in module state, every call sees.
    /// A warm-up that leaves a thread running (an OpenMP pool, a CUDA context) is refused
    #[arg(long, value_name = "JSON|first", value_parser = parse_warmup, help_heading = "Zygote")]
    warmup: Option<crate::sweep::Warmup>,
}

/// `run --help`, after the options.
const RUN_AFTER_HELP: &str = "Output: stdout has the node's events as JSON lines as they come \
     ({\"event\": \"yield\", \"outputs\": {...}}), then the result alone on the last line; \
     stderr has what the node prints, live, and a failed call's traceback.\n\n\
     Examples:\n  \
     fluksio-zygote run examples/square.py -k x=3\n  \
     fluksio-zygote run train.py --kwargs '{\"lr\": 0.01}' -k epochs=2 | tail -n 1 | jq .loss\n\n\
     Exit codes: 0 the call succeeded; 1 it failed; 2 it could not start (a usage error, a \
     node that does not load, an argument its function does not take); 130 Ctrl-C (143 \
     SIGTERM): the call was ended; 141 the reader of stdout went away.";

#[derive(Args)]
#[command(
    after_help = SWEEP_AFTER_HELP,
    group(clap::ArgGroup::new("calls").required(true).args(["grids", "input"]))
)]
struct SweepArgs {
    /// The node's source file: defines `process(**inputs)` or one public function.
    /// Its directory is first on sys.path, as under `python NODE.py`
    node: PathBuf,

    /// An axis, NAME=VALUES: x=0..999 (both ends), x=0..1:0.1 (a step; values rounded to
    /// its decimals), x=1,2,5, opt=adam,sgd, or a JSON list x='[1, [2, 3]]'. Repeat for
    /// a product of axes, the first slowest
    #[arg(long = "grid", value_name = "NAME=VALUES", help_heading = "Calls")]
    grids: Vec<String>,

    /// A file of keyword arguments, one JSON object per line, one call each (`-`: stdin,
    /// read to its end first); instead of --grid
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "grids",
        help_heading = "Calls"
    )]
    input: Option<PathBuf>,

    /// A keyword argument every call gets, NAME=VALUE (JSON where it parses, else a
    /// string); repeat it. A name may not also be an axis
    #[arg(short = 'k', value_name = "NAME=VALUE", help_heading = "Calls")]
    pairs: Vec<String>,

    /// Keyword arguments every call gets, as one JSON object
    #[arg(long, value_name = "JSON", help_heading = "Calls")]
    kwargs: Option<String>,

    /// Calls in flight at once [default: the number of CPUs]. Each call's BLAS and OpenMP
    /// pools get the CPUs ÷ N threads, at least 1 (--threads-per-call sets it)
    #[arg(long, short = 'j', value_name = "N", value_parser = parse_jobs, help_heading = "Running")]
    jobs: Option<usize>,

    /// Zygotes forking the calls, each a fork of the one that loaded the node, each with
    /// its share of -j: one zygote feeds the calls of about three cores, so many cores
    /// need several [default: one per 3 CPUs, at most -j]
    #[arg(long, value_name = "N", value_parser = parse_lanes, help_heading = "Running")]
    lanes: Option<usize>,

    /// End a call still running after SECONDS: it fails with NodeTimeout, everything it
    /// started is killed, and the sweep goes on
    #[arg(long, value_name = "SECONDS", value_parser = parse_timeout, help_heading = "Running")]
    timeout: Option<std::time::Duration>,

    #[command(flatten)]
    warmup: WarmupArgs,

    /// Write the result lines to FILE instead of stdout
    #[arg(long, short = 'o', value_name = "FILE", help_heading = "Output")]
    output: Option<PathBuf>,

    #[command(flatten, next_help_heading = "Zygote")]
    zygote: ZygoteArgs,
}

/// `sweep --help`, after the options.
const SWEEP_AFTER_HELP: &str = "Output: one JSON line per call as it ends (completion order): {\"index\", \"kwargs\", \
     \"ok\", \"result\" or \"error\", \"events\" (what it yielded or emitted), \"logs\" (what \
     it printed), \"duration_ms\"}. On stderr a progress bar when stdout and stderr are a \
     terminal, and a summary listing the failures by error type.\n\n\
     Examples:\n  \
     fluksio-zygote sweep examples/square.py --grid x=0..999\n  \
     fluksio-zygote sweep train.py --grid lr=0.001..0.01:0.001 --grid opt=adam,sgd -k epochs=3 -o runs.jsonl\n  \
     fluksio-zygote sweep train.py --input points.jsonl -j 4 | jq 'select(.ok | not)'\n\n\
     Exit codes: 0 every call succeeded; 1 some failed; 2 it could not start (a usage error, \
     a node that does not load, an argument its function does not take, checked before any \
     call); 130 Ctrl-C (143 SIGTERM): the calls in flight ended, the results so far written \
     and summarised; 141 the reader of its output went away (| head), quietly.";

/// `--lanes N`: at least one zygote forking the calls.
fn parse_lanes(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 lanes would fork no call; give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of lanes")),
    }
}

/// `--threads-per-call N`: at least one.
fn parse_threads(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 threads would run nothing; give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of threads")),
    }
}

/// `--timeout SECONDS`: a positive number of seconds.
fn parse_timeout(text: &str) -> Result<std::time::Duration, String> {
    match text.parse::<f64>() {
        Ok(seconds) if seconds > 0.0 && seconds.is_finite() => {
            Ok(std::time::Duration::from_secs_f64(seconds))
        }
        _ => Err(format!(
            "{text:?} is not a number of seconds above 0 (e.g. 30 or 0.5)"
        )),
    }
}

/// `--warmup JSON|first`.
fn parse_warmup(text: &str) -> Result<crate::sweep::Warmup, String> {
    if text.trim() == "first" {
        return Ok(crate::sweep::Warmup::FirstPoint);
    }
    match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(kwargs)) => Ok(crate::sweep::Warmup::Kwargs(kwargs)),
        Ok(_) | Err(_) => Err(format!(
            "{text:?} is neither `first` nor a JSON object of keyword arguments (e.g. \
             '{{\"x\": 1}}')"
        )),
    }
}

/// `-j N`: at least one call in flight.
fn parse_jobs(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 calls in flight would run nothing; give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of calls")),
    }
}

/// `worker --help`, after the options.
const WORKER_AFTER_HELP: &str = "The engine's pool passes no flags: set them in its environment \
     (FLUKSIO_PRELOAD=numpy,pandas, FLUKSIO_PYTHON=/venv/bin/python, FLUKSIO_STANDBY, \
     FLUKSIO_ISOLATION, FLUKSIO_CALL_MEMORY_LIMIT_MIB, FLUKSIO_CONTAINMENT, RUST_LOG, \
     FLUKSIO_LOG_FORMAT).\n\n\
     Examples:\n  \
     PythonWorkerPool(\"/usr/local/bin/fluksio-zygote\", size=4)   # the engine's pool, in Python\n  \
     echo '{\"id\": 1, \"op\": \"run\", \"flow\": \"f\", \"node\": \"n\", \"source\": \"def process(): return 1\"}' | fluksio-zygote worker\n\n\
     Exit codes: 0 stdin closed; 1 an error while serving; 2 it could not start.";

/// Parses the command line and runs it.
pub fn main() -> ExitCode {
    crate::zygote::signals::note_ignored_at_start();
    let cli = Cli::parse_from(rewrite_worker_main(std::env::args_os().collect()));
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
            timeout: args.timeout,
            warmup: args.warmup.warmup,
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
