//! The settings of this process the kernel holds that a call can change
//! and the resident can set back itself (and the one the CPU holds, the
//! floating-point environment): signal dispositions, the signal
//! mask and the alternate stack, the working directory, the umask, the
//! resource limits, the interval timers, the timer slack, the name and
//! the nice value; and, every call, the restartable-sequences
//! registration, memory locks (`mlockall(MCL_FUTURE)` shows nowhere) and
//! any syscall user dispatch (nor does it).
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
//! and a call that wrote over it has had its writes undone. The
//! restartable-sequences registration and the memory locks alone are set
//! back before (the kernel writes into a registered area, which the
//! restore would put back under it; the restore maps regions again, which
//! `MCL_FUTURE` would lock): a call that wrote over what they are set back
//! to is native code against the runtime.

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
    /// The restartable-sequences area registered for this thread.
    rseq: Registration,
    /// No memory was locked (`VmLck`): every lock a call leaves, and
    /// `mlockall(MCL_FUTURE)`, which no file shows, can be undone whole.
    /// (Where some was, the snapshot's own mappings lost it: its regions
    /// are mapped anew, unlocked.)
    locked_nothing: bool,
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
                rseq: Registration::now(),
                locked_nothing: locked_nothing(),
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

    /// Sets the restartable-sequences registration back: glibc's area
    /// registered again where a call unregistered it (`sched_getcpu` would
    /// read a CPU that never changes again, in every later call), none
    /// where it had none. `Err`: a call registered an area of its own,
    /// which cannot be unregistered without its signature: the kernel
    /// would go on writing into memory the next call is handed.
    pub fn put_back_rseq(&self) -> Result<(), String> {
        let registered = match self.rseq {
            Registration::Of(rseq) => rseq.register(),
            // A spare area of ours registered and let go again: none is.
            Registration::None => Rseq::spare()
                .register()
                .map(|()| Rseq::spare().unregister()),
            Registration::Unknown => Ok(()),
        };
        registered.map_err(|errno| {
            let error = std::io::Error::from_raw_os_error(errno);
            format!("a restartable-sequences area of the call's is registered ({error})")
        })
    }

    /// Unlocks all memory where none was locked before the snapshot: a
    /// call's `mlockall(MCL_FUTURE)` would lock every mapping the calls
    /// after it make (and, past `RLIMIT_MEMLOCK`, fail their allocations),
    /// and nothing the kernel shows says it is set until one does.
    pub fn put_back_memory_locks(&self) {
        if self.locked_nothing {
            // SAFETY: munlockall has no preconditions.
            unsafe { libc::munlockall() };
        }
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

/// Turns off any syscall user dispatch a call turned on
/// (`PR_SET_SYSCALL_USER_DISPATCH`, Linux 5.11), which no file shows. Left
/// on with its selector byte allowing, it waits in memory the later calls
/// are handed: one that happens to write another value there has its next
/// system call trapped, or its process killed. First thing after a call:
/// one left blocking traps this very system call (`SIGSYS` ends the
/// resident where the call installed no handler; one that emulates system
/// calls is native code against the runtime, as PROTOCOL-NOTES says).
pub fn end_syscall_dispatch() {
    const PR_SET_SYSCALL_USER_DISPATCH: libc::c_int = 59;
    const PR_SYS_DISPATCH_OFF: libc::c_ulong = 0;
    // SAFETY: prctl with plain values; where the kernel has no dispatch
    // (EINVAL), nothing was on.
    unsafe {
        libc::prctl(
            PR_SET_SYSCALL_USER_DISPATCH,
            PR_SYS_DISPATCH_OFF,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
            0 as libc::c_ulong,
        )
    };
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

/// Whether this process has no memory locked (`VmLck: 0 kB`).
fn locked_nothing() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|status| {
        status
            .lines()
            .any(|line| line.starts_with("VmLck:") && line[6..].trim() == "0 kB")
    })
}

/// A restartable-sequences registration (`rseq(2)`, Linux 4.18): an area
/// of the thread's where the kernel writes the CPU it runs on.
#[derive(Clone, Copy)]
struct Rseq {
    area: usize,
    length: u32,
    signature: u32,
}

/// The signature glibc registers with (`RSEQ_SIG`): 4 bytes the kernel
/// checks before an abort handler, so one of the C library's own.
#[cfg(target_arch = "x86_64")]
const RSEQ_SIGNATURE: u32 = 0x5305_3053;
#[cfg(target_arch = "aarch64")]
const RSEQ_SIGNATURE: u32 = 0xd428_bc00;
#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
const RSEQ_SIGNATURE: u32 = 0;

const RSEQ_FLAG_UNREGISTER: libc::c_int = 1;

/// The spare area of [`Rseq::spare`]: `struct rseq` is 32 bytes, aligned
/// to 32.
#[repr(C, align(32))]
struct SpareArea([u8; 32]);
static mut SPARE_AREA: SpareArea = SpareArea([0; 32]);

/// The registration a resident had when its snapshot was taken.
#[derive(Clone, Copy)]
enum Registration {
    /// glibc's, of the area it keeps for the thread.
    Of(Rseq),
    /// None (`GLIBC_TUNABLES=glibc.pthread.rseq=0`, an older glibc).
    None,
    /// One this cannot name, or a kernel without `rseq`: neither compared
    /// nor set back (a call can change it through native code alone).
    Unknown,
}

impl Registration {
    /// glibc's registration for this thread (2.35 and later): its area
    /// lies at `__rseq_offset` from the thread pointer, and is registered
    /// where `__rseq_size` is not 0. Its length is the one the kernel
    /// answers "already registered" to.
    fn now() -> Registration {
        // SAFETY: dlsym of glibc's exported `ptrdiff_t` and `unsigned int`,
        // each read once.
        let (offset, size) = unsafe {
            let offset = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr());
            let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
            if offset.is_null() || size.is_null() {
                return Registration::none_or_unknown();
            }
            (*(offset as *const isize), *(size as *const u32))
        };
        // glibc registered none (`glibc.pthread.rseq=0`).
        let area = thread_pointer().and_then(|tp| tp.checked_add_signed(offset));
        let Some(area) = area.filter(|_| size > 0) else {
            return Registration::none_or_unknown();
        };
        // The length it registered with: 32 (the original `struct rseq`),
        // or its feature size where a later glibc gives more.
        let lengths = std::iter::once(size.max(32)).chain((64..=256).step_by(32));
        for length in lengths {
            let rseq = Rseq {
                area,
                length,
                signature: RSEQ_SIGNATURE,
            };
            match rseq.call(0) {
                Err(libc::EBUSY) => return Registration::Of(rseq),
                // It registered: there was none. Let go again.
                Ok(()) => {
                    rseq.unregister();
                    return Registration::None;
                }
                Err(_) => {}
            }
        }
        Registration::Unknown
    }

    /// Where glibc's area cannot be found: whether any is registered.
    fn none_or_unknown() -> Registration {
        match Rseq::spare().call(0) {
            Ok(()) => {
                Rseq::spare().unregister();
                Registration::None
            }
            Err(_) => Registration::Unknown,
        }
    }
}

impl Rseq {
    /// An area of this process's own, in its static memory, to ask the
    /// kernel with whether any is registered.
    fn spare() -> Rseq {
        Rseq {
            area: std::ptr::addr_of!(SPARE_AREA) as usize,
            length: 32,
            signature: RSEQ_SIGNATURE,
        }
    }

    /// Registers it: `Ok` where it was already registered as it is, or
    /// now is; `Err` with the kernel's errno where another area is.
    fn register(&self) -> Result<(), i32> {
        match self.call(0) {
            Ok(()) | Err(libc::EBUSY) => Ok(()),
            Err(errno) => Err(errno),
        }
    }

    fn unregister(&self) {
        let _ = self.call(RSEQ_FLAG_UNREGISTER);
    }

    fn call(&self, flags: libc::c_int) -> Result<(), i32> {
        // SAFETY: rseq with an area of this thread's that outlives the
        // registration (the C library's, in the thread's TLS, or a static).
        super::state::returned(unsafe {
            libc::syscall(
                libc::SYS_rseq,
                self.area,
                self.length,
                flags,
                self.signature,
            )
        })
        .map(drop)
    }
}

/// This thread's thread pointer (where its TLS lies).
#[cfg(target_arch = "x86_64")]
fn thread_pointer() -> Option<usize> {
    const ARCH_GET_FS: libc::c_int = 0x1003;
    let mut base = 0usize;
    // SAFETY: arch_prctl writes the FS base into a local.
    let read = unsafe { libc::syscall(libc::SYS_arch_prctl, ARCH_GET_FS, &mut base) };
    (read == 0).then_some(base)
}

#[cfg(target_arch = "aarch64")]
fn thread_pointer() -> Option<usize> {
    let base: usize;
    // SAFETY: reads the thread ID register, as glibc's own `__thread` does.
    unsafe { std::arch::asm!("mrs {}, tpidr_el0", out(reg) base) };
    Some(base)
}

#[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
fn thread_pointer() -> Option<usize> {
    None
}
