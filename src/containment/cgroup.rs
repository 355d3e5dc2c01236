//! The cgroup files containment uses: finding a hierarchy this process may
//! write, making a subtree in it, and the few files of a cell.
//!
//! Two hierarchies matter. The v2 (unified) one has `cgroup.kill`, which
//! ends every process of a cgroup and of its descendants at once, whatever
//! sessions they made for themselves and however fast they fork. Memory is
//! limited where a memory controller can be written: v2's `memory.max` when
//! the subtree can enable it, else v1's `memory.limit_in_bytes` (a hybrid
//! host mounts both, with the controllers on v1).

use std::fs;
use std::io::{self, Write};
use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};

/// Which cgroup interface a directory speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Version {
    V1,
    V2,
}

/// Where a hierarchy is mounted and where this process sits in it.
#[derive(Debug, Clone)]
pub struct Placement {
    pub version: Version,
    /// This process's own cgroup directory.
    pub own: PathBuf,
}

/// This process's place in the v2 hierarchy, if one is mounted.
pub fn unified() -> Option<Placement> {
    let mount = mount_point(|fstype, _| fstype == "cgroup2")?;
    let own = own_path(|id, controllers| id == "0" && controllers.is_empty())?;
    Some(Placement {
        version: Version::V2,
        own: mount.join(own.trim_start_matches('/')),
    })
}

/// This process's place in the v1 memory hierarchy, if one is mounted.
pub fn memory_v1() -> Option<Placement> {
    let mount = mount_point(|fstype, options| {
        fstype == "cgroup" && options.split(',').any(|o| o == "memory")
    })?;
    let own = own_path(|_, controllers| controllers.split(',').any(|c| c == "memory"))?;
    Some(Placement {
        version: Version::V1,
        own: mount.join(own.trim_start_matches('/')),
    })
}

/// The mount point of the first cgroup filesystem `wanted` accepts (by
/// filesystem type and super-block options), from `/proc/self/mountinfo`.
fn mount_point(wanted: impl Fn(&str, &str) -> bool) -> Option<PathBuf> {
    let mountinfo = fs::read_to_string("/proc/self/mountinfo").ok()?;
    mountinfo.lines().find_map(|line| {
        // "36 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory"
        let (mount, fs_part) = line.split_once(" - ")?;
        let point = mount.split(' ').nth(4)?;
        let mut fs_fields = fs_part.split(' ');
        let fstype = fs_fields.next()?;
        let options = fs_fields.nth(1).unwrap_or("");
        wanted(fstype, options).then(|| PathBuf::from(point))
    })
}

/// This process's cgroup path in the hierarchy whose id and controller
/// list `wanted` accepts, from `/proc/self/cgroup` ("4:memory:/a/b",
/// "0::/a" for v2).
fn own_path(wanted: impl Fn(&str, &str) -> bool) -> Option<String> {
    let cgroups = fs::read_to_string("/proc/self/cgroup").ok()?;
    cgroups.lines().find_map(|line| {
        let mut fields = line.splitn(3, ':');
        let (id, controllers, path) = (fields.next()?, fields.next()?, fields.next()?);
        wanted(id, controllers).then(|| path.to_string())
    })
}

/// Writes `value` to a cgroup file in one `write`, as the kernel wants.
pub fn write(path: &Path, value: &str) -> io::Result<()> {
    fs::OpenOptions::new()
        .write(true)
        .open(path)?
        .write_all(value.as_bytes())
}

/// Opens a cell's `cgroup.procs` for the child to join with (`0` names the
/// writer), close-on-exec.
pub fn open_procs(dir: &Path) -> io::Result<OwnedFd> {
    Ok(fs::OpenOptions::new()
        .write(true)
        .open(dir.join("cgroup.procs"))?
        .into())
}

/// Whether a v2 cgroup still has a live process in it or below it.
/// Zombies do not count: an exited child not yet reaped leaves it empty.
pub fn populated(dir: &Path) -> bool {
    match fs::read_to_string(dir.join("cgroup.events")) {
        Ok(events) => events
            .lines()
            .any(|line| line.split_once(' ') == Some(("populated", "1"))),
        // Gone is empty.
        Err(_) => false,
    }
}

/// Whether a v1 cgroup still has a process in it (`cgroup.procs` lists
/// live ones; v1 has no `cgroup.events`).
pub fn has_procs(dir: &Path) -> bool {
    fs::read_to_string(dir.join("cgroup.procs")).is_ok_and(|procs| !procs.trim().is_empty())
}

/// The kernel's count of OOM kills in a cell: v2's `memory.events`
/// `oom_kill`, v1's `memory.oom_control` `oom_kill`.
pub fn oom_kills(dir: &Path, version: Version) -> u64 {
    let file = match version {
        Version::V2 => "memory.events",
        Version::V1 => "memory.oom_control",
    };
    fs::read_to_string(dir.join(file))
        .ok()
        .and_then(|text| {
            text.lines()
                .find_map(|line| line.strip_prefix("oom_kill ")?.trim().parse().ok())
        })
        .unwrap_or(0)
}

/// Removes a cgroup directory and every cgroup a node made under it,
/// deepest first. Cgroup directories hold only kernel files, which
/// `rmdir` removes with them.
pub fn remove_tree(dir: &Path) {
    if let Ok(entries) = fs::read_dir(dir) {
        for entry in entries.flatten() {
            if entry.file_type().is_ok_and(|t| t.is_dir()) {
                remove_tree(&entry.path());
            }
        }
    }
    let _ = fs::remove_dir(dir);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_unified_hierarchy_is_found_where_this_process_lives() {
        // Every Linux this runs on mounts one; the test says where it is.
        if let Some(placement) = unified() {
            assert!(placement.own.join("cgroup.procs").exists(), "{placement:?}");
        }
    }
}
