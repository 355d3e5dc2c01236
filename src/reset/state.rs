//! What memory cannot put back: the state of this process the kernel
//! holds, read whole before the first call and compared after each.
//!
//! Every item is a name and its value as text, so that a change names
//! itself ("fd 7: absent → /tmp/x pos 0"). PROTOCOL-NOTES lists them.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::ops::Range;

/// The process's kernel-held state: every item's name and value, back to
/// back in one buffer, read with no allocation per item (it is read after
/// every call).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct State {
    text: String,
    /// Each item: where its name and its value are in `text`.
    items: Vec<(Range<usize>, Range<usize>)>,
}

impl State {
    /// Reads it now.
    pub fn read() -> State {
        let mut state = State {
            text: String::with_capacity(32 * 1024),
            items: Vec::with_capacity(256),
        };
        fds(&mut state);
        tasks(&mut state);
        signals(&mut state);
        places(&mut state);
        limits(&mut state);
        status(&mut state);
        timers(&mut state);
        identity(&mut state);
        scheduling(&mut state);
        state
    }

    /// The first difference from `before`, said as a person would read it.
    pub fn changed_from(&self, before: &State) -> Option<String> {
        if self == before {
            return None;
        }
        let (now, was) = (self.by_name(), before.by_name());
        for (key, value) in &now {
            let old = was.get(key).copied().unwrap_or("absent");
            if old != *value {
                return Some(format!("{key}: {} → {}", shorten(old), shorten(value)));
            }
        }
        was.iter()
            .find(|(key, _)| !now.contains_key(*key))
            .map(|(key, old)| format!("{key}: {} → absent", shorten(old)))
    }

    fn by_name(&self) -> BTreeMap<&str, &str> {
        self.items
            .iter()
            .map(|(name, value)| (&self.text[name.clone()], &self.text[value.clone()]))
            .collect()
    }

    /// Starts an item: its name, formatted into the buffer.
    fn name(&mut self, name: std::fmt::Arguments<'_>) -> Item<'_> {
        let from = self.text.len();
        let _ = self.text.write_fmt(name);
        let named = from..self.text.len();
        Item {
            value_from: self.text.len(),
            named,
            state: self,
        }
    }

    /// An item whose value is formatted.
    fn add(&mut self, name: &str, value: std::fmt::Arguments<'_>) {
        self.name(format_args!("{name}")).write(value);
    }
}

/// An item being written: its value goes into the buffer until it is
/// dropped.
struct Item<'a> {
    state: &'a mut State,
    named: Range<usize>,
    value_from: usize,
}

impl Item<'_> {
    fn write(self, value: std::fmt::Arguments<'_>) {
        let _ = self.state.text.write_fmt(value);
    }

    /// The value is a file's content (lossy UTF-8), or why it is unreadable.
    fn file(self, path: &std::ffi::CStr) {
        read_into(path, &mut self.state.text);
    }

    /// The value is where a link points, or empty.
    fn link(self, path: &std::ffi::CStr) {
        link_into(path, &mut self.state.text);
    }

    fn text(&mut self) -> &mut String {
        &mut self.state.text
    }
}

impl Drop for Item<'_> {
    fn drop(&mut self) {
        let value = self.value_from..self.state.text.len();
        self.state.items.push((self.named.clone(), value));
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

/// This process's `/proc/self`, open (`-1` until [`open_proc_self`]): the
/// paths below it are then looked up from it, not walked from `/` again
/// for each of the ~40 items read after every call.
static PROC_SELF: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

/// Opens `/proc/self` for the reads of this process's state from here on.
/// Call before the first [`State::read`] whose fds are compared: its fd is
/// one of them.
pub fn open_proc_self() {
    // SAFETY: open with a static path.
    let fd = unsafe {
        libc::open(
            c"/proc/self".as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd >= 0 {
        let fd = crate::fds::out_of_the_way(fd);
        let before = PROC_SELF.swap(fd, std::sync::atomic::Ordering::Relaxed);
        if before >= 0 {
            // SAFETY: the one this replaces, ours alone.
            unsafe { libc::close(before) };
        }
    }
}

/// `path` below `/proc/self`: the directory's fd and the rest of the path,
/// where it is open; else `AT_FDCWD` and the whole path.
fn at(path: &std::ffi::CStr) -> (libc::c_int, &std::ffi::CStr) {
    let fd = PROC_SELF.load(std::sync::atomic::Ordering::Relaxed);
    let below = path
        .to_bytes_with_nul()
        .strip_prefix(b"/proc/self/")
        .and_then(|rest| std::ffi::CStr::from_bytes_with_nul(rest).ok());
    match below {
        Some(rest) if fd >= 0 => (fd, rest),
        _ => (libc::AT_FDCWD, path),
    }
}

/// Appends a file's content to `into` (lossy UTF-8), or why it could not be
/// read.
fn read_into(path: &std::ffi::CStr, into: &mut String) {
    let (dir, path) = at(path);
    // SAFETY: openat with a NUL-terminated path.
    let fd = unsafe { libc::openat(dir, path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        let _ = write!(into, "unreadable ({})", std::io::Error::last_os_error());
        return;
    }
    let mut bytes = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        // SAFETY: reads into a local buffer, within its length.
        let n = unsafe { libc::read(fd, buffer.as_mut_ptr().cast(), buffer.len()) };
        if n < 0 {
            let _ = write!(into, "unreadable ({})", std::io::Error::last_os_error());
        }
        if n <= 0 {
            break;
        }
        bytes.extend_from_slice(&buffer[..n as usize]);
    }
    // SAFETY: closing our fd.
    unsafe { libc::close(fd) };
    into.push_str(&String::from_utf8_lossy(&bytes));
}

/// Appends `lines` to `text`, `between` each, each line's words separated
/// by one space.
fn push_joined<'a>(
    text: &mut String,
    lines: impl Iterator<Item = impl Iterator<Item = &'a str>>,
    between: &str,
) {
    for (i, words) in lines.enumerate() {
        if i > 0 {
            text.push_str(between);
        }
        for (j, word) in words.enumerate() {
            if j > 0 {
                text.push(' ');
            }
            text.push_str(word);
        }
    }
}

/// Appends where a link points to `into`, nothing if it is gone.
fn link_into(path: &std::ffi::CStr, into: &mut String) -> bool {
    let mut buffer = [0u8; libc::PATH_MAX as usize];
    let (dir, path) = at(path);
    // SAFETY: readlinkat into a local buffer, within its length.
    let n =
        unsafe { libc::readlinkat(dir, path.as_ptr(), buffer.as_mut_ptr().cast(), buffer.len()) };
    if n < 0 {
        return false;
    }
    into.push_str(&String::from_utf8_lossy(&buffer[..n as usize]));
    true
}

/// A NUL-terminated path, formatted on the stack.
struct ProcPath {
    bytes: [u8; 64],
}

impl ProcPath {
    fn new(path: std::fmt::Arguments<'_>) -> ProcPath {
        let mut text = ProcPath { bytes: [0; 64] };
        let mut cursor = std::io::Cursor::new(&mut text.bytes[..63]);
        let _ = std::io::Write::write_fmt(&mut cursor, path);
        text
    }

    fn as_c_str(&self) -> &std::ffi::CStr {
        std::ffi::CStr::from_bytes_until_nul(&self.bytes).unwrap_or(c"")
    }
}

/// Each open fd: what it is, its offset and its flags, and the locks held.
fn fds(state: &mut State) {
    let Ok(entries) = std::fs::read_dir("/proc/self/fd") else {
        state.add("fds", format_args!("unreadable"));
        return;
    };
    let mut numbers: Vec<i32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    numbers.sort_unstable();
    let (mut target, mut info) = (String::new(), String::new());
    for fd in numbers {
        target.clear();
        if !link_into(
            ProcPath::new(format_args!("/proc/self/fd/{fd}")).as_c_str(),
            &mut target,
        ) {
            // The directory's own fd, closed since.
            continue;
        }
        info.clear();
        read_into(
            ProcPath::new(format_args!("/proc/self/fdinfo/{fd}")).as_c_str(),
            &mut info,
        );
        // Offset, flags and what an epoll, a signalfd, an inotify or a
        // timerfd watches; not counters that move on their own. The
        // standard streams' offsets are the runtime's too (they are
        // shared with it, in every isolation): output moves them.
        let kept = info.lines().filter(|line| {
            !(line.starts_with("eventfd-count")
                || line.starts_with("it_value")
                || line.starts_with("ticks")
                || line.starts_with("mnt_id")
                || (fd <= 2 && line.starts_with("pos:")))
        });
        let mut item = state.name(format_args!("fd {fd}"));
        let text = item.text();
        text.push_str(&target);
        text.push_str(" (");
        push_joined(text, kept.map(str::split_whitespace), ", ");
        text.push(')');
    }
    let pid = std::process::id().to_string();
    let mut locks = String::new();
    read_into(c"/proc/locks", &mut locks);
    let ours = locks
        .lines()
        .filter(|l| l.split_whitespace().nth(4) == Some(pid.as_str()))
        .map(|l| l.split_whitespace().skip(1));
    push_joined(state.name(format_args!("file locks")).text(), ours, "; ");
}

/// Threads, and child processes (a zombie is one).
fn tasks(state: &mut State) {
    let threads = std::fs::read_dir("/proc/self/task").map_or(0, |d| d.count());
    state.add("threads", format_args!("{threads}"));
    let pid = std::process::id();
    let mut item = state.name(format_args!("child processes"));
    read_into(
        ProcPath::new(format_args!("/proc/self/task/{pid}/children")).as_c_str(),
        item.text(),
    );
    trim_end(item.text());
}

/// Drops the whitespace the value being written ends with.
fn trim_end(text: &mut String) {
    text.truncate(text.trim_end().len());
}

/// Every signal's disposition, the mask, what is pending, the alternate
/// stack. Sets are shown as the kernel's 64-bit words.
fn signals(state: &mut State) {
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
        state
            .name(format_args!("signal {signal:>2}"))
            .write(format_args!(
                "handler {:#x} flags {:#x} mask {:#x}",
                action.sa_sigaction,
                action.sa_flags,
                word(&action.sa_mask)
            ));
    }
    // SAFETY: reads of the mask and the pending set into local sets.
    let (mask, pending) = unsafe {
        let mut mask: libc::sigset_t = std::mem::zeroed();
        let mut pending: libc::sigset_t = std::mem::zeroed();
        libc::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
        libc::sigpending(&mut pending);
        (mask, pending)
    };
    state.add("signal mask", format_args!("{:#x}", word(&mask)));
    state.add("signals pending", format_args!("{:#x}", word(&pending)));
    // SAFETY: sigaltstack with no new stack reads the current one.
    let stack = unsafe {
        let mut stack: libc::stack_t = std::mem::zeroed();
        libc::sigaltstack(std::ptr::null(), &mut stack);
        stack
    };
    state.add(
        "signal stack",
        format_args!("{:p} {} {}", stack.ss_sp, stack.ss_size, stack.ss_flags),
    );
}

/// A signal set as the kernel holds it: one word, signal N at bit N - 1.
fn word(set: &libc::sigset_t) -> u64 {
    // SAFETY: sigset_t is at least 8 bytes; the kernel's set is its first
    // word.
    unsafe { std::ptr::read_unaligned((set as *const libc::sigset_t).cast::<u64>()) }
}

/// Where it is: the working directory, the root, its cgroup, namespaces.
fn places(state: &mut State) {
    state.name(format_args!("cwd")).link(c"/proc/self/cwd");
    state.name(format_args!("root")).link(c"/proc/self/root");
    state.name(format_args!("exe")).link(c"/proc/self/exe");
    let mut item = state.name(format_args!("cgroup"));
    read_into(c"/proc/self/cgroup", item.text());
    trim_end(item.text());
    drop(item);
    let Ok(entries) = std::fs::read_dir("/proc/self/ns") else {
        return;
    };
    let mut names: Vec<String> = entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .collect();
    names.sort_unstable();
    for name in names {
        state
            .name(format_args!("namespace {name}"))
            .link(ProcPath::new(format_args!("/proc/self/ns/{name}")).as_c_str());
    }
}

/// Every resource limit.
fn limits(state: &mut State) {
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
        state
            .name(format_args!("rlimit {resource:>2}"))
            .write(format_args!("{} {}", limit.rlim_cur, limit.rlim_max));
    }
}

/// From `/proc/self/status`: credentials and capabilities, the umask,
/// seccomp, no_new_privs, speculation controls.
fn status(state: &mut State) {
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
    let mut text = String::new();
    read_into(c"/proc/self/status", &mut text);
    for line in text.lines() {
        if let Some((key, value)) = line.split_once(':')
            && KEPT.contains(&key)
        {
            state
                .name(format_args!("status {key}"))
                .write(format_args!("{}", value.trim()));
        }
    }
}

/// Interval timers, POSIX timers, the timer slack.
fn timers(state: &mut State) {
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
        state.name(format_args!("timer {name}")).write(format_args!(
            "armed {armed} interval {}.{:06}",
            timer.it_interval.tv_sec, timer.it_interval.tv_usec
        ));
    }
    state
        .name(format_args!("posix timers"))
        .file(c"/proc/self/timers");
    // SAFETY: prctl reads.
    let slack = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
    state.add("timer slack", format_args!("{slack}"));
}

/// How it is named and what it runs with: the environment and arguments
/// as the kernel holds them, its name, its session and group, prctl's
/// settings, its personality.
fn identity(state: &mut State) {
    state
        .name(format_args!("environ"))
        .file(c"/proc/self/environ");
    state
        .name(format_args!("cmdline"))
        .file(c"/proc/self/cmdline");
    state.name(format_args!("comm")).file(c"/proc/self/comm");
    // SAFETY: plain reads of this process's ids and settings.
    let (sid, pgid, personality) = unsafe {
        (
            libc::getsid(0),
            libc::getpgid(0),
            libc::personality(0xffff_ffff),
        )
    };
    state.add("session", format_args!("{sid} {pgid}"));
    state.add("personality", format_args!("{personality}"));
    let mut item = state.name(format_args!("prctl"));
    for (name, option) in [
        ("dumpable", libc::PR_GET_DUMPABLE),
        ("keepcaps", libc::PR_GET_KEEPCAPS),
        ("securebits", libc::PR_GET_SECUREBITS),
        ("thp_disable", libc::PR_GET_THP_DISABLE),
    ] {
        // SAFETY: prctl reads.
        let value = unsafe { libc::prctl(option, 0, 0, 0, 0) };
        let _ = write!(item.text(), "{name}={value} ");
    }
    let mut signal: libc::c_int = 0;
    let mut subreaper: libc::c_int = 0;
    // SAFETY: prctl writes an int at the pointer given.
    unsafe {
        libc::prctl(libc::PR_GET_PDEATHSIG, &mut signal);
        libc::prctl(libc::PR_GET_CHILD_SUBREAPER, &mut subreaper);
    }
    item.write(format_args!("pdeathsig={signal} subreaper={subreaper}"));
    let mut item = state.name(format_args!("oom_score_adj"));
    read_into(c"/proc/self/oom_score_adj", item.text());
    trim_end(item.text());
}

/// Its priority, scheduler and CPUs.
fn scheduling(state: &mut State) {
    // SAFETY: reads of this process's scheduling.
    let (nice, policy, cpus, ioprio) = unsafe {
        *libc::__errno_location() = 0;
        let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
        let policy = libc::sched_getscheduler(0);
        let mut cpus: libc::cpu_set_t = std::mem::zeroed();
        libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut cpus);
        let ioprio = libc::syscall(libc::SYS_ioprio_get, 1, 0);
        (nice, policy, cpus, ioprio)
    };
    state.add("nice", format_args!("{nice}"));
    state.add("scheduler", format_args!("{policy}"));
    let mut item = state.name(format_args!("cpus"));
    // SAFETY: reads of a set the kernel filled.
    let count = unsafe { libc::CPU_COUNT(&cpus) };
    let _ = write!(item.text(), "{count} [");
    let mut first = true;
    for cpu in 0..libc::CPU_SETSIZE as usize {
        // SAFETY: as above.
        if unsafe { libc::CPU_ISSET(cpu, &cpus) } {
            let _ = write!(item.text(), "{}{cpu}", if first { "" } else { ", " });
            first = false;
        }
    }
    item.write(format_args!("]"));
    state.add("ioprio", format_args!("{ioprio}"));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_below_proc_self_are_read_through_its_open_directory() {
        open_proc_self();
        let (dir, rest) = at(c"/proc/self/status");
        assert!(dir >= 0 && rest == c"status");
        assert_eq!(at(c"/proc/locks").1, c"/proc/locks");
        let mut status = String::new();
        read_into(c"/proc/self/status", &mut status);
        let pid = format!("\nPid:\t{}\n", std::process::id());
        assert!(status.contains(&pid), "{status}");
        let mut cwd = String::new();
        assert!(link_into(c"/proc/self/cwd", &mut cwd));
        assert_eq!(std::path::Path::new(&cwd), std::env::current_dir().unwrap());
    }

    #[test]
    fn a_change_is_read_and_named() {
        // Other tests' threads open and close fds meanwhile: only the
        // item changed here is compared.
        let before = State::read();
        assert_eq!(before.changed_from(&before.clone()), None);
        // The timer slack is this thread's own: no other test sees it.
        // SAFETY: prctl reads and sets this thread's timer slack.
        let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 123_456 as libc::c_ulong) };
        let after = State::read();
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, old as libc::c_ulong) };
        assert_eq!(before.by_name()["timer slack"], old.to_string());
        assert_eq!(after.by_name()["timer slack"], "123456");
        assert!(before.items.len() > 80, "{} items", before.items.len());
    }

    #[test]
    fn an_item_gone_or_new_is_named() {
        let mut before = State::read();
        let mut extra = before.clone();
        extra.add("made up", format_args!("x"));
        assert_eq!(
            extra.changed_from(&before).as_deref(),
            Some("made up: absent → x")
        );
        assert_eq!(
            before.changed_from(&extra).as_deref(),
            Some("made up: x → absent")
        );
        before.add("made up", format_args!("y"));
        assert_eq!(
            before.changed_from(&extra).as_deref(),
            Some("made up: x → y")
        );
    }
}
