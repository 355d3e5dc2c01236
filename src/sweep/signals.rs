//! Ctrl-C (SIGINT) and SIGTERM for `run` and `sweep`, whatever the node did
//! with signals.
//!
//! The zygote is this process, and a node's module-level code runs in it:
//! `import signal` (which `subprocess` does) installs CPython's SIGINT
//! handler, which only sets a flag for Python code to see, and the zygote
//! runs no Python between calls, so Ctrl-C was lost. So our own handler is
//! installed at start and again once the node has loaded (its code may have
//! replaced ours), and every forked child gets back the handlers the node
//! would have had without us (a `pthread_atfork` child handler), so node
//! code sees what it would under `python node.py`.
//!
//! The first signal asks the loop to stop (it polls with a timeout, and
//! the signal interrupts the poll); a second one exits at once, 128 + the
//! signal, leaving the calls' cells to the parent-death signal and warden.

use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

const SIGNALS: [libc::c_int; 2] = [libc::SIGINT, libc::SIGTERM];

/// The signal that asked us to stop; 0 while none has.
static RECEIVED: AtomicI32 = AtomicI32::new(0);
/// Whether children must get the node's handlers back.
static ARMED: AtomicBool = AtomicBool::new(false);

/// What each of [`SIGNALS`] was before ours: what the node installed, or
/// the default. Written only while one thread runs and before any fork
/// reads it.
static mut THEIRS: [Option<libc::sigaction>; 2] = [None, None];

extern "C" fn on_signal(signal: libc::c_int) {
    if RECEIVED.swap(signal, Ordering::SeqCst) != 0 {
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + signal) };
    }
}

extern "C" fn in_child() {
    if !ARMED.load(Ordering::SeqCst) {
        return;
    }
    // SAFETY: sigaction is async-signal-safe; THEIRS is not written after
    // arming, and this runs in the single-threaded child of a fork.
    unsafe {
        let theirs = &*std::ptr::addr_of!(THEIRS);
        for (signal, action) in SIGNALS.iter().zip(theirs) {
            if let Some(action) = action {
                libc::sigaction(*signal, action, std::ptr::null_mut());
            }
        }
    }
}

fn ours() -> libc::sigaction {
    // SAFETY: a zeroed sigaction is valid; the fields set are plain data.
    let mut action: libc::sigaction = unsafe { std::mem::zeroed() };
    action.sa_sigaction = on_signal as *const () as libc::sighandler_t;
    // No SA_RESTART: the signal interrupts the loop's poll.
    action.sa_flags = 0;
    action
}

fn is_ours(action: &libc::sigaction) -> bool {
    action.sa_sigaction == on_signal as *const () as libc::sighandler_t
}

/// Installs our handlers. Call first, while this process has one thread;
/// the first call also registers the fork handler.
pub fn install() {
    static REGISTERED: std::sync::Once = std::sync::Once::new();
    REGISTERED.call_once(|| {
        // SAFETY: registering a plain function as a fork child handler.
        unsafe { libc::pthread_atfork(None, None, Some(in_child)) };
    });
    // SAFETY: only this (the zygote's one) thread touches THEIRS; sigaction
    // with valid pointers.
    unsafe {
        let theirs = &mut *std::ptr::addr_of_mut!(THEIRS);
        for (signal, slot) in SIGNALS.iter().zip(theirs.iter_mut()) {
            let mut previous: libc::sigaction = std::mem::zeroed();
            libc::sigaction(*signal, &ours(), &mut previous);
            // The node's own, unless it left ours in place.
            if !is_ours(&previous) {
                *slot = Some(previous);
            }
        }
    }
    ARMED.store(true, Ordering::SeqCst);
}

/// Once the node has loaded into the zygote: ours again, over whatever its
/// module-level code installed (which its children get back).
pub fn reinstall() {
    install();
}

/// The signal that asked us to stop, if one has.
pub fn received() -> Option<i32> {
    match RECEIVED.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(signal),
    }
}

/// The exit code for a stop by `signal`: 128 + its number, as a shell says.
pub fn exit_code(signal: i32) -> u8 {
    (128 + signal).clamp(0, 255) as u8
}
