//! The command line's arguments: every subcommand's flags, their help and
//! the parsers of their values, as clap reads them. What each command does
//! with them is in `cli` itself. Over the usual length: most of it is the
//! help text of each flag.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

use crate::telemetry::{LOG_FORMAT_ENV, LogFormat};
use crate::zygote::ZygoteOptions;

#[derive(Parser)]
#[command(
    name = "fluksio-zygote",
    version,
    about = "Runs the Python code of Fluksio nodes: CPython embedded, heavy modules \
             imported once in a zygote, a forked child per call.",
    after_help = MAIN_AFTER_HELP
)]
pub(super) struct Cli {
    #[command(subcommand)]
    pub(super) command: Command,

    /// How log lines on stderr are written: `text`, or `json` (one object a line)
    #[arg(long, global = true, env = LOG_FORMAT_ENV, value_enum, default_value_t = LogFormat::Text,
          help_heading = "Logs")]
    pub(super) log_format: LogFormat,
}

/// `--help`, after the commands.
pub(super) const MAIN_AFTER_HELP: &str = "Invoked as `fluksio-zygote PATH/worker_main.py`, it is \
     `fluksio-zygote worker`: give the binary to the engine's PythonWorkerPool as its \
     interpreter.\n\n\
     Logs go to stderr; RUST_LOG sets their level (default info: a line per call start and \
     end), --log-format json makes them JSON lines.\n\n\
     Exit codes: 0 done; 1 a call failed (run, sweep), a refusal by the engine (agent) or an \
     error while serving; 2 it could not start (a usage error, a --python it cannot embed, a \
     --preload that fails, an address in use), with what to do on stderr; 130/143 stopped by \
     SIGINT/SIGTERM (run, sweep).";

#[derive(Subcommand)]
pub(super) enum Command {
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
pub(super) const AGENT_AFTER_HELP: &str = "Examples:\n  \
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
pub(super) struct AgentArgs {
    /// The engine's worker endpoint: wss://…/api/v1/workers/attach
    #[arg(long, help_heading = "Engine")]
    pub(super) url: String,

    /// Issued by POST /api/v1/workers/tokens; sent as a bearer header, never in the URL
    #[arg(
        long,
        env = "FLUKSIO_WORKER_TOKEN",
        hide_env_values = true,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    pub(super) token: String,

    /// This worker's name [default: the host name]
    #[arg(long, help_heading = "Engine")]
    pub(super) name: Option<String>,

    /// Comma-separated, e.g. gpu,cuda12: what a node's worker matches
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    pub(super) labels: String,

    /// Calls the engine may send at once
    #[arg(long, default_value_t = 1, help_heading = "Engine")]
    pub(super) parallel: u32,

    /// Zygotes forking one node's calls: its own, and lanes forked from it as its calls
    /// in flight grow (each with the node loaded as there). One zygote feeds the calls
    /// of about three cores, so many cores need several [default: one per 3 CPUs]
    #[arg(long, value_name = "N", value_parser = parse_lanes, help_heading = "Zygote")]
    pub(super) lanes: Option<usize>,

    /// The artifact store [default: beside --url: ws→http, /workers/attach → /artifacts]
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    pub(super) artifact_url: String,

    /// The address the engine reaches this machine's services on
    /// [default: the address the engine sees this worker connect from]
    #[arg(
        long,
        default_value = "",
        hide_default_value = true,
        help_heading = "Engine"
    )]
    pub(super) service_host: String,

    /// Allow ws:// and http:// to an engine off this machine: the token and every secret a
    /// node is handed then cross the network in clear
    #[arg(long, help_heading = "Engine")]
    pub(super) insecure: bool,

    /// Cores to advertise [default: what the job or the machine has]
    #[arg(long, help_heading = "Inventory")]
    pub(super) cpus: Option<u64>,

    /// GPUs to advertise [default: SLURM's or FLUKSIO_WORKER_GPUS, else /dev/nvidia* counted]
    #[arg(long, help_heading = "Inventory")]
    pub(super) gpus: Option<u64>,

    /// Memory in MB to advertise [default: what the job or the machine has]
    #[arg(long, help_heading = "Inventory")]
    pub(super) ram_mb: Option<u64>,

    /// Stop after this many seconds with nothing running, for a worker a batch job started
    /// [default: never]
    #[arg(
        long,
        default_value_t = 0.0,
        hide_default_value = true,
        value_name = "SECONDS",
        help_heading = "Engine"
    )]
    pub(super) max_idle: f64,

    /// A PEM file of CA certificates to trust besides the system's, for a private engine
    #[arg(long, value_name = "PATH", help_heading = "Engine")]
    pub(super) ca_cert: Option<PathBuf>,

    #[command(flatten, next_help_heading = "Zygote")]
    pub(super) zygote: ZygoteArgs,
}

#[derive(Args)]
pub(super) struct ZygoteLinkArgs {
    /// The inherited Unix socket to the agent
    #[arg(long, required_unless_present = "listen")]
    pub(super) link_fd: Option<i32>,

    /// Serve pool slots (`worker --shared-zygote`) on a Unix socket at PATH
    #[arg(long, value_name = "PATH", conflicts_with = "link_fd")]
    pub(super) listen: Option<PathBuf>,

    /// The inherited metrics page of the agent (`crate::metrics`)
    #[arg(long)]
    pub(super) metrics_fd: Option<i32>,

    /// The most zygotes forking one node's calls (the agent's --lanes)
    #[arg(long, value_name = "N", value_parser = parse_lanes)]
    pub(super) lanes: Option<usize>,

    #[command(flatten)]
    pub(super) zygote: ZygoteArgs,
}

#[derive(Args)]
pub(super) struct FetchArgs {
    /// The artifact's digest: sha256: and 64 lowercase hex digits
    pub(super) digest: String,
}

/// How the zygote starts: which Python, what it imports up front.
#[derive(Args, Debug, Clone)]
pub(super) struct ZygoteArgs {
    /// The interpreter node code runs on: a path or a name on PATH (python3); a venv's
    /// bin/python works. It must be the embedded Python's build or a venv made from it
    /// [default: the activated venv ($VIRTUAL_ENV), else the venv this binary is installed
    /// in, else the interpreter it was built against]
    #[arg(long, env = "FLUKSIO_PYTHON", value_name = "PATH")]
    pub(super) python: Option<PathBuf>,

    /// Modules to import once in the zygote, before the first fork (comma-separated),
    /// e.g. numpy,pandas
    #[arg(
        long,
        env = "FLUKSIO_PRELOAD",
        value_delimiter = ',',
        value_name = "MODULES"
    )]
    pub(super) preload: Vec<String>,

    /// Each call's memory limit: a call over it is killed and its reply says so
    /// (cgroup memory where it can be made, else RLIMIT_DATA)
    #[arg(long, env = "FLUKSIO_CALL_MEMORY_LIMIT_MIB", value_name = "MiB")]
    pub(super) call_memory_limit: Option<u64>,

    /// Children kept forked and set up ahead of their calls: more absorbs bursts,
    /// each costs a process (its page tables); 0 forks each call on demand
    #[arg(long, env = "FLUKSIO_STANDBY", value_name = "N", default_value_t = 2)]
    pub(super) standby: usize,

    /// `call`: a fresh child per call, nothing one call does is seen by the next.
    /// `node`: one child per node serving its calls in turn, module state kept as in a
    /// reused worker_main.py (replaced by a fresh fork after a crash or a source change).
    /// `reset` (opt-in, new): one child per node whose memory is put back after each call
    /// to what it was before the first, and the signal handlers, cwd, umask and limits a
    /// call set; anything else a call changed retires it for a fresh fork (a node that
    /// does so call after call gets a fresh fork per call for a while)
    #[arg(long, env = "FLUKSIO_ISOLATION", value_enum, default_value_t = IsolationArg::Call)]
    pub(super) isolation: IsolationArg,

    /// With --isolation node or reset: calls a node's child serves before a fresh fork
    /// replaces it
    #[arg(long, env = "FLUKSIO_MAX_CALLS_PER_CHILD", value_name = "N")]
    pub(super) max_calls_per_child: Option<u64>,

    /// The largest reply (or event) a call may send, in MiB: one over it ends the call
    /// with a ReplyTooLarge error (its process killed) and the worker serves on. Default
    /// 1024: the engine parses a reply into several times its size; beyond that, return
    /// an artifact (fluksio.save_artifact)
    #[arg(long, env = crate::lines::MAX_REPLY_ENV, value_name = "MIB",
          default_value_t = crate::lines::DEFAULT_MAX_REPLY_MB)]
    pub(super) max_reply_mb: usize,

    /// Threads each call's BLAS and OpenMP pools get (OpenBLAS, MKL, BLIS, OpenMP: those
    /// loaded, and OMP_NUM_THREADS and its kin for those loaded later). Default: the CPUs
    /// shared among the calls in flight, at least 1 each, so that -j 4 on 8 CPUs gives
    /// each call 2; a thread variable set in this environment is respected
    #[arg(long, env = crate::zygote::threads::THREADS_PER_CALL_ENV, value_name = "N",
          value_parser = parse_threads)]
    pub(super) threads_per_call: Option<usize>,

    /// `on`: a module a node's calls import (from the Python installation: the standard
    /// library, site-packages) is imported into the zygote too, tried in a child first,
    /// so later calls start with it loaded. `off`: every call imports for itself
    #[arg(long, env = "FLUKSIO_LEARN_IMPORTS", value_enum, value_name = "WHEN",
          default_value_t = Switch::On)]
    pub(super) learn_imports: Switch,

    /// Serve Prometheus metrics on http://ADDR/metrics (calls by outcome, call and fork
    /// durations, the zygote's memory, its children, the agent's reconnects), e.g.
    /// 127.0.0.1:9464
    #[arg(long, value_name = "ADDR", help_heading = "Logs")]
    pub(super) metrics: Option<String>,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Switch {
    On,
    Off,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum IsolationArg {
    Call,
    Node,
    Reset,
}

impl ZygoteArgs {
    /// The flags that start a zygote the way these do (a shared zygote is
    /// started with its first slot's).
    pub(super) fn as_flags(&self) -> Vec<String> {
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
        if self.isolation == IsolationArg::Reset {
            // A shared zygote serves its slots' calls in residents only
            // under reset (`zygote::placement`).
            flags.extend(["--isolation".to_string(), "reset".to_string()]);
        }
        if let Some(calls) = options.max_calls_per_child {
            flags.extend(["--max-calls-per-child".to_string(), calls.to_string()]);
        }
        flags
    }

    pub(super) fn options(&self) -> ZygoteOptions {
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
                IsolationArg::Reset => crate::zygote::resident::Isolation::Reset,
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
pub(super) struct WorkerArgs {
    #[command(flatten, next_help_heading = "Zygote")]
    pub(super) zygote: ZygoteArgs,

    /// Refuse (and skip) a request line longer than this, in MiB
    #[arg(long, value_name = "MIB", default_value_t = 512)]
    pub(super) max_request_mb: usize,

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
    pub(super) node_zygote_mib: u64,

    /// Share one zygote with every worker started alike on this machine (the pool's
    /// slots): one copy of the preloads, and a killed worker costs its call's child,
    /// not a cold start. The zygote starts with the first and ends with the last
    #[arg(long, env = crate::slot::SHARED_ZYGOTE_ENV, value_parser = clap::builder::FalseyValueParser::new())]
    pub(super) shared_zygote: bool,
}

#[derive(Args)]
#[command(after_help = RUN_AFTER_HELP)]
pub(super) struct RunArgs {
    /// The node's source file: defines `process(**inputs)` or one public function.
    /// Its directory is first on sys.path, as under `python NODE.py`
    pub(super) node: PathBuf,

    /// A keyword argument, NAME=VALUE; the value is JSON where it parses (-k n=3 is an
    /// int, -k 'xs=[1, 2]' a list), else a string (-k opt=adam). Repeat it
    #[arg(short = 'k', value_name = "NAME=VALUE", help_heading = "Arguments")]
    pub(super) pairs: Vec<String>,

    /// Keyword arguments as one JSON object, e.g. '{"x": 1, "opt": "adam"}'
    #[arg(long, value_name = "JSON", help_heading = "Arguments")]
    pub(super) kwargs: Option<String>,

    /// End the call if it is still running after SECONDS (NodeTimeout), with everything
    /// it started
    #[arg(long, value_name = "SECONDS", value_parser = parse_timeout)]
    pub(super) timeout: Option<std::time::Duration>,

    #[command(flatten)]
    pub(super) warmup: WarmupArgs,

    #[command(flatten, next_help_heading = "Zygote")]
    pub(super) zygote: ZygoteArgs,
}

/// `--warmup`, for `run` and `sweep`.
#[derive(Args)]
pub(super) struct WarmupArgs {
    /// Call the node once in its zygote before any call is forked, with these keyword
    /// arguments (a JSON object) or `first` (the first point's): what a library builds on
    /// its first call (caches, lazy imports, BLAS buffers) is then built once and every
    /// call starts with it. Whatever the warm-up leaves in module state, every call sees.
    /// A warm-up that leaves a thread running (an OpenMP pool, a CUDA context) is refused
    #[arg(long, value_name = "JSON|first", value_parser = parse_warmup, help_heading = "Zygote")]
    pub(super) warmup: Option<crate::sweep::Warmup>,
}

/// `run --help`, after the options.
pub(super) const RUN_AFTER_HELP: &str = "Output: stdout has the node's events as JSON lines as they come \
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
pub(super) struct SweepArgs {
    /// The node's source file: defines `process(**inputs)` or one public function.
    /// Its directory is first on sys.path, as under `python NODE.py`
    pub(super) node: PathBuf,

    /// An axis, NAME=VALUES: x=0..999 (both ends), x=0..1:0.1 (a step; values rounded to
    /// its decimals), x=1,2,5, opt=adam,sgd, or a JSON list x='[1, [2, 3]]'. Repeat for
    /// a product of axes, the first slowest
    #[arg(long = "grid", value_name = "NAME=VALUES", help_heading = "Calls")]
    pub(super) grids: Vec<String>,

    /// A file of keyword arguments, one JSON object per line, one call each (`-`: stdin,
    /// read to its end first); instead of --grid
    #[arg(
        long,
        value_name = "FILE",
        conflicts_with = "grids",
        help_heading = "Calls"
    )]
    pub(super) input: Option<PathBuf>,

    /// A keyword argument every call gets, NAME=VALUE (JSON where it parses, else a
    /// string); repeat it. A name may not also be an axis
    #[arg(short = 'k', value_name = "NAME=VALUE", help_heading = "Calls")]
    pub(super) pairs: Vec<String>,

    /// Keyword arguments every call gets, as one JSON object
    #[arg(long, value_name = "JSON", help_heading = "Calls")]
    pub(super) kwargs: Option<String>,

    /// Calls in flight at once [default: the number of CPUs, under SLURM those of the task:
    /// SLURM_CPUS_PER_TASK]. Each call's BLAS and OpenMP pools get the CPUs ÷ N threads, at
    /// least 1 (--threads-per-call sets it)
    #[arg(long, short = 'j', value_name = "N", value_parser = parse_jobs, help_heading = "Running")]
    pub(super) jobs: Option<usize>,

    /// Zygotes forking the calls, each a fork of the one that loaded the node, each with
    /// its share of -j: one zygote feeds the calls of about three cores, so many cores
    /// need several [default: one per 3 CPUs, at most -j]
    #[arg(long, value_name = "N", value_parser = parse_lanes, help_heading = "Running")]
    pub(super) lanes: Option<usize>,

    /// End a call still running after SECONDS: it fails with NodeTimeout, everything it
    /// started is killed, and the sweep goes on
    #[arg(long, value_name = "SECONDS", value_parser = parse_timeout, help_heading = "Running")]
    pub(super) timeout: Option<std::time::Duration>,

    /// Give each call a GPU of its own: it runs only when one of the GPU's slots is free,
    /// and sees CUDA_VISIBLE_DEVICES = that GPU alone. IDS: indices or UUIDs, e.g. 0,1,2,3;
    /// `all`: those in CUDA_VISIBLE_DEVICES where it is set, else every GPU the driver
    /// lists. The zygote itself never initialises CUDA
    #[arg(long, value_name = "IDS|all", help_heading = "GPUs")]
    pub(super) gpus: Option<String>,

    /// Calls in flight on each GPU at once (-j, if smaller, caps them all)
    #[arg(long, value_name = "N", default_value_t = 1, value_parser = parse_per_gpu,
          requires = "gpus", help_heading = "GPUs")]
    pub(super) per_gpu: usize,

    /// Each GPU slot's standby children make their CUDA context before their call arrives,
    /// so that a call's first kernel does not wait for one
    #[arg(long, requires = "gpus", help_heading = "GPUs")]
    pub(super) cuda_warm: bool,

    #[command(flatten)]
    pub(super) warmup: WarmupArgs,

    /// Write the result lines to FILE instead of stdout. A shard writes FILE with
    /// `.K-of-N` before its extension (results.2-of-4.jsonl), or in place of `{shard}`
    #[arg(long, short = 'o', value_name = "FILE", help_heading = "Output")]
    pub(super) output: Option<PathBuf>,

    /// Skip the points FILE (-o) answers already, each matched by index and kwargs (a
    /// changed grid is refused), and append the rest; a cut last line is dropped and its
    /// point runs again. A missing FILE is a fresh start
    #[arg(long, requires = "output", help_heading = "Output")]
    pub(super) resume: bool,

    /// As --resume, and the points whose line says "ok": false run again (their lines
    /// replaced)
    #[arg(long, requires = "output", help_heading = "Output")]
    pub(super) retry_failed: bool,

    /// Run only shard K of N (0 ≤ K < N): the points whose index % N is K. Default under
    /// SLURM: the array task's place (SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT), or in
    /// an srun step the task's rank (SLURM_PROCID of SLURM_NTASKS)
    #[arg(long, value_name = "K/N", value_parser = parse_shard, help_heading = "Running")]
    pub(super) shard: Option<crate::sweep::shard::Shard>,

    /// Run nothing: merge the shards' files of FILE (-o) into FILE, in index order, each
    /// line checked against these points, and say what is missing (exit 1 where a point
    /// is missing or failed). Give the sweep's own arguments
    #[arg(long, requires = "output", conflicts_with_all = ["resume", "retry_failed", "shard"],
          help_heading = "Output")]
    pub(super) merge: bool,

    #[command(flatten, next_help_heading = "Zygote")]
    pub(super) zygote: ZygoteArgs,
}

/// `sweep --help`, after the options.
pub(super) const SWEEP_AFTER_HELP: &str = "Output: one JSON line per call as it ends (completion order): {\"index\", \"kwargs\", \
     \"ok\", \"result\" or \"error\", \"events\" (what it yielded or emitted), \"logs\" (what \
     it printed), \"gpu\" (under --gpus), \"duration_ms\"}. On stderr a progress bar when stdout and stderr are a \
     terminal, and a summary listing the failures by error type.\n\n\
     Examples:\n  \
     fluksio-zygote sweep examples/square.py --grid x=0..999\n  \
     fluksio-zygote sweep train.py --grid lr=0.001..0.01:0.001 --grid opt=adam,sgd -k epochs=3 -o runs.jsonl\n  \
     fluksio-zygote sweep train.py --input points.jsonl -j 4 | jq 'select(.ok | not)'\n\n\
     Exit codes: 0 every call succeeded; 1 some failed; 2 it could not start (a usage error, \
     a node that does not load, an argument its function does not take, checked before any \
     call); 130 Ctrl-C (143 SIGTERM): the calls in flight ended, the results so far written \
     and summarised; 141 the reader of its output went away (| head), quietly.";

/// `--per-gpu N`: at least one.
fn parse_per_gpu(text: &str) -> Result<usize, String> {
    match text.parse::<usize>() {
        Ok(0) => Err("0 calls per GPU would run nothing; give 1 or more".into()),
        Ok(n) => Ok(n),
        Err(_) => Err(format!("{text:?} is not a number of calls")),
    }
}

/// `--shard K/N`.
fn parse_shard(text: &str) -> Result<crate::sweep::shard::Shard, String> {
    crate::sweep::shard::Shard::parse(text)
}

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
pub(super) const WORKER_AFTER_HELP: &str = "The engine's pool passes no flags: set them in its environment \
     (FLUKSIO_PRELOAD=numpy,pandas, FLUKSIO_PYTHON=/venv/bin/python, FLUKSIO_STANDBY, \
     FLUKSIO_ISOLATION, FLUKSIO_CALL_MEMORY_LIMIT_MIB, FLUKSIO_CONTAINMENT, RUST_LOG, \
     FLUKSIO_LOG_FORMAT).\n\n\
     Examples:\n  \
     PythonWorkerPool(\"/usr/local/bin/fluksio-zygote\", size=4)   # the engine's pool, in Python\n  \
     echo '{\"id\": 1, \"op\": \"run\", \"flow\": \"f\", \"node\": \"n\", \"source\": \"def process(): return 1\"}' | fluksio-zygote worker\n\n\
     Exit codes: 0 stdin closed; 1 an error while serving; 2 it could not start.";
