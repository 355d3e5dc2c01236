//! The chart: one panel per scenario, a horizontal bar per row, on a log
//! scale (a reused worker's 0.02 ms and a fresh interpreter's 1 s in one
//! panel), the value written beside each bar. Drawn with plotters into an
//! RGB buffer, written as PNG.
//!
//! Text needs a TrueType font, which plotters (without its `ttf` feature,
//! which pulls in font-kit) does not find by itself: the first of the usual
//! system fonts is loaded at run time. Without one the bars are drawn
//! without their labels, and the report says so.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::{FontStyle, register_font};

use super::matrix::{Results, Scenario, Server};
use super::ours::Variant;

/// Fonts tried in turn (Debian, Fedora, Arch, Alpine, macOS).
pub const FONTS: [&str; 6] = [
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation/LiberationSans-Regular.ttf",
    "/Library/Fonts/Arial.ttf",
];
/// The family name the loaded font is registered under.
const FAMILY: &str = "sans-serif";

const WIDTH: u32 = 1400;
const COLUMNS: u32 = 2;
const TITLE_H: u32 = 30;
const BAR_H: u32 = 16;
const ROW_H: u32 = 22;
const LABEL_W: i32 = 190;
const VALUE_W: i32 = 90;
const PAD: i32 = 12;

/// One scenario's bars: each server's value, where it ran.
type Panel = (Scenario, Vec<(Server, Option<f64>)>);

/// Draws `results` into a PNG at `path`.
pub fn draw(results: &Results, path: &Path) -> Result<(), String> {
    let text = load_font();
    let panels: Vec<Panel> = Scenario::ALL
        .iter()
        .map(|&scenario| {
            let rows = results
                .rows
                .iter()
                .filter(|r| r.scenario == scenario)
                .map(|r| (r.server, r.outcome.as_ref().ok().map(|m| m.value())))
                .collect::<Vec<_>>();
            (scenario, rows)
        })
        .filter(|(_, rows)| !rows.is_empty())
        .collect();
    let rows_per_line: Vec<u32> = panels
        .chunks(COLUMNS as usize)
        .map(|line| {
            line.iter()
                .map(|(_, rows)| rows.len() as u32)
                .max()
                .unwrap_or(0)
        })
        .collect();
    let height = rows_per_line
        .iter()
        .map(|rows| TITLE_H + rows * ROW_H + 2 * PAD as u32)
        .sum::<u32>()
        .max(100);
    let mut buffer = vec![255u8; (WIDTH * height * 3) as usize];
    {
        let root = BitMapBackend::with_buffer(&mut buffer, (WIDTH, height)).into_drawing_area();
        let panel_w = (WIDTH / COLUMNS) as i32;
        let mut top = 0i32;
        for (line, &rows) in panels.chunks(COLUMNS as usize).zip(&rows_per_line) {
            for (column, (scenario, bars)) in line.iter().enumerate() {
                let left = column as i32 * panel_w;
                panel(&root, (left, top), panel_w, *scenario, bars, text)
                    .map_err(|e| e.to_string())?;
            }
            top += (TITLE_H + rows * ROW_H) as i32 + 2 * PAD;
        }
        root.present().map_err(|e| e.to_string())?;
    }
    write_png(path, &buffer, WIDTH, height)?;
    labelled(text)
}

/// Registers the first font found; whether text can be drawn.
pub fn load_font() -> bool {
    for path in FONTS {
        if let Ok(bytes) = std::fs::read(path) {
            // plotters keeps fonts for the life of the process.
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if register_font(FAMILY, FontStyle::Normal, bytes).is_ok() {
                return true;
            }
        }
    }
    false
}

fn color(server: Server) -> RGBColor {
    match server {
        Server::Pool => RGBColor(120, 120, 120),
        Server::Spawn => RGBColor(214, 39, 40),
        Server::Ours(Variant::Call) => RGBColor(31, 119, 180),
        Server::Ours(Variant::Standby(_)) => RGBColor(23, 190, 207),
        Server::Ours(Variant::Node) => RGBColor(44, 160, 44),
        Server::Ours(Variant::Reset) => RGBColor(188, 189, 34),
        Server::OursRestarted => RGBColor(148, 103, 189),
        Server::SharedZygote => RGBColor(140, 86, 75),
        Server::Floor { .. } => RGBColor(30, 30, 30),
    }
}

type Area<'a> = DrawingArea<BitMapBackend<'a>, plotters::coord::Shift>;

fn panel(
    root: &Area<'_>,
    (left, top): (i32, i32),
    width: i32,
    scenario: Scenario,
    bars: &[(Server, Option<f64>)],
    text: bool,
) -> Result<(), DrawingAreaErrorKind<<BitMapBackend<'static> as DrawingBackend>::ErrorType>> {
    let measured: Vec<f64> = bars
        .iter()
        .filter_map(|(_, v)| *v)
        .filter(|v| *v > 0.0)
        .collect();
    let lo = measured.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = measured.iter().copied().fold(0.0, f64::max);
    // One decade of room below the smallest, so its bar still shows.
    let (lo, hi) = ((lo / 10.0).log10(), (hi * 1.05).log10());
    let bar_x = left + PAD + LABEL_W;
    let bar_w = (width - 2 * PAD - LABEL_W - VALUE_W).max(10);
    let title = ("sans-serif", 16).into_font().color(&BLACK);
    let label = ("sans-serif", 13).into_font().color(&BLACK);
    if text {
        root.draw(&Text::new(scenario.short(), (left + PAD, top + PAD), title))?;
        root.draw(&Text::new(
            "log scale",
            (left + width - PAD - 70, top + PAD + 2),
            ("sans-serif", 11)
                .into_font()
                .color(&RGBColor(150, 150, 150)),
        ))?;
    }
    for (i, (server, value)) in bars.iter().enumerate() {
        let y = top + PAD + TITLE_H as i32 + i as i32 * ROW_H as i32;
        if text {
            root.draw(&Text::new(
                server.short(),
                (left + PAD, y + 1),
                label.clone(),
            ))?;
        }
        match value {
            Some(v) if *v > 0.0 && hi > lo => {
                let length =
                    ((v.log10() - lo) / (hi - lo) * bar_w as f64).clamp(2.0, bar_w as f64) as i32;
                root.draw(&Rectangle::new(
                    [(bar_x, y), (bar_x + length, y + BAR_H as i32)],
                    color(*server).filled(),
                ))?;
                if text {
                    root.draw(&Text::new(
                        number(*v),
                        (bar_x + length + 4, y + 1),
                        label.clone(),
                    ))?;
                }
            }
            _ => {
                if text {
                    root.draw(&Text::new(
                        "not run",
                        (bar_x, y + 1),
                        ("sans-serif", 13)
                            .into_font()
                            .color(&RGBColor(150, 150, 150)),
                    ))?;
                }
            }
        }
    }
    Ok(())
}

/// 0.0213 → "0.021", 1.5 → "1.50", 612.3 → "612".
pub fn number(v: f64) -> String {
    if v >= 100.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.2}")
    } else {
        format!("{v:.3}")
    }
}

pub fn write_png(path: &Path, rgb: &[u8], width: u32, height: u32) -> Result<(), String> {
    let file = std::fs::File::create(path)
        .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
    let mut encoder = png::Encoder::new(std::io::BufWriter::new(file), width, height);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    let mut writer = encoder.write_header().map_err(|e| e.to_string())?;
    writer.write_image_data(rgb).map_err(|e| e.to_string())?;
    writer.finish().map_err(|e| e.to_string())
}

/// A chart drawn `text` or not: without a font it has bars but no labels,
/// which the report says.
pub fn labelled(text: bool) -> Result<(), String> {
    if text {
        Ok(())
    } else {
        Err(format!(
            "no TrueType font found (tried {}): the PNG has bars but no labels",
            FONTS.join(", ")
        ))
    }
}
