//! fluksio-zygote: runs the Python code of Fluksio nodes.
//!
//! CPython is embedded (the `fluksio-embed` crate) in a single-threaded
//! *zygote* process that imports the heavy modules once (torch, numpy,
//! pandas) and forks one child per call, in a cell of its own. Every call
//! goes through one pipeline: parsed at the edge ([`protocol`]), placed and
//! run by a zygote ([`zygote`]), followed to its end, answered for if its
//! node wrote no reply ([`end`]), contained and reaped ([`containment`],
//! [`process`]). The modes are front ends over it, each a transport:
//!
//! - [`worker`]: the JSON-line worker contract on stdin/stdout, a drop-in
//!   for `worker_main.py` in the engine's `PythonWorkerPool`;
//! - [`slot`]: the same contract for a pool slot, its calls forked by a
//!   zygote shared with the other slots;
//! - [`agent`]: the remote worker, protocol 3 to the engine over a
//!   WebSocket;
//! - [`sweep`]: `run` and `sweep`, the local main jobs: a node once per
//!   grid point, no engine needed.
//!
//! ARCHITECTURE.md maps every module and the invariants they keep.

pub mod agent;
pub mod artifacts;
pub mod bind_now;
pub mod cli;
pub mod containment;
pub mod end;
pub mod fds;
pub mod fluksio;
pub mod lines;
pub mod link;
pub mod metrics;
pub mod nesting;
pub mod output;
pub mod poll_set;
pub mod process;
pub mod protocol;
pub mod python_str;
pub mod reset;
pub mod scrub;
pub mod slot;
pub mod sweep;
pub mod telemetry;
pub mod worker;
pub mod zygote;
