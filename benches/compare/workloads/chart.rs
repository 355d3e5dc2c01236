//! The chart of `--workloads`: a group of bars per workload, one per
//! row, each the row's wall time against joblib's on a log scale. joblib is
//! the line at 1×; a bar grows from it, down for a row faster than joblib,
//! up for a slower one, so that 0.5× and 2× are as long. A short black mark
//! across ours' `--isolation node` and `--isolation call` bars is that
//! row's target.
//!
//! Drawn as [`super::super::chart`] draws the matrix: plotters into an RGB
//! buffer, a system font loaded at run time, written as PNG.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use super::super::chart::{load_font, number, write_png};
use super::super::support::factor_text;
use super::report::{
    CALL_LONG_TARGET, CALL_SHORT_TARGET, LONG_POINT_MS, NODE_TARGET, RESET_TARGET,
};
use super::{Results, Way, WorkloadResult};

const WIDTH: u32 = 1400;
const HEIGHT: u32 = 660;
/// The plot's edges: room for the title and legend above, the axis'
/// labels left, the workloads' names below.
const LEFT: i32 = 80;
const RIGHT: i32 = 30;
const TOP: i32 = 110;
const BOTTOM: i32 = 70;

/// The rows with a bar: every row but joblib, which is the 1× line.
const BARS: [Way; 8] = [
    Way::Call,
    Way::CallWarmup,
    Way::CallNoLearn,
    Way::Node,
    Way::Reset,
    Way::ResetWarmup,
    Way::Fork,
    Way::Loop,
];

fn color(way: Way) -> RGBColor {
    match way {
        Way::Call => RGBColor(31, 119, 180),
        Way::CallWarmup => RGBColor(23, 190, 207),
        Way::CallNoLearn => RGBColor(148, 103, 189),
        Way::Node => RGBColor(44, 160, 44),
        Way::Reset => RGBColor(188, 189, 34),
        Way::ResetWarmup => RGBColor(140, 86, 75),
        Way::Joblib => RGBColor(30, 30, 30),
        Way::Fork => RGBColor(255, 127, 14),
        Way::Loop => RGBColor(214, 39, 40),
    }
}

/// The ratio a row's bar shows, when it has one.
fn bar(workload: &WorkloadResult, way: Way) -> Option<f64> {
    workload.ratio(way).filter(|r| *r > 0.0)
}

/// The target marked across a row's bar, if it has one.
fn target(workload: &WorkloadResult, way: Way) -> Option<f64> {
    match way {
        Way::Node => Some(NODE_TARGET),
        Way::Reset | Way::ResetWarmup => Some(RESET_TARGET),
        Way::Call => workload.point_ms.map(|ms| {
            if ms >= LONG_POINT_MS {
                CALL_LONG_TARGET
            } else {
                CALL_SHORT_TARGET
            }
        }),
        _ => None,
    }
}

/// Draws `results` into a PNG at `path`.
pub fn draw(results: &Results, path: &Path) -> Result<(), String> {
    let text = load_font();
    let mut buffer = vec![255u8; (WIDTH * HEIGHT * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buffer, (WIDTH, HEIGHT)).into_drawing_area();
        plot(&root, results, text).map_err(|e| e.to_string())?;
        root.present().map_err(|e| e.to_string())?;
    }
    write_png(path, &buffer, WIDTH, HEIGHT)?;
    super::super::chart::labelled(text)
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;
type Drawn =
    Result<(), DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>>;

fn plot(root: &Area<'_>, results: &Results, text: bool) -> Drawn {
    let gray = RGBColor(150, 150, 150);
    let grid = RGBColor(225, 225, 225);
    // The scale: every ratio and every target, and 1×, with some room.
    let values: Vec<f64> = results
        .workloads
        .iter()
        .flat_map(|w| {
            BARS.iter()
                .flat_map(move |&way| [bar(w, way), target(w, way)])
                .flatten()
        })
        .chain([1.0])
        .collect();
    let lo = (values.iter().copied().fold(f64::INFINITY, f64::min) / 1.5).log10();
    let hi = (values.iter().copied().fold(0.0, f64::max) * 1.5).log10();
    let (plot_top, plot_bottom) = (TOP, HEIGHT as i32 - BOTTOM);
    let y = |ratio: f64| -> i32 {
        let share = (ratio.log10() - lo) / (hi - lo);
        plot_bottom - (share * (plot_bottom - plot_top) as f64).round() as i32
    };
    let (plot_left, plot_right) = (LEFT, WIDTH as i32 - RIGHT);

    if text {
        root.draw(&Text::new(
            "Wall time of the whole command against joblib.Parallel(n_jobs=2)'s: lower is better",
            (LEFT, 14),
            ("sans-serif", 18).into_font().color(&BLACK),
        ))?;
        let mut x = LEFT;
        for way in BARS {
            root.draw(&Rectangle::new(
                [(x, 52), (x + 14, 66)],
                color(way).filled(),
            ))?;
            root.draw(&Text::new(
                way.short(),
                (x + 20, 52),
                ("sans-serif", 13).into_font().color(&BLACK),
            ))?;
            x += 20 + 7 * way.short().len() as i32 + 24;
        }
        root.draw(&Text::new(
            "joblib is the 1× line; a black mark across a bar is that row's target; log scale",
            (LEFT, 78),
            ("sans-serif", 12).into_font().color(&gray),
        ))?;
    }

    // The scale's lines: 1, 2 and 5 of each decade in range.
    for decade in (lo.floor() as i32)..=(hi.ceil() as i32) {
        for step in [1.0, 2.0, 5.0] {
            let value = step * 10f64.powi(decade);
            if value.log10() < lo || value.log10() > hi {
                continue;
            }
            let at = y(value);
            root.draw(&PathElement::new(
                vec![(plot_left, at), (plot_right, at)],
                grid,
            ))?;
            if text {
                // 1× is joblib's line.
                let name = if value == 1.0 { "joblib " } else { "" };
                root.draw(&Text::new(
                    format!("{name}{}×", scale_text(value)),
                    (plot_left - 8, at),
                    ("sans-serif", 12)
                        .into_font()
                        .color(&gray)
                        .pos(Pos::new(HPos::Right, VPos::Center)),
                ))?;
            }
        }
    }

    let groups = results.workloads.len().max(1) as i32;
    let group_w = (plot_right - plot_left) / groups;
    let bar_w = (group_w * 4 / 5) / BARS.len() as i32;
    let one = y(1.0);
    for (g, workload) in results.workloads.iter().enumerate() {
        let group_left = plot_left + g as i32 * group_w + group_w / 10;
        if text {
            let point = workload
                .point_ms
                .map(|ms| format!(", {} ms a point", number(ms)))
                .unwrap_or_default();
            root.draw(&Text::new(
                workload.name,
                (
                    plot_left + g as i32 * group_w + group_w / 2,
                    plot_bottom + 12,
                ),
                ("sans-serif", 15)
                    .into_font()
                    .color(&BLACK)
                    .pos(Pos::new(HPos::Center, VPos::Top)),
            ))?;
            root.draw(&Text::new(
                format!("{} points{point}", workload.points),
                (
                    plot_left + g as i32 * group_w + group_w / 2,
                    plot_bottom + 32,
                ),
                ("sans-serif", 12)
                    .into_font()
                    .color(&gray)
                    .pos(Pos::new(HPos::Center, VPos::Top)),
            ))?;
        }
        for (i, &way) in BARS.iter().enumerate() {
            let left = group_left + i as i32 * bar_w + 1;
            let right = left + bar_w - 2;
            let middle = (left + right) / 2;
            let label = ("sans-serif", 11).into_font();
            let Some(ratio) = bar(workload, way) else {
                if text {
                    root.draw(&Text::new(
                        "n/a",
                        (middle, one - 4),
                        label.color(&gray).pos(Pos::new(HPos::Center, VPos::Bottom)),
                    ))?;
                }
                continue;
            };
            let end = y(ratio);
            // At least 2 px, so that 1.0× still shows.
            let (top, bottom) = if end <= one {
                (end.min(one - 2), one)
            } else {
                (one, end.max(one + 2))
            };
            root.draw(&Rectangle::new(
                [(left, top), (right, bottom)],
                color(way).filled(),
            ))?;
            let goal = target(workload, way).map(y);
            if let Some(at) = goal {
                root.draw(&Rectangle::new(
                    [(left - 3, at - 1), (right + 3, at + 1)],
                    BLACK.filled(),
                ))?;
            }
            if text {
                let differs = workload.row(way).is_some_and(|r| r.differs.is_some());
                let (words, colour) = if differs {
                    (format!("{}≠", ratio_text(ratio)), RED)
                } else {
                    (ratio_text(ratio), BLACK)
                };
                // Beyond the bar's end, and beyond its target's mark where
                // that is near it.
                let near = |mark: i32| (mark - end).abs() <= 14;
                let (at, anchor) = if end <= one {
                    let mark = goal.filter(|&m| near(m) && m < top).unwrap_or(top);
                    (mark.min(top) - 3, VPos::Bottom)
                } else {
                    let mark = goal.filter(|&m| near(m) && m > bottom).unwrap_or(bottom);
                    (mark.max(bottom) + 3, VPos::Top)
                };
                root.draw(&Text::new(
                    words,
                    (middle, at),
                    label.color(&colour).pos(Pos::new(HPos::Center, anchor)),
                ))?;
            }
        }
    }
    // joblib's line, over the bars' feet.
    root.draw(&Rectangle::new(
        [(plot_left, one), (plot_right, one + 1)],
        color(Way::Joblib).filled(),
    ))?;
    Ok(())
}

/// A bar's ratio as written beside it: 0.5 → "0.50", 12.3 → "12".
fn ratio_text(ratio: f64) -> String {
    if ratio >= 10.0 {
        factor_text(ratio)
    } else {
        format!("{ratio:.2}")
    }
}

/// A scale line's label: 0.5 → "0.5", 1 → "1", 20 → "20".
fn scale_text(value: f64) -> String {
    let text = format!("{value:.3}");
    text.trim_end_matches('0').trim_end_matches('.').to_string()
}
