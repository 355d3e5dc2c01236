//! `sweep … -o results.jsonl --merge`: the shards' files of a sweep
//! (`results.0-of-4.jsonl` …) made into `results.jsonl`, in index order,
//! each line checked against the sweep's points, and what is missing
//! counted and named, with the command that runs it.

use std::path::{Path, PathBuf};

use super::points::Points;
use super::shard::Shard;
use super::written;

/// How many missing points the report names.
const LISTED: usize = 10;

/// What a merge found.
pub struct Report {
    output: PathBuf,
    shards: usize,
    files: usize,
    total: usize,
    failed: usize,
    missing: Vec<usize>,
    /// Shards that have no file at all.
    absent: Vec<Shard>,
}

/// Merges the shard files of `output` (the sweep's `-o`) into it.
pub fn merge(output: &Path, points: &Points) -> Result<Report, String> {
    let found = shard_files(output)?;
    let Some(count) = found.first().map(|(shard, _)| shard.count) else {
        return Err(format!(
            "no shard files of {} found (they are named {})\nhint: give the -o the shards \
             were run with",
            output.display(),
            Shard { index: 0, count: 4 }.output(output).display()
        ));
    };
    if let Some((other, path)) = found.iter().find(|(shard, _)| shard.count != count) {
        return Err(format!(
            "shard files of different splits lie beside {}: of {count} and of {} ({}); \
             merge one split\nhint: remove the files of the split you do not want",
            output.display(),
            other.count,
            path.display()
        ));
    }
    let mut by_index: Vec<Option<String>> = vec![None; points.len()];
    let mut failed = 0;
    for (shard, path) in &found {
        for line in written::read(path, points, *shard)?.lines {
            failed += usize::from(!line.ok);
            by_index[line.index] = Some(line.text);
        }
    }
    let missing: Vec<usize> = (0..points.len())
        .filter(|&i| by_index[i].is_none())
        .collect();
    let absent = (0..count)
        .map(|index| Shard { index, count })
        .filter(|shard| !found.iter().any(|(found, _)| found == shard))
        .collect();
    written::replace(output, by_index.iter().flatten().map(String::as_str))?;
    Ok(Report {
        output: output.to_path_buf(),
        shards: count,
        files: found.len(),
        total: points.len(),
        failed,
        missing,
        absent,
    })
}

/// The files beside `output` that its shards wrote, with their shards,
/// ordered by shard.
fn shard_files(output: &Path) -> Result<Vec<(Shard, PathBuf)>, String> {
    let dir = match output.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let template = Shard {
        index: 0,
        count: 1 << 20,
    }
    .output(output);
    let template = template
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tag = Shard {
        index: 0,
        count: 1 << 20,
    }
    .tag();
    let (prefix, suffix) = template.split_once(&tag).expect("the tag is in the name");
    let entries =
        std::fs::read_dir(&dir).map_err(|e| format!("cannot read {}: {e}", dir.display()))?;
    let mut found = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(tag) = name
            .strip_prefix(prefix)
            .and_then(|rest| rest.strip_suffix(suffix))
        else {
            continue;
        };
        let Some((index, count)) = tag.split_once("-of-") else {
            continue;
        };
        if let Ok(shard) = Shard::parse(&format!("{index}/{count}"))
            && shard.tag() == tag
        {
            found.push((shard, entry.path()));
        }
    }
    found.sort_by_key(|(shard, _)| (shard.count, shard.index));
    Ok(found)
}

impl Report {
    /// Every point is there, and succeeded.
    pub fn is_complete(&self) -> bool {
        self.missing.is_empty() && self.failed == 0
    }
}

impl std::fmt::Display for Report {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let present = self.total - self.missing.len();
        write!(
            f,
            "merged {} of {} shard files into {}: {present} of {} points, {} failed, {} missing",
            self.files,
            self.shards,
            self.output.display(),
            self.total,
            self.failed,
            self.missing.len()
        )?;
        if self.missing.is_empty() {
            return Ok(());
        }
        let listed: Vec<String> = self
            .missing
            .iter()
            .take(LISTED)
            .map(|i| format!("#{i}"))
            .collect();
        write!(f, "\n  missing: {}", listed.join(", "))?;
        if self.missing.len() > LISTED {
            write!(f, ", … and {} more", self.missing.len() - LISTED)?;
        }
        for shard in &self.absent {
            write!(f, "\n  shard {shard} wrote no file")?;
        }
        let mut short: Vec<usize> = self.missing.iter().map(|i| i % self.shards).collect();
        short.dedup();
        short.sort_unstable();
        short.dedup();
        let shards: Vec<String> = short
            .iter()
            .map(|k| format!("--shard {k}/{}", self.shards))
            .collect();
        match shards.as_slice() {
            [one] => write!(
                f,
                "\n  to finish: run the sweep again with {one} --resume, then --merge"
            ),
            _ => write!(
                f,
                "\n  to finish: run the sweep again with --resume for each of {}, then --merge",
                shards.join(", ")
            ),
        }?;
        Ok(())
    }
}
