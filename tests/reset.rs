//! `--isolation reset`: one child per node, put back after every call to
//! the memory it had before its first. The next call cannot tell it from a
//! fresh fork: no module state, no cache, no kwargs or result of a call
//! before it anywhere in its memory, nothing the call started still
//! running. What memory cannot hold is set back where the child can (a
//! signal handler, the working directory, a limit...); what it cannot (an
//! fd left open, a thread...) retires the child, and a fresh fork serves
//! on.

mod common;

use common::{MEMORY_SCAN, Worker, masked, run};
use serde_json::{Value, json};

/// A worker whose calls are all served by residents: these tests are of
/// what happens to one that cannot be put back, many in a row, where a
/// node would otherwise fall back to fresh forks (tested by itself in
/// `a_node_whose_residents_cannot_be_put_back_gets_fresh_forks_instead`).
fn reset_worker() -> Worker {
    reset_worker_with(&[])
}

fn reset_worker_with(env: &[(&str, &str)]) -> Worker {
    let mut env = env.to_vec();
    env.push(("FLUKSIO_RESET_FALLBACK_AFTER", "0"));
    Worker::zygote_with(&["--isolation", "reset"], &env)
}

/// The pid that served a call, and what it returned, from a node that
/// returns `[os.getpid(), result]`.
fn served(reply: &Value) -> (i64, Value) {
    assert_eq!(reply["ok"], true, "{reply}");
    (
        reply["result"][0].as_i64().expect("a pid"),
        reply["result"][1].clone(),
    )
}

/// The calls were served by a node's residents, each put back and reused:
/// two at most (the second serves while the first is put back), a call
/// after the other. A caller whose first call imports what the zygote then
/// learns leaves that call out: its resident is replaced by one forked
/// with the import (`tests/warm_calls.rs`).
fn served_by_residents(pids: &[i64]) {
    let mut children = pids.to_vec();
    children.sort_unstable();
    children.dedup();
    assert!(
        children.len() <= 2 && pids.len() > children.len(),
        "a node's residents served them, in turn: {pids:?}"
    );
}

/// Some child served more than one of the calls: residents were reused
/// (through a link, whose calls may be spread over more than two).
fn a_resident_served_more_than_one(pids: &[i64]) {
    assert!(
        (1..pids.len()).any(|i| pids[..i].contains(&pids[i])),
        "a resident served more than one call: {pids:?}"
    );
}

const STATE: &str = r#"import os, sys, functools
seen = []
@functools.lru_cache(maxsize=None)
def cached(x):
    return x
def process(x):
    state = {
        "seen": list(seen),
        "cached": cached.cache_info().currsize,
        "colorsys": getattr(sys.modules.get("colorsys"), "left_by_a_call", None),
        "env": os.environ.get("LEFT_BY_A_CALL"),
    }
    seen.append(x)
    cached(x)
    import colorsys
    colorsys.left_by_a_call = x
    os.environ["LEFT_BY_A_CALL"] = str(x)
    return [os.getpid(), state]
"#;

#[test]
fn each_call_finds_the_node_as_the_first_did_in_the_same_child() {
    let mut worker = reset_worker();
    let pids: Vec<i64> = (0..6)
        .map(|x| {
            let (pid, state) = served(&worker.call(&run(x, "state", STATE, json!({"x": x}))).reply);
            assert_eq!(
                state,
                json!({"seen": [], "cached": 0, "colorsys": null, "env": null}),
                "call {x} saw what an earlier call left"
            );
            pid
        })
        .collect();
    served_by_residents(&pids[1..]);
    // Under --isolation node the same child keeps all of it.
    let mut node = Worker::zygote(&["--isolation", "node"]);
    node.call(&run(0, "state", STATE, json!({"x": 0})));
    let (_, state) = served(&node.call(&run(1, "state", STATE, json!({"x": 1}))).reply);
    assert_eq!(state["seen"], json!([0]), "{state}");
}

/// A node that is the victim (holding `sent`, returning it reversed) or
/// the scanner, one node so that one child serves both.
fn victim_or_scanner() -> String {
    format!(
        "{}\nimport os\ndef process(masked=None, sent=None, padding=''):\n    if masked is not None:\n        return [os.getpid(), scan(masked)]\n    return [os.getpid(), sent[::-1]]\n",
        MEMORY_SCAN.replace("def process(masked):", "def scan(masked):")
    )
}

#[test]
fn no_call_finds_what_earlier_calls_of_its_child_were_sent_or_returned() {
    let source = victim_or_scanner();
    // Requests of pages, of blocks past glibc's first mmap threshold, and
    // of blocks that land in the heap's room made before the snapshot
    // (`reset::heap`), whose pages a call writes and the put-back copies.
    for padding in [16_000, 700_000, 6_000_000] {
        let sent = format!("reset-secret-{padding}-{}", std::process::id());
        let returned: String = sent.chars().rev().collect();
        let padding = "p".repeat(padding);
        let mut worker = reset_worker();
        let mut pids = Vec::new();
        for id in 0..3 {
            let kwargs = json!({"sent": sent, "padding": padding});
            let (pid, result) = served(&worker.call(&run(id, "both", &source, kwargs)).reply);
            assert_eq!(result, returned.as_str());
            pids.push(pid);
        }
        let served_secrets = pids.clone();
        for (id, secret) in (10..).step_by(10).zip([&sent, &returned]) {
            // Scanned again until a child that served the secrets scans:
            // the next call may go to a second resident while the first is
            // put back.
            let mut scanned_by = Vec::new();
            for id in id..id + 6 {
                let reply = worker
                    .call(&run(id, "both", &source, json!({"masked": masked(secret)})))
                    .reply;
                let (pid, hits) = served(&reply);
                assert_eq!(
                    hits,
                    json!([]),
                    "an earlier call's {secret:?} is in a later call's memory: {reply}"
                );
                scanned_by.push(pid);
                if served_secrets.contains(&pid) {
                    break;
                }
            }
            assert!(
                scanned_by.iter().any(|pid| served_secrets.contains(pid)),
                "a child that served the secrets scanned: {served_secrets:?}, {scanned_by:?}"
            );
            pids.extend(scanned_by);
        }
        served_by_residents(&pids);
    }
}

/// Past the restores that also drop the pages no call changed (every 32nd):
/// what each of 40 calls held is gone, before and after them.
#[test]
fn a_long_run_of_calls_in_one_child_leaves_none_of_them_in_its_memory() {
    let source = victim_or_scanner();
    let mut worker = reset_worker();
    let mut pids = Vec::new();
    let secrets: Vec<String> = (0..40)
        .map(|i| format!("long-run-{i}-{}", std::process::id()))
        .collect();
    for (id, sent) in (0..).zip(&secrets) {
        let (pid, _) = served(
            &worker
                .call(&run(id, "both", &source, json!({"sent": sent})))
                .reply,
        );
        pids.push(pid);
    }
    for (id, secret) in (100..).zip([&secrets[0], &secrets[31], &secrets[32], &secrets[39]]) {
        let reply = worker
            .call(&run(id, "both", &source, json!({"masked": masked(secret)})))
            .reply;
        let (pid, hits) = served(&reply);
        pids.push(pid);
        assert_eq!(
            hits,
            json!([]),
            "{secret:?} is in a later call's memory: {reply}"
        );
    }
    served_by_residents(&pids);
}

#[test]
fn what_a_call_started_is_gone_before_the_next_and_the_child_serves_on() {
    let source = r#"import os, subprocess, sys, time
def process(check=None):
    if check is not None:
        alive = []
        for pid in check:
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return [os.getpid(), alive]
    sleeper = subprocess.Popen(["sleep", "300"]).pid
    # A daemon: it leaves the call's session and its parent.
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            os.write(write, str(os.getpid()).encode())
            time.sleep(300)
        os._exit(0)
    os.close(write)
    daemon = int(os.read(read, 32))
    os.close(read)
    return [os.getpid(), [sleeper, daemon]]
"#;
    let mut worker = reset_worker();
    let (first, started) = served(&worker.call(&run(1, "daemon", source, json!({}))).reply);
    let started: Vec<i32> = common::pids_in(&started);
    for &pid in &started {
        assert!(
            common::wait_gone(pid, std::time::Duration::from_secs(10)),
            "{pid} outlived its call"
        );
    }
    // The next calls may go to a second resident while the first is put
    // back; the first serves again within a few.
    let later: Vec<i64> = (2..6)
        .map(|id| {
            let (pid, alive) = served(
                &worker
                    .call(&run(id, "daemon", source, json!({"check": started})))
                    .reply,
            );
            assert_eq!(alive, json!([]));
            pid
        })
        .collect();
    assert!(
        later.contains(&first),
        "ending them did not cost the child ({first}): {later:?}"
    );
}

/// Python both nodes below start with: glibc's restartable-sequences area.
const RSEQ_AREA: &str = r#"import ctypes, os
def rseq_area():
    # glibc's restartable-sequences area: __rseq_offset past the thread
    # pointer (x86-64: arch_prctl(ARCH_GET_FS)). None before glibc 2.35,
    # where it registers none, or off x86-64 (the system calls' numbers).
    libc = ctypes.CDLL(None, use_errno=True)
    try:
        if os.uname().machine != "x86_64" or ctypes.c_uint.in_dll(libc, "__rseq_size").value == 0:
            return libc, None
    except ValueError:
        return libc, None
    base = ctypes.c_ulong()
    libc.syscall(158, 0x1003, ctypes.byref(base))
    return libc, ctypes.c_ulong(base.value + ctypes.c_long.in_dll(libc, "__rseq_offset").value)
"#;

/// What one call may change that memory does not hold and the child
/// cannot set back: each retires the child that ran it, and the next call
/// gets a fresh one, which is put back after its own calls again.
#[test]
fn what_memory_cannot_put_back_retires_the_child_and_a_fresh_fork_serves_on() {
    let source = RSEQ_AREA.to_string()
        + r#"import ctypes, ctypes.util, os, signal, threading, time
kept = []
def process(change=None):
    if change == "fd":
        kept.append(open("/proc/self/status"))
    elif change == "thread":
        threading.Thread(target=time.sleep, args=(300,), daemon=True).start()
    elif change == "pending":
        # Blocked and raised: setting the mask back would deliver it.
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
        signal.raise_signal(signal.SIGUSR2)
    elif change == "posix timer":
        timer = ctypes.c_void_p()
        rt = ctypes.CDLL(ctypes.util.find_library("rt"), use_errno=True)
        assert rt.timer_create(1, None, ctypes.byref(timer)) == 0
    elif change == "lock":
        # A POSIX lock of this process's, on its stderr: held until it exits.
        import fcntl
        fcntl.lockf(2, fcntl.LOCK_EX | fcntl.LOCK_NB)
    elif change == "keyring":
        # A key in the process's own keyring (x86-64: add_key), which the
        # calls after it could read, where a fresh fork has none.
        libc = ctypes.CDLL(None, use_errno=True)
        libc.syscall.restype = ctypes.c_long
        added = libc.syscall(248, b"user", b"kwargs", b"secret", 6, ctypes.c_long(-2))
        if added < 0:
            return [os.getpid(), f"refused: {os.strerror(ctypes.get_errno())}"]
    elif change == "gs base":
        # x86-64: arch_prctl(ARCH_SET_GS), 64 bits the next call could read.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.syscall(158, 0x1001, ctypes.c_ulong(0x1234000)) != 0:
            return [os.getpid(), f"refused: {os.strerror(ctypes.get_errno())}"]
    elif change == "rseq of its own":
        # glibc's restartable-sequences area let go and one of the call's
        # registered (x86-64: rseq): the kernel would go on writing the CPU
        # into memory the next call is handed.
        libc, glibcs = rseq_area()
        if glibcs is None:
            return [os.getpid(), "refused: glibc registers none here (or not x86-64)"]
        assert libc.syscall(334, glibcs, 32, 1, 0x53053053) == 0
        area = (ctypes.c_char * 64)()
        kept.append(area)
        aligned = ctypes.c_ulong((ctypes.addressof(area) + 31) & ~31)
        assert libc.syscall(334, aligned, 32, 0, 0x12345678) == 0, os.strerror(ctypes.get_errno())
    elif change == "no write-execute":
        # PR_SET_MDWE, PR_MDWE_REFUSE_EXEC_GAIN: for good, by design.
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(65, 1, 0, 0, 0) != 0:
            return [os.getpid(), f"refused: {os.strerror(ctypes.get_errno())}"]
    return [os.getpid(), change]
"#;
    let mut worker = reset_worker_with(&[("RUST_LOG", "info")]);
    let mut id = 0;
    let mut call = |worker: &mut Worker, change: Value| {
        id += 1;
        served(
            &worker
                .call(&run(id, "leaky", &source, json!({"change": change})))
                .reply,
        )
    };
    served_by_residents(
        &(0..4)
            .map(|_| call(&mut worker, Value::Null).0)
            .collect::<Vec<_>>(),
    );
    // Each with the reason its retirement gives.
    for (change, why) in [
        ("fd", "fd "),
        ("thread", "thread"),
        ("pending", "signal"),
        ("posix timer", "posix timers"),
        ("lock", "file locks"),
        ("no write-execute", "prctl, more"),
        ("keyring", "keyrings"),
        ("gs base", "prctl, more"),
        ("rseq of its own", "restartable-sequences"),
    ] {
        let (pid, echoed) = call(&mut worker, json!(change));
        // Where the kernel refuses it (keys under a container's seccomp
        // profile, no MDWE before Linux 6.3), nothing is left either.
        if echoed.as_str().is_some_and(|e| e.starts_with("refused")) {
            eprintln!("{echoed}: not tried");
            continue;
        }
        assert_eq!(echoed, change);
        let after: Vec<i64> = (0..4).map(|_| call(&mut worker, Value::Null).0).collect();
        assert!(
            !after.contains(&pid),
            "{change}: the child that ran it ({pid}) was retired: {after:?}"
        );
        served_by_residents(&after);
        // Its log comes through a reader thread: waited for.
        let mut log = String::new();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while !log.contains("could not be put back") && std::time::Instant::now() < deadline {
            log.push_str(&worker.stderr_so_far());
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let retired = log
            .lines()
            .find(|line| line.contains("could not be put back"))
            .unwrap_or_else(|| panic!("{change}: no retirement said: {log}"));
        assert!(retired.contains(why), "{change}: {retired}");
    }
}

/// What one call may change that the kernel holds and the child sets back
/// itself (a signal handler, the working directory, the umask, a limit, a
/// timer, its name, the mask, the nice value, a fault handler's alternate
/// stack, the rounding, the restartable-sequences registration, memory
/// locks, a syscall user dispatch): the next call finds each as the first
/// call did, and the child that ran it serves on.
#[test]
fn what_a_call_set_that_the_child_can_set_back_is_set_back_and_the_child_serves_on() {
    let source = RSEQ_AREA.to_string()
        + r#"import ctypes, ctypes.util, faulthandler, os, resource, signal
class StackT(ctypes.Structure):
    _fields_ = [("sp", ctypes.c_void_p), ("flags", ctypes.c_int), ("size", ctypes.c_size_t)]
def alternate_stack():
    stack = StackT()
    ctypes.CDLL(None).sigaltstack(None, ctypes.byref(stack))
    return [stack.sp, stack.flags, stack.size]
libm = ctypes.CDLL(ctypes.util.find_library("m"))
def rseq_registered():
    # Unregistering with a wrong signature changes nothing: EPERM where the
    # area is registered, EINVAL where it is not.
    libc, area = rseq_area()
    if area is None:
        return "glibc registers none"
    libc.syscall(334, area, 32, 1, 0)
    return os.strerror(ctypes.get_errno())
# A syscall user dispatch's selector: while it reads 1 (block), a system
# call traps (SIGSYS, which ends the process) where a dispatch is on.
selector = ctypes.c_char(b"\0")
dispatch_turned_on = False
def dispatch_probe():
    if dispatch_turned_on:
        return "on, in this call"
    selector.value = b"\x01"
    os.getpid()
    selector.value = b"\x00"
    return "off"
def locked_when_mapping():
    # What a mapping made now has locked: all of it after mlockall(MCL_FUTURE).
    import mmap
    try:
        fresh = mmap.mmap(-1, 4096)
    except OSError as error:
        return f"no mapping: {error}"
    fresh[0:1] = b"x"
    locked = [l for l in open("/proc/self/status") if l.startswith("VmLck")][0].split(":")[1].strip()
    fresh.close()
    return locked
def seen():
    status = dict(line.split(":\t", 1) for line in open("/proc/self/status").read().splitlines())
    return {
        "rounding": libm.fegetround(),
        "cwd": os.getcwd(),
        "status": {k: status[k].strip() for k in ("Umask", "SigBlk", "SigIgn", "SigCgt")},
        "nofile": resource.getrlimit(resource.RLIMIT_NOFILE),
        "timers": [signal.getitimer(t) for t in (signal.ITIMER_REAL, signal.ITIMER_VIRTUAL)],
        "name": open("/proc/self/comm").read(),
        "nice": os.nice(0),
        "alternate stack": alternate_stack(),
        "rseq": rseq_registered(),
        "locked": locked_when_mapping(),
        "dispatch": dispatch_probe(),
    }
def process(change=None):
    if change == "signal":
        signal.signal(signal.SIGUSR1, lambda *a: None)
        signal.signal(signal.SIGHUP, signal.SIG_IGN)
    elif change == "cwd":
        os.chdir("/")
    elif change == "umask":
        os.umask(0o077)
    elif change == "rlimit":
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft - 1, hard))
    elif change == "timer":
        signal.setitimer(signal.ITIMER_VIRTUAL, 100.0)
        signal.setitimer(signal.ITIMER_REAL, 5.0)
    elif change == "name":
        ctypes.CDLL(None).prctl(15, b"renamed", 0, 0, 0)
    elif change == "mask":
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR2})
    elif change == "nice":
        os.nice(1)
    elif change == "faulthandler":
        faulthandler.enable(file=2)
    elif change == "rounding":
        # FE_TOWARDZERO (x86-64): every later sum would round so.
        libm.fesetround(0xC00)
    elif change == "libc signals":
        # The C library's own two, which its sigaction refuses, set by the
        # system calls themselves (x86-64: rt_sigaction, rt_sigprocmask):
        # ignored where they were not, and not where they were (as a
        # process that started this one may have left them).
        libc = ctypes.CDLL(None)
        for number in (32, 33):
            was = (ctypes.c_ulong * 4)()
            libc.syscall(13, number, None, was, 8)
            flipped = (ctypes.c_ulong * 4)(0 if was[0] == 1 else 1, 0, 0, 0)
            libc.syscall(13, number, flipped, None, 8)
        libc.syscall(14, 0, ctypes.byref(ctypes.c_ulong(3 << 31)), None, 8)
    elif change == "rseq":
        # glibc's registration let go (x86-64: rseq, RSEQ_FLAG_UNREGISTER):
        # sched_getcpu() would answer one CPU for every later call.
        libc, area = rseq_area()
        if area is not None:
            assert libc.syscall(334, area, 32, 1, 0x53053053) == 0
    elif change == "syscall dispatch":
        # PR_SET_SYSCALL_USER_DISPATCH on, its selector allowing: left on,
        # a later call that writes 1 there traps its next system call.
        global dispatch_turned_on
        on = ctypes.CDLL(None).prctl(59, ctypes.c_ulong(1), ctypes.c_ulong(0), ctypes.c_ulong(0),
                                     ctypes.c_ulong(ctypes.addressof(selector)))
        dispatch_turned_on = on == 0
    elif change == "mlockall":
        # MCL_FUTURE: every mapping made from here on locked. Only where no
        # limit would refuse this call's own mappings (root, or none).
        if os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_MEMLOCK)[0] == resource.RLIM_INFINITY:
            ctypes.CDLL(None).mlockall(2)
    elif change == "alarms":
        # Still firing once the call is over, into a handler of the call's
        # run on its alternate stack.
        faulthandler.enable(file=2)
        signal.signal(signal.SIGALRM, lambda *a: None)
        signal.setitimer(signal.ITIMER_REAL, 1e-4, 1e-4)
    return [os.getpid(), seen()]
"#;
    // Its own fault handler, had the zygote one, would be no change.
    let mut command = std::process::Command::new(common::ZYGOTE);
    command
        .args(["worker", "--isolation", "reset"])
        .env("RUST_LOG", "info")
        .env_remove("PYTHONFAULTHANDLER");
    let mut worker = Worker::spawn(command);
    let mut id = 0;
    let mut call = |worker: &mut Worker, change: Value| {
        id += 1;
        served(
            &worker
                .call(&run(id, "settings", &source, json!({"change": change})))
                .reply,
        )
    };
    let first: Vec<(i64, Value)> = (0..4).map(|_| call(&mut worker, Value::Null)).collect();
    let (_, before) = first[3].clone();
    // Lowering the nice value again takes the privilege to.
    // SAFETY: geteuid has no failure.
    let root = unsafe { libc::geteuid() } == 0;
    for change in [
        "signal",
        "cwd",
        "umask",
        "rlimit",
        "timer",
        "name",
        "mask",
        "nice",
        "faulthandler",
        "rounding",
        "libc signals",
        "rseq",
        "mlockall",
        "syscall dispatch",
        "alarms",
    ] {
        if change == "nice" && !root {
            continue;
        }
        if change == "rseq" && before["rseq"] == "glibc registers none" {
            eprintln!("rseq: glibc registers none here, nothing to let go");
            continue;
        }
        let (pid, during) = call(&mut worker, json!(change));
        // Refused here: no RLIMIT_MEMLOCK and no privilege; a kernel
        // without syscall user dispatch (before 5.11).
        let refused = match change {
            "mlockall" => during["locked"] == before["locked"],
            "syscall dispatch" => during["dispatch"] == before["dispatch"],
            _ => false,
        };
        if refused {
            eprintln!("{change}: refused here, nothing to set back");
            continue;
        }
        assert_ne!(during, before, "{change}: the call changed something");
        let after: Vec<(i64, Value)> = (0..4).map(|_| call(&mut worker, Value::Null)).collect();
        for (_, seen) in &after {
            assert_eq!(seen, &before, "{change}: set back for the next calls");
        }
        // Not retired: still there, waiting for a call (which of a node's
        // residents serves the next is the first put back).
        let log = worker.stderr_so_far();
        assert!(!log.contains("could not be put back"), "{change}: {log}");
        assert!(
            !common::is_gone(pid as i32),
            "{change}: the child that ran it ({pid}) serves on"
        );
        let mut pids: Vec<i64> = after.iter().map(|(pid, _)| *pid).collect();
        pids.push(pid);
        served_by_residents(&pids);
    }
}

/// A node that leaves a thread behind in every call (as tqdm's monitor
/// does) retires every resident it runs in. After a few calls in a row its
/// calls get a fresh fork each instead, for a while, as under `--isolation
/// call`: no call ever runs in a process an earlier call ran in. Through
/// `worker` and a sweep alike.
#[test]
fn a_node_whose_residents_cannot_be_put_back_gets_fresh_forks_instead() {
    let source = "import os, threading, time\ndef process(x):\n    threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n    return [os.getpid(), x]\n";
    let calls = 40;
    let mut worker = Worker::zygote_with(&["--isolation", "reset"], &[("RUST_LOG", "info")]);
    let pids: Vec<i64> = (0..calls)
        .map(|x| {
            let (pid, echoed) = served(
                &worker
                    .call(&run(x, "threads", source, json!({"x": x})))
                    .reply,
            );
            assert_eq!(echoed, x);
            pid
        })
        .collect();
    let (_, log) = worker.finish();
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(distinct.len(), pids.len(), "each call a process of its own");
    assert!(log.contains("get a fresh fork each"), "{log}");
    let retired = log.matches("could not be put back after its call").count();
    assert!(
        retired < 10,
        "{retired} of {calls} calls forked a resident only to retire it: {log}"
    );

    let dir = common::scratch("reset-fallback");
    let node = dir.join("threads.py");
    std::fs::write(&node, source).unwrap();
    let output = std::process::Command::new(common::ZYGOTE)
        .args(["sweep", node.to_str().unwrap(), "--grid", "x=0..39"])
        .args(["-j", "2", "--isolation", "reset"])
        .env("RUST_LOG", "info")
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&output.stderr);
    let pids: Vec<i64> = String::from_utf8_lossy(&output.stdout)
        .lines()
        .map(|l| {
            let line: Value = serde_json::from_str(l).unwrap();
            served(&line).0
        })
        .collect();
    assert_eq!(pids.len(), 40, "{stderr}");
    let mut distinct = pids.clone();
    distinct.sort_unstable();
    distinct.dedup();
    assert_eq!(
        distinct.len(),
        pids.len(),
        "each point a process of its own"
    );
    assert!(stderr.contains("get a fresh fork each"), "{stderr}");
    let retired = stderr
        .matches("could not be put back after its call")
        .count();
    assert!(retired < 12, "{retired} of 40 points: {stderr}");
}

/// The snapshot a restore copies from cannot be written by a call: its
/// view is a read-only mapping that `mprotect` will not make writable,
/// and `/proc/self/mem` will not write through. (Mapped through a
/// read-only fd of the sealed memfd: a shared mapping of the memfd itself
/// is refused before Linux 6.7.)
#[test]
fn no_call_can_write_the_snapshot_it_is_put_back_from() {
    let source = r#"import ctypes, os
def process(x=None):
    libc = ctypes.CDLL(None, use_errno=True)
    views = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        # Shared: the snapshot's private mappings are its regions.
        if "fluksio-reset" in line and fields[1][1:] == "--s":
            views.append([int(v, 16) for v in fields[0].split("-")])
    refused = []
    for start, end in views:
        made = libc.mprotect(ctypes.c_void_p(start), ctypes.c_size_t(4096), 3)
        refused.append(["mprotect", made, os.strerror(ctypes.get_errno())])
        try:
            with open("/proc/self/mem", "r+b", buffering=0) as mem:
                mem.seek(start)
                mem.write(b"call")
            refused.append(["mem", "written"])
        except OSError as error:
            refused.append(["mem", error.strerror])
    return [os.getpid(), [len(views), refused, x]]
"#;
    let mut worker = reset_worker();
    let mut served_by = Vec::new();
    for id in 1..=4 {
        let reply = worker.call(&run(id, "view", source, json!({"x": id})));
        let (pid, found) = served(&reply.reply);
        served_by.push(pid);
        assert_eq!(found[0], 1, "one view of the snapshot: {found}");
        assert_eq!(found[2], id, "the call's own kwargs: {found}");
        for attempt in found[1].as_array().unwrap() {
            match attempt[0].as_str() {
                Some("mprotect") => assert_eq!(attempt[1], -1, "{found}"),
                _ => assert_ne!(attempt[1], "written", "{found}"),
            }
        }
    }
    served_by_residents(&served_by);
}

/// What a call does in the normal course, that is put back, and must not
/// cost the child: files opened and closed, memory mapped and freed, a
/// module imported, the environment changed, a subprocess run.
#[test]
fn what_memory_does_put_back_keeps_the_child() {
    let source = r#"import mmap, os, subprocess
def process(x):
    with open("/proc/self/status") as f:
        f.read()
    big = bytearray(64 << 20)
    big[::4096] = b"x" * len(big[::4096])
    area = mmap.mmap(-1, 8 << 20)
    area[:5] = b"hello"
    import decimal, fractions
    os.environ["CALL"] = str(x)
    out = subprocess.run(["true"]).returncode
    return [os.getpid(), [x, out]]
"#;
    let mut worker = reset_worker();
    let pids: Vec<i64> = (0..5)
        .map(|x| {
            let (pid, result) = served(
                &worker
                    .call(&run(x, "normal", source, json!({"x": x})))
                    .reply,
            );
            assert_eq!(result, json!([x, 0]));
            pid
        })
        .collect();
    served_by_residents(&pids[1..]);
    // Their memory went back down: what the calls mapped is unmapped.
    let rss_kib = |pid: i64| -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    };
    for &pid in &pids[1..] {
        assert!(
            rss_kib(pid) < 64 * 1024,
            "{} KiB resident after calls of 64 MiB each",
            rss_kib(pid)
        );
    }
}

#[test]
fn a_sweep_put_back_between_points_answers_as_fresh_children_do() {
    let dir = common::scratch("reset-sweep");
    let node = dir.join("node.py");
    std::fs::write(
        &node,
        "import os\nseen = []\ndef process(x):\n    seen.append(x)\n    if x == 5:\n        os._exit(3)\n    if x == 7:\n        raise ValueError(x)\n    return {'x': x, 'seen': list(seen)}\n",
    )
    .unwrap();
    let sweep = |isolation: &str| -> Vec<Value> {
        let output = std::process::Command::new(common::ZYGOTE)
            .args([
                "sweep",
                node.to_str().unwrap(),
                "--grid",
                "x=0..19",
                "-j",
                "2",
            ])
            .args(["--isolation", isolation])
            .stdin(std::process::Stdio::null())
            .output()
            .unwrap();
        let mut lines: Vec<Value> = String::from_utf8_lossy(&output.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
        lines.sort_by_key(|l| l["index"].as_u64());
        for line in &mut lines {
            line.as_object_mut().unwrap().remove("duration_ms");
        }
        lines
    };
    let reset = sweep("reset");
    assert_eq!(reset.len(), 20);
    assert_eq!(reset, sweep("call"));
}

/// A call runs in the same process as the runtime that puts it back, with
/// the same control socket: it can write the word that says "put back"
/// itself, and read from the socket the next call's assignment comes down.
/// Neither gets it the next call: the assignment goes only to a child seen
/// from outside at the runtime's own wait, one thread, no node code
/// running.
#[test]
fn a_call_that_forges_its_childs_word_never_gets_the_next_call() {
    let dir = common::scratch("reset-forge");
    let loot = dir.join("loot");
    let source = format!(
        r#"import json, os, sys, threading, time
LOOT = {loot:?}
def fds(kind):
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{{fd}}").startswith(kind) and int(fd) > 2:
                yield int(fd)
        except OSError:
            pass
def steal(fd):
    with open(LOOT, "ab") as out:
        while True:
            data = os.read(fd, 1 << 16)
            if not data:
                return
            out.write(data)
            out.flush()
def process(role, secret=None, id=None):
    if role == "victim":
        return [os.getpid(), secret[::-1]]
    for fd in list(fds("socket:")):
        os.write(fd, b"ready\n")
        if role == "thief":
            threading.Thread(target=steal, args=(fd,), daemon=True).start()
        else:
            # The reply forged on the call's own line pipe, then the
            # socket read on this very thread.
            for line_fd in list(fds("pipe:")):
                reply = {{"id": id, "call_id": "", "ok": True, "result": [os.getpid(), "forged"], "logs": ""}}
                os.write(line_fd, (json.dumps(reply) + "\n").encode())
            steal(fd)
    return [os.getpid(), role]
"#,
        loot = loot.display().to_string()
    );
    for (round, role) in ["thief", "blocker"].into_iter().enumerate() {
        let secret = format!("next-call-secret-{round}-{}", std::process::id());
        let mut worker = reset_worker();
        let base = 10 * round as i64;
        let (attacker, _) = served(
            &worker
                .call(&run(base, "n", &source, json!({"role": role, "id": base})))
                .reply,
        );
        let reply = worker
            .call(&run(
                base + 1,
                "n",
                &source,
                json!({"role": "victim", "secret": secret}),
            ))
            .reply;
        let (victim, result) = served(&reply);
        assert_eq!(result, secret.chars().rev().collect::<String>());
        assert_ne!(victim, attacker, "{role}: the attacker's child was retired");
        let stolen = std::fs::read(&loot).unwrap_or_default();
        assert!(
            !String::from_utf8_lossy(&stolen).contains(&secret),
            "{role}: the next call's assignment reached the call before it"
        );
    }
}

/// A call that changes one of the fds the runtime keeps open for the
/// put-back, and nothing else, with no native code: `os.dup2` of a file
/// of its own at its number (a directory mirroring `/proc/self` as it was
/// in place of `/proc/self`, a copy of a file in place of the file), an
/// `lseek`, an open file description's lock, a signal for its `SIGIO`.
/// Through a mirror every check of the state would read what it was
/// before the call; the others are state a next call could read back.
/// Each, alone, retires the child that ran it. And a call that mirrors
/// `/proc/self` and then changes its working directory and umask and
/// leaves an fd open passes none of it on.
#[test]
fn a_call_that_changes_a_fd_the_runtime_keeps_is_retired() {
    let dir = common::scratch("reset-kept-fds");
    let source = format!(
        r#"import fcntl, os, shutil, struct, tempfile
WORK = {work:?}
def copy_tree(src, dst):
    os.makedirs(dst, exist_ok=True)
    for name in os.listdir(src):
        path = os.path.join(src, name)
        try:
            if os.path.islink(path) or name in ("fd", "ns", "cwd", "root", "exe"):
                os.symlink(os.readlink(path), os.path.join(dst, name))
            elif os.path.isdir(path):
                continue
            else:
                with open(path, "rb") as f, open(os.path.join(dst, name), "wb") as out:
                    out.write(f.read())
        except OSError:
            pass
def mirror_of(target, fake):
    if os.path.isdir(target):
        copy_tree(target, fake)
        pid = os.getpid()
        for sub in ("fd", "fdinfo", "ns"):
            if os.path.isdir(os.path.join(target, sub)):
                copy_tree(os.path.join(target, sub), os.path.join(fake, sub))
        children = f"{{target}}/task/{{pid}}/children"
        if os.path.exists(children):
            os.makedirs(f"{{fake}}/task/{{pid}}", exist_ok=True)
            shutil.copyfile(children, f"{{fake}}/task/{{pid}}/children")
        return os.open(fake, os.O_RDONLY | os.O_DIRECTORY)
    if target.startswith("/memfd:"):
        return os.memfd_create(target[len("/memfd:"):].split(" ")[0])
    with open(fake, "wb") as out:
        try:
            with open(target, "rb") as f:
                out.write(f.read(1 << 20))
        except OSError:
            pass
    return os.open(fake, os.O_RDONLY)
def process(act, which=0):
    um = os.umask(0); os.umask(um)
    fds = {{}}
    for n in os.listdir("/proc/self/fd"):
        try:
            fds[int(n)] = os.readlink(f"/proc/self/fd/{{n}}")
        except OSError:
            pass
    kept = [n for n, target in sorted(fds.items())
            if n >= 100 and not target.startswith(("socket:", "pipe:"))]
    if act == "look":
        return [os.getpid(), {{"cwd": os.getcwd(), "umask": um, "kept": kept,
                               "fds": sorted(fds.values())}}]
    n = kept[which]
    target = fds[n]
    if act == "swap":
        made = mirror_of(target, tempfile.mktemp(dir=WORK))
        os.dup2(made, n, inheritable=False)
        os.close(made)
    elif act in ("seek", "lock", "signal"):
        try:
            if act == "seek":
                os.lseek(n, 4096, os.SEEK_SET)
            elif act == "lock":
                # F_OFD_SETLK, a read lock on the first byte.
                fcntl.fcntl(n, 37, struct.pack("hhqqi", fcntl.F_RDLCK, 0, 0, 1, 0))
            else:
                fcntl.fcntl(n, 10, 10)  # F_SETSIG: SIGUSR1
        except OSError as e:
            # Not on this fd (an O_PATH fd has no offset): nothing changed.
            return [os.getpid(), None]
    elif act == "swap and leave":
        made = mirror_of(target, tempfile.mktemp(dir=WORK))
        os.dup2(made, n, inheritable=False)
        os.close(made)
        os.open(WORK, os.O_RDONLY)
        os.chdir(WORK)
        os.umask(0o077)
    return [os.getpid(), target]
"#,
        work = dir.display().to_string()
    );
    let mut worker = reset_worker();
    let mut id = 0;
    let mut call = |worker: &mut Worker, kwargs: Value| {
        id += 1;
        served(&worker.call(&run(id, "n", &source, kwargs)).reply)
    };
    let (_, before) = call(&mut worker, json!({"act": "look"}));
    let kept = before["kept"].as_array().unwrap().len();
    assert!(
        kept >= 10,
        "the runtime keeps fds for the put-back: {before}"
    );
    let mut tried = Vec::new();
    for which in 0..kept {
        tried.push(json!({"act": "swap", "which": which}));
        tried.push(json!({"act": "seek", "which": which}));
    }
    // A lock and a signal on each (the snapshot's memfd, the /proc files;
    // an `O_PATH` fd takes neither).
    for which in 0..kept {
        tried.push(json!({"act": "lock", "which": which}));
        tried.push(json!({"act": "signal", "which": which}));
    }
    tried.push(json!({"act": "swap and leave", "which": 0}));
    let mut changed = 0;
    for kwargs in tried {
        let (changer, target) = call(&mut worker, kwargs.clone());
        changed += usize::from(!target.is_null());
        for _ in 0..2 {
            let (pid, seen) = call(&mut worker, json!({"act": "look"}));
            if !target.is_null() {
                assert_ne!(
                    pid, changer,
                    "{kwargs} on {target}: the child that ran it was retired"
                );
            }
            assert_eq!(seen["cwd"], before["cwd"], "{kwargs}: {seen}");
            assert_eq!(seen["umask"], before["umask"], "{kwargs}: {seen}");
            assert_eq!(
                seen["fds"].as_array().unwrap().len(),
                before["fds"].as_array().unwrap().len(),
                "{kwargs}: {seen}"
            );
        }
    }
    assert!(changed > 2 * kept, "most changes took: {changed}");
}

/// A call that writes a reply of its own down its pipe, then returns: its
/// real reply comes after the one it forged, where the runtime no longer
/// reads it as this call's. It must not be read as the next call's either:
/// a child with anything unread in its pipe at its wait is retired.
#[test]
fn what_a_call_wrote_past_its_reply_is_never_read_as_the_next_calls() {
    let source = r#"import json, os, time
def process(role, secret=None, id=None):
    if role == "victim":
        return [os.getpid(), secret[::-1]]
    for fd in range(3, 64):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("pipe:"):
                continue
        except OSError:
            continue
        reply = {"id": id, "call_id": "", "ok": True, "result": [os.getpid(), "forged"], "logs": ""}
        os.write(fd, (json.dumps(reply) + "\n").encode())
    time.sleep(0.3)
    return [os.getpid(), "the liar's own reply"]
"#;
    let mut worker = reset_worker();
    let (liar, said) = served(
        &worker
            .call(&run(1, "n", source, json!({"role": "liar", "id": 1})))
            .reply,
    );
    assert_eq!(
        said, "forged",
        "its own first line answers it, as in call mode"
    );
    for id in 2..4 {
        let secret = format!("secret-{id}");
        let reply = worker
            .call(&run(
                id,
                "n",
                source,
                json!({"role": "victim", "secret": secret}),
            ))
            .reply;
        assert_eq!(reply["id"], id, "another call's reply: {reply}");
        let (victim, result) = served(&reply);
        assert_eq!(result, secret.chars().rev().collect::<String>(), "{reply}");
        assert_ne!(victim, liar, "the liar's child was retired");
    }
}

/// A pool slot of a shared zygote (`worker --shared-zygote`, as the pool
/// starts it) under `--isolation reset`; slots of one scope share a zygote.
fn reset_slot(scope: &str) -> Worker {
    Worker::zygote_with(
        &["--isolation", "reset"],
        &[
            ("FLUKSIO_SHARED_ZYGOTE", "1"),
            ("FLUKSIO_TEST_SCOPE", scope),
            ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "2"),
        ],
    )
}

/// A slot has its reply before its resident is put back, and a call that
/// comes meanwhile gets another resident. A pause between calls lets the
/// first be put back, so that the calls below show reuse; no answer
/// depends on it.
const SETTLE: std::time::Duration = std::time::Duration::from_millis(300);

#[test]
fn pool_slots_of_a_shared_zygote_are_served_by_residents_put_back() {
    let mut slots = [reset_slot("reset-state"), reset_slot("reset-state")];
    let mut pids = Vec::new();
    for x in 0..6 {
        let slot = &mut slots[x as usize % 2];
        let (pid, state) = served(&slot.call(&run(x, "state", STATE, json!({"x": x}))).reply);
        assert_eq!(
            state,
            json!({"seen": [], "cached": 0, "colorsys": null, "env": null}),
            "call {x} saw what an earlier call left"
        );
        pids.push(pid);
        std::thread::sleep(SETTLE);
    }
    a_resident_served_more_than_one(&pids);
}

#[test]
fn no_slot_finds_in_a_resident_what_another_slots_calls_were_sent_or_returned() {
    let source = victim_or_scanner();
    let mut victim = reset_slot("reset-scan");
    let mut scanner = reset_slot("reset-scan");
    let mut secrets = Vec::new();
    let mut victims = Vec::new();
    let mut scanners = Vec::new();
    for round in 0..4 {
        let sent = format!("slot-secret-{round}-{}", std::process::id());
        let request = run(2 * round, "both", &source, json!({"sent": sent}));
        let (pid, result) = served(&victim.call(&request).reply);
        assert_eq!(result, sent.chars().rev().collect::<String>());
        victims.push(pid);
        secrets.push(result.as_str().expect("a string").to_string());
        secrets.push(sent);
        std::thread::sleep(SETTLE);
        for (id, secret) in (100 * (round + 1)..).zip(&secrets) {
            let request = run(id, "both", &source, json!({"masked": masked(secret)}));
            let reply = scanner.call(&request).reply;
            let (pid, hits) = served(&reply);
            assert_eq!(
                hits,
                json!([]),
                "another slot's {secret:?} is in a later call's memory: {reply}"
            );
            scanners.push(pid);
        }
        std::thread::sleep(SETTLE);
    }
    assert!(
        scanners.iter().any(|pid| victims.contains(pid)),
        "some scan ran in a child that had served a secret: {victims:?} {scanners:?}"
    );
}

#[test]
fn a_slot_killed_mid_call_ends_its_resident_and_the_next_slot_is_served() {
    let source = "import fluksio, os, subprocess, time\ndef process(hang=False):\n    if hang:\n        sleeper = subprocess.Popen(['setsid', 'sleep', '3600'])\n        fluksio.emit(pids=[os.getpid(), sleeper.pid])\n        time.sleep(3600)\n    return [os.getpid(), 'served']\n";
    let mut doomed = reset_slot("reset-kill");
    let mut next = reset_slot("reset-kill");
    doomed.send(&run(1, "hang", source, json!({"hang": true})));
    let event = doomed.next_line();
    let pids = common::pids_in(&event["outputs"]["pids"]);
    // The pool's timeout: SIGKILL to the slot it spawned.
    common::sigkill(doomed.pid());
    for pid in pids {
        assert!(
            common::wait_gone(pid, std::time::Duration::from_secs(15)),
            "{pid} outlived its slot's call"
        );
    }
    let (_, result) = served(&next.call(&run(2, "hang", source, json!({}))).reply);
    assert_eq!(result, "served");
}

#[test]
fn the_agent_serves_its_calls_in_residents_put_back() {
    use common::agent::{Agent, WAIT};
    use common::engine::{Answer, Engine};
    let engine = Engine::start(Answer::Welcome);
    // What calls import is not learned by the zygote here: each call must
    // find only what the first did.
    let agent = Agent::start(
        &engine.url,
        &["--isolation", "reset", "--learn-imports", "off"],
        &[("RUST_LOG", "info")],
    );
    let connection = engine.next_connection(WAIT);
    let request = |x: i64| {
        json!({"op": "run", "id": x, "call_id": format!("c{x}"), "flow": "f", "node": "state",
               "source": STATE, "kwargs": {"x": x}})
    };
    let mut pids = Vec::new();
    for x in 0..5 {
        let (_, reply) = connection.reply_to(&request(x), WAIT);
        let (pid, state) = served(&reply);
        assert_eq!(
            state,
            json!({"seen": [], "cached": 0, "colorsys": null, "env": null}),
            "call {x} saw what an earlier call left ({pids:?} {pid}): {}",
            agent.log()
        );
        pids.push(pid);
        std::thread::sleep(SETTLE);
    }
    a_resident_served_more_than_one(&pids);
    // A cancel ends the resident serving the call; the next call is served.
    let hang = "import time, os\ndef process():\n    time.sleep(3600)\n";
    connection.send(
        &json!({"op": "run", "id": 9, "call_id": "hang", "flow": "f",
                            "node": "hang", "source": hang, "kwargs": {}}),
    );
    std::thread::sleep(std::time::Duration::from_millis(500));
    connection.send(&json!({"op": "cancel", "call_id": "hang"}));
    let (_, reply) = connection.reply("hang", WAIT);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
    let (_, reply) = connection.reply_to(&request(10), WAIT);
    assert_eq!(served(&reply).1["seen"], json!([]), "{reply}");
}

/// A resident keeps its own fds (its control socket; under reset the
/// pagemap, the mappings and the snapshot) above the low numbers, so node
/// code opens files where it would in a fresh child: two at once are
/// consecutive, from 3, as under `python3` (CPython's `test_closerange`
/// skips itself without that).
#[test]
fn node_code_in_a_resident_opens_files_at_the_fds_a_fresh_child_gives() {
    let source = r#"import os
def process(x):
    first = os.open("/dev/null", os.O_RDONLY)
    second = os.open("/dev/null", os.O_RDONLY)
    os.close(first)
    os.close(second)
    return [os.getpid(), [first, second]]
"#;
    for isolation in ["call", "node", "reset"] {
        let mut worker = Worker::zygote(&["--isolation", isolation]);
        let pids: Vec<i64> = (0..3)
            .map(|x| {
                let reply = worker
                    .call(&run(x, "normal", source, json!({"x": x})))
                    .reply;
                let (pid, fds) = served(&reply);
                assert_eq!(fds, json!([3, 4]), "under --isolation {isolation}");
                pid
            })
            .collect();
        if isolation != "call" {
            served_by_residents(&pids);
        }
    }
}

/// The environment a call is given, as Python and C see it: each
/// variable, in order.
const ENVIRONMENT: &str = r#"import ctypes, os
def process(x):
    environ = ctypes.POINTER(ctypes.c_char_p).in_dll(ctypes.CDLL(None), "environ")
    c = []
    while environ[len(c)]:
        c.append(environ[len(c)].decode())
    return [os.getpid(), {"python": list(os.environ.items()), "c": c}]
"#;

/// A resident sets the thread variables every call is given before its
/// snapshot (the runtime's, the same each call). A call that brings
/// variables of its own through the agent, or values of its own for
/// those, still finds each variable where a fresh child would, with a
/// fresh child's value: nothing of the set-up's or of an earlier call's is
/// left, in Python's order or C's. With no thread variable in the agent's
/// environment, with one of the user's, and with that one overridden by
/// `--threads-per-call`.
#[test]
fn each_call_finds_the_environment_a_fresh_child_is_given() {
    use common::agent::{Agent, WAIT};
    use common::engine::{Answer, Engine};
    let envs = [
        json!({}),
        json!({"FROM_THE_CALL": "1"}),
        json!({}),
        json!({"OMP_NUM_THREADS": "3"}),
        json!({}),
        json!({"FROM_THE_CALL": "2", "OPENBLAS_NUM_THREADS": "1", "HOME": "/elsewhere"}),
        json!({}),
        json!({}),
    ];
    let mut removed = common::THREAD_VARIABLES.to_vec();
    removed.push("FROM_THE_CALL");
    let users: [&[(&str, &str)]; 3] = [
        &[],
        &[("OMP_NUM_THREADS", "2")],
        // `--threads-per-call` overrides the user's variable, call by call.
        &[("OMP_NUM_THREADS", "2"), ("FLUKSIO_THREADS_PER_CALL", "1")],
    ];
    for user_set in users {
        // One engine: its address is in every call's environment.
        let engine = Engine::start(Answer::Welcome);
        let agent = |isolation: &str| {
            let mut env = vec![("FLUKSIO_RESET_FALLBACK_AFTER", "0")];
            env.extend_from_slice(user_set);
            let agent = Agent::start_with_only(
                &engine.url,
                &["--isolation", isolation, "--learn-imports", "off"],
                &removed,
                &env,
            );
            (agent, engine.next_connection(WAIT))
        };
        let (reset_agent, reset) = agent("reset");
        let (_fresh_agent, fresh) = agent("call");
        let mut pids = Vec::new();
        for (x, env) in envs.iter().enumerate() {
            let request = json!({"op": "run", "id": x, "call_id": format!("c{x}"), "flow": "f",
                                 "node": "environment", "source": ENVIRONMENT,
                                 "kwargs": {"x": x}, "env": env});
            let (pid, seen) = served(&reset.reply_to(&request, WAIT).1);
            let (_, expected) = served(&fresh.reply_to(&request, WAIT).1);
            assert_eq!(
                seen,
                expected,
                "call {x} (env {env}, the agent's {user_set:?}): a resident's environment \
                 against a fresh child's\n{}",
                reset_agent.log()
            );
            pids.push(pid);
            std::thread::sleep(SETTLE);
        }
        a_resident_served_more_than_one(&pids);
    }
}

/// Each call write-protects what pages of the snapshot's regions it can
/// through its own pagemap (`PAGEMAP_SCAN` with `PM_SCAN_WP_MATCHING`,
/// no fd needed), or counts those protected. A mapping registered with a
/// userfaultfd in asynchronous mode takes it, and its bits would outlive
/// the put-back for a later call to read (the regions were, at 6e542c2,
/// for one scan to walk them all: 144 of 387 pages still protected two
/// calls later). No region may be.
const WRITE_PROTECTS: &str = r#"import fcntl, os, struct, ctypes
PAGEMAP_SCAN = 0xc0606610
WP_MATCHING = 1
PAGE_IS_WRITTEN, PAGE_IS_PRESENT, PAGE_IS_SWAPPED = 2, 8, 16
def regions():
    out = []
    for line in open("/proc/self/maps"):
        f = line.split()
        if "fluksio-reset" in line and f[1] == "rw-p":
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b))
    return out
def scan(fd, a, b, flags, inverted, mask, anyof, ret):
    vec = ctypes.create_string_buffer(24 * 1024)
    arg = struct.pack("12Q", 96, flags, a, b, 0, ctypes.addressof(vec), 1024, 0, inverted, mask, anyof, ret)
    buf = bytearray(arg)
    n = fcntl.ioctl(fd, PAGEMAP_SCAN, buf)
    pages = 0
    for i in range(n):
        s, e, c = struct.unpack_from("3Q", vec, 24 * i)
        pages += (e - s) // 4096
    return pages
def process(act):
    fd = os.open("/proc/self/pagemap", os.O_RDONLY)
    total = 0
    for a, b in regions():
        try:
            if act == "protect":
                total += scan(fd, a, b, WP_MATCHING, 0, 0, PAGE_IS_PRESENT, PAGE_IS_PRESENT)
            else:
                total += scan(fd, a, b, 0, PAGE_IS_WRITTEN, PAGE_IS_WRITTEN, PAGE_IS_PRESENT | PAGE_IS_SWAPPED, PAGE_IS_WRITTEN)
        except OSError as e:
            pass
    os.close(fd)
    return [os.getpid(), act, total]
"#;

#[test]
fn no_call_leaves_pages_write_protected_for_a_later_call_to_read() {
    let mut worker = reset_worker();
    let mut pids = Vec::new();
    for (id, act) in ["look", "protect", "look", "protect", "look", "look", "look"]
        .into_iter()
        .enumerate()
    {
        let request = run(id as i64, "protects", WRITE_PROTECTS, json!({"act": act}));
        let reply = worker.call(&request).reply;
        assert_eq!(reply["ok"], true, "{reply}");
        let result = &reply["result"];
        if act == "look" {
            assert_eq!(
                result[2], 0,
                "call {id}: pages left write-protected: {reply}"
            );
        }
        pids.push(result[0].as_i64().expect("a pid"));
    }
    served_by_residents(&pids[1..]);
}

/// What no call may leave in memory that is not writable: a write through
/// `/proc/self/mem` (which writes a private read-only page, code too, as
/// a debugger's breakpoint does: pure Python, no `ctypes`), or through
/// `mprotect` made writable and read-only again, into a library's code,
/// its read-only data and its relocated pointers (`RELRO`), and into
/// anonymous memory read-only or inaccessible since the set-up, and the
/// kernel's own code (`[vdso]`, whose resident is retired). Each call
/// reads every target first and then writes its own mark there: every
/// call must read what the set-up left.
#[test]
fn no_call_leaves_writes_in_memory_that_is_not_writable_for_a_later_call_to_read() {
    let source = r#"import ctypes, mmap, os, _bisect
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
ANONYMOUS = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
# Anonymous memory written at the set-up and then made read-only, and
# some made inaccessible.
read_only = libc.mmap(None, 4096, 3, ANONYMOUS, -1, 0)
ctypes.memmove(read_only, b"set-up", 6)
libc.mprotect(read_only, 4096, mmap.PROT_READ)
inaccessible = libc.mmap(None, 4096, 3, ANONYMOUS, -1, 0)
ctypes.memmove(inaccessible, b"set-up", 6)
libc.mprotect(inaccessible, 4096, 0)

def mappings_of(path):
    found = []
    for line in open("/proc/self/maps"):
        fields = line.split()
        if len(fields) > 5 and fields[5] == path:
            start, end = (int(v, 16) for v in fields[0].split("-"))
            found.append((start, end, fields[1], int(fields[2], 16)))
    return sorted(found)

def relro_of(path, base):
    # PT_GNU_RELRO, from the file's program headers: its pointers are
    # relocated at load and then made read-only.
    with open(path, "rb") as elf:
        header = elf.read(64)
        phoff = int.from_bytes(header[32:40], "little")
        size, count = (int.from_bytes(header[i:i + 2], "little") for i in (54, 56))
        elf.seek(phoff)
        table = elf.read(size * count)
    for i in range(count):
        entry = table[i * size:(i + 1) * size]
        if int.from_bytes(entry[0:4], "little") == 0x6474E552:
            vaddr, memsz = (int.from_bytes(entry[i:i + 8], "little") for i in (16, 40))
            end = (base + vaddr + memsz) & ~4095
            assert end > base + vaddr, "RELRO spans a page"
            return end - 16
    raise AssertionError("no RELRO")

def targets():
    # _bisect's code and its read-only data (right above the code), and its
    # RELRO: all unused by the call.
    library = mappings_of(_bisect.__file__)
    base = [m for m in library if m[3] == 0][0][0]
    code = [m for m in library if "x" in m[2]][0]
    rodata = [m for m in library if m[0] == code[1]][0]
    return {
        "code": code[1] - 16,
        "rodata": rodata[1] - 16,
        "relro": relro_of(_bisect.__file__, base),
        "read-only": read_only,
        "inaccessible": inaccessible,
        # The kernel's code, the padding at its end.
        "vdso": mappings_of("[vdso]")[0][1] - 16,
    }

def process(call):
    found = {}
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        for name, at in targets().items():
            mem.seek(at)
            found[name] = mem.read(6).hex()
            if name == "vdso" and call != 3:
                continue  # its resident cannot be put back: once
            mem.seek(at)
            try:
                mem.write(b"call%02d" % call)
            except OSError:
                pass  # refused: a shared mapping of a file opened read-only
    # The read-only page made writable, written and made read-only again.
    found["mprotected"] = ctypes.string_at(read_only + 8, 6).hex()
    if libc.mprotect(read_only, 4096, 3) == 0:
        ctypes.memmove(read_only + 8, b"call%02d" % call, 6)
        libc.mprotect(read_only, 4096, mmap.PROT_READ)
    return [os.getpid(), found]
"#;
    let mut worker = reset_worker();
    let mut served_by = Vec::new();
    let mut first = None;
    for call in 1..=6 {
        let reply = worker.call(&run(call, "read-only", source, json!({"call": call})));
        let (pid, found) = served(&reply.reply);
        served_by.push(pid);
        let marks: Vec<String> = (1..call)
            .map(|earlier| {
                format!("call{earlier:02}")
                    .bytes()
                    .map(|b| format!("{b:02x}"))
                    .collect()
            })
            .collect();
        for (name, read) in found.as_object().unwrap() {
            assert!(
                !marks.iter().any(|mark| mark == read.as_str().unwrap()),
                "call {call} read what an earlier call wrote at {name}: {found}"
            );
        }
        let first = first.get_or_insert_with(|| found.clone());
        assert_eq!(&found, first, "call {call} reads what the set-up left");
    }
    a_resident_served_more_than_one(&served_by);
}

/// A library's code and read-only data, and RELRO, are sealed in a
/// resident (`mseal`, Linux 6.10): the put-back reads only the mappings a
/// call can change. A call that tries to unmap or re-protect them is
/// refused (or, where the kernel cannot seal, its resident is retired),
/// and every later call finds them as they were; a read-only mapping a
/// call leaves, which the put-back does not read, is found by the size of
/// them all and unmapped, its resident kept.
#[test]
fn no_call_unmaps_or_reprotects_sealed_memory_and_what_it_maps_read_only_is_gone() {
    let source = r#"import ctypes, mmap, os, _bisect, bisect
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

def line_at(address):
    for line in open("/proc/self/maps"):
        start, end = (int(v, 16) for v in line.split()[0].split("-"))
        if start <= address < end:
            return " ".join(line.split()[:3])
    return None

CODE = next(
    int(line.split("-")[0], 16)
    for line in open("/proc/self/maps")
    if line.rstrip().endswith(_bisect.__file__) and line.split()[1].startswith("r-x")
)

def process(action, left=0):
    done = None
    if action == "unmap":
        done = [libc.munmap(CODE, 4096), ctypes.get_errno()]
    elif action == "protect":
        done = [libc.mprotect(CODE, 4096, 0), ctypes.get_errno()]
    elif action == "map":
        with open(_bisect.__file__, "rb") as f:
            done = libc.mmap(None, 4096, mmap.PROT_READ, mmap.MAP_PRIVATE, f.fileno(), 0)
    return [os.getpid(), {
        "done": done,
        "code": line_at(CODE),
        "left": line_at(left) if left else None,
        "bisect": bisect.bisect([1, 3, 5], 4),
    }]
"#;
    let mut worker = reset_worker();
    let mut id = 0;
    let mut call = |worker: &mut Worker, kwargs: Value| {
        id += 1;
        served(&worker.call(&run(id, "sealed", source, kwargs)).reply)
    };
    let (_, before) = call(&mut worker, json!({"action": "look"}));
    let code = before["code"].clone();
    assert!(
        code.as_str().is_some_and(|line| line.contains("r-x")),
        "{before}"
    );
    let (_, mapped) = call(&mut worker, json!({"action": "map"}));
    let left = mapped["done"].as_u64().expect("an address");
    assert!(mapped["left"].is_null() && left > 0, "{mapped}");
    let mut pids = Vec::new();
    let mut refused = true;
    for action in ["unmap", "protect"] {
        let (pid, tried) = call(&mut worker, json!({"action": action}));
        pids.push(pid);
        // Sealed: refused (EPERM); where the kernel cannot seal, done, and
        // the resident that did it is retired.
        refused &= tried["done"] == json!([-1, libc::EPERM]);
        for _ in 0..3 {
            let (pid, after) = call(&mut worker, json!({"action": "look", "left": left}));
            pids.push(pid);
            assert_eq!(after["code"], code, "{action}: {after}");
            assert_eq!(after["bisect"], 2, "{action}: {after}");
            assert_eq!(after["left"], Value::Null, "{action}: {after}");
        }
    }
    if refused {
        served_by_residents(&pids);
    } else {
        eprintln!("this kernel does not seal (mseal, Linux 6.10): the calls were refused nothing");
    }
}
