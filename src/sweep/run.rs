//! `fluksio-zygote run NODE.py -k x=1`: one call, as `python node.py` would
//! run it, with the zygote's containment.
//!
//! - stdout: the node's events as JSON lines as they come
//!   (`{"event": "yield", "outputs": {…}}`), then the result, alone on the
//!   last line (`| tail -n 1` for it alone; `| jq` reads every line);
//! - stderr: what the node prints, live; on a failure, its traceback.
//!
//! Exit codes as `sweep`'s (see the module above): 0, 1 when the call
//! failed, 2 when it could not start, 130/143 when stopped, 141 when the
//! reader of stdout went away.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

use super::calls::Calls;
use super::report::{self, Reply};
use super::{OUTPUT_CLOSED, check_calls, fail, kwargs, load, read_node, say, signals, take_stdout};
use crate::zygote::{self, ZygoteOptions};

/// How `run` is run.
#[derive(Debug, Clone)]
pub struct RunOptions {
    pub zygote: ZygoteOptions,
    pub node: PathBuf,
    /// The call's keyword arguments as a JSON object.
    pub kwargs: Option<String>,
    /// And as `NAME=VALUE` each.
    pub pairs: Vec<String>,
    /// The call is ended if still running after this long (`NodeTimeout`).
    pub timeout: Option<std::time::Duration>,
    /// The node called once in its zygote before the call is forked.
    pub warmup: Option<super::Warmup>,
}

pub fn run(options: &RunOptions) -> ExitCode {
    let (node, dir) = match read_node(&options.node, "run") {
        Ok(read) => read,
        Err(message) => return fail("run", &message, 2),
    };
    let call = match kwargs::fixed(options.kwargs.as_deref(), &options.pairs) {
        Ok(call) => call,
        Err(message) => return fail("run", &message, 2),
    };
    // Its stdin stays: one call may read the terminal (pdb, input()).
    let mut stdout = match take_stdout(false) {
        Ok(stdout) => std::io::BufWriter::new(stdout),
        Err(e) => return fail("run", &format!("cannot set up its output: {e}"), 2),
    };
    signals::install();
    zygote::node::name_bad_values();
    zygote::channel::accept_numpy();
    zygote::node::set_script(&options.node);
    fluksio_embed::capture::tee_to_stderr();
    zygote::run(
        &options.zygote,
        zygote::print_startup_error,
        |py, zygote| {
            let warmup = options.warmup.as_ref().map(|warmup| match warmup {
                super::Warmup::Kwargs(kwargs) => kwargs.clone(),
                super::Warmup::FirstPoint => call.clone(),
            });
            if let Err(message) = load(py, zygote, &node, &dir, false, warmup.as_ref()) {
                return fail("run", &message, 2);
            }
            let calls_list = [call.clone()];
            let describe = |_: usize| "-k and --kwargs".to_string();
            if let Err(message) = check_calls(py, zygote, &node, &calls_list, &describe) {
                return fail("run", &message, 2);
            }
            signals::reinstall();
            let mut calls = Calls::new(zygote, &node);
            calls.set_timeout(options.timeout);
            if let Err(message) = calls.start(py, 0, &call) {
                return fail("run", &message, 1);
            }
            let mut shown = 0;
            let code = loop {
                if let Some(signal) = signals::received() {
                    calls.kill_all();
                    let _ = stdout.flush();
                    break fail(
                        "run",
                        &format!(
                            "stopped by {}: the call was ended",
                            nix::sys::signal::Signal::try_from(signal)
                                .map(|s| s.as_str())
                                .unwrap_or("a signal")
                        ),
                        signals::exit_code(signal),
                    );
                }
                let finished = match calls.step() {
                    Ok(finished) => finished,
                    Err(message) => {
                        calls.kill_all();
                        break fail("run", &message, 1);
                    }
                };
                let events: &[Vec<u8>] = match &finished.first() {
                    Some(done) => &done.answer.events,
                    None => calls.events().next().map_or(&[], |(_, events)| events),
                };
                let mut lines = String::new();
                for event in &events[shown.min(events.len())..] {
                    lines.push_str(&report::event_json(event));
                    lines.push('\n');
                }
                shown = events.len();
                if let Err(error) = stdout
                    .write_all(lines.as_bytes())
                    .and_then(|()| stdout.flush())
                {
                    calls.kill_all();
                    break closed_or_failed(error);
                }
                let Some(done) = finished.into_iter().next() else {
                    continue;
                };
                break finish(&done.answer.reply, &mut stdout);
            };
            drop(calls);
            zygote.shutdown();
            code
        },
    )
}

/// The result on stdout (exit 0), or the failure on stderr (exit 1).
fn finish(reply: &[u8], stdout: &mut impl Write) -> ExitCode {
    let Ok(reply) = serde_json::from_slice::<Reply<'_>>(reply) else {
        return fail(
            "run",
            &format!(
                "unreadable reply: {}",
                String::from_utf8_lossy(reply).trim()
            ),
            1,
        );
    };
    if reply.ok {
        let result = reply.result.map_or("null", |r| r.get());
        return match writeln!(stdout, "{result}").and_then(|()| stdout.flush()) {
            Ok(()) => ExitCode::SUCCESS,
            Err(error) => closed_or_failed(error),
        };
    }
    let error = reply.error_body();
    if !error.traceback.is_empty() {
        let _ = write!(std::io::stderr(), "{}", error.traceback);
        return ExitCode::FAILURE;
    }
    // A process that ended without a reply has `short` = `message`: its
    // type goes in front here.
    let short = if error.short.is_empty() || error.short == error.message {
        format!("{}: {}", error.kind, error.message)
    } else {
        error.short
    };
    fail("run", &format!("the call failed: {short}"), 1)
}

fn closed_or_failed(error: std::io::Error) -> ExitCode {
    if error.kind() == std::io::ErrorKind::BrokenPipe {
        return ExitCode::from(OUTPUT_CLOSED);
    }
    say(&format!(
        "fluksio-zygote run: cannot write the result: {error}"
    ));
    ExitCode::FAILURE
}
