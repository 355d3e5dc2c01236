//! What memory cannot put back: the state of this process the kernel
//! holds, read whole before the first call and compared after each.
//!
//! Every item is a name and its value as text, so that a change names
//! itself ("fd 7: absent → /tmp/x pos 0"). PROTOCOL-NOTES lists them.

use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The process's kernel-held state, by item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct State(BTreeMap<String, String>);

impl State {
    /// Reads it now.
    pub fn read() -> State {
        let mut items = BTreeMap::new();
        fds(&mut items);
        tasks(&mut items);
        signals(&mut items);
        places(&mut items);
        limits(&mut items);
        status(&mut items);
        timers(&mut items);
        identity(&mut items);
        scheduling(&mut items);
        State(items)
    }

    /// The first difference from `before`, said as a person would read it.
    pub fn changed_from(&self, before: &State) -> Option<String> {
        let absent = String::from("absent");
        for (key, value) in &self.0 {
            let was = before.0.get(key).unwrap_or(&absent);
            if was != value {
                return Some(format!("{key}: {} → {}", shorten(was), shorten(value)));
            }
        }
        for (key, was) in &before.0 {
            if !self.0.contains_key(key) {
                return Some(format!("{key}: {} → absent", shorten(was)));
            }
        }
        None
    }
}

fn shorten(text: &str) -> String {
    const MOST: usize = 120;
    if text.len() <= MOST {
        return text.to_string();
    }
    let mut cut = MOST;
    while !text.is_char_boundary(cut) {
        cut -= 1;
    }
    format!("{}…", &text[..cut])
}

fn read(path: &str) -> String {
    std::fs::read(path)
        .map(|bytes| String::from_utf8_lossy(&bytes).into_owned())
        .unwrap_or_else(|e| format!("unreadable ({e})"))
}

/// Each open fd: what it is, its offset and its flags, and the locks held.
fn fds(items: &mut BTreeMap<String, String>) {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        items.insert("fds".into(), "unreadable".into());
        return;
    };
    let mut numbers: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    numbers.sort_unstable();
    for fd in numbers {
        let Ok(target) = std::fs::read_link(format!("/proc/self/fd/{fd}")) else {
            // The directory's own fd, closed since.
            continue;
        };
        let info = read(&format!("/proc/self/fdinfo/{fd}"));
        // Offset, flags and what an epoll, a signalfd, an inotify or a
        // timerfd watches; not counters that move on their own. The
        // standard streams' offsets are the runtime's too (they are
        // shared with it, in every isolation): output moves them.
        let info: Vec<String> = info
            .lines()
            .filter(|l| !l.starts_with("eventfd-count") && !l.starts_with("it_value"))
            .filter(|l| !l.starts_with("ticks") && !l.starts_with("mnt_id"))
            .filter(|l| fd > 2 || !l.starts_with("pos:"))
            .map(|l| l.split_whitespace().collect::<Vec<_>>().join(" "))
            .collect();
        items.insert(
            format!("fd {fd}"),
            format!("{} ({})", target.display(), info.join(", ")),
        );
    }
    let pid = std::process::id().to_string();
    let locks: Vec<String> = read("/proc/locks")
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(pid.as_str()))
        .map(|l| l.split_whitespace().skip(1).collect::<Vec<_>>().join(" "))
        .collect();
    items.insert("file locks".into(), locks.join("; "));
}

/// Threads, and child processes (a zombie is one).
fn tasks(items: &mut BTreeMap<String, String>) {
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    items.insert("threads".into(), threads.to_string());
    let children = read(&format!("/proc/self/task/{}/children", std::process::id()));
    items.insert("child processes".into(), children.trim().to_string());
}

/// Every signal's disposition, the mask, what is pending, the alternate
/// stack.
fn signals(items: &mut BTreeMap<String, String>) {
    for signal in 1..=libc::SIGRTMAX() {
        if signal == libc::SIGKILL || signal == libc::SIGSTOP {
            continue;
        }
        // SAFETY: reads a disposition into a zeroed sigaction.
        let action = unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            if libc::sigaction(signal, std::ptr::null(), &mut action) != 0 {
                continue;
            }
            action
        };
        let mask: Vec<i32> = (1..=libc::SIGRTMAX())
            // SAFETY: sigismember on a set the kernel filled.
            .filter(|&s| unsafe { libc::sigismember(&action.sa_mask, s) } == 1)
            .collect();
        items.insert(
            format!("signal {signal:>2}"),
            format!(
                "handler {:#x} flags {:#x} mask {mask:?}",
                action.sa_sigaction, action.sa_flags
            ),
        );
    }
    let members = |set: &libc::sigset_t| -> Vec<i32> {
        (1..=libc::SIGRTMAX())
            // SAFETY: sigismember on a set the kernel filled.
            .filter(|&s| unsafe { libc::sigismember(set, s) } == 1)
            .collect()
    };
    // SAFETY: reads of the mask and the pending set into local sets.
    let (mask, pending) = unsafe {
        let mut mask: libc::sigset_t = std::mem::zeroed();
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
        libc::sigpending(&mut pending);
        (mask, pending)
    };
    items.insert("signal mask".into(), format!("{:?}", members(&mask)));
    items.insert("signals pending".into(), format!("{:?}", members(&pending)));
    // SAFETY: sigaltstack with no new stack reads the current one.
    let stack = unsafe {
        let mut stack: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut stack);
        stack
    };
    items.insert(
        "signal stack".into(),
        format!("{:p} {} {}", stack.ss_sp, stack.ss_size, stack.ss_flags),
    );
}

/// Where it is: the working directory, the root, its cgroup, namespaces.
fn places(items: &mut BTreeMap<String, String>) {
    for link in ["cwd", "root", "exe"] {
        let target = std::fs::read_link(format!("/proc/self/{link}"))
            .map(|t| t.display().to_string())
            .unwrap_or_default();
        items.insert(link.into(), target);
    }
    items.insert(
        "cgroup".into(),
        read("/proc/self/cgroup").trim().to_string(),
    );
    if let Ok(entries) = std::fs::read_dir("/proc/self/ns") {
        for entry in entries.flatten() {
            let target = std::fs::read_link(entry.path())
                .map(|t| t.display().to_string())
                .unwrap_or_default();
            items.insert(
                format!("namespace {}", entry.file_name().to_string_lossy()),
                target,
            );
        }
    }
}

/// Every resource limit.
fn limits(items: &mut BTreeMap<String, String>) {
    // RLIMIT_CPU (0) to RLIMIT_RTTIME (15): all Linux has.
    for resource in 0..16 {
        // SAFETY: getrlimit into a local.
        let limit = unsafe {
            let mut limit: libc::rlimit = std::mem::zeroed();
            if libc::getrlimit(resource as _, &mut limit) != 0 {
                continue;
            }
            limit
        };
        items.insert(
            format!("rlimit {resource:>2}"),
            format!("{} {}", limit.rlim_cur, limit.rlim_max),
        );
    }
}

/// From `/proc/self/status`: credentials and capabilities, the umask,
/// seccomp, no_new_privs, speculation controls.
fn status(items: &mut BTreeMap<String, String>) {
    const KEPT: &[&str] = &[
        "Umask",
        "Uid",
        "Gid",
        "Groups",
        "CapInh",
        "CapPrm",
        "CapEff",
        "CapBnd",
        "CapAmb",
        "NoNewPrivs",
        "Seccomp",
        "Seccomp_filters",
        "Speculation_Store_Bypass",
        "SpeculationIndirectBranch",
        "THP_enabled",
    ];
    for line in read("/proc/self/status").lines() {
        if let Some((key, value)) = line.split_once(':')
            && KEPT.contains(&key)
        {
            items.insert(format!("status {key}"), value.trim().to_string());
        }
    }
}

/// Interval timers, POSIX timers, the timer slack.
fn timers(items: &mut BTreeMap<String, String>) {
    for (name, which) in [
        ("ITIMER_REAL", libc::ITIMER_REAL),
        ("ITIMER_VIRTUAL", libc::ITIMER_VIRTUAL),
        ("ITIMER_PROF", libc::ITIMER_PROF),
    ] {
        // SAFETY: getitimer into a local.
        let timer = unsafe {
            let mut timer: libc::itimerval = std::mem::zeroed();
            libc::getitimer(which, &mut timer);
            timer
        };
        // An armed timer counts down: armed or not, and its interval.
        let armed = timer.it_value.tv_sec != 0 || timer.it_value.tv_usec != 0;
        items.insert(
            format!("timer {name}"),
            format!(
                "armed {armed} interval {}.{:06}",
                timer.it_interval.tv_sec, timer.it_interval.tv_usec
            ),
        );
    }
    items.insert("posix timers".into(), read("/proc/self/timers"));
    // SAFETY: prctl reads.
    let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
    items.insert("timer slack".into(), slack.to_string());
}

/// How it is named and what it runs with: the environment and arguments
/// as the kernel holds them, its name, its session and group, prctl's
/// settings, its personality.
fn identity(items: &mut BTreeMap<String, String>) {
    items.insert("environ".into(), read("/proc/self/environ"));
    items.insert("cmdline".into(), read("/proc/self/cmdline"));
    items.insert("comm".into(), read("/proc/self/comm"));
    // SAFETY: plain reads of this process's ids and settings.
    let (sid, pgid, personality) = unsafe {
        (
            libc::getsid(0),
            libc::getpgid(0),
            libc::personality(0xffff_ffff),
        )
    };
    items.insert("session".into(), format!("{sid} {pgid}"));
    items.insert("personality".into(), personality.to_string());
    let mut prctl = String::new();
    for (name, option) in [
        ("dumpable", libc::PR_GET_DUMPABLE),
        ("keepcaps", libc::PR_GET_KEEPCAPS),
        ("securebits", libc::PR_GET_SECUREBITS),
        ("thp_disable", libc::PR_GET_THP_DISABLE),
    ] {
        // SAFETY: prctl reads.
        let value = unsafe { libc::prctl(option, 0, 0, 0, 0) };
        let _ = write!(prctl, "{name}={value} ");
    }
    let mut signal: libc::c_int = 0;
    let mut subreaper: libc::c_int = 0;
    // SAFETY: prctl writes an int at the pointer given.
    unsafe {
        libc::prctl(libc::PR_GET_PDEATHSIG, &mut signal);
        libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut subreaper);
    }
    let _ = write!(prctl, "pdeathsig={signal} subreaper={subreaper}");
    items.insert("prctl".into(), prctl);
    items.insert(
        "oom_score_adj".into(),
        read("/proc/self/oom_score_adj").trim().to_string(),
    );
}

/// Its priority, scheduler and CPUs.
fn scheduling(items: &mut BTreeMap<String, String>) {
    // SAFETY: reads of this process's scheduling.
    unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        let policy = libc::sched_getscheduler(0);
        let mut cpus: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut cpus);
        let count = libc::CPU_COUNT(&cpus);
        let first: Vec<usize> = (0..1024).filter(|&c| libc::CPU_ISSET(c, &cpus)).collect();
        items.insert("nice".into(), nice.to_string());
        items.insert("scheduler".into(), policy.to_string());
        items.insert("cpus".into(), format!("{count} {first:?}"));
        let ioprio = libc::syscall(libc::SYS_ioprio_get, 1, 0);
        items.insert("ioprio".into(), ioprio.to_string());
    }
}
