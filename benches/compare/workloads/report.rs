//! The report of `--workloads`: one Markdown table of every
//! workload's rows (wall time, against joblib, per-call p50, whether the
//! results match), then the targets, a verdict column each (with what a
//! call of `--isolation call` costs beyond its point: the crude split of
//! where its time goes that can be read from outside), then how every row
//! was run.
//!
//! A row's ratio is its wall time over joblib's, on the same points: lower
//! is better, and 0.5× means it took half as long.

use std::fmt::Write;
use std::path::Path;

use super::runner::Measured;
use super::{JOBS, Results, Row, Way, WorkloadOptions, WorkloadResult, compare};

/// `--isolation node` against joblib, on every workload.
pub const NODE_TARGET: f64 = 0.8;
/// `--isolation reset` against joblib, on every workload: isolated calls
/// no slower than joblib's reused workers.
pub const RESET_TARGET: f64 = 1.0;
/// `--isolation call` against joblib where a point takes [`LONG_POINT_MS`]
/// or more: the fork is paid back.
pub const CALL_LONG_TARGET: f64 = 1.0;
/// `--isolation call` against joblib on points under [`LONG_POINT_MS`],
/// where a fork per point is most of a point.
pub const CALL_SHORT_TARGET: f64 = 3.0;
/// What makes a point long, in process.
pub const LONG_POINT_MS: f64 = 20.0;

/// The whole report.
pub fn markdown(
    options: &WorkloadOptions,
    results: &Results,
    png: &Path,
    chart_note: Option<&str>,
) -> String {
    let mut out = String::from("# fluksio-zygote against joblib: real nodes, end to end\n\n");
    let _ = writeln!(out, "```sh\n{}\n```\n", options.command_line);
    let _ = writeln!(
        out,
        "{}; Python {} ({}); {JOBS} calls in flight in every row but the for-loop; load \
         average {} before the first row, {} after the last.\n",
        super::super::report::machine(),
        results.python_version,
        options.python.display(),
        load(results.load[0]),
        load(results.load[1]),
    );
    out.push_str(
        "Each row runs the same points by the whole command a user would type, timed start to \
         exit: the interpreter's start-up, the imports and the workers' start-up count. \
         \"Against joblib\" is the row's wall time over joblib's (lower is better). CPU is the \
         user and system time of the command and every process under it; others' is what the \
         rest of the machine took meanwhile (other processes, steal): a row with much of it \
         was slowed by them, and should be run again. \"Per call\" \
         is ours' p50 as the sweep reports it (a point handed out to its reply), and the \
         for-loop's median \
         point in process (the point alone). Every row's results are checked against the \
         for-loop's, point by point, floats within a relative ",
    );
    let _ = writeln!(out, "{:e}.\n", compare::RELATIVE_TOLERANCE);
    out.push_str(&table(results));
    out.push('\n');
    super::super::report::chart_line(
        &mut out,
        png,
        chart_note,
        "wall time against joblib's, per workload",
    );
    out.push_str("## Targets, as measured in this run\n\n");
    out.push_str(&targets(results));
    out.push_str("\n## How each row ran\n\n");
    out.push_str(&how(results));
    out
}

fn load(average: Option<f64>) -> String {
    average.map_or_else(|| "unknown".into(), |a| format!("{a:.2}"))
}

/// The table: every workload, every row.
pub fn table(results: &Results) -> String {
    let mut out = String::from(
        "| workload | run as | wall | against joblib | CPU (others') | per call, p50 | results |\n\
         | --- | --- | ---: | ---: | ---: | ---: | --- |\n",
    );
    for workload in &results.workloads {
        let name = format!("{} ({} points)", workload.name, workload.points);
        for row in &workload.rows {
            let (wall, ratio, cpu, p50) = match &row.outcome {
                Ok(measured) => (
                    format!("{:.2} s", measured.wall.as_secs_f64()),
                    against_joblib(workload, row.way),
                    match measured.others_cpu {
                        Some(others) => format!(
                            "{:.1} s ({:.1} s)",
                            measured.cpu.as_secs_f64(),
                            others.as_secs_f64()
                        ),
                        None => format!("{:.1} s", measured.cpu.as_secs_f64()),
                    },
                    per_call(workload, row.way, measured),
                ),
                Err(why) => (
                    format!("failed: {why}"),
                    String::new(),
                    String::new(),
                    String::new(),
                ),
            };
            let _ = writeln!(
                out,
                "| {} | {} | {} | {} | {} | {} | {} |",
                name,
                row.way.label(),
                cell(&wall),
                ratio,
                cpu,
                p50,
                cell(&agreement(workload, row)),
            );
        }
    }
    out
}

/// Text safe inside a table cell.
fn cell(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

fn against_joblib(workload: &WorkloadResult, way: Way) -> String {
    if way == Way::Joblib {
        return "1×".into();
    }
    workload
        .ratio(way)
        .map(|r| format!("{r:.2}×"))
        .unwrap_or_default()
}

fn per_call(workload: &WorkloadResult, way: Way, measured: &Measured) -> String {
    match (measured.p50_ms, way) {
        (Some(ms), _) => milliseconds(ms),
        (None, Way::Loop) => workload
            .point_ms
            .map(|ms| format!("{} in process", milliseconds(ms)))
            .unwrap_or_default(),
        (None, _) => String::new(),
    }
}

/// 0.0213 → "0.021 ms", 4.25 → "4.25 ms", 160.4 → "160 ms".
fn milliseconds(ms: f64) -> String {
    format!("{} ms", super::super::chart::number(ms))
}

/// "same", "the reference", "results differ at …", or nothing for a row
/// that did not run.
fn agreement(workload: &WorkloadResult, row: &Row) -> String {
    if row.outcome.is_err() {
        return String::new();
    }
    if let Some(at) = &row.differs {
        return format!("**results differ** at {at}");
    }
    match workload.reference {
        Some(way) if way == row.way => "the reference".into(),
        Some(way) => format!("same as the {}'s", way.label()),
        None => String::new(),
    }
}

/// The targets' table: a workload a line, a verdict column per target.
pub fn targets(results: &Results) -> String {
    let mut out = format!(
        "| workload | a point, in process | `--isolation call`, a call's p50 (beyond the point) | \
         `--isolation node` ≤ {NODE_TARGET}× joblib | \
         `--isolation reset` ≤ {RESET_TARGET}× joblib | \
         `--isolation reset --warmup first` ≤ {RESET_TARGET}× joblib | \
         `--isolation call` ≤ {CALL_LONG_TARGET}× joblib, points of {LONG_POINT_MS} ms or more | \
         `--isolation call` ≤ {CALL_SHORT_TARGET}× joblib, points under {LONG_POINT_MS} ms |\n\
         | --- | ---: | ---: | --- | --- | --- | --- | --- |\n"
    );
    for workload in &results.workloads {
        let point = workload.point_ms.map(milliseconds).unwrap_or_default();
        let call = workload
            .row(Way::Call)
            .and_then(|r| r.outcome.as_ref().ok()?.p50_ms)
            .map(|p50| match workload.point_ms {
                Some(point) => {
                    let sign = if p50 >= point { '+' } else { '−' };
                    let beyond = milliseconds((p50 - point).abs());
                    format!("{} ({sign}{beyond})", milliseconds(p50))
                }
                None => milliseconds(p50),
            })
            .unwrap_or_default();
        let node = verdict(workload, Way::Node, NODE_TARGET);
        let reset = verdict(workload, Way::Reset, RESET_TARGET);
        let reset_warmed = verdict(workload, Way::ResetWarmup, RESET_TARGET);
        let (long, short) = match workload.point_ms {
            Some(ms) if ms >= LONG_POINT_MS => (
                verdict(workload, Way::Call, CALL_LONG_TARGET),
                "—".to_string(),
            ),
            Some(_) => (
                "—".to_string(),
                verdict(workload, Way::Call, CALL_SHORT_TARGET),
            ),
            None => {
                let unknown = "not judged: no point time (the for-loop did not run)".to_string();
                (unknown.clone(), unknown)
            }
        };
        let _ = writeln!(
            out,
            "| {} | {point} | {call} | {} | {} | {} | {} | {} |",
            workload.name,
            cell(&node),
            cell(&reset),
            cell(&reset_warmed),
            cell(&long),
            cell(&short)
        );
    }
    out
}

/// A target's cell: the ratio, met or missed and by how much, or why there
/// is no verdict.
fn verdict(workload: &WorkloadResult, way: Way, bound: f64) -> String {
    let Some(row) = workload.row(way) else {
        return "not run".into();
    };
    if row.outcome.is_err() {
        return "not measured: the row failed".into();
    }
    if row.differs.is_some() {
        return "**missed**: results differ".into();
    }
    match workload.ratio(way) {
        None => "not measured: joblib's row failed".into(),
        Some(r) if r <= bound => format!("**{r:.2}×**: met"),
        Some(r) => format!(
            "**{r:.2}×**: **missed**, by {:.0}%",
            100.0 * (r / bound - 1.0)
        ),
    }
}

/// The command of each row, and each workload's preloads.
fn how(results: &Results) -> String {
    let mut out = String::new();
    for way in Way::ALL {
        let command = match way {
            Way::Call => "fluksio-zygote sweep NODE.py --input POINTS.jsonl -j 2 --preload MODULES -o OUT.jsonl --isolation call".into(),
            Way::CallWarmup => "… the same, `--isolation call --warmup first`".into(),
            Way::CallNoLearn => "… the same, `--isolation call --learn-imports off`".into(),
            Way::Node => "… the same, `--isolation node`".into(),
            Way::Reset => "… the same, `--isolation reset`".into(),
            Way::ResetWarmup => "… the same, `--isolation reset --warmup first`".into(),
            _ => format!(
                "python benches/workloads/baseline.py {} NODE.py POINTS.jsonl OUT.jsonl {JOBS}",
                way.method().unwrap_or_default()
            ),
        };
        let command = if command.starts_with('…') {
            command
        } else {
            format!("`{command}`")
        };
        let _ = writeln!(out, "- {}: {command}", way.label());
    }
    out.push_str("\nMODULES, the node's own top-level imports:\n\n");
    for workload in &results.workloads {
        let preload = if workload.preload.is_empty() {
            "nothing".to_string()
        } else {
            format!("`{}`", workload.preload.join(","))
        };
        let _ = writeln!(out, "- {}: {preload}", workload.name);
    }
    out
}

// Run by tests/bench_units.rs. Cargo sets cfg(test) for every bench and
// test, so the benches compile this too, without its #[test] functions.
#[cfg(test)]
#[allow(unused_imports, dead_code)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn workload(walls: &[(Way, f64)], point_ms: Option<f64>) -> WorkloadResult {
        WorkloadResult {
            name: "w",
            points: 10,
            preload: vec!["numpy".into()],
            point_ms,
            reference: Some(Way::Loop),
            rows: walls
                .iter()
                .map(|&(way, s)| Row {
                    way,
                    outcome: Ok(Measured {
                        wall: Duration::from_secs_f64(s),
                        cpu: Duration::ZERO,
                        others_cpu: None,
                        p50_ms: None,
                    }),
                    differs: None,
                })
                .collect(),
        }
    }

    #[test]
    fn verdicts_follow_the_point_length() {
        let long = workload(
            &[
                (Way::Joblib, 10.0),
                (Way::Call, 9.0),
                (Way::Node, 9.5),
                (Way::Loop, 20.0),
            ],
            Some(25.0),
        );
        let short = workload(
            &[
                (Way::Joblib, 2.0),
                (Way::Call, 5.0),
                (Way::Node, 1.0),
                (Way::Loop, 4.0),
            ],
            Some(4.0),
        );
        let table = targets(&Results {
            workloads: vec![long, short],
            python_version: "3".into(),
            load: [None, None],
        });
        let lines: Vec<&str> = table.lines().collect();
        assert!(lines[2].contains("**0.90×**: met | —"), "{}", lines[2]);
        assert!(
            lines[2].contains("**0.95×**: **missed**, by 19%"),
            "{}",
            lines[2]
        );
        assert!(
            lines[3].contains("**0.50×**: met | not run | not run | — | **2.50×**: met"),
            "{}",
            lines[3]
        );
    }
}
