//! What the benches share: the product binary and its interpreter, a
//! worker client ([`driver`]), the reference baselines ([`reference`]), the
//! C fork floor ([`floor`]), what `/proc` says ([`procfs`]), and latency
//! statistics read the right way round. Each bench uses a part of it.

#![allow(dead_code)]

pub mod driver;
pub mod floor;
pub mod procfs;
pub mod reference;

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::Duration;

/// `--name N` from the bench's arguments, or `default`.
pub fn flag(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|at| args.get(at + 1)?.parse().ok())
        .unwrap_or(default)
}

pub const ZYGOTE: &str = env!("CARGO_BIN_EXE_fluksio-zygote");

/// The interpreter the zygote embeds, which the reference runs on too: asked
/// of the zygote itself, so both sides run the very same Python.
pub fn python() -> PathBuf {
    let output = Command::new(ZYGOTE)
        .arg("worker")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            let request = r#"{"id":0,"op":"run","flow":"b","node":"p","source":"import sys\ndef process():\n    return sys.executable\n"}"#;
            writeln!(child.stdin.take().expect("stdin"), "{request}")?;
            child.wait_with_output()
        })
        .expect("the zygote answers");
    let reply: serde_json::Value = serde_json::from_slice(&output.stdout).expect("a JSON reply");
    PathBuf::from(reply["result"].as_str().expect("a path"))
}

/// p50, p99 and mean of a set of latencies.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Stats {
    pub p50: Duration,
    pub p99: Duration,
    pub mean: Duration,
    pub samples: usize,
}

impl Stats {
    /// `None` for no samples.
    pub fn of(samples: &[Duration]) -> Option<Stats> {
        let mut sorted = samples.to_vec();
        sorted.sort_unstable();
        // Nearest rank: the smallest sample with at least q of them at or below it.
        let rank =
            |q: f64| sorted[((q * sorted.len() as f64).ceil() as usize).clamp(1, sorted.len()) - 1];
        (!sorted.is_empty()).then(|| Stats {
            p50: rank(0.50),
            p99: rank(0.99),
            mean: sorted.iter().sum::<Duration>() / sorted.len() as u32,
            samples: sorted.len(),
        })
    }
}

/// Milliseconds, for tables.
pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// How one number compares with another, read the right way round: never
/// "0.0× faster". `ours` and `theirs` are the two values; `lower_is_better`
/// for times and memory, not for rates. Returns e.g. ("this", 24.1) when
/// ours wins by 24.1×, ("other", 3.1) when the other side wins by 3.1×.
pub fn winner(ours: f64, theirs: f64, lower_is_better: bool) -> Option<(Side, f64)> {
    if !(ours > 0.0 && theirs > 0.0 && ours.is_finite() && theirs.is_finite()) {
        return None;
    }
    let ours_better = if lower_is_better {
        ours <= theirs
    } else {
        ours >= theirs
    };
    let factor = if ours > theirs {
        ours / theirs
    } else {
        theirs / ours
    };
    Some((if ours_better { Side::This } else { Side::Other }, factor))
}

/// Which side of a comparison wins.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    This,
    Other,
}

/// `1.234` → "1.2", `24.4` → "24", to a sensible number of digits.
pub fn factor_text(factor: f64) -> String {
    if factor >= 10.0 {
        format!("{factor:.0}")
    } else {
        format!("{factor:.1}")
    }
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;

    #[test]
    fn ratios_read_the_right_way_round() {
        assert_eq!(winner(1.0, 24.0, true), Some((Side::This, 24.0)));
        assert_eq!(winner(3.1, 1.0, true), Some((Side::Other, 3.1)));
        assert_eq!(winner(200.0, 100.0, false), Some((Side::This, 2.0)));
        assert_eq!(winner(0.0, 1.0, true), None);
        assert_eq!(factor_text(0.96_f64.recip()), "1.0");
        assert_eq!(factor_text(54.9), "55");
    }
}
