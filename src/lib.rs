//! fluksio-zygote: runs the Python code of Fluksio nodes.
//!
//! CPython is embedded in a single-threaded *zygote* process that imports
//! the heavy modules once (torch, numpy, pandas) and forks one child per
//! call, in its own session. It speaks the contracts Fluksio already uses:
//!
//! - [`worker`]: the JSON-line worker contract on stdin/stdout, a drop-in
//!   for `worker_main.py` in the engine's `PythonWorkerPool`;
//! - [`sweep`]: a local main job, no engine needed: a node once per grid
//!   point.
//!
//! [`zygote`] is the fork server, [`fluksio`] the module node code imports,
//! [`protocol`] the wire types, [`process`] how children end.

pub mod agent;
pub mod artifacts;
pub mod cli;
pub mod containment;
pub mod end;
pub mod fds;
pub mod fluksio;
pub mod lines;
pub mod link;
pub mod metrics;
pub mod output;
pub mod process;
pub mod protocol;
pub mod python_str;
pub mod scrub;
pub mod slot;
pub mod sweep;
pub mod telemetry;
pub mod worker;
pub mod zygote;
