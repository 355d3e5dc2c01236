//! The agent's flags.

use crate::zygote::ZygoteOptions;

/// The agent's flags, as agent.py's.
#[derive(Debug, Clone)]
pub struct AgentOptions {
    pub url: String,
    pub token: String,
    pub name: String,
    pub labels: Vec<String>,
    pub zygote: ZygoteOptions,
    pub parallel: u32,
    pub artifact_url: String,
    pub service_host: String,
    pub insecure: bool,
    pub cpus: Option<u64>,
    pub gpus: Option<u64>,
    pub ram_mb: Option<u64>,
    pub max_idle: f64,
    pub ca_cert: Option<std::path::PathBuf>,
    /// `--metrics ADDR`, served from this process.
    pub metrics: Option<String>,
}
