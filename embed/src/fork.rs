//! Forking the interpreter, and knowing whether it was safe to.
//!
//! The issues this solves:
//! 1. A fork copies one thread. Any other thread that held a lock (malloc's,
//!    the import lock, a library's own) leaves it held forever in the child.
//!    So the zygote must fork with one thread, but "one thread" cannot be
//!    read from `/proc` before the fork: numpy's OpenBLAS keeps a pool that
//!    it stops itself in a `pthread_atfork` prepare handler. The count that
//!    matters is the one *after* every prepare handler ran, and that is what
//!    `census` reads: registered before any library is loaded, it runs last
//!    (prepare handlers run in reverse order of registration).
//! 2. CPython has its own before/after-fork work (the import lock, its
//!    runtime locks, `os.register_at_fork` hooks such as logging's handler
//!    locks). [`fork`] brackets the syscall exactly as `os.fork()` does.
//! 3. A call's child must not outlive its zygote, nor leave its own children
//!    behind when it goes: [`become_call_child`] gives it a session and a
//!    death signal whose handler kills that whole session.
//! 4. What the runtime does at each fork (wiping what belongs to other
//!    calls in the child, keeping its books of children in the parent) must
//!    happen at exact points inside the bracketing: the child's part before
//!    `PyOS_AfterFork_Child` runs any Python (`os.register_at_fork` hooks).
//!    The runtime hands those parts over once, as [`ForkHooks`], with
//!    [`install`].

use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use nix::unistd::Pid;
use pyo3::ffi;
use pyo3::prelude::*;

/// Set only around the zygote's own forks: a node forking in its child
/// (multiprocessing, say) must not pay for a census nobody reads.
static CENSUS_ARMED: AtomicBool = AtomicBool::new(false);
/// Threads alive at the last fork, counted after every prepare handler ran.
static THREADS_AT_FORK: AtomicUsize = AtomicUsize::new(0);
/// What the zygote tolerates at fork: the threads its preloads left that do
/// not stop at fork (normally none, so 1).
static TOLERATED_AT_FORK: AtomicUsize = AtomicUsize::new(1);

/// Exit code of a child that was forked while a stray thread ran: it runs
/// nothing and leaves at once, and the zygote recovers.
pub const UNSAFE_FORK_EXIT: i32 = 117;

/// The runtime's part of every fork [`fork`] makes.
#[derive(Debug, Clone, Copy)]
pub struct ForkHooks {
    /// In the child, once it is known to be safe and before CPython's
    /// after-fork work runs any Python: what the parent held that this
    /// child must not read goes. Only what is safe between `fork` and
    /// `PyOS_AfterFork_Child` (no Python, no lock another thread held).
    pub in_child: fn(),
    /// In the parent, for each child forked.
    pub forked: fn(Pid),
    /// In the parent, for each child [`forks_safely`] forked and reaped
    /// itself.
    pub reaped: fn(Pid),
}

impl ForkHooks {
    /// Nothing to do: what a fork does before [`install`].
    pub const NONE: ForkHooks = ForkHooks {
        in_child: || {},
        forked: |_| {},
        reaped: |_| {},
    };
}

static HOOKS: OnceLock<ForkHooks> = OnceLock::new();

fn hooks() -> &'static ForkHooks {
    HOOKS.get().unwrap_or(&ForkHooks::NONE)
}

/// Registers `census` and the runtime's `hooks`. Call once, before the
/// interpreter starts, so every library loaded later registers its handlers
/// after the census, and they run first. A second call changes nothing.
pub fn install(hooks: ForkHooks) {
    if HOOKS.set(hooks).is_err() {
        return;
    }
    // SAFETY: registering a plain extern "C" function with no state.
    unsafe { libc::pthread_atfork(Some(census), None, None) };
}

/// How long a census waits for threads that are already on their way out:
/// a pool stopped with `pthread_join` may still be counted for a few
/// microseconds after the join returned.
const CENSUS_SETTLE: Duration = Duration::from_millis(5);

extern "C" fn census() {
    if !CENSUS_ARMED.load(Ordering::SeqCst) {
        return;
    }
    let mut threads = threads_now();
    if threads > 1 {
        let start = Instant::now();
        while threads > 1 && start.elapsed() < CENSUS_SETTLE {
            std::thread::yield_now();
            threads = threads_now();
        }
    }
    THREADS_AT_FORK.store(threads, Ordering::SeqCst);
}

/// The threads of this process now, read from `/proc/self/stat`.
pub fn threads_now() -> usize {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else {
        return 1;
    };
    // Field 20 (num_threads); the command name in field 2 is parenthesised
    // and may contain spaces, so count from after its closing parenthesis.
    stat.rsplit_once(')')
        .and_then(|(_, rest)| rest.split_whitespace().nth(17))
        .and_then(|n| n.parse().ok())
        .unwrap_or(1)
}

/// Sets how many threads a fork may see and still be safe (see `census`).
pub fn tolerate_at_fork(threads: usize) {
    TOLERATED_AT_FORK.store(threads.max(1), Ordering::SeqCst);
}

/// Threads the last fork saw.
pub fn threads_at_last_fork() -> usize {
    THREADS_AT_FORK.load(Ordering::SeqCst)
}

/// The two sides of a fork.
pub enum Forked {
    /// In the parent. `safe` is false when a thread that does not stop at
    /// fork was running: the child then exits at once with
    /// [`UNSAFE_FORK_EXIT`] and has run nothing.
    Parent {
        pid: Pid,
        safe: bool,
    },
    Child,
}

/// `os.fork()`, from Rust: CPython's bracketing around `fork(2)`. The
/// stack below the caller is zeroed first ([`zero_stack_below`]): what the
/// zygote's deeper frames left there (another call's request, parsed) is
/// where the child's own frames go, and would be read from their unset
/// slots.
pub fn fork(_py: Python<'_>) -> std::io::Result<Forked> {
    zero_stack_below();
    // SAFETY: the GIL is held (the `Python` token proves it), which
    // PyOS_BeforeFork requires; each branch calls the matching after-fork
    // function, the failure path included, as posixmodule.c does.
    unsafe {
        ffi::PyOS_BeforeFork();
        CENSUS_ARMED.store(true, Ordering::SeqCst);
        let pid = libc::fork();
        CENSUS_ARMED.store(false, Ordering::SeqCst);
        if pid == 0 {
            if THREADS_AT_FORK.load(Ordering::SeqCst) > TOLERATED_AT_FORK.load(Ordering::SeqCst) {
                // Another thread may hold any lock; touch nothing.
                libc::_exit(UNSAFE_FORK_EXIT);
            }
            // What the parent held for other calls (the requests in
            // flight, say) is not this child's to read.
            (hooks().in_child)();
            ffi::PyOS_AfterFork_Child();
            return Ok(Forked::Child);
        }
        let error = std::io::Error::last_os_error();
        ffi::PyOS_AfterFork_Parent();
        if pid < 0 {
            return Err(error);
        }
        let pid = Pid::from_raw(pid);
        (hooks().forked)(pid);
        let safe =
            THREADS_AT_FORK.load(Ordering::SeqCst) <= TOLERATED_AT_FORK.load(Ordering::SeqCst);
        Ok(Forked::Parent { pid, safe })
    }
}

/// Bytes of stack [`zero_stack_below`] writes over.
pub const STACK_ZEROED: usize = 64 * 1024;

/// Writes zeros over [`STACK_ZEROED`] bytes of stack right below its
/// caller's frame: what deeper frames left there (a request parsed, a
/// call's arguments decoded) is found by no frame made there later, in
/// this process or in a child forked with its stack.
#[inline(never)]
pub fn zero_stack_below() {
    let mut zeroed = std::mem::MaybeUninit::<[u8; STACK_ZEROED]>::uninit();
    // SAFETY: zeros written over a local, whole; `black_box` keeps the
    // writes (a memset, where a byte at a time cost 1.6% of a put-back).
    unsafe { std::ptr::write_bytes(zeroed.as_mut_ptr(), 0, 1) };
    std::hint::black_box(&mut zeroed);
}

/// Whether this process can fork with no stray thread: answered by forking
/// once, as a call would, when more than one thread is alive.
pub fn forks_safely(py: Python<'_>) -> bool {
    if threads_now() <= TOLERATED_AT_FORK.load(Ordering::SeqCst) {
        return true;
    }
    match fork(py) {
        // SAFETY: leave at once; the child exists only to be counted.
        Ok(Forked::Child) => unsafe { libc::_exit(0) },
        Ok(Forked::Parent { pid, safe }) => {
            reap(pid);
            safe
        }
        Err(_) => false,
    }
}

/// Waits for `pid`, which has nothing to report, and tells the runtime.
fn reap(pid: Pid) {
    let mut status: libc::c_int = 0;
    loop {
        // SAFETY: a pointer to a live local; waitpid writes only through it.
        let done = unsafe { libc::waitpid(pid.as_raw(), &mut status, 0) };
        if done == pid.as_raw() {
            (hooks().reaped)(pid);
            return;
        }
        if std::io::Error::last_os_error().kind() != std::io::ErrorKind::Interrupted {
            return;
        }
    }
}

/// The signal the kernel sends a call's child when its zygote dies. Not
/// SIGKILL: its handler first kills the child's whole session, so what the
/// node started goes too. Real-time, so no library expects to own it.
fn parent_death_signal() -> libc::c_int {
    libc::SIGRTMAX() - 1
}

extern "C" fn on_parent_death(_: libc::c_int) {
    // SAFETY: kill and _exit are async-signal-safe. Group 0 is our own
    // session's group, which this child leads.
    unsafe {
        libc::kill(0, libc::SIGKILL);
        libc::_exit(1);
    }
}

/// Makes a freshly forked process a call's child: its own session, and dead
/// with everything it started when `zygote` dies.
pub fn become_call_child(zygote: Pid) {
    // SAFETY: setsid, sigaction and prctl act on this process alone; the
    // handler only calls async-signal-safe functions.
    unsafe {
        libc::setsid();
        let mut action: libc::sigaction = std::mem::zeroed();
        action.sa_sigaction = on_parent_death as *const () as usize;
        libc::sigemptyset(&mut action.sa_mask);
        libc::sigaction(parent_death_signal(), &action, std::ptr::null_mut());
        libc::prctl(
            libc::PR_SET_PDEATHSIG,
            parent_death_signal() as libc::c_ulong,
        );
        // The zygote may have died between fork and prctl, before the death
        // signal was armed.
        if libc::getppid() != zygote.as_raw() {
            on_parent_death(0);
        }
    }
}

/// `gc.freeze()`: whatever the zygote allocated since stays in the
/// permanent generation, so a child's collections never touch (and copy)
/// the zygote's pages.
pub fn freeze_gc(py: Python<'_>) {
    if let Ok(gc) = py.import("gc") {
        let _ = gc.call_method0("freeze");
    }
}
