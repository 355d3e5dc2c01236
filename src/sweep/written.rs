//! What a results file already holds: read back for `--resume`,
//! `--retry-failed` and `--merge`, every line checked against the sweep
//! that is about to use it.
//!
//! A line is the sweep's own (`{"index", "kwargs", "ok", …}`); it answers
//! its point only if the point at that index has those very kwargs, so a
//! changed grid or `--input` is refused rather than silently mixed in. A
//! last line without its newline is what a killed sweep was writing: it is
//! dropped, and its point runs again.

use std::fs::File;
use std::io::Write;
use std::path::Path;

use serde::Deserialize;
use serde_json::Value;

use super::points::Points;
use super::shard::Shard;

/// One complete line of a results file.
pub struct Line {
    pub index: usize,
    pub ok: bool,
    /// The line as written, without its newline.
    pub text: String,
}

/// A results file, read and checked.
pub struct Written {
    /// Its lines, one per point (a repeated point's first), in file order.
    pub lines: Vec<Line>,
    /// The file holds more than `lines`: a cut last line, or a point twice.
    pub untidy: bool,
}

#[derive(Deserialize)]
struct Head {
    index: usize,
    kwargs: Value,
    ok: bool,
}

/// Reads `path`, each line checked to be a point of `points` in `shard`.
/// A missing file holds nothing.
pub fn read(path: &Path, points: &Points, shard: Shard) -> Result<Written, String> {
    let bytes = match std::fs::read(path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => return Err(format!("cannot read {}: {e}", path.display())),
    };
    let text = String::from_utf8_lossy(&bytes);
    let complete = match text.rfind('\n') {
        Some(end) => &text[..=end],
        None => "",
    };
    let mut untidy = complete.len() != text.len();
    let mut seen = vec![false; points.len()];
    let mut lines = Vec::new();
    for (number, line) in complete.lines().enumerate() {
        if line.trim().is_empty() {
            untidy = true;
            continue;
        }
        let at = || format!("{} line {}", path.display(), number + 1);
        let head: Head = serde_json::from_str(line).map_err(|e| {
            format!(
                "{} is not a result line of a sweep ({e})\nhint: --resume and --merge read \
                 only what a sweep wrote",
                at()
            )
        })?;
        let index = head.index;
        if index >= points.len() {
            return Err(format!(
                "{} is point #{index}, but this sweep has {} points: the grid or --input \
                 changed since it was written{CHANGED_HINT}",
                at(),
                points.len()
            ));
        }
        if !shard.holds(index) {
            return Err(format!(
                "{} is point #{index}, which is not in shard {shard} (its points are the \
                 indices i with i % {} == {}): the file is another shard's\nhint: give the \
                 --shard it was written with",
                at(),
                shard.count,
                shard.index
            ));
        }
        let expected = Value::Object(points.get(index));
        if head.kwargs != expected {
            return Err(format!(
                "{} is point #{index} with {}, but this sweep's point #{index} is {expected}: \
                 the grid or --input changed since it was written{CHANGED_HINT}",
                at(),
                head.kwargs
            ));
        }
        if std::mem::replace(&mut seen[index], true) {
            untidy = true;
            continue;
        }
        lines.push(Line {
            index,
            ok: head.ok,
            text: line.to_string(),
        });
    }
    Ok(Written { lines, untidy })
}

const CHANGED_HINT: &str = "\nhint: resume with the arguments that wrote it, or start over \
                            (remove the file, or give another -o)";

/// Replaces `path` with `lines`, each ended by a newline, so that a crash
/// leaves either the old file or the new one.
pub fn replace<'a>(path: &Path, lines: impl Iterator<Item = &'a str>) -> Result<(), String> {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let temporary = path.with_file_name(format!(".{name}.{}.tmp", std::process::id()));
    let written = (|| {
        let mut out = std::io::BufWriter::new(File::create(&temporary)?);
        for line in lines {
            out.write_all(line.as_bytes())?;
            out.write_all(b"\n")?;
        }
        out.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&temporary, path)
    })();
    written.map_err(|e| {
        let _ = std::fs::remove_file(&temporary);
        format!("cannot rewrite {}: {e}", path.display())
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sweep::grid::{Grid, parse_axis};

    fn points(axis: &str) -> Points {
        Points::Grid(Grid::new(vec![parse_axis(axis).unwrap()], Default::default()).unwrap())
    }

    fn file(name: &str, text: &str) -> std::path::PathBuf {
        let path = std::env::temp_dir().join(format!("fz-written-{name}-{}", std::process::id()));
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn a_cut_last_line_and_a_repeat_are_dropped() {
        let path = file(
            "cut",
            "{\"index\": 1, \"kwargs\": {\"x\": 1}, \"ok\": true}\n{\"index\": 1, \"kwargs\": {\"x\": 1}, \"ok\": false}\n{\"index\": 0, \"kwargs\": {\"x\": 0}, \"ok\": fa",
        );
        let written = read(&path, &points("x=0..3"), Shard::WHOLE).unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(written.untidy);
        assert_eq!(written.lines.len(), 1);
        assert!(written.lines[0].ok);
    }

    #[test]
    fn a_changed_grid_is_refused_with_the_point_that_differs() {
        let path = file(
            "changed",
            "{\"index\": 2, \"kwargs\": {\"x\": 2}, \"ok\": true}\n",
        );
        let refused = read(&path, &points("x=10..13"), Shard::WHOLE)
            .err()
            .unwrap();
        let fewer = read(&path, &points("x=0..1"), Shard::WHOLE).err().unwrap();
        let other_shard = read(&path, &points("x=0..3"), Shard { index: 1, count: 2 }).err();
        let _ = std::fs::remove_file(&path);
        assert!(
            refused.contains("is point #2 with {\"x\":2}, but this sweep's point #2 is {\"x\":12}"),
            "{refused}"
        );
        assert!(fewer.contains("this sweep has 2 points"), "{fewer}");
        assert!(other_shard.unwrap().contains("another shard's"));
    }

    #[test]
    fn a_foreign_line_is_refused() {
        let path = file("foreign", "hello\n");
        let refused = read(&path, &points("x=0..3"), Shard::WHOLE).err().unwrap();
        let _ = std::fs::remove_file(&path);
        assert!(
            refused.contains("line 1 is not a result line of a sweep"),
            "{refused}"
        );
    }
}
