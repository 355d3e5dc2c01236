//! Every function bound when the process starts, as `LD_BIND_NOW` asks.
//!
//! The issue this solves: the dynamic linker binds a library's function
//! the first time it is called (libpython, and libc's own calls into the
//! loader, are built for that), and to do it its trampoline saves every
//! vector register on the stack (`_dl_runtime_resolve_xsavec`). Those
//! registers hold what was last copied or searched through them: in the
//! zygote, a request's kwargs. The saved bytes stay in the stack, later
//! frames leave them in slots they never set, and every child forked from
//! there has them: a resident's later calls read an earlier call's
//! arguments (`tests/reset.rs`:
//! `no_call_finds_what_earlier_calls_of_its_child_were_sent_or_returned`,
//! one run in two on this machine). Bound at start, no function is bound
//! while a call's bytes are in the registers.
//!
//! The loader reads `LD_BIND_NOW` only as a program starts, so a process
//! started without it starts again with it (`execve` of itself: the same
//! pid, fds, ignored signals and mask), then takes it out of its
//! environment, which is the user's again for everything it runs.

use std::ffi::{CString, OsString};
use std::os::unix::ffi::OsStringExt;

const BIND_NOW: &str = "LD_BIND_NOW";
/// Set only by the start again: `LD_BIND_NOW` is ours to take out, or to
/// set back to the empty value it had (`empty`).
const ADDED: &str = "FLUKSIO_ADDED_LD_BIND_NOW";

/// Right after the command line is read, before any thread, in a process
/// that forks calls: starts it again with every function bound, unless it
/// was so started. Where it cannot (its file not found), it goes on as it
/// is. (A pool slot's worker, `fetch` and the warden fork no call: they
/// start once, as they did.)
pub fn ensure() {
    if let Some(added) = std::env::var_os(ADDED) {
        let ours = std::env::var_os(BIND_NOW).is_some_and(|value| value == "1");
        // SAFETY: the start of main: no thread yet, none reads the environment.
        unsafe {
            std::env::remove_var(ADDED);
            if ours {
                if added == "empty" {
                    std::env::set_var(BIND_NOW, "");
                } else {
                    std::env::remove_var(BIND_NOW);
                }
                return;
            }
        }
        // A marker from elsewhere, with no `LD_BIND_NOW` of ours: started
        // as any other time.
    }
    let had = std::env::var_os(BIND_NOW);
    if had.as_ref().is_some_and(|value| !value.is_empty()) {
        return;
    }
    let added = if had.is_some() { "empty" } else { "absent" };
    let Some(argv) = c_strings(std::env::args_os()) else {
        return;
    };
    let env = std::env::vars_os()
        .filter(|(key, _)| key != BIND_NOW)
        .map(|(key, value)| {
            let mut pair = key;
            pair.push("=");
            pair.push(value);
            pair
        })
        .chain([
            format!("{BIND_NOW}=1").into(),
            format!("{ADDED}={added}").into(),
        ]);
    let Some(envp) = c_strings(env) else {
        return;
    };
    let pointers = |strings: &[CString]| -> Vec<*const libc::c_char> {
        (strings.iter().map(|s| s.as_ptr()))
            .chain([std::ptr::null()])
            .collect()
    };
    let (argv_ptrs, envp_ptrs) = (pointers(&argv), pointers(&envp));
    // Its own file by its path, not `/proc/self/exe`: the kernel names the
    // process after the file it was given (`comm`, as `ps` shows it).
    let Some(path) = std::env::current_exe()
        .ok()
        .and_then(|path| CString::new(path.into_os_string().into_vec()).ok())
    else {
        return;
    };
    // SAFETY: NUL-terminated arrays of NUL-terminated strings, alive
    // across the call; it returns only where the exec failed.
    unsafe { libc::execve(path.as_ptr(), argv_ptrs.as_ptr(), envp_ptrs.as_ptr()) };
}

fn c_strings(strings: impl Iterator<Item = OsString>) -> Option<Vec<CString>> {
    strings.map(|s| CString::new(s.into_vec()).ok()).collect()
}
