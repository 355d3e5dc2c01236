//! The report: one Markdown table of every row, each compared with the
//! reference pool and with the C fork floor of its scenario, read the right
//! way round ("ours is 24× faster", "the pool is 3.1× faster"), and the
//! targets with the ratio this run measured.

use std::fmt::Write;
use std::path::Path;

use super::BenchOptions;
use super::matrix::{Metric, Results, Row, Scenario, Server};
use super::ours::Variant;
use super::support::{Side, factor_text, ms, winner};

/// The whole report: how it was run, the table, the targets.
pub fn markdown(
    options: &BenchOptions,
    results: &Results,
    png: &Path,
    chart_note: Option<&str>,
) -> String {
    let mut out = String::new();
    let preload = if options.preload.is_empty() {
        "nothing".to_string()
    } else {
        options.preload.join(",")
    };
    let _ = writeln!(
        out,
        "# fluksio-zygote against the reference: {preload} preloaded\n"
    );
    let _ = writeln!(out, "```sh\n{}\n```\n", options.command_line);
    let _ = writeln!(
        out,
        "{}; Python {} ({}); reference: {}; our zygote's anonymous RSS with the trivial node: {}.\n",
        machine(),
        results.python_version,
        options.python.display(),
        options.reference.display(),
        results
            .anon_kib
            .map(|k| format!("{} MiB", k / 1024))
            .unwrap_or_else(|| "unknown".into())
    );
    out.push_str(&table(results));
    out.push('\n');
    chart_line(&mut out, png, chart_note, "the same rows, as bars");
    out.push_str("## Issue 8's targets, as measured in this run\n\n");
    for line in targets(results) {
        let _ = writeln!(out, "- {line}");
    }
    out
}

/// The table: a row per line, scenarios in order.
pub fn table(results: &Results) -> String {
    let mut out = String::from(
        "| scenario | served by | measured | against the reference pool | against the C fork floor | how |\n\
         | --- | --- | ---: | --- | --- | --- |\n",
    );
    for scenario in Scenario::ALL {
        for row in results.rows.iter().filter(|r| r.scenario == scenario) {
            let (measured, pool, floor) = match &row.outcome {
                Ok(metric) => (
                    measured(metric),
                    against_pool(results, row, metric),
                    against_floor(results, row, metric),
                ),
                Err(why) => (format!("not run: {why}"), String::new(), String::new()),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} |",
                scenario.title(),
                row.server.label(),
                cell(&measured),
                cell(&pool),
                cell(&floor),
                cell(&row.note)
            );
        }
    }
    out
}

/// Text safe inside a table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn measured(metric: &Metric) -> String {
    match *metric {
        Metric::Latency(stats) => format!(
            "p50 {:.3} ms, p99 {:.3} ms ({} calls)",
            ms(stats.p50),
            ms(stats.p99),
            stats.samples
        ),
        Metric::Rate(rate) => format!("{rate:.0} calls/s"),
        Metric::Pss { kib, .. } => format!("{:.0} MiB", kib as f64 / 1024.0),
    }
}

/// "ours is 24× faster", "the pool uses 1.3× less memory".
fn wins(who: &str, factor: f64, metric: &Metric) -> String {
    match metric {
        Metric::Pss { .. } => format!("{who} uses {}× less memory", factor_text(factor)),
        _ => format!("{who} is {}× faster", factor_text(factor)),
    }
}

fn against_pool(results: &Results, row: &Row, metric: &Metric) -> String {
    if row.server == Server::Pool {
        return "baseline".into();
    }
    let Some(pool) = results.metric(row.scenario, Server::Pool) else {
        return String::new();
    };
    let name = if row.server.is_ours() { "ours" } else { "this" };
    match winner(metric.value(), pool.value(), metric.lower_is_better()) {
        Some((Side::This, f)) => wins(name, f, metric),
        Some((Side::Other, f)) => wins("the pool", f, metric),
        None => String::new(),
    }
}

fn against_floor(results: &Results, row: &Row, metric: &Metric) -> String {
    if matches!(row.server, Server::Floor { .. }) {
        return "floor".into();
    }
    if matches!(metric, Metric::Pss { .. }) {
        return String::new();
    }
    let Some(floor) = results.floor(row.scenario) else {
        return String::new();
    };
    let ratio = metric.value() / floor.value();
    match metric {
        Metric::Rate(_) if ratio >= 1.0 => format!("{:.1}× the floor's rate", ratio),
        Metric::Rate(_) if ratio >= 0.01 => format!("{:.0}% of the floor's rate", 100.0 * ratio),
        Metric::Rate(_) => format!("the floor is {}× faster", factor_text(ratio.recip())),
        _ if ratio >= 1.0 => format!("{ratio:.2}× the floor"),
        _ => format!("{}× under the floor", factor_text(ratio.recip())),
    }
}

/// The machine, for the report's header.
pub fn machine() -> String {
    let cpuinfo = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    let model = cpuinfo
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|m| m.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_else(|| "unknown CPU".into());
    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
    let memory = std::fs::read_to_string("/proc/meminfo")
        .ok()
        .and_then(|m| {
            m.lines()
                .find_map(|l| l.strip_prefix("MemTotal:"))
                .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        })
        .map(|kib| format!("{:.0} GiB", kib as f64 / 1048576.0))
        .unwrap_or_default();
    let kernel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    format!(
        "{date}, {cpus} CPUs ({model}), {memory} memory, Linux {}",
        kernel.trim(),
        date = today()
    )
}

/// Today's date, UTC, as YYYY-MM-DD (civil from days since 1970).
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0) as i64;
    let z = secs.div_euclid(86_400) + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!("{year:04}-{month:02}-{day:02}")
}

/// A target's line: the ratio, met or not, by how much.
fn verdict(what: &str, ratio: Option<f64>, bound: f64, at_most: bool) -> String {
    let sign = if at_most { "≤" } else { "≥" };
    match ratio {
        None => format!("{what}: not measured (a row did not run)"),
        Some(r) if (at_most && r <= bound) || (!at_most && r >= bound) => {
            format!("{what}: **{r:.2}×** (target {sign} {bound:.2}×): met")
        }
        Some(r) => {
            let by = if at_most {
                r / bound - 1.0
            } else {
                1.0 - r / bound
            };
            format!(
                "{what}: **{r:.2}×** (target {sign} {bound:.2}×): **missed**, by {:.0}%",
                100.0 * by
            )
        }
    }
}

/// A ratio reported with no target.
fn ratio_only(what: &str, ratio: Option<f64>) -> String {
    match ratio {
        Some(ratio) => format!("{what}: **{ratio:.2}×** (no target)"),
        None => format!("{what}: not measured (a row did not run)"),
    }
}

/// One line per target of issue 8.
pub fn targets(results: &Results) -> Vec<String> {
    let value = |scenario, server| results.metric(scenario, server).map(|m| m.value());
    let floor = |scenario| results.floor(scenario).map(|m| m.value());
    let over = |a: Option<f64>, b: Option<f64>| Some(a? / b?);
    let call = Server::Ours(Variant::Call);
    let node = Server::Ours(Variant::Node);
    let reset = Server::Ours(Variant::Reset);
    let pool = Server::Pool;
    let mut lines = vec![
        verdict(
            "`--isolation node` through the pool's own client, p50 against the reused pool's",
            over(
                value(Scenario::PoolBackToBack, node),
                value(Scenario::PoolBackToBack, pool),
            ),
            1.0,
            true,
        ),
        verdict(
            "`--isolation call`, spaced 5 ms, p50 against the reused pool's (this process as the client)",
            over(value(Scenario::Spaced, call), value(Scenario::Spaced, pool)),
            3.0,
            true,
        ),
        verdict(
            "`--isolation call`, spaced 5 ms, through the pool's own client, against the reused pool's",
            over(
                value(Scenario::PoolSpaced, call),
                value(Scenario::PoolSpaced, pool),
            ),
            3.0,
            true,
        ),
        verdict(
            "`--isolation call`, back to back, p50 against the C fork floor at the same anonymous RSS",
            over(
                value(Scenario::BackToBack, call),
                floor(Scenario::BackToBack),
            ),
            2.0,
            true,
        ),
    ];
    lines.push(verdict(
        "`--isolation reset`, back to back, p50 against the C fork floor at the same anonymous RSS",
        over(
            value(Scenario::BackToBack, reset),
            floor(Scenario::BackToBack),
        ),
        1.0,
        true,
    ));
    for scenario in [Scenario::Throughput, Scenario::Sweep] {
        lines.push(verdict(
            &format!(
                "{}: `--isolation reset`, calls/s against the C fork floor's with 2 processes",
                scenario.title()
            ),
            over(value(scenario, reset), floor(scenario)),
            1.0,
            false,
        ));
        lines.push(verdict(
            &format!(
                "{}: `--isolation call` (`sweep -j 2`), calls/s against the C fork floor's with 2 processes",
                scenario.title()
            ),
            over(value(scenario, call), floor(scenario)),
            0.7,
            false,
        ));
        lines.push(verdict(
            &format!(
                "{}: `--isolation node` (`sweep -j 2 --isolation node`), calls/s against the reference pool of 2",
                scenario.title()
            ),
            over(value(scenario, node), value(scenario, pool)),
            1.0,
            false,
        ));
    }
    lines.extend([
        verdict(
            "the next call after a kill: the pool's cold respawn against ours, `--isolation call`",
            over(value(Scenario::AfterKill, pool), value(Scenario::AfterKill, call)),
            100.0,
            false,
        ),
        verdict(
            "8 concurrent calls' total PSS, `sweep -j 8`, against 8 pool workers', the node's array loaded at module level",
            over(value(Scenario::PssWeights, call), value(Scenario::PssWeights, pool)),
            1.0 / 3.0,
            true,
        ),
        ratio_only(
            "the same, each call allocating an array of its own (in every design 8 copies, so no ratio can go below the arrays' share)",
            over(value(Scenario::Pss, call), value(Scenario::Pss, pool)),
        ),
        verdict(
            "N pool slots sharing a zygote, total PSS against N private zygotes', the node's array loaded at module level",
            over(
                value(Scenario::PssWeights, Server::SharedZygote),
                value(Scenario::PssWeights, node),
            ),
            0.5,
            true,
        ),
        verdict(
            "(6) the small node's p50 after the big node is compiled against before, `--isolation call`",
            over(value(Scenario::SmallAfter, call), value(Scenario::SmallBefore, call)),
            1.2,
            true,
        ),
        verdict(
            "(6) the same, `--isolation node`",
            over(value(Scenario::SmallAfter, node), value(Scenario::SmallBefore, node)),
            1.2,
            true,
        ),
        verdict(
            "torch: cold python + import torch + the call against ours, `--preload torch`",
            over(value(Scenario::Torch, Server::Spawn), value(Scenario::Torch, call)),
            100.0,
            false,
        ),
        verdict(
            "torch: a call against the C fork floor at the torch zygote's RSS",
            over(value(Scenario::Torch, call), floor(Scenario::Torch)),
            2.0,
            true,
        ),
    ]);
    lines
}

/// The chart's line in a report: the PNG beside it, or why it is not.
pub fn chart_line(out: &mut String, png: &std::path::Path, chart_note: Option<&str>, alt: &str) {
    match chart_note {
        None => {
            let name = png
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let _ = writeln!(out, "![{alt}]({name})\n");
        }
        Some(note) => {
            let _ = writeln!(out, "({note})\n");
        }
    }
}
