//! Node code behaves as it does under `python3`: signal dispositions,
//! buffered output at the end of a call, `atexit`, `sys.argv`, and
//! multiprocessing with the node's own functions (PROTOCOL-NOTES, "Node
//! code and python3").

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Worker, compile, run, scratch};
use nix::sys::signal::{self as sigaction, SigHandler, Signal};
use serde_json::{Value, json};

/// A node that reports its signal table (Python's) and its kernel
/// dispositions (`/proc/self/status`, signals 1 to 31: above are real-time
/// signals, one of which the runtime keeps as its parent-death signal).
const TABLE: &str = r#"
import signal

def process():
    table = {s: repr(signal.getsignal(s)) for s in range(1, signal.NSIG) if s not in (32, 33)}
    status = dict(line.split(":\t") for line in open("/proc/self/status").read().splitlines() if line.startswith("Sig"))
    low = lambda key: int(status[key], 16) & 0xFFFFFFFF
    return {"table": table, "blocked": low("SigBlk"), "ignored": low("SigIgn"), "caught": low("SigCgt")}
"#;

/// `command` started with every signal at its default but `ignored`, which
/// it inherits ignored (as under `nohup`, or a shell's background job):
/// whatever this test process was started with does not leak in.
fn started_with(mut command: Command, ignored: &'static [Signal]) -> Command {
    use std::os::unix::process::CommandExt;
    // SAFETY: only sigaction between fork and exec (async-signal-safe).
    unsafe {
        command.pre_exec(move || {
            for signal in Signal::iterator() {
                if !matches!(signal, Signal::SIGKILL | Signal::SIGSTOP) {
                    let _ = sigaction::signal(signal, SigHandler::SigDfl);
                }
            }
            for &signal in ignored {
                let _ = sigaction::signal(signal, SigHandler::SigIgn);
            }
            Ok(())
        });
    }
    command
}

fn python3_table(ignored: &'static [Signal]) -> Value {
    let script = format!("{TABLE}\nimport json\nprint(json.dumps(process()))\n");
    let mut command = Command::new(common::python());
    command.args(["-c", &script]);
    let output = started_with(command, ignored)
        .output()
        .expect("python3 runs");
    serde_json::from_slice(&output.stdout).expect("the table as JSON")
}

fn result(worker: &mut Worker, id: i64, node: &str, source: &str) -> Value {
    let answer = worker.call(&run(id, node, source, json!({})));
    answer.reply
}

fn ok(reply: &Value) -> &Value {
    assert_eq!(reply["ok"], true, "the call failed: {reply}");
    &reply["result"]
}

/// A node whose module level imports `signal` and installs handlers,
/// compiled (loaded into the zygote) before the calls under test.
const INSTALLS_HANDLERS: &str = r#"
import signal, subprocess, asyncio
signal.signal(signal.SIGTERM, lambda *a: None)
signal.signal(signal.SIGUSR1, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})

def process():
    return "loaded"
"#;

fn started_worker(args: &[&str], ignored: &'static [Signal]) -> Worker {
    let mut command = Command::new(common::ZYGOTE);
    command.arg("worker").args(args);
    Worker::spawn(started_with(command, ignored))
}

#[test]
fn a_call_starts_with_the_signal_dispositions_of_a_fresh_python3() {
    let expected = python3_table(&[]);
    let mut worker = started_worker(&[], &[]);
    assert_eq!(ok(&result(&mut worker, 1, "table", TABLE)), &expected);
    // Another node's module-level handlers change nothing for this one.
    let loaded = worker
        .call(&compile(2, "installs", INSTALLS_HANDLERS))
        .reply;
    assert_eq!(loaded["ok"], true, "{loaded}");
    assert_eq!(ok(&result(&mut worker, 3, "table2", TABLE)), &expected);
    // Preloads are loads too.
    let mut preloaded = started_worker(&["--preload", "signal,subprocess,asyncio,numpy"], &[]);
    assert_eq!(ok(&result(&mut preloaded, 1, "table", TABLE)), &expected);
}

/// Started under `nohup` (SIGHUP ignored) or as a shell's background job
/// (SIGINT and SIGQUIT ignored), `python3` keeps those ignored: so does a
/// call, in a fresh child and in a resident.
#[test]
fn a_signal_the_worker_was_started_with_ignored_stays_ignored_in_a_call() {
    for ignored in [
        &[Signal::SIGHUP][..],
        &[Signal::SIGINT, Signal::SIGQUIT][..],
    ] {
        let expected = python3_table(ignored);
        for isolation in ["call", "node"] {
            let mut worker = started_worker(&["--isolation", isolation], ignored);
            assert_eq!(
                ok(&result(&mut worker, 1, "table", TABLE)),
                &expected,
                "{ignored:?}, --isolation {isolation}"
            );
        }
    }
}

const SIGINT_SELF: &str = r#"
import os, time

def process():
    try:
        os.kill(os.getpid(), 2)
        time.sleep(5)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "nothing"
"#;

const INTERRUPT_MAIN: &str = r#"
import _thread, time

def process():
    try:
        _thread.interrupt_main()
        time.sleep(5)
    except KeyboardInterrupt:
        return "KeyboardInterrupt"
    return "nothing"
"#;

#[test]
fn sigint_in_a_call_is_keyboard_interrupt_whatever_was_imported_before() {
    let mut worker = Worker::zygote(&[]);
    for round in 0..2 {
        let id = round * 10;
        assert_eq!(
            ok(&result(&mut worker, id + 1, "kill", SIGINT_SELF)),
            "KeyboardInterrupt"
        );
        assert_eq!(
            ok(&result(&mut worker, id + 2, "interrupt", INTERRUPT_MAIN)),
            "KeyboardInterrupt"
        );
        // An uncaught one is the call's error, as python3 would raise it.
        let uncaught = result(
            &mut worker,
            id + 3,
            "uncaught",
            "import os\ndef process():\n    os.kill(os.getpid(), 2)\n",
        );
        assert_eq!(uncaught["error"]["type"], "KeyboardInterrupt", "{uncaught}");
        let loaded = worker
            .call(&compile(id + 4, "installs", INSTALLS_HANDLERS))
            .reply;
        assert_eq!(loaded["ok"], true, "{loaded}");
    }
}

#[test]
fn a_nodes_own_module_level_handlers_are_its_calls_and_no_one_elses() {
    let own = r#"
import os, signal, time
got = []
signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
signal.signal(signal.SIGUSR1, signal.SIG_IGN)

def process():
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGUSR1)
    time.sleep(0.05)
    return {"got": got, "usr1": repr(signal.getsignal(signal.SIGUSR1))}
"#;
    let mut worker = Worker::zygote(&[]);
    for id in 1..=2 {
        let got = ok(&result(&mut worker, id, "own", own)).clone();
        assert_eq!(got, json!({"got": [15], "usr1": "<Handlers.SIG_IGN: 1>"}));
    }
    let other = result(
        &mut worker,
        3,
        "other",
        "import os, signal\ndef process():\n    os.kill(os.getpid(), signal.SIGTERM)\n    import time; time.sleep(5)\n",
    );
    assert!(
        other["error"]["message"]
            .as_str()
            .is_some_and(|m| m.contains("killed by SIGTERM")),
        "{other}"
    );
}

#[test]
fn a_write_past_rlimit_fsize_is_an_oserror_not_sigxfsz() {
    let dir = scratch("fsize");
    let source = format!(
        "import resource\ndef process():\n    resource.setrlimit(resource.RLIMIT_FSIZE, (1000, resource.RLIM_INFINITY))\n    try:\n        with open({:?}, 'wb') as f:\n            f.write(b'x' * 5000)\n    except OSError as e:\n        return e.errno\n",
        dir.join("big").to_string_lossy()
    );
    let mut worker = Worker::zygote(&[]);
    assert_eq!(ok(&result(&mut worker, 1, "fsize", &source)), 27);
}

fn wait_for_exit(worker: &mut Worker, limit: Duration) -> Option<std::process::ExitStatus> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok(Some(status)) = worker.child.try_wait() {
            return Some(status);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

#[test]
fn sigint_and_sigterm_end_the_worker_whatever_a_compiled_node_imported() {
    use std::os::unix::process::ExitStatusExt;
    for (signal, number) in [
        (nix::sys::signal::Signal::SIGINT, 2),
        (nix::sys::signal::Signal::SIGTERM, 15),
    ] {
        let mut worker = Worker::zygote(&[]);
        let loaded = worker
            .call(&compile(1, "installs", INSTALLS_HANDLERS))
            .reply;
        assert_eq!(loaded["ok"], true, "{loaded}");
        // A call after the load, so the zygote has run Python since.
        ok(&result(&mut worker, 2, "installs", INSTALLS_HANDLERS));
        nix::sys::signal::kill(nix::unistd::Pid::from_raw(worker.pid()), signal)
            .expect("signalled");
        let status = wait_for_exit(&mut worker, Duration::from_secs(20))
            .unwrap_or_else(|| panic!("the worker outlived {signal:?}"));
        assert_eq!(status.signal(), Some(number), "{status:?}");
    }
}

#[test]
fn buffered_output_is_written_by_every_ending_of_a_call_and_once() {
    let dir = scratch("buffers");
    let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
    let source = format!(
        r#"
import logging, sys
opened_at_load = open({module:?}, "w")
opened_at_load.write("loaded;")
logging.basicConfig(filename={log:?}, level=logging.INFO, format="%(message)s")

def process(how, n):
    opened_at_load.write(f"call{{n}};")
    here = open({here:?} + str(n), "w")
    here.write("written")
    logging.info("logged %s", n)
    sys.__stdout__.write(f"stdout {{n}}\n")
    if how == "raise":
        raise ValueError("failed")
    if how == "exit":
        sys.exit(3)
    if how == "generator":
        return (x for x in [{{"n": n}}])
    return n
"#,
        module = path("module.txt"),
        log = path("log.txt"),
        here = path("here"),
    );
    // A generator node is a generator function: its own source.
    let generator = source.replace("return (x for x in [{\"n\": n}])", "yield {\"n\": n}");
    assert_ne!(generator, source);
    let mut worker = Worker::zygote(&[]);
    let hows = ["return", "raise", "exit", "generator"];
    for (n, how) in hows.iter().enumerate() {
        let node = if *how == "generator" {
            &generator
        } else {
            &source
        };
        let reply = worker
            .call(&run(
                n as i64,
                if *how == "generator" { "gen" } else { "buf" },
                node,
                json!({"how": how, "n": n}),
            ))
            .reply;
        match *how {
            "return" | "generator" => assert_eq!(reply["ok"], true, "{reply}"),
            "raise" => assert_eq!(reply["error"]["type"], "ValueError", "{reply}"),
            _ => assert!(
                reply["error"]["message"]
                    .as_str()
                    .is_some_and(|m| m.contains("exited with code 3")),
                "{reply}"
            ),
        }
        assert_eq!(
            std::fs::read_to_string(path("here") + &n.to_string()).unwrap_or_default(),
            "written",
            "{how}"
        );
    }
    let (_, stderr) = worker.finish();
    let module = std::fs::read_to_string(path("module.txt")).expect("the module's file");
    // The generator node's own module wrote its own "loaded;" (it truncated
    // the file, as python3 running it would).
    assert!(module.starts_with("loaded;"), "{module}");
    assert_eq!(module.matches("loaded;").count(), 1, "{module}");
    assert!(module.contains("call3;"), "{module}");
    let log = std::fs::read_to_string(path("log.txt")).expect("the log file");
    for n in 0..hows.len() {
        assert!(log.contains(&format!("logged {n}")), "{log}");
        assert!(stderr.contains(&format!("stdout {n}")), "{stderr}");
        assert_eq!(
            stderr.matches(&format!("stdout {n}")).count(),
            1,
            "{stderr}"
        );
    }
}

#[test]
fn atexit_handlers_do_not_run_however_a_call_ends() {
    let dir = scratch("atexit");
    let marker = dir.join("ran").to_string_lossy().into_owned();
    let source = format!(
        r#"
import atexit, sys
def mark(what):
    with open({marker:?}, "a") as f:
        f.write(what + ";")
atexit.register(mark, "module")

def process(how):
    atexit.register(mark, "call")
    if how == "raise":
        raise ValueError("failed")
    if how == "exit":
        sys.exit(0)
    return how
"#
    );
    let mut worker = Worker::zygote(&[]);
    for (id, how) in ["return", "raise", "exit"].iter().enumerate() {
        worker.call(&run(id as i64, "atexit", &source, json!({"how": how})));
    }
    worker.finish();
    assert!(!dir.join("ran").exists(), "an atexit handler ran");
}

#[test]
fn a_flush_that_blocks_does_not_hold_the_call() {
    // A pipe nobody reads, full, behind a buffered writer with more to go.
    let source = r#"
import os
r, w = os.pipe()
os.set_blocking(w, False)
try:
    while True:
        os.write(w, b"x" * 65536)
except BlockingIOError:
    pass
os.set_blocking(w, True)
stuck = open(w, "wb")

def process():
    stuck.write(b"y" * 100)
    return "returned"
"#;
    let mut worker = Worker::zygote(&[]);
    let start = Instant::now();
    assert_eq!(ok(&result(&mut worker, 1, "stuck", source)), "returned");
    eprintln!("a call whose flush blocked took {:?}", start.elapsed());
    assert_eq!(
        ok(&result(
            &mut worker,
            2,
            "next",
            "def process():\n    return 2\n"
        )),
        2
    );
}

#[test]
fn sys_argv_is_the_node_as_python3_would_have_it() {
    let source = "import sys\nargv_at_load = list(sys.argv)\ndef process():\n    return [argv_at_load, sys.argv, sys.orig_argv, sys.executable]\n";
    let mut worker = Worker::zygote(&[]);
    let got = ok(&result(&mut worker, 1, "argv", source)).clone();
    let executable = got[3].clone();
    assert_eq!(got[0], json!(["<node t.argv>"]));
    assert_eq!(got[1], json!(["<node t.argv>"]));
    assert_eq!(got[2], json!([executable, "<node t.argv>"]));
    // Under `run`, the node's file as given, as `python3 FILE`.
    let dir = scratch("argv");
    let file = dir.join("show_argv.py");
    std::fs::write(&file, source).expect("the node's file");
    let output = Command::new(common::ZYGOTE)
        .arg("run")
        .arg(&file)
        .output()
        .expect("run runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let last: Value = serde_json::from_str(stdout.lines().last().expect("a result")).expect("JSON");
    let given = file.to_string_lossy();
    assert_eq!(last[1], json!([given]), "{stdout}");
    assert_eq!(last[2], json!([executable, given]), "{stdout}");
}

#[test]
fn multiprocessing_runs_the_nodes_own_functions_with_every_start_method() {
    let pool = r#"
import multiprocessing as mp

def square(x):
    return x * x

def process(method):
    with mp.get_context(method).Pool(2) as pool:
        return pool.map(square, [1, 2, 3])
"#;
    let executor = r#"
import concurrent.futures as cf, multiprocessing as mp

def cube(x):
    return x ** 3

def process(method):
    with cf.ProcessPoolExecutor(2, mp_context=mp.get_context(method)) as executor:
        return list(executor.map(cube, [2, 3]))
"#;
    let process = r#"
import multiprocessing as mp
import fluksio

@fluksio.node(name="put")

def put(queue, x):
    queue.put(x + 1)

def process(method):
    context = mp.get_context(method)
    queue = context.Queue()
    child = context.Process(target=put, args=(queue, 41))
    child.start()
    got = queue.get(timeout=30)
    child.join()
    return [got, child.exitcode]
"#;
    let mut worker = Worker::zygote(&["--preload", "multiprocessing"]);
    let mut id = 0;
    for method in ["fork", "spawn", "forkserver"] {
        for (node, source, expected) in [
            ("pool", pool, json!([1, 4, 9])),
            ("executor", executor, json!([8, 27])),
            ("process", process, json!([42, 0])),
        ] {
            id += 1;
            let reply = worker
                .call(&run(id, node, source, json!({"method": method})))
                .reply;
            assert_eq!(ok(&reply), &expected, "{node} with {method}");
        }
    }
    // A node loaded in each call's child (it starts a thread at load) too.
    let threaded = format!(
        "import threading\nthreading.Thread(target=lambda: __import__('time').sleep(3600), daemon=True).start()\n{pool}"
    );
    let reply = worker
        .call(&run(100, "threaded", &threaded, json!({"method": "spawn"})))
        .reply;
    assert_eq!(ok(&reply), &json!([1, 4, 9]));
}

#[test]
fn the_node_module_directory_goes_with_the_worker() {
    let mut worker = Worker::zygote(&[]);
    let source = "import sys\ndef process():\n    return sys.path[-1]\n";
    let dir = ok(&result(&mut worker, 1, "where", source))
        .as_str()
        .expect("a path")
        .to_string();
    assert!(std::path::Path::new(&dir).is_dir(), "{dir}");
    let module = std::fs::read_dir(&dir).expect("listable").count();
    assert!(module >= 1, "no module written in {dir}");
    worker.finish();
    assert!(!std::path::Path::new(&dir).exists(), "{dir} is left behind");
}

#[test]
fn a_call_holds_no_pidfd_of_another_call() {
    let dir = scratch("pidfds");
    let file = dir.join("fds.py");
    std::fs::write(
        &file,
        "import os, time\ndef process(i):\n    time.sleep(0.2)\n    links = []\n    for fd in os.listdir('/proc/self/fd'):\n        try:\n            links.append(os.readlink(f'/proc/self/fd/{fd}'))\n        except OSError:\n            pass\n    return sum('pidfd' in link for link in links)\n",
    )
    .expect("the node's file");
    let output = Command::new(common::ZYGOTE)
        .arg("sweep")
        .arg(&file)
        .args(["--grid", "i=0..5", "-j", "3"])
        .output()
        .expect("sweep runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    for line in stdout.lines() {
        let line: Value = serde_json::from_str(line).expect("a JSON line");
        assert_eq!(line["result"], 0, "a call holds pidfds: {line}");
    }
    assert_eq!(stdout.lines().count(), 6, "{stdout}");
}

/// `--isolation node`: a resident child keeps its files open between calls
/// and writes them out when idle, and everything when it is retired (the
/// worker's stdin closing right behind the last reply, say).
#[test]
fn a_resident_writes_out_its_files_between_calls_and_when_retired() {
    let dir = scratch("resident-buffers");
    let file = dir.join("calls.txt").to_string_lossy().into_owned();
    let source = format!(
        "F = open({file:?}, 'a')\ndef process(i):\n    F.write('call %d;' % i)\n    return i\n"
    );
    let written = || std::fs::read_to_string(&file).unwrap_or_default();
    let mut worker = Worker::zygote(&["--isolation", "node"]);
    assert_eq!(
        worker.call(&run(0, "n", &source, json!({"i": 0}))).reply["result"],
        0
    );
    // Idle after its reply, it flushes (within a few ms).
    let start = Instant::now();
    while !written().contains("call 0;") && start.elapsed() < Duration::from_secs(5) {
        std::thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(written(), "call 0;", "written out while the resident waits");
    for i in 1..50 {
        worker.call(&run(i, "n", &source, json!({"i": i})));
    }
    let (code, _) = worker.finish();
    assert_eq!(code, Some(0));
    let all: String = (0..50).map(|i| format!("call {i};")).collect();
    assert_eq!(
        written(),
        all,
        "every call's line, once, when it was retired"
    );
}
