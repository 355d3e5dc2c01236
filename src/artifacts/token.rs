//! The worker's token for the artifact store, kept out of node code's reach.
//!
//! The engine's pool and agent.py hand it over as `FLUKSIO_ARTIFACT_TOKEN`
//! in the environment, where any node could read it. The zygote takes it
//! out before the interpreter starts: the variable is removed, and its value
//! is overwritten where the kernel keeps the process's original environment
//! (`/proc/self/environ` reads that copy, not `os.environ`). From then on it
//! lives only in this module, which sends it as a header and never puts it
//! in a message.

use std::ffi::CStr;
use std::sync::OnceLock;

pub const TOKEN_ENV: &str = "FLUKSIO_ARTIFACT_TOKEN";

static TOKEN: OnceLock<Option<String>> = OnceLock::new();

/// Takes the token out of the environment. Call once, first thing, while
/// the process has one thread.
pub fn take_token() {
    let token = std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty());
    scrub_original_environment();
    // SAFETY: called at start-up, before any other thread exists.
    unsafe { std::env::remove_var(TOKEN_ENV) };
    let _ = TOKEN.set(token);
}

/// Uses `token` for the artifact store (the agent's own worker token).
pub fn use_token(token: &str) {
    let _ = TOKEN.set(Some(token.to_string()).filter(|t| !t.is_empty()));
}

/// The token, if this process was given one.
pub fn token() -> Option<&'static str> {
    TOKEN.get().and_then(|t| t.as_deref())
}

/// Puts the token back for a process this one starts as itself (a zygote
/// restarting, a zygote the agent launches): it takes it out again.
pub fn reinstate_token_for(command: &mut std::process::Command) {
    if let Some(token) = token() {
        command.env(TOKEN_ENV, token);
    }
}

/// Overwrites the value in the environment block the process started with.
fn scrub_original_environment() {
    unsafe extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    let prefix = format!("{TOKEN_ENV}=");
    // SAFETY: single-threaded start-up; `environ` is a NULL-terminated array
    // of NUL-terminated strings, which this only overwrites in place, within
    // their own length.
    unsafe {
        let mut entry = environ;
        while !entry.is_null() && !(*entry).is_null() {
            let text = CStr::from_ptr(*entry).to_bytes();
            if text.starts_with(prefix.as_bytes()) {
                let value = (*entry).add(prefix.len());
                std::ptr::write_bytes(value, b'x', text.len() - prefix.len());
            }
            entry = entry.add(1);
        }
    }
}
