//! Nothing a call starts outlives it, whatever it does to get away:
//! `setsid()` daemons, double forks, fork bombs, ignored and blocked
//! signals; after its reply, a crash, a cancel, and a SIGKILL of the
//! worker, the agent or the agent's zygote. Each runs under the cgroup
//! mechanism (the default where cgroups can be made, as here) and, where
//! the fallback promises it too, under `FLUKSIO_CONTAINMENT=session`.
//! Memory: a call over `--call-memory-limit` gets a clear reply, and the
//! OOM killer is pointed at calls, never at the runtime.

mod common;

use std::path::Path;
use std::time::Duration;

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{Worker, run, wait_gone};
use serde_json::{Value, json};

/// Gone well within this; the bound is for a loaded machine, not a target.
const GONE: Duration = Duration::from_secs(15);

const SESSION: &[(&str, &str)] = &[("FLUKSIO_CONTAINMENT", "session")];

/// A node that starts a classic daemon (fork, `setsid`, fork again, the
/// middle one exits) that ignores every signal it can, blocks the rest and
/// sleeps; `then` runs after, with `daemon` its pid.
fn daemon_node(then: &str) -> String {
    format!(
        r#"import fluksio, os, signal, time
def process():
    read, write = os.pipe()
    if os.fork() == 0:
        os.setsid()
        if os.fork() == 0:
            for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGRTMAX - 1):
                signal.signal(s, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_BLOCK, set(signal.Signals) - {{signal.SIGKILL, signal.SIGSTOP}})
            os.write(write, str(os.getpid()).encode() + b"\n")
            time.sleep(3600)
        os._exit(0)
    daemon = int(os.read(read, 64))
    {then}
"#
    )
}

/// The first integer of the `pids` output of an emit, or of a result.
fn pid_in(value: &Value) -> i32 {
    value.as_i64().expect("a pid") as i32
}

fn assert_gone(pid: i32, after: &str) {
    assert!(
        wait_gone(pid, GONE),
        "process {pid} outlived its call {after}"
    );
}

#[test]
fn a_setsid_daemon_is_gone_after_the_reply() {
    for env in [&[][..], SESSION] {
        let mut worker = Worker::zygote_with(&[], env);
        let reply = worker
            .call(&run(1, "daemon", &daemon_node("return daemon"), json!({})))
            .reply;
        assert_gone(pid_in(&reply["result"]), &format!("replied ({env:?})"));
        let reply = worker
            .call(&run(2, "next", "def process():\n    return 7\n", json!({})))
            .reply;
        assert_eq!(reply["result"], 7, "the worker serves on");
    }
}

#[test]
fn a_setsid_daemon_is_gone_after_its_call_crashes() {
    for env in [&[][..], SESSION] {
        let mut worker = Worker::zygote_with(&[], env);
        let source = daemon_node("fluksio.emit(pid=daemon)\n    os._exit(3)");
        let answer = worker.call(&run(1, "crash", &source, json!({})));
        assert!(
            answer.reply["error"]["message"]
                .as_str()
                .unwrap()
                .contains("exited with code 3"),
            "{}",
            answer.reply
        );
        assert_gone(
            pid_in(&answer.events[0]["outputs"]["pid"]),
            &format!("crashed ({env:?})"),
        );
    }
}

#[test]
fn a_daemon_that_ignores_every_signal_dies_with_its_killed_worker() {
    let mut worker = Worker::zygote(&[]);
    let source = daemon_node(
        "fluksio.emit(pids=[daemon, os.getpid()])\n    \
         for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGRTMAX - 1):\n        \
         signal.signal(s, signal.SIG_IGN)\n    \
         time.sleep(3600)",
    );
    worker.send(&run(1, "stubborn", &source, json!({})));
    let event = worker.next_line();
    let pids = common::pids_in(&event["outputs"]["pids"]);
    // As the engine's pool does on a timeout: SIGKILL to the pid it spawned.
    common::sigkill(worker.pid());
    for pid in pids {
        assert_gone(pid, "after its worker was SIGKILLed");
    }
}

/// A fork bomb, bounded so the machine survives it: every process forks
/// two children down to a depth, each leaves its session, records its pid
/// and sleeps.
fn fork_bomb(pids: &Path) -> String {
    format!(
        r#"import os, time
def bomb(depth, record):
    for _ in range(2):
        if depth and os.fork() == 0:
            os.setsid()
            with open(record, "a") as f:
                f.write(f"{{os.getpid()}}\n")
            bomb(depth - 1, record)
            time.sleep(3600)
def process():
    bomb(6, {record:?})
    while len(open({record:?}).read().split()) < 126:
        time.sleep(0.01)
    return "detonated"
"#,
        record = pids.display().to_string()
    )
}

#[test]
fn a_fork_bomb_that_leaves_its_sessions_is_ended_with_its_call() {
    let dir = common::scratch("bomb");
    for (index, env) in [&[][..], SESSION].into_iter().enumerate() {
        let record = dir.join(format!("pids-{index}"));
        std::fs::write(&record, "").unwrap();
        let mut worker = Worker::zygote_with(&[], env);
        let reply = worker
            .call(&run(1, "bomb", &fork_bomb(&record), json!({})))
            .reply;
        assert_eq!(reply["result"], "detonated", "{reply}");
        let pids: Vec<i32> = std::fs::read_to_string(&record)
            .unwrap()
            .split_whitespace()
            .map(|p| p.parse().unwrap())
            .collect();
        assert_eq!(pids.len(), 126);
        for pid in pids {
            assert_gone(pid, &format!("of a fork bomb ({env:?})"));
        }
    }
}

#[test]
fn a_multiprocessing_pool_is_gone_after_the_reply() {
    let mut worker = Worker::zygote(&[]);
    let source = "import multiprocessing as mp\npool = None\ndef process():\n    global pool\n    pool = mp.get_context('fork').Pool(3)\n    return [p.pid for p in pool._pool]\n";
    let reply = worker.call(&run(1, "pool", source, json!({}))).reply;
    for pid in reply["result"].as_array().expect("pids") {
        assert_gone(pid_in(pid), "(a pool left open)");
    }
}

fn agent_with_connection(args: &[&str]) -> (Engine, Agent, common::engine::Connection) {
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, args, &[]);
    let connection = engine.next_connection(WAIT);
    (engine, agent, connection)
}

fn agent_run(call_id: &str, source: &str) -> Value {
    json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": call_id, "source": source, "kwargs": {}})
}

/// Starts the daemon node through the agent; the daemon's and the call's pids.
fn agent_daemon(connection: &common::engine::Connection, call_id: &str) -> Vec<i32> {
    let source = daemon_node(
        "fluksio.emit(pids=[daemon, os.getpid()])\n    \
         signal.signal(signal.SIGRTMAX - 1, signal.SIG_IGN)\n    \
         time.sleep(3600)",
    );
    connection.send(&agent_run(call_id, &source));
    let emitted = connection.until(WAIT, |m| m["event"] == "emit");
    emitted.last().expect("an emit")["outputs"]["pids"]
        .as_array()
        .expect("pids")
        .iter()
        .map(pid_in)
        .collect()
}

#[test]
fn a_cancelled_call_takes_its_daemon_with_it() {
    let (_engine, _agent, connection) = agent_with_connection(&[]);
    let pids = agent_daemon(&connection, "c1");
    connection.send(&json!({"op": "cancel", "call_id": "c1"}));
    let (_, reply) = connection.reply("c1", WAIT);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
    for pid in pids {
        assert_gone(pid, "after a cancel");
    }
}

#[test]
fn a_sigkilled_agent_takes_its_calls_daemons_and_services_with_it() {
    let dir = common::scratch("agent-kill");
    let (_engine, agent, connection) = agent_with_connection(&[]);
    let mut pids = agent_daemon(&connection, "k1");
    // A service that starts a process of its own in a session of its own.
    let record = dir.join("service-child");
    connection.send(&json!({
        "op": "serve", "call_id": "svc",
        "argv": ["sh", "-c", "setsid sleep 3600 & echo $! > \"$1\"; exec sleep 3600", "sh", record.to_str().unwrap()],
    }));
    let mut service_child = None;
    for _ in 0..500 {
        if let Some(pid) = std::fs::read_to_string(&record)
            .ok()
            .and_then(|t| t.trim().parse::<i32>().ok())
        {
            service_child = Some(pid);
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    pids.push(service_child.expect("the service started its child"));
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    for pid in pids {
        assert_gone(pid, "after the agent was SIGKILLed");
    }
}

#[test]
fn a_sigkilled_zygote_takes_its_calls_daemons_with_it() {
    let (_engine, _agent, connection) = agent_with_connection(&[]);
    let pids = agent_daemon(&connection, "z1");
    // The call's parent is the agent's zygote.
    let zygote = common::parent_of(pids[1]);
    common::sigkill(zygote);
    let (_, reply) = connection.reply("z1", WAIT);
    assert_eq!(reply["ok"], false, "{reply}");
    for pid in pids {
        assert_gone(pid, "after its zygote was SIGKILLed");
    }
}

/// Allocates `mb` MiB in 16 MiB steps, touching every page.
const GREEDY: &str = "def process(mb):\n    held = []\n    for _ in range(mb // 16):\n        held.append(bytearray(16 * 1024 * 1024))\n    return len(held) * 16\n";

#[test]
fn a_call_over_its_memory_limit_gets_a_clear_error_and_the_worker_serves_on() {
    for env in [&[][..], SESSION] {
        let mut worker = Worker::zygote_with(&["--call-memory-limit", "128"], env);
        let under = worker
            .call(&run(1, "greedy", GREEDY, json!({"mb": 64})))
            .reply;
        assert_eq!(under["result"], 64, "{under}");
        // Bounded: at most 512 MiB is ever asked for.
        let over = worker
            .call(&run(2, "greedy", GREEDY, json!({"mb": 512})))
            .reply;
        assert_eq!(over["ok"], false, "{over}");
        assert_eq!(over["error"]["type"], "MemoryError", "{over}");
        let message = over["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("exceeded the call's memory limit of 128 MiB"),
            "{env:?}: {message}"
        );
        let after = worker
            .call(&run(3, "greedy", GREEDY, json!({"mb": 32})))
            .reply;
        assert_eq!(after["result"], 32, "the worker serves on: {after}");
    }
}

#[test]
fn the_memory_limit_is_also_set_by_the_environment_for_the_pool() {
    let mut worker = Worker::zygote_with(&[], &[("FLUKSIO_CALL_MEMORY_LIMIT_MIB", "96")]);
    let over = worker
        .call(&run(1, "greedy", GREEDY, json!({"mb": 320})))
        .reply;
    assert!(
        over["error"]["message"]
            .as_str()
            .unwrap()
            .contains("memory limit of 96 MiB"),
        "{over}"
    );
}

#[test]
fn the_oom_killer_is_pointed_at_calls_never_at_the_runtime() {
    let mut worker = Worker::zygote(&[]);
    let source = "import os\ndef process():\n    return [int(open('/proc/self/oom_score_adj').read()), os.getppid()]\n";
    let reply = worker.call(&run(1, "oom", source, json!({}))).reply;
    assert_eq!(reply["result"][0], 1000, "{reply}");
    let zygote: i32 = std::fs::read_to_string(format!("/proc/{}/oom_score_adj", worker.pid()))
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    assert!(
        zygote < 1000,
        "the zygote is not the OOM killer's first pick"
    );
}
