//! The `hello` an agent opens every session with: who it is, what it holds.

use std::path::Path;

use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use super::options::AgentOptions;

/// The protocol spoken with the engine.
pub const PROTOCOL: u32 = 3;

/// The first frame of a session.
pub fn hello(options: &AgentOptions, venv_digest: &str) -> Value {
    json!({
        "op": "hello",
        "protocol": PROTOCOL,
        "version": env!("CARGO_PKG_VERSION"),
        "name": options.name,
        "labels": options.labels,
        "python": options.zygote.python.display().to_string(),
        "max_parallel": options.parallel,
        "venv_digest": venv_digest,
        "inventory": inventory(options),
        "service_host": options.service_host,
    })
}

fn inventory(options: &AgentOptions) -> Value {
    json!({
        "cpus": options.cpus.filter(|&c| c > 0).unwrap_or_else(detect_cpus),
        "gpus": options.gpus.unwrap_or_else(detect_gpus),
        "ram_mb": options.ram_mb.filter(|&r| r > 0).or_else(detect_ram_mb),
    })
}

fn digits(name: &str) -> Option<u64> {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))?
        .parse()
        .ok()
}

/// Cores this agent may use: what the batch job was given, or the machine.
fn detect_cpus() -> u64 {
    digits("SLURM_CPUS_ON_NODE")
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get() as u64))
}

/// Memory in MB, or None where it cannot be asked, which is allowed.
fn detect_ram_mb() -> Option<u64> {
    if let Some(given) = digits("SLURM_MEM_PER_NODE") {
        return Some(given);
    }
    // SAFETY: sysconf only reads system configuration.
    let (pages, size) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGE_SIZE),
        )
    };
    (pages > 0 && size > 0).then(|| pages as u64 * size as u64 / (1 << 20))
}

/// What this agent was given, else what the machine appears to have: no
/// vendor tool is asked, NVIDIA's device nodes are counted.
fn detect_gpus() -> u64 {
    for name in ["SLURM_GPUS_ON_NODE", "FLUKSIO_WORKER_GPUS"] {
        if let Some(given) = digits(name) {
            return given;
        }
    }
    if let Ok(listed) = std::env::var("SLURM_JOB_GPUS")
        && !listed.trim().is_empty()
    {
        return listed.split(',').filter(|p| !p.trim().is_empty()).count() as u64;
    }
    std::fs::read_dir("/dev")
        .map(|entries| {
            entries
                .flatten()
                .filter(|e| {
                    let name = e.file_name();
                    let name = name.to_string_lossy();
                    name.strip_prefix("nvidia")
                        .is_some_and(|n| n.starts_with(|c: char| c.is_ascii_digit()))
                })
                .count() as u64
        })
        .unwrap_or(0)
}

/// 16 hex digits of the sha256 of `python -m pip freeze`: what is installed,
/// so the engine can tell when it drifted. Blocking: run it off the runtime.
pub fn venv_digest(python: &Path) -> String {
    let listing = std::process::Command::new(python)
        .args(["-m", "pip", "freeze"])
        .stdin(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .output();
    match listing {
        Ok(output) => Sha256::digest(&output.stdout)
            .iter()
            .take(8)
            .map(|b| format!("{b:02x}"))
            .collect(),
        Err(_) => String::new(),
    }
}
