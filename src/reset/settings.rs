//! The settings of this process the kernel holds that a call can change
//! and the resident can set back itself (and the one the CPU holds, the
//! floating-point environment): signal dispositions, the signal
//! mask and the alternate stack, the working directory, the umask, the
//! resource limits, the interval timers, the timer slack, the name and
//! the nice value.
//!
//! A call that installs a signal handler (a library's import may),
//! changes directory or lowers a limit would otherwise retire its
//! resident. Set back, it costs nothing: the comparison that follows
//! ([`super::state`]) still reads every item but the dispositions (of
//! which it reads only which signals are caught and which ignored: every
//! one is set back by the system call itself, and one the kernel refused
//! would retire the resident), and one that could not be set back (a hard
//! limit raised again without the privilege, a signal pending, a
//! directory gone) retires the resident as before.
//!
//! Signals are held from the moment a call is over ([`hold_signals`]): a
//! handler the call installed, run once memory is put back, would write
//! into that memory (CPython's notes a signal as tripped, for the next
//! call to run its handler) or run the call's own code, and one running
//! on the call's alternate stack would write its frame there. They stay
//! held until every disposition and the alternate stack are the
//! snapshot's again ([`Settings::put_back_signals`]).
//!
//! What is set back is read before the snapshot, onto the heap, so it is
//! in the snapshot's memory: it is set back only once memory is put back,
//! and a call that wrote over it has had its writes undone.

use std::os::fd::RawFd;

use super::pinned::Pinned;

/// The settings as they were when the snapshot was taken.
pub struct Settings {
    actions: Vec<(libc::c_int, KernelAction)>,
    mask: libc::sigset_t,
    alternate_stack: libc::stack_t,
    /// The working directory (`O_PATH`); `None` if it could not be opened.
    cwd: Option<Pinned>,
    umask: libc::mode_t,
    limits: Vec<(libc::c_int, libc::rlimit)>,
    timers: [(libc::c_int, libc::itimerval); 3],
    timer_slack: libc::c_ulong,
    name: [u8; 16],
    nice: libc::c_int,
    /// The floating-point environment (x87 and SSE control and status:
    /// rounding, flush-to-zero, exception flags), glibc's `fenv_t`.
    floating_point: FloatingPoint,
}

/// Room for glibc's `fenv_t` (32 bytes on x86-64, 8 on arm64).
#[derive(Clone, Copy, Default)]
#[repr(C, align(16))]
struct FloatingPoint([u64; 8]);

#[link(name = "m")]
unsafe extern "C" {
    fn fegetenv(env: *mut FloatingPoint) -> libc::c_int;
    fn fesetenv(env: *const FloatingPoint) -> libc::c_int;
}

impl Settings {
    /// Reads them now (`Err`: one cannot be, so it could not be set back).
    pub fn read() -> Result<Box<Settings>, String> {
        // SAFETY: each is a read of this process's settings into a local
        // or a zeroed struct; umask is read by setting it and setting it
        // back, with one thread running.
        unsafe {
            let mut actions = Vec::with_capacity(64);
            for signal in settable_signals() {
                // One left out would be neither set back nor compared.
                let action = KernelAction::of(signal)
                    .ok_or_else(|| format!("signal {signal}'s disposition cannot be read"))?;
                actions.push((signal, action));
            }
            let mut mask: libc::sigset_t = std::mem::zeroed();
            libc::sigprocmask(libc::SIG_BLOCK, std::ptr::null(), &mut mask);
            let mut alternate_stack: libc::stack_t = std::mem::zeroed();
            libc::sigaltstack(std::ptr::null(), &mut alternate_stack);
            let umask = libc::umask(0o022);
            libc::umask(umask);
            let mut limits = Vec::with_capacity(16);
            // RLIMIT_CPU (0) to RLIMIT_RTTIME (15): all Linux has.
            for resource in 0..16 {
                let mut limit: libc::rlimit = std::mem::zeroed();
                if libc::getrlimit(resource as _, &mut limit) == 0 {
                    limits.push((resource, limit));
                }
            }
            let mut timers = [
                (libc::ITIMER_REAL, std::mem::zeroed()),
                (libc::ITIMER_VIRTUAL, std::mem::zeroed()),
                (libc::ITIMER_PROF, std::mem::zeroed()),
            ];
            for (which, timer) in &mut timers {
                libc::getitimer(*which, timer);
            }
            let mut name = [0u8; 16];
            libc::prctl(libc::PR_GET_NAME, name.as_mut_ptr());
            *libc::__errno_location() = 0;
            let nice = libc::getpriority(libc::PRIO_PROCESS, 0);
            let mut floating_point = FloatingPoint::default();
            if fegetenv(&mut floating_point) != 0 {
                return Err("the floating-point environment cannot be read".into());
            }
            Ok(Box::new(Settings {
                actions,
                mask,
                alternate_stack,
                cwd: open_cwd(),
                umask,
                limits,
                timers,
                timer_slack: super::state::timer_slack(),
                name,
                nice,
                floating_point,
            }))
        }
    }

    /// The fd it keeps open: the working directory.
    pub fn kept(&self) -> Option<&Pinned> {
        self.cwd.as_ref()
    }

    /// Sets every signal's disposition and the alternate stack back, with
    /// signals held ([`hold_signals`]); then the mask, where no signal is
    /// pending (setting a disposition to ignore one drops it: a `SIGCHLD`
    /// of the call's children, ended). One pending is left held, for the
    /// comparison to find.
    /// `Err`: a disposition could not be set back (what the comparison
    /// reads of them, which are caught and which ignored, would not show
    /// one handler for another).
    pub fn put_back_signals(&self) -> Result<(), String> {
        for (signal, action) in &self.actions {
            if !action.set(*signal) {
                return Err(format!(
                    "signal {signal}'s disposition could not be set back"
                ));
            }
        }
        // SAFETY: each sets this process's signal settings to values they
        // had, read by the calls `read` pairs with them.
        unsafe {
            libc::sigaltstack(&self.alternate_stack, std::ptr::null_mut());
            let mut pending: libc::sigset_t = std::mem::zeroed();
            libc::sigpending(&mut pending);
            if super::state::word(&pending) == 0 {
                set_mask(libc::SIG_SETMASK, super::state::word(&self.mask));
            }
        }
        Ok(())
    }

    /// Sets the floating-point environment back: a call that changed the
    /// rounding or set flush-to-zero (a library built with `-ffast-math`
    /// does, as it loads) would change every later call's arithmetic, and
    /// its exception flags would be theirs to test. Every call: it is one
    /// instruction's worth, and nothing the kernel shows.
    pub fn put_back_floating_point(&self) {
        // SAFETY: fesetenv with an environment fegetenv filled.
        unsafe { fesetenv(&self.floating_point) };
    }

    /// Sets the rest back as it was read, as far as the kernel lets this
    /// process: what it refuses stays as the call left it, for the
    /// comparison to find.
    pub fn put_back(&self) {
        // SAFETY: each sets a setting of this process to a value it had,
        // read by the calls `read` pairs with them.
        unsafe {
            for (which, timer) in &self.timers {
                libc::setitimer(*which, timer, std::ptr::null_mut());
            }
            if let Some(fd) = self.cwd.as_ref().and_then(|cwd| cwd.fd().ok()) {
                libc::fchdir(fd);
            }
            libc::umask(self.umask);
            for (resource, limit) in &self.limits {
                libc::setrlimit(*resource as _, limit);
            }
            libc::prctl(libc::PR_SET_TIMERSLACK, self.timer_slack);
            libc::prctl(libc::PR_SET_NAME, self.name.as_ptr());
            libc::setpriority(libc::PRIO_PROCESS, 0, self.nice);
        }
    }
}

/// Disarms the interval timers, then holds every signal (SIGKILL and
/// SIGSTOP aside), which needs nothing read before: from the moment a
/// call is over no handler it installed runs, and nothing it armed fires,
/// until [`Settings::put_back_signals`]. (Disarmed first: a tick between
/// the two is the call's handler's, run before memory is put back, not a
/// signal left pending.) A timer the snapshot had armed is armed again by
/// [`Settings::put_back`].
pub fn hold_signals() {
    // SAFETY: disarms this process's timers and blocks signals for this,
    // the only thread: a zeroed timer and a full set, both locals.
    unsafe {
        let disarmed: libc::itimerval = std::mem::zeroed();
        for which in [libc::ITIMER_REAL, libc::ITIMER_VIRTUAL, libc::ITIMER_PROF] {
            libc::setitimer(which, &disarmed, std::ptr::null_mut());
        }
    }
    set_mask(libc::SIG_BLOCK, !0);
}

/// Every signal a disposition can be set for: all 64 the kernel has but
/// SIGKILL and SIGSTOP, the C library's own two (32 and 33, which its
/// `sigaction` refuses, and a call can still set by the system call)
/// among them.
pub(super) fn settable_signals() -> impl Iterator<Item = libc::c_int> {
    (1..=64).filter(|&signal| signal != libc::SIGKILL && signal != libc::SIGSTOP)
}

/// A disposition as the kernel holds it (`struct sigaction` of the
/// `rt_sigaction` system call), read and set by the system call itself:
/// the C library's wrapper hides its own signals.
#[derive(Clone, Copy, Default, PartialEq, Eq)]
#[repr(C)]
pub(super) struct KernelAction {
    handler: usize,
    flags: libc::c_ulong,
    restorer: usize,
    mask: u64,
}

impl KernelAction {
    /// `signal`'s disposition now.
    pub(super) fn of(signal: libc::c_int) -> Option<KernelAction> {
        let mut action = KernelAction::default();
        // SAFETY: rt_sigaction reads the disposition into a local of the
        // kernel's layout, with the kernel's set size.
        let read = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                std::ptr::null::<KernelAction>(),
                &mut action,
                8usize,
            )
        };
        (read == 0).then_some(action)
    }

    /// Sets it as `signal`'s disposition: whether the kernel took it.
    fn set(&self, signal: libc::c_int) -> bool {
        // SAFETY: rt_sigaction sets a disposition this process had.
        let set = unsafe {
            libc::syscall(
                libc::SYS_rt_sigaction,
                signal,
                self,
                std::ptr::null_mut::<KernelAction>(),
                8usize,
            )
        };
        set == 0
    }
}

/// Changes the signal mask by the system call: the C library's wrapper
/// leaves its own two signals out of any set it is given.
fn set_mask(how: libc::c_int, set: u64) {
    // SAFETY: rt_sigprocmask with a local set of the kernel's size.
    unsafe {
        libc::syscall(
            libc::SYS_rt_sigprocmask,
            how,
            &set,
            std::ptr::null_mut::<u64>(),
            8usize,
        )
    };
}

/// The working directory, open for `fchdir` (`O_PATH`: it reads nothing,
/// and has no offset a call could move).
fn open_cwd() -> Option<Pinned> {
    // SAFETY: open with a NUL-terminated path.
    let fd: RawFd = unsafe {
        libc::open(
            c".".as_ptr(),
            libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
        )
    };
    if fd < 0 {
        return None;
    }
    // A directory's change time moves as files are made in it: not part
    // of what it is.
    Pinned::adopt(fd, "the working directory it had").ok()
}
