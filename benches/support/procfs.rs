//! What `/proc` says about processes: a process's anonymous RSS (what the
//! fork floor is sized by), the PSS of process trees (what memory a set of
//! processes costs the machine, shared pages divided among their sharers),
//! and CPU time and page faults, its own and its reaped children's (the
//! profile of a call, split between the zygote and the call's child).

use std::collections::BTreeSet;
use std::time::Duration;

/// CPU time and minor page faults of a process and of its reaped children
/// (`/proc/PID/stat`: minflt, cminflt, utime, stime, cutime, cstime).
#[derive(Debug, Clone, Copy, Default)]
pub struct Usage {
    pub cpu: Duration,
    pub faults: u64,
    pub children_cpu: Duration,
    pub children_faults: u64,
}

impl Usage {
    /// Of `pid` now.
    pub fn of(pid: u32) -> Result<Usage, String> {
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))
            .map_err(|e| format!("cannot read /proc/{pid}/stat: {e}"))?;
        // Fields after `(comm)`, numbered from 3 (state) as in proc(5).
        let rest = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let fields: Vec<u64> = rest
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .collect();
        let field = |n: usize| fields.get(n - 3).copied().unwrap_or(0);
        // SAFETY: sysconf has no preconditions.
        let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
        let ticks = |t: u64| Duration::from_secs_f64(t as f64 / hz);
        Ok(Usage {
            faults: field(10),
            children_faults: field(11),
            cpu: ticks(field(14) + field(15)),
            children_cpu: ticks(field(16) + field(17)),
        })
    }

    /// What was spent between `self` and `later`, per one of `calls`, as
    /// text: "zygote 1.7 ms CPU, 100 faults; children 3.9 ms CPU, 400
    /// faults, per call".
    pub fn per_call(&self, later: &Usage, calls: usize) -> String {
        let n = calls.max(1) as f64;
        let cpu = |a: Duration, b: Duration| b.saturating_sub(a).as_secs_f64() * 1e3 / n;
        let faults = |a: u64, b: u64| b.saturating_sub(a) as f64 / n;
        format!(
            "per call: {:.2} ms CPU and {:.0} faults in the worker, {:.2} ms CPU and {:.0} faults in reaped children",
            cpu(self.cpu, later.cpu),
            faults(self.faults, later.faults),
            cpu(self.children_cpu, later.children_cpu),
            faults(self.children_faults, later.children_faults)
        )
    }
}

/// A `Name:   1234 kB` field of a `/proc` file, in KiB.
fn field_kib(text: &str, name: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.strip_prefix(name))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
}

/// `RssAnon` of a process, in KiB.
pub fn anon_kib(pid: u32) -> Result<u64, String> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status"))
        .map_err(|e| format!("cannot read /proc/{pid}/status: {e}"))?;
    field_kib(&status, "RssAnon:").ok_or_else(|| format!("no RssAnon in /proc/{pid}/status"))
}

/// `Pss` of a process from `smaps_rollup`, in KiB; `None` if it has gone.
pub fn pss_kib(pid: u32) -> Option<u64> {
    let rollup = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).ok()?;
    field_kib(&rollup, "Pss:")
}

/// Every process whose parent chain reaches one of `roots`, the roots
/// included (from one scan of `/proc`).
pub fn tree(roots: &[u32]) -> BTreeSet<u32> {
    let mut parents = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/proc") {
        for entry in entries.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|s| s.parse::<u32>().ok())
            else {
                continue;
            };
            let Ok(stat) = std::fs::read_to_string(format!("/proc/{pid}/stat")) else {
                continue;
            };
            // `pid (comm) state ppid …`: comm may hold spaces and parentheses.
            let ppid = stat
                .rsplit_once(')')
                .and_then(|(_, rest)| rest.split_whitespace().nth(1))
                .and_then(|p| p.parse::<u32>().ok());
            if let Some(ppid) = ppid {
                parents.push((pid, ppid));
            }
        }
    }
    let mut found: BTreeSet<u32> = roots.iter().copied().collect();
    loop {
        let before = found.len();
        for &(pid, ppid) in &parents {
            if found.contains(&ppid) {
                found.insert(pid);
            }
        }
        if found.len() == before {
            return found;
        }
    }
}

/// Total PSS of the trees under `roots`, in KiB, and how many processes.
pub fn tree_pss_kib(roots: &[u32]) -> (u64, usize) {
    let pids = tree(roots);
    let total = pids.iter().filter_map(|&pid| pss_kib(pid)).sum();
    (total, pids.len())
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;

    #[test]
    fn reads_this_process() {
        let me = std::process::id();
        assert!(anon_kib(me).unwrap() > 0);
        assert!(pss_kib(me).unwrap() > 0);
        assert!(tree(&[me]).contains(&me));
        assert_eq!(field_kib("Pss:    12 kB\n", "Pss:"), Some(12));
    }
}
