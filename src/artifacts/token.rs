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

/// Takes the token out of the environment, and every other credential
/// with it (see [`is_credential`]). Call once, first thing, while the
/// process has one thread.
pub fn take_token() {
    let token = std::env::var(TOKEN_ENV).ok().filter(|t| !t.is_empty());
    hide_variable(TOKEN_ENV);
    let _ = TOKEN.set(token);
    hide_credentials();
}

/// Environment node code is never given: the engine's own lists. `SECRET_KEY`
/// decrypts every stored secret; a `*_TOKEN` is somebody's credential.
const DENY_PREFIXES: [&str; 3] = ["DATABASE_URL", "FIRST_SUPERUSER", "SENTRY_DSN"];
const DENY_WORDS: [&str; 3] = ["PASSWORD", "SECRET", "TOKEN"];

/// Whether `key` names a credential: it starts with `DATABASE_URL`,
/// `FIRST_SUPERUSER` or `SENTRY_DSN`, or holds `PASSWORD`, `SECRET` or
/// `TOKEN` in any case. agent.py's list, applied in every mode.
pub fn is_credential(key: &str) -> bool {
    let upper = key.to_uppercase();
    DENY_PREFIXES.iter().any(|p| key.starts_with(p)) || DENY_WORDS.iter().any(|w| upper.contains(w))
}

/// Takes every credential out of this process's environment and overwrites
/// its value in `/proc/self/environ`: the engine's pool starts its workers
/// with the engine's own environment (`DATABASE_URL`, `SECRET_KEY`, …),
/// which a node must not read, in `worker` mode as under the agent. Call
/// while the process has one thread.
pub fn hide_credentials() {
    let keys: Vec<String> = std::env::vars_os()
        .filter_map(|(key, _)| key.into_string().ok())
        .filter(|key| is_credential(key))
        .collect();
    for key in keys {
        hide_variable(&key);
    }
}

/// Removes `name` from the environment and overwrites its value where
/// `/proc/self/environ` reads it. Call while the process has one thread.
pub fn hide_variable(name: &str) {
    scrub_original_environment(name);
    // SAFETY: the caller runs this single-threaded, at start-up.
    unsafe { std::env::remove_var(name) };
}

/// Uses `token` for the artifact store (the agent's own worker token).
pub fn use_token(token: &str) {
    let _ = TOKEN.set(Some(token.to_string()).filter(|t| !t.is_empty()));
}

/// Overwrites the value of `--flag VALUE` or `--flag=VALUE` where
/// `/proc/self/cmdline` (and `ps`) read this process's arguments. The
/// arguments were parsed already; only what other processes see changes.
pub fn hide_argument(flag: &str) {
    let Some((argc, argv)) = ARGUMENTS.get().copied() else {
        return;
    };
    let with_value = format!("{flag}=");
    // SAFETY: argv holds argc NUL-terminated strings the kernel put on the
    // stack at exec; they are overwritten in place, within their length.
    unsafe {
        let argv = argv as *const *mut libc::c_char;
        let mut hide_next = false;
        for index in 0..argc as usize {
            let arg = *argv.add(index);
            if arg.is_null() {
                break;
            }
            let text = CStr::from_ptr(arg).to_bytes();
            let length = text.len();
            if hide_next {
                std::ptr::write_bytes(arg, b'x', length);
                hide_next = false;
            } else if text == flag.as_bytes() {
                hide_next = true;
            } else if text.starts_with(with_value.as_bytes()) {
                std::ptr::write_bytes(arg.add(with_value.len()), b'x', length - with_value.len());
            }
        }
    }
}

/// argc and argv as the C runtime passed them, kept for `hide_argument`.
static ARGUMENTS: OnceLock<(i32, usize)> = OnceLock::new();

/// Run by the C runtime before `main`, with the program's own arguments
/// (glibc passes argc, argv and envp to `.init_array` functions).
extern "C" fn remember_arguments(
    argc: i32,
    argv: *const *const libc::c_char,
    _envp: *const *const libc::c_char,
) {
    let _ = ARGUMENTS.set((argc, argv as usize));
}

#[used]
#[unsafe(link_section = ".init_array")]
static REMEMBER_ARGUMENTS: extern "C" fn(
    i32,
    *const *const libc::c_char,
    *const *const libc::c_char,
) = remember_arguments;

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
fn scrub_original_environment(name: &str) {
    unsafe extern "C" {
        static mut environ: *mut *mut libc::c_char;
    }
    let prefix = format!("{name}=");
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
