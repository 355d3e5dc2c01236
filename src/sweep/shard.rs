//! `--shard K/N`: one of N disjoint parts of a sweep's points, so that the
//! tasks of a SLURM array (or a loop over hosts) each run one and the union
//! of their files is the whole sweep.
//!
//! Point `i` belongs to shard `i % N`: round robin, not blocks, because a
//! grid's first axis varies slowest, and a costly value of it (a large
//! model) would otherwise land in one shard whole.

use std::path::{Path, PathBuf};

/// One shard of a sweep: `index` of `count`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub index: usize,
    pub count: usize,
}

/// Where a shard came from, for the line that says which one runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Origin {
    Flag,
    /// `SLURM_ARRAY_TASK_ID` of `SLURM_ARRAY_TASK_COUNT`.
    SlurmArray,
    /// `SLURM_PROCID` of `SLURM_NTASKS`, in a step `srun` started.
    SlurmTasks,
}

impl Shard {
    /// Every point: what a sweep without shards runs.
    pub const WHOLE: Shard = Shard { index: 0, count: 1 };

    /// `--shard K/N`, 0 ≤ K < N.
    pub fn parse(text: &str) -> Result<Shard, String> {
        let usage = || format!("{text:?} is not a shard: give K/N, e.g. 0/4 for the first of 4");
        let (index, count) = text.split_once('/').ok_or_else(usage)?;
        let index: usize = index.trim().parse().map_err(|_| usage())?;
        let count: usize = count.trim().parse().map_err(|_| usage())?;
        if count == 0 {
            return Err(format!("{text:?}: a sweep cannot be split into 0 shards"));
        }
        if index >= count {
            return Err(format!(
                "{text:?}: shards are counted from 0, so the last of {count} is {}/{count}",
                count - 1
            ));
        }
        Ok(Shard { index, count })
    }

    /// The shard SLURM's environment gives this task, if any: an array
    /// task's place in its array, else (in a step of several tasks that
    /// `srun` started) the task's rank. `var` reads a variable.
    pub fn from_slurm(
        var: impl Fn(&str) -> Option<String>,
    ) -> Result<Option<(Shard, Origin)>, String> {
        let number = |name: &str| -> Result<Option<usize>, String> {
            match var(name) {
                None => Ok(None),
                Some(text) => text.trim().parse().map(Some).map_err(|_| {
                    format!("{name}={text:?} is not a number\nhint: give --shard K/N")
                }),
            }
        };
        if let Some(id) = number("SLURM_ARRAY_TASK_ID")? {
            let count = number("SLURM_ARRAY_TASK_COUNT")?.unwrap_or(1).max(1);
            // `--array=1-8` or `--array=0-14:2`: a task's place, from 0.
            let min = number("SLURM_ARRAY_TASK_MIN")?.unwrap_or(0);
            let step = number("SLURM_ARRAY_TASK_STEP")?.unwrap_or(1).max(1);
            let offset = id.checked_sub(min).filter(|offset| offset % step == 0);
            return match offset.map(|offset| offset / step).filter(|&k| k < count) {
                Some(index) => Ok(Some((Shard { index, count }, Origin::SlurmArray))),
                None => Err(format!(
                    "cannot tell this array task's shard: SLURM_ARRAY_TASK_ID={id} is not the \
                     min {min} plus a multiple of the step {step} below {count} tasks (an \
                     --array of a list?)\nhint: give --shard K/N yourself"
                )),
            };
        }
        // Only in a step `srun` started: the batch script itself has
        // SLURM_NTASKS of the whole job, yet runs once.
        if var("SLURM_STEP_ID").is_some_and(|step| step.trim().parse::<u64>().is_ok())
            && let (Some(rank), Some(tasks)) = (number("SLURM_PROCID")?, number("SLURM_NTASKS")?)
            && tasks > 1
            && rank < tasks
        {
            return Ok(Some((
                Shard {
                    index: rank,
                    count: tasks,
                },
                Origin::SlurmTasks,
            )));
        }
        Ok(None)
    }

    pub fn is_whole(&self) -> bool {
        self.count == 1
    }

    /// Whether point `index` is this shard's.
    pub fn holds(&self, index: usize) -> bool {
        index % self.count == self.index
    }

    /// This shard's points of a sweep of `total`, ascending.
    pub fn points(&self, total: usize) -> impl Iterator<Item = usize> + use<> {
        (self.index..total).step_by(self.count)
    }

    /// `K-of-N`, as it goes into a file name.
    pub fn tag(&self) -> String {
        format!("{}-of-{}", self.index, self.count)
    }

    /// The file this shard writes for `-o path`: `{shard}` in its name
    /// replaced by `K-of-N`, else `.K-of-N` put before its extension
    /// (`results.jsonl` → `results.2-of-4.jsonl`). The whole sweep's is
    /// `path` itself.
    pub fn output(&self, path: &Path) -> PathBuf {
        if self.is_whole() {
            return path.to_path_buf();
        }
        let name = path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let named = if name.contains(SHARD_PLACEHOLDER) {
            name.replace(SHARD_PLACEHOLDER, &self.tag())
        } else {
            match name.rsplit_once('.').filter(|(stem, _)| !stem.is_empty()) {
                Some((stem, extension)) => format!("{stem}.{}.{extension}", self.tag()),
                None => format!("{name}.{}", self.tag()),
            }
        };
        path.with_file_name(named)
    }
}

/// Where a shard's tag goes in `-o`'s file name, if the user places it.
pub const SHARD_PLACEHOLDER: &str = "{shard}";

impl std::fmt::Display for Shard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.index, self.count)
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Origin::Flag => "--shard",
            Origin::SlurmArray => "SLURM_ARRAY_TASK_ID of SLURM_ARRAY_TASK_COUNT",
            Origin::SlurmTasks => "SLURM_PROCID of SLURM_NTASKS",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&str, &str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |name| {
            vars.iter()
                .find(|(n, _)| *n == name)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn shards_split_every_point_once() {
        let total = 10_001;
        let mut seen = vec![0; total];
        for index in 0..7 {
            let shard = Shard { index, count: 7 };
            for point in shard.points(total) {
                assert!(shard.holds(point));
                seen[point] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1));
        assert_eq!(Shard::WHOLE.points(3).collect::<Vec<_>>(), [0, 1, 2]);
    }

    #[test]
    fn the_flag_is_read_and_checked() {
        assert_eq!(Shard::parse("2/4"), Ok(Shard { index: 2, count: 4 }));
        assert!(
            Shard::parse("4/4")
                .unwrap_err()
                .contains("the last of 4 is 3/4")
        );
        assert!(Shard::parse("0/0").unwrap_err().contains("0 shards"));
        assert!(Shard::parse("two").unwrap_err().contains("give K/N"));
    }

    #[test]
    fn slurm_arrays_give_each_task_its_place() {
        let array = |vars: &[(&str, &str)]| Shard::from_slurm(env(vars));
        assert_eq!(
            array(&[
                ("SLURM_ARRAY_TASK_ID", "3"),
                ("SLURM_ARRAY_TASK_COUNT", "4")
            ]),
            Ok(Some((Shard { index: 3, count: 4 }, Origin::SlurmArray)))
        );
        // --array=1-4
        let from_one = [
            ("SLURM_ARRAY_TASK_ID", "1"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_STEP", "1"),
        ];
        assert_eq!(
            array(&from_one),
            Ok(Some((Shard { index: 0, count: 4 }, Origin::SlurmArray)))
        );
        // --array=0-6:2 is 0, 2, 4, 6.
        let stepped = [
            ("SLURM_ARRAY_TASK_ID", "6"),
            ("SLURM_ARRAY_TASK_COUNT", "4"),
            ("SLURM_ARRAY_TASK_MIN", "0"),
            ("SLURM_ARRAY_TASK_STEP", "2"),
        ];
        assert_eq!(
            array(&stepped),
            Ok(Some((Shard { index: 3, count: 4 }, Origin::SlurmArray)))
        );
        // --array=1,5,9 (a list): no place to compute.
        let listed = [
            ("SLURM_ARRAY_TASK_ID", "5"),
            ("SLURM_ARRAY_TASK_COUNT", "3"),
            ("SLURM_ARRAY_TASK_MIN", "1"),
            ("SLURM_ARRAY_TASK_STEP", "1"),
        ];
        assert!(array(&listed).unwrap_err().contains("give --shard K/N"));
    }

    #[test]
    fn srun_tasks_shard_but_a_batch_script_does_not() {
        let tasks = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2")];
        assert_eq!(Shard::from_slurm(env(&tasks)), Ok(None));
        let step = [
            ("SLURM_PROCID", "1"),
            ("SLURM_NTASKS", "2"),
            ("SLURM_STEP_ID", "0"),
        ];
        assert_eq!(
            Shard::from_slurm(env(&step)),
            Ok(Some((Shard { index: 1, count: 2 }, Origin::SlurmTasks)))
        );
        assert_eq!(Shard::from_slurm(env(&[])), Ok(None));
    }

    #[test]
    fn each_shard_writes_its_own_file() {
        let shard = Shard { index: 2, count: 4 };
        let out = |p: &str| shard.output(Path::new(p)).display().to_string();
        assert_eq!(out("runs/results.jsonl"), "runs/results.2-of-4.jsonl");
        assert_eq!(out("results"), "results.2-of-4");
        assert_eq!(out("out-{shard}.jsonl"), "out-2-of-4.jsonl");
        assert_eq!(out(".hidden"), ".hidden.2-of-4");
        assert_eq!(
            Shard::WHOLE.output(Path::new("r.jsonl")),
            Path::new("r.jsonl")
        );
    }
}
