//! What memory cannot put back: the state of this process the kernel
//! holds, read whole before the first call and compared after each.
//!
//! Every item is a name and its value as text, so that a change names
//! itself ("fd 7: absent → /tmp/x pos 0"). PROTOCOL-NOTES lists them.
//! The files below `/proc/self` are read through fds opened once and
//! checked before each read ([`super::pinned`]): a call can put its own
//! file at any fd's number.

use std::collections::BTreeMap;
use std::ffi::CStr;
use std::fmt::Write as _;
use std::ops::Range;
use std::os::fd::RawFd;

use super::pinned::{self, Pinned, ProcSelf};

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
    /// Reads it now, through `proc`'s files; `kept` are every fd the
    /// runtime keeps open across calls (`proc`'s among them), each listed
    /// as what it was opened on, or as replaced.
    pub fn read(proc: &ProcSelf, kept: &[&Pinned]) -> State {
        let mut state = State {
            text: String::with_capacity(32 * 1024),
            items: Vec::with_capacity(256),
        };
        let at = Source::new(proc, kept);
        fds(&mut state, &at);
        tasks(&mut state, &at);
        signals(&mut state);
        places(&mut state, &at);
        limits(&mut state);
        status(&mut state, &at);
        timers(&mut state, &at);
        identity(&mut state, &at);
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
    fn file(self, at: &Source<'_>, file: &Pinned) {
        read_into(at, file, &mut self.state.text);
    }

    /// The value is where a link below `dir` points, or why it is
    /// unreadable.
    fn link(self, at: &Source<'_>, dir: &Pinned, path: &CStr) {
        link_into(at, dir, path, &mut self.state.text);
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

/// Where the state is read from: `/proc/self`'s files, and every fd the
/// runtime keeps, each checked once for the read (five system calls a
/// check), however often it is read through.
struct Source<'a> {
    proc: &'a ProcSelf,
    kept: &'a [&'a Pinned],
    replaced: Vec<pinned::Replaced>,
}

impl<'a> Source<'a> {
    fn new(proc: &'a ProcSelf, kept: &'a [&'a Pinned]) -> Source<'a> {
        let replaced = kept.iter().filter_map(|pin| pin.fd().err()).collect();
        Source {
            proc,
            kept,
            replaced,
        }
    }

    /// `pin`'s fd as checked for this read, never one replaced (a call's
    /// file at its number could be anything: `/dev/zero`, read to its
    /// end, has none). A pin not among those kept is checked now.
    fn fd(&self, pin: &Pinned) -> Result<RawFd, pinned::Replaced> {
        if let Some(replaced) = self.replaced.iter().find(|r| r.fd == pin.number()) {
            return Err(*replaced);
        }
        if self.kept.iter().any(|kept| std::ptr::eq(*kept, pin)) {
            Ok(pin.number())
        } else {
            pin.fd()
        }
    }
}

/// Appends a file's content to `into` (lossy UTF-8), read from its start,
/// or why it could not be read.
fn read_into(at: &Source<'_>, file: &Pinned, into: &mut String) {
    let mut bytes = Vec::with_capacity(4096);
    let read = at
        .fd(file)
        .map_err(|replaced| std::io::Error::other(replaced.to_string()))
        .and_then(|fd| pinned::read_whole(fd, &mut bytes));
    match read {
        Ok(()) => into.push_str(&String::from_utf8_lossy(&bytes)),
        Err(error) => {
            let _ = write!(into, "unreadable ({error})");
        }
    }
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

/// Appends where link `path` below `dir` points to `into`: `false`, and
/// nothing appended, if it is gone; why, if `dir` is not the runtime's.
fn link_into(at: &Source<'_>, dir: &Pinned, path: &CStr, into: &mut String) -> bool {
    let dir = match at.fd(dir) {
        Ok(fd) => fd,
        Err(replaced) => {
            let _ = write!(into, "unreadable ({replaced})");
            return true;
        }
    };
    let mut buffer = [0u8; libc::PATH_MAX as usize];
    // SAFETY: readlinkat into a local buffer, within its length.
    let n =
        unsafe { libc::readlinkat(dir, path.as_ptr(), buffer.as_mut_ptr().cast(), buffer.len()) };
    if n < 0 {
        return false;
    }
    into.push_str(&String::from_utf8_lossy(&buffer[..n as usize]));
    true
}

/// The names `dir` lists, each NUL-terminated, or why they are unreadable.
fn names_in(at: &Source<'_>, dir: &Pinned) -> std::io::Result<Vec<u8>> {
    let fd = at
        .fd(dir)
        .map_err(|replaced| std::io::Error::other(replaced.to_string()))?;
    let mut names = Vec::with_capacity(1024);
    pinned::list_fd(fd, &mut names)?;
    Ok(names)
}

fn each_name(names: &[u8]) -> impl Iterator<Item = &CStr> {
    names
        .split_inclusive(|&b| b == 0)
        .filter_map(|name| CStr::from_bytes_with_nul(name).ok())
}

/// Each open fd: what it is, its offset and its flags, and the locks held.
/// An fd the runtime keeps is what it was opened on, or replaced.
fn fds(state: &mut State, at: &Source<'_>) {
    let proc = at.proc;
    let names = match names_in(at, &proc.fds) {
        Ok(names) => names,
        Err(why) => {
            state.add("fds", format_args!("unreadable ({why})"));
            return;
        }
    };
    let mut numbers: Vec<(RawFd, &CStr)> = each_name(&names)
        .filter_map(|name| Some((name.to_str().ok()?.parse().ok()?, name)))
        .collect();
    numbers.sort_unstable();
    // Every open file's `major:minor:inode`, as `/proc/locks` names it.
    let mut files = Vec::with_capacity(numbers.len());
    let mut target = String::new();
    for (fd, name) in numbers {
        if let Some(pin) = at.kept.iter().find(|pin| pin.number() == fd) {
            let item = state.name(format_args!("fd {fd}"));
            match at.fd(pin) {
                Ok(_) => item.write(format_args!("kept: {}", pin.name())),
                Err(replaced) => item.write(format_args!("{replaced}")),
            }
            files.push(lock_name(pin.inode()));
            continue;
        }
        target.clear();
        if !link_into(at, &proc.fds, name, &mut target) {
            // Closed since it was listed.
            continue;
        }
        let mut item = state.name(format_args!("fd {fd}"));
        let text = item.text();
        text.push_str(&target);
        let file = describe_fd(text, fd, &target, at);
        // The standard streams' files are the runtime's and beyond (a log
        // file others may lock): their locks are seen by this pid only.
        if fd > 2 {
            files.push(lock_name(file));
        }
    }
    // The locks this process holds (a POSIX lock names its pid), and any
    // lock on a file it has open: an open file description's lock (an
    // OFD lock names no pid, -1) or a `flock` a child of the call took
    // through an fd it shares (its pid).
    let pid = std::process::id().to_string();
    let mut locks = String::new();
    read_into(at, &proc.locks, &mut locks);
    let held = locks
        .lines()
        .map(|line| {
            line.split_whitespace()
                .filter(|w| *w != "->")
                .collect::<Vec<_>>()
        })
        .filter(|words| {
            words.get(4) == Some(&pid.as_str())
                || words
                    .get(5)
                    .is_some_and(|file| files.iter().any(|f| f == file))
        })
        .map(|words| words.into_iter().skip(1));
    push_joined(state.name(format_args!("file locks")).text(), held, "; ");
}

/// A file as `/proc/locks` names it: `major:minor:inode`, hex device.
fn lock_name((dev, ino): (u64, u64)) -> String {
    format!("{:02x}:{:02x}:{ino}", libc::major(dev), libc::minor(dev))
}

/// Appends what open fd `fd` (a link to `target`) is beyond its file: the
/// file's inode, its offset (not for the standard streams: they are
/// shared with the runtime, in every isolation, and output moves them),
/// its flags, who gets its `SIGIO` and as which signal, a pipe's size. An
/// fd that is no file, pipe or socket (an epoll, a signalfd, an inotify,
/// a timerfd, an eventfd, a pidfd, a device) also what it watches or
/// holds, from its fdinfo, less what moves on its own. Its device and
/// inode.
fn describe_fd(text: &mut String, fd: RawFd, target: &str, at: &Source<'_>) -> (u64, u64) {
    // SAFETY: reads of an fd of this process: fstat into a zeroed struct,
    // fcntl's and lseek's reads touch no memory.
    let (inode, offset, status_flags, fd_flags, owner, signal) = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        libc::fstat(fd, &mut stat);
        (
            (stat.st_dev, stat.st_ino),
            libc::lseek(fd, 0, libc::SEEK_CUR),
            libc::fcntl(fd, libc::F_GETFL),
            libc::fcntl(fd, libc::F_GETFD),
            libc::fcntl(fd, libc::F_GETOWN),
            libc::fcntl(fd, pinned::F_GETSIG),
        )
    };
    let _ = write!(text, " (inode {}:{}", inode.0, inode.1);
    if fd > 2 {
        let _ = write!(text, ", pos {offset}");
    }
    let _ = write!(
        text,
        ", flags {status_flags:o}, fd flags {fd_flags}, owner {owner}, signal {signal}"
    );
    if target.starts_with("pipe:") {
        // SAFETY: as above.
        let size = unsafe { libc::fcntl(fd, libc::F_GETPIPE_SZ) };
        let _ = write!(text, ", size {size}");
    }
    let plain = (target.starts_with('/') && !target.starts_with("/dev/"))
        || target.starts_with("pipe:")
        || target.starts_with("socket:");
    if !plain {
        let mut info = String::new();
        let path = format!("fdinfo/{fd}\0");
        read_fdinfo(at, &path, &mut info);
        let kept = info.lines().filter(|line| {
            !(line.starts_with("pos:")
                || line.starts_with("flags:")
                || line.starts_with("mnt_id:")
                || line.starts_with("ino:")
                || line.starts_with("eventfd-count")
                || line.starts_with("it_value")
                || line.starts_with("ticks"))
        });
        text.push_str(", ");
        push_joined(text, kept.map(str::split_whitespace), ", ");
    }
    text.push(')');
    inode
}

/// Appends `/proc/self/` + `path` (NUL-terminated), opened and read whole.
fn read_fdinfo(at: &Source<'_>, path: &str, into: &mut String) {
    let dir = match at.fd(&at.proc.dir) {
        Ok(fd) => fd,
        Err(replaced) => {
            let _ = write!(into, "unreadable ({replaced})");
            return;
        }
    };
    // SAFETY: openat with a NUL-terminated path.
    let fd = unsafe { libc::openat(dir, path.as_ptr().cast(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        let _ = write!(into, "unreadable ({})", std::io::Error::last_os_error());
        return;
    }
    // SAFETY: the fd just opened, ours alone.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    let _ = std::io::Read::read_to_string(&mut file, into);
}

/// Threads, and child processes (a zombie is one).
fn tasks(state: &mut State, at: &Source<'_>) {
    match names_in(at, &at.proc.tasks) {
        Ok(names) => state.add("threads", format_args!("{}", each_name(&names).count())),
        Err(replaced) => state.add("threads", format_args!("unreadable ({replaced})")),
    }
    let mut item = state.name(format_args!("child processes"));
    read_into(at, &at.proc.children, item.text());
    trim_end(item.text());
}

/// Drops the whitespace the value being written ends with.
fn trim_end(text: &mut String) {
    text.truncate(text.trim_end().len());
}

/// The mask, what is pending, the alternate stack. Sets are shown as the
/// kernel's 64-bit words. Every disposition is set back before this is
/// read ([`super::settings::Settings::put_back_signals`]), so which are
/// caught and which ignored are compared (`status`), not read one by one.
fn signals(state: &mut State) {
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
pub(super) fn word(set: &libc::sigset_t) -> u64 {
    // SAFETY: sigset_t is at least 8 bytes; the kernel's set is its first
    // word.
    unsafe { std::ptr::read_unaligned((set as *const libc::sigset_t).cast::<u64>()) }
}

/// Where it is: the working directory, the root, its cgroup, namespaces.
fn places(state: &mut State, at: &Source<'_>) {
    let proc = at.proc;
    state.name(format_args!("cwd")).link(at, &proc.dir, c"cwd");
    state
        .name(format_args!("root"))
        .link(at, &proc.dir, c"root");
    state.name(format_args!("exe")).link(at, &proc.dir, c"exe");
    let mut item = state.name(format_args!("cgroup"));
    read_into(at, &proc.cgroup, item.text());
    trim_end(item.text());
    drop(item);
    let names = match names_in(at, &proc.namespaces) {
        Ok(names) => names,
        Err(replaced) => {
            state.add("namespaces", format_args!("unreadable ({replaced})"));
            return;
        }
    };
    let mut names: Vec<&CStr> = each_name(&names).collect();
    names.sort_unstable();
    for name in names {
        state
            .name(format_args!("namespace {}", name.to_string_lossy()))
            .link(at, &proc.namespaces, name);
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
/// seccomp, no_new_privs, speculation controls, the signals ignored and
/// caught.
fn status(state: &mut State, at: &Source<'_>) {
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
        "SigIgn",
        "SigCgt",
    ];
    let mut text = String::new();
    read_into(at, &at.proc.status, &mut text);
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
fn timers(state: &mut State, at: &Source<'_>) {
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
        .file(at, &at.proc.timers);
    let slack = timer_slack();
    state.add("timer slack", format_args!("{slack}"));
}

/// How it is named and what it runs with: the environment and arguments
/// as the kernel holds them, its name, its session and group, prctl's
/// settings, its personality.
fn identity(state: &mut State, at: &Source<'_>) {
    let proc = at.proc;
    state.name(format_args!("environ")).file(at, &proc.environ);
    state.name(format_args!("cmdline")).file(at, &proc.cmdline);
    state.name(format_args!("comm")).file(at, &proc.comm);
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
    let mut item = state.name(format_args!("prctl, more"));
    for (name, option) in MORE_PRCTL {
        // SAFETY: prctl reads a setting, returned (or an error).
        let value = returned(unsafe {
            libc::syscall(
                libc::SYS_prctl,
                *option,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
                0 as libc::c_ulong,
            )
        });
        let _ = write!(item.text(), "{name}={value:?} ");
    }
    let mut tsc: libc::c_int = 0;
    // SAFETY: prctl writes an int at the pointer given.
    let read = returned(unsafe {
        libc::syscall(
            libc::SYS_prctl,
            PR_GET_TSC,
            &mut tsc,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    });
    let _ = write!(item.text(), "tsc={read:?} {tsc}");
    #[cfg(target_arch = "x86_64")]
    for (name, code) in ARCH_PRCTL {
        let mut value: u64 = 0;
        // SAFETY: arch_prctl reads a setting into a u64 at the pointer
        // given (or fails).
        let read = returned(unsafe { libc::syscall(libc::SYS_arch_prctl, *code, &mut value) });
        let _ = write!(item.text(), " {name}={read:?} {value:#x}");
    }
    drop(item);
    keyrings(state);
    let mut item = state.name(format_args!("oom_score_adj"));
    read_into(at, &proc.oom_score_adj, item.text());
    trim_end(item.text());
}

/// prctl's settings a call can change and none of the above shows, read by
/// returning them: memory-deny-write-execute (which cannot be undone),
/// machine-check kill policy, KSM merging, the I/O flusher flag.
const MORE_PRCTL: &[(&str, libc::c_long)] = &[
    ("mdwe", 66),         // PR_GET_MDWE
    ("mce_kill", 34),     // PR_MCE_KILL_GET
    ("memory_merge", 68), // PR_GET_MEMORY_MERGE
    ("io_flusher", 58),   // PR_GET_IO_FLUSHER
];

/// Whether a time-stamp counter read faults (`PR_SET_TSC`).
const PR_GET_TSC: libc::c_long = 25;

/// x86's per-process settings (`arch_prctl`): CPUID faulting, the AMX
/// state permitted, linear address masking, shadow stacks, and the GS
/// base, which nothing here uses.
#[cfg(target_arch = "x86_64")]
const ARCH_PRCTL: &[(&str, libc::c_long)] = &[
    ("cpuid", 0x1011),      // ARCH_GET_CPUID
    ("xcomp_perm", 0x1022), // ARCH_GET_XCOMP_PERM
    ("untag_mask", 0x4001), // ARCH_GET_UNTAG_MASK
    ("shstk", 0x5005),      // ARCH_SHSTK_STATUS
    ("gs_base", 0x1004),    // ARCH_GET_GS: 64 bits a call could leave
];

/// Its keyrings: the thread's and the process's, each with the keys it
/// holds (a key a call added there would be the next call's to read), and
/// which session keyring it is in (joining another is the call's). The
/// session keyring's own keys are not compared: it is shared with other
/// processes, as the user's keyring and the file system are.
fn keyrings(state: &mut State) {
    const KEYCTL_GET_KEYRING_ID: libc::c_long = 0;
    const KEYCTL_READ: libc::c_long = 11;
    let mut item = state.name(format_args!("keyrings"));
    for (name, special) in [("thread", -1), ("process", -2), ("session", -3)] {
        // SAFETY: keyctl asks which keyring a special id names, creating
        // none.
        let id = returned(unsafe {
            libc::syscall(
                libc::SYS_keyctl,
                KEYCTL_GET_KEYRING_ID,
                special as libc::c_long,
                0 as libc::c_ulong,
            )
        });
        let _ = write!(item.text(), "{name}={id:?}");
        if let (Ok(id), false) = (id, name == "session") {
            let mut keys = [0i32; 64];
            // SAFETY: keyctl writes at most the buffer's size of key ids.
            let size = unsafe {
                libc::syscall(
                    libc::SYS_keyctl,
                    KEYCTL_READ,
                    id,
                    keys.as_mut_ptr(),
                    std::mem::size_of_val(&keys),
                )
            };
            let held = (size.max(0) as usize / 4).min(keys.len());
            let _ = write!(item.text(), " holding {size} bytes: {:?}", &keys[..held]);
        }
        item.text().push(' ');
    }
}

/// A system call's return: its value, or its error (`errno`, read right
/// after it, before anything else can set it).
pub(super) fn returned(value: libc::c_long) -> Result<libc::c_long, i32> {
    if value < 0 {
        Err(std::io::Error::last_os_error().raw_os_error().unwrap_or(0))
    } else {
        Ok(value)
    }
}

/// The timer slack, in nanoseconds, whole: glibc's `prctl` returns an
/// `int`, which a slack of 2^32 ns or more would not fit.
pub(super) fn timer_slack() -> libc::c_ulong {
    // SAFETY: a read, by the system call itself, whose result is a long.
    unsafe { libc::syscall(libc::SYS_prctl, libc::PR_GET_TIMERSLACK, 0, 0, 0, 0) as libc::c_ulong }
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
    fn the_files_below_proc_self_are_read_through_its_kept_fds() {
        let proc = ProcSelf::open().unwrap();
        let all = proc.all();
        let at = Source::new(&proc, &all);
        let mut status = String::new();
        read_into(&at, &proc.status, &mut status);
        let pid = format!("\nPid:\t{}\n", std::process::id());
        assert!(status.contains(&pid), "{status}");
        let mut cwd = String::new();
        assert!(link_into(&at, &proc.dir, c"cwd", &mut cwd));
        assert_eq!(std::path::Path::new(&cwd), std::env::current_dir().unwrap());
        let state = State::read(&proc, &proc.all());
        let items = state.by_name();
        let dir = format!("fd {}", proc.dir.number());
        assert_eq!(items[dir.as_str()], "kept: /proc/self");
        assert!(items.contains_key("namespace mnt"), "{items:?}");
    }

    #[test]
    fn a_directory_put_in_place_of_proc_self_is_read_as_replaced() {
        let proc = ProcSelf::open().unwrap();
        let before = State::read(&proc, &proc.all());
        let elsewhere = std::fs::File::open("/").unwrap();
        // SAFETY: dup2 onto this test's own kept fd.
        unsafe {
            libc::dup2(
                std::os::fd::AsRawFd::as_raw_fd(&elsewhere),
                proc.dir.number(),
            )
        };
        let after = State::read(&proc, &proc.all());
        let change = after.changed_from(&before).expect("a change");
        assert!(
            change.contains("where the runtime keeps /proc/self,"),
            "{change}"
        );
        assert!(after.by_name()["cwd"].starts_with("unreadable"));
        // SAFETY: closes the stranger at the kept number, this test's own.
        unsafe { libc::close(proc.dir.number()) };
        // The number is free now: another test may have it by the drop.
        std::mem::forget(proc);
    }

    #[test]
    fn a_change_is_read_and_named() {
        // Other tests' threads open and close fds meanwhile: only the
        // item changed here is compared.
        let proc = ProcSelf::open().unwrap();
        let before = State::read(&proc, &proc.all());
        assert_eq!(before.changed_from(&before.clone()), None);
        // The timer slack is this thread's own: no other test sees it.
        // SAFETY: prctl reads and sets this thread's timer slack.
        let old = unsafe { libc::prctl(libc::PR_GET_TIMERSLACK) };
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, 123_456 as libc::c_ulong) };
        let after = State::read(&proc, &proc.all());
        // SAFETY: as above.
        unsafe { libc::prctl(libc::PR_SET_TIMERSLACK, old as libc::c_ulong) };
        assert_eq!(before.by_name()["timer slack"], old.to_string());
        assert_eq!(after.by_name()["timer slack"], "123456");
        assert!(before.items.len() > 80, "{} items", before.items.len());
    }

    #[test]
    fn an_item_gone_or_new_is_named() {
        let proc = ProcSelf::open().unwrap();
        let mut before = State::read(&proc, &proc.all());
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
