//! No call can see or touch another call or the runtime. Tried the way an
//! attacker would, from inside a node while other calls run: list
//! `/proc/self/fd` and `fdinfo`, signal every pidfd found, poke every
//! eventfd, walk every shared mapping in `/proc/self/maps` through
//! `/proc/self/mem`, looking for what another call printed and overwriting
//! it; and, since a child is a copy of the zygote's memory, freed heap
//! included, search all of its own memory for what earlier calls were sent
//! and returned. In `worker` mode, through the agent with `--parallel 2`,
//! and in a sweep with `-j 3`; each under `--isolation call` and `reset`.

mod common;

use std::time::Duration;

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Engine};
use common::{MEMORY_SCAN, Worker, masked, run};
use serde_json::{Value, json};

/// Every test runs in each: a fresh child per call, and a resident put back
/// after each call.
const ISOLATIONS: [&str; 2] = ["call", "reset"];

/// What the victim prints, for the attacker to look for.
const SECRET: &str = "victim-A-was-here-7d1c";

/// The attacker: reports everything it could reach, and harms what it can.
///
/// Both sides build the secret in the call (a join: CPython folds `a + b`
/// of literals at compile time): the node's module is in the zygote's
/// memory, and so in every child (and, under `reset`, in the snapshot's
/// read-only view), and a constant or global there is no call's.
const ATTACKER: &str = r#"import os, signal
def attack():
    SECRET = "".join(["victim-A-", "was-here-7d1c"]).encode()
    found = {"fds": {}, "pidfds": [], "eventfds": [], "sockets": [], "shared": [],
             "seen": 0, "seen_in": [], "forged": 0, "signalled": 0, "cwd": os.getcwd()}
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
            info = open(f"/proc/self/fdinfo/{fd}").read()
        except OSError:
            continue
        found["fds"][fd] = link
        if "pidfd" in link:
            found["pidfds"].append(info)
            try:
                signal.pidfd_send_signal(int(fd), signal.SIGKILL)
                found["signalled"] += 1
            except OSError:
                pass
        elif "eventfd" in link:
            found["eventfds"].append(fd)
            try:
                os.write(int(fd), (1).to_bytes(8, "little"))
            except OSError:
                pass
        elif link.startswith("socket:"):
            found["sockets"].append(fd)
    with open("/proc/self/mem", "r+b", buffering=0) as mem:
        for line in open("/proc/self/maps"):
            fields = line.split()
            if fields[1][3] != "s":
                continue
            found["shared"].append(line.strip())
            start, end = (int(x, 16) for x in fields[0].split("-"))
            try:
                mem.seek(start)
                data = mem.read(end - start)
            except OSError:
                continue
            at = data.find(SECRET)
            while at >= 0:
                found["seen"] += 1
                found["seen_in"].append([line.strip(), data[max(0, at - 64):at + 64].hex()])
                try:
                    mem.seek(start + at)
                    mem.write(b"FORGED".ljust(len(SECRET), b"!"))
                    found["forged"] += 1
                except OSError:
                    pass
                at = data.find(SECRET, at + 1)
    return found
"#;

/// The victim: prints the secret, then waits until `release` exists (a
/// minute at most: an attacker that never releases it fails the test, not
/// hangs it).
fn victim(release: &std::path::Path) -> String {
    let (head, tail) = SECRET.split_at(9);
    format!(
        "import fluksio, os, time\ndef victim():\n    print(''.join([{head:?}, {tail:?}]))\n    fluksio.emit(ready=True)\n    deadline = time.monotonic() + 60\n    while not os.path.exists({release:?}):\n        if time.monotonic() > deadline:\n            return 'never released'\n        time.sleep(0.01)\n    return 'A'\n",
        release = release.display().to_string()
    )
}

/// What an attacker must have found: its own stdio and reply pipe, one
/// shared mapping (its own log buffer), nothing of anyone else's. Under
/// `reset` also what puts its own process back (PROTOCOL-NOTES): its
/// control socket to the zygote, whose word is checked from outside
/// (`tests/reset.rs` forges it), the pagemap, its own maps (read-only,
/// queried for its mappings), its own `/proc/PID` and the files below it
/// its state is read from after each call (read-only; `/proc/locks` and
/// its cell's `cgroup.procs` too), the sealed snapshot (its view
/// read-only), and its own reply pipe's second fd.
fn assert_reached_nothing(found: &Value, isolation: &str) {
    let reset = isolation == "reset";
    assert_eq!(
        found["pidfds"],
        json!([]),
        "a pidfd of another process: {found}"
    );
    assert_eq!(
        found["eventfds"],
        json!([]),
        "another child's wake-up call: {found}"
    );
    assert_eq!(
        found["sockets"].as_array().unwrap().len(),
        usize::from(reset),
        "a socket of the runtime: {found}"
    );
    assert_eq!(
        found["seen"], 0,
        "another call's logs were readable: {found}"
    );
    assert_eq!(found["forged"], 0, "{found}");
    assert_eq!(found["signalled"], 0, "{found}");
    let writable: Vec<_> = found["shared"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|m| m.as_str().unwrap().split_whitespace().nth(1) == Some("rw-s"))
        .collect();
    assert_eq!(
        writable.len(),
        1,
        "only its own log buffer is shared writable: {found}"
    );
    let fds = found["fds"].as_object().unwrap();
    // Its own pid, as its pagemap's path names it: what it holds of /proc
    // must be its own.
    let own = fds
        .values()
        .filter_map(|t| t.as_str()?.strip_suffix("/pagemap")?.strip_prefix("/proc/"))
        .next()
        .unwrap_or("");
    // What the put-back reads after each call, kept open (`reset::pinned`):
    // its own files below /proc/PID, read-only; and the working directory
    // it sets back (`O_PATH`), the call's own.
    let children = format!("/task/{own}/children");
    let own_proc = [
        "",
        "/pagemap",
        "/maps",
        "/statm",
        "/fd",
        "/ns",
        "/task",
        "/status",
        "/environ",
        "/cmdline",
        "/comm",
        "/timers",
        "/cgroup",
        "/oom_score_adj",
        &children,
    ];
    let reset_own = |target: &str| {
        reset
            && (target.starts_with("socket:")
                || target
                    .strip_prefix("/proc/")
                    .and_then(|rest| rest.strip_prefix(own))
                    .is_some_and(|rest| own_proc.contains(&rest))
                || target == "/proc/locks"
                || found["cwd"] == target
                || (target.starts_with("/sys/fs/cgroup/") && target.ends_with("/cgroup.procs"))
                || target.starts_with("/memfd:fluksio-reset"))
    };
    let extra: Vec<&str> = fds
        .iter()
        .filter(|(fd, _)| !["0", "1", "2"].contains(&fd.as_str()))
        .map(|(_, target)| target.as_str().unwrap())
        .filter(|target| !reset_own(target))
        .collect();
    let pipes = if reset { 2 } else { 1 };
    assert_eq!(
        extra.len(),
        pipes,
        "no fd beyond stdio but its reply pipe: {found}"
    );
    assert!(extra.iter().all(|t| t.starts_with("pipe:")), "{found}");
    // Under `reset` a link's call (the agent's, a pool slot's) has a pipe
    // of its own in place of its child's, which waits beside it: what a
    // call writes there retires the child (`tests/reset.rs`).
    if !reset {
        assert!(extra.iter().all(|t| *t == extra[0]), "{found}");
    }
}

fn assert_victim_untouched(reply: &Value) {
    assert_eq!(reply["ok"], true, "the victim survived: {reply}");
    assert_eq!(reply["result"], "A", "{reply}");
    let logs = reply["logs"].as_str().unwrap();
    assert!(
        logs.contains(SECRET),
        "its own logs, as it printed them: {reply}"
    );
    assert!(!logs.contains("FORGED"), "{reply}");
}

#[test]
fn in_worker_mode_a_call_reaches_nothing_of_the_calls_before_it_or_the_worker() {
    let dir = common::scratch("attack-worker");
    let release = dir.join("release");
    std::fs::write(&release, "").unwrap();
    for isolation in ISOLATIONS {
        let mut worker = Worker::zygote(&["--isolation", isolation]);
        let source = format!(
            "{}\n{ATTACKER}\ndef process(role):\n    return victim() if role == 'victim' else attack()\n",
            victim(&release)
        );
        for id in 0..3 {
            let answer = worker.call(&run(id, "n", &source, json!({"role": "victim"})));
            assert_victim_untouched(&answer.reply);
        }
        let reply = worker
            .call(&run(9, "n", &source, json!({"role": "attacker"})))
            .reply;
        assert_reached_nothing(&reply["result"], isolation);
    }
}

#[test]
fn through_the_agent_one_call_cannot_kill_or_forge_another_in_flight() {
    for isolation in ISOLATIONS {
        one_call_cannot_kill_or_forge_another_through_the_agent(isolation);
    }
}

fn one_call_cannot_kill_or_forge_another_through_the_agent(isolation: &str) {
    let dir = common::scratch("attack-agent");
    let release = dir.join("release");
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(
        &engine.url,
        &["--parallel", "2", "--isolation", isolation],
        &[],
    );
    let connection = engine.next_connection(WAIT);
    let call = |call_id: &str, source: String| json!({"op": "run", "id": call_id, "call_id": call_id, "flow": "f", "node": call_id, "source": source, "kwargs": {}});
    connection.send(&call(
        "victim",
        format!(
            "{}\ndef process():\n    return victim()\n",
            victim(&release)
        ),
    ));
    connection.until(WAIT, |m| m["event"] == "emit");
    connection.send(&call(
        "attacker",
        format!("{ATTACKER}\ndef process():\n    return attack()\n"),
    ));
    let (_, attacked) = connection.reply("attacker", WAIT);
    std::fs::write(&release, "").unwrap();
    let (_, victim_reply) = connection.reply("victim", WAIT);
    assert_reached_nothing(&attacked["result"], isolation);
    assert_victim_untouched(&victim_reply);
}

#[test]
fn through_the_agent_a_call_in_a_lane_cannot_kill_or_forge_one_of_its_node_zygote() {
    let dir = common::scratch("attack-agent-lanes");
    let release = dir.join("release");
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(&engine.url, &["--parallel", "8", "--lanes", "2"], &[]);
    let connection = engine.next_connection(WAIT);
    // One node: the victim and two holders keep its zygote's fork loop
    // busy (three in flight), a third holder asks for a lane, and the
    // attacker, sent after, is forked by the lane.
    let source = format!(
        "{}\n{ATTACKER}\nimport fluksio, os, time\ndef process(role):\n    if role == 'victim':\n        return victim()\n    if role == 'attacker':\n        return {{'found': attack(), 'parent': os.getppid()}}\n    fluksio.emit(ready=True, parent=os.getppid())\n    while not os.path.exists({:?}):\n        time.sleep(0.01)\n    return os.getppid()\n",
        victim(&release),
        release.display().to_string()
    );
    let call = |call_id: &str, role: &str| json!({"op": "run", "id": call_id, "call_id": call_id, "flow": "f", "node": "shared", "source": source, "kwargs": {"role": role}});
    connection.send(&call("victim", "victim"));
    connection.until(WAIT, |m| m["event"] == "emit");
    let mut node_zygote = 0;
    for holder in ["h1", "h2", "h3"] {
        connection.send(&call(holder, "holder"));
        let started = connection.until(WAIT, |m| m["event"] == "emit");
        node_zygote = started.last().unwrap()["outputs"]["parent"]
            .as_i64()
            .unwrap();
    }
    common::agent::wait_for_a_lane(node_zygote as i32);
    std::thread::sleep(Duration::from_millis(200));
    let (_, attacked) = connection.reply_to(&call("attacker", "attacker"), WAIT);
    std::fs::write(&release, "").unwrap();
    let mut replies = std::collections::HashMap::new();
    while replies.len() < 4 {
        let message = connection.recv(WAIT).expect("the held calls' replies");
        if message.get("event").is_none() {
            replies.insert(message["call_id"].as_str().unwrap().to_string(), message);
        }
    }
    assert_ne!(
        attacked["result"]["parent"], node_zygote,
        "the attacker was forked by the lane: {attacked}"
    );
    assert_reached_nothing(&attacked["result"]["found"], "call");
    assert_victim_untouched(&replies["victim"]);
}

#[test]
fn in_a_sweep_one_point_cannot_kill_or_forge_another_in_flight() {
    let dir = common::scratch("attack-sweep");
    let release = dir.join("release");
    let node = dir.join("node.py");
    std::fs::write(
        &node,
        format!(
            "{}\n{ATTACKER}\nimport time\ndef process(x):\n    if x == 0:\n        return victim()\n    time.sleep(0.3)\n    found = attack()\n    open({:?}, 'w').close()\n    return found\n",
            victim(&release),
            release.display().to_string()
        ),
    )
    .unwrap();
    // From one zygote, and from three lanes (each a zygote of its own).
    for (lanes, isolation) in ["1", "3"]
        .into_iter()
        .flat_map(|lanes| ISOLATIONS.map(|isolation| (lanes, isolation)))
    {
        let _ = std::fs::remove_file(&release);
        let output = std::process::Command::new(common::ZYGOTE)
            .args([
                "sweep",
                node.to_str().unwrap(),
                "--grid",
                "x=0..2",
                "-j",
                "3",
                "--lanes",
                lanes,
                "--isolation",
                isolation,
            ])
            .stdin(std::process::Stdio::null())
            .output()
            .expect("the sweep runs");
        let stdout = String::from_utf8_lossy(&output.stdout);
        let points: Vec<Value> = stdout
            .lines()
            .filter_map(|l| serde_json::from_str(l).ok())
            .collect();
        assert_eq!(
            points.len(),
            3,
            "--lanes {lanes}: {stdout}\n{}",
            String::from_utf8_lossy(&output.stderr)
        );
        for point in &points {
            assert_eq!(point["ok"], true, "--lanes {lanes}: {point}");
            if point["kwargs"]["x"] == 0 {
                assert_eq!(point["result"], "A", "the victim survived: {point}");
            } else {
                assert_reached_nothing(&point["result"], isolation);
            }
        }
    }
}

#[test]
fn no_call_finds_what_earlier_calls_were_sent_or_returned_anywhere_in_its_memory() {
    let sent = format!("kwarg-secret-{}", std::process::id());
    let returned = format!("result-secret-{}", std::process::id());
    let victim =
        "def process(sent, returned, padding):\n    return {'returned': returned, 'echo': sent}\n";
    // Long, with the secrets last: a later, shorter request read into the
    // same buffer would not overwrite them.
    let padding = "p".repeat(16_000);
    // Under `node` too: the scan is another node's, whose resident is
    // forked from the zygote that relayed the victim's replies.
    for (binary, isolation) in common::builds()
        .iter()
        .flat_map(|b| ["call", "node", "reset"].map(|i| (b.clone(), i)))
    {
        let mut worker = Worker::zygote_of(&binary, &["--isolation", isolation]);
        for id in 0..3 {
            let reply = worker
                .call(&run(
                    id,
                    "victim",
                    victim,
                    json!({"padding": padding, "returned": returned, "sent": sent}),
                ))
                .reply;
            assert_eq!(reply["result"]["returned"], returned.as_str(), "{reply}");
        }
        for (id, secret) in [(10, &sent), (11, &returned)] {
            let reply = worker
                .call(&run(
                    id,
                    "scan",
                    MEMORY_SCAN,
                    json!({"masked": masked(secret)}),
                ))
                .reply;
            assert_eq!(
                reply["result"],
                json!([]),
                "{}, {isolation}: an earlier call's {secret:?} is in a later call's memory: {reply}",
                binary.display()
            );
        }
    }
}

/// One node that is the victim (holding `sent` in its kwargs) or the
/// scanner (`masked`): the same node, so its calls fork from the same
/// zygote, with no compile between them to replace its standby children.
fn victim_or_scanner(gate: &std::path::Path) -> String {
    format!(
        "{}\nimport os, time\ndef process(masked=None, sent=None, padding='', hold=False):\n    if masked is not None:\n        return scan(masked)\n    while hold and not os.path.exists({:?}):\n        time.sleep(0.01)\n    return sent[::-1]\n",
        MEMORY_SCAN.replace("def process(masked):", "def scan(masked):"),
        gate.display().to_string()
    )
}

/// `sent`, and what the victim returns for it.
fn sent_and_returned(name: &str) -> [String; 2] {
    let sent = format!("{name}-secret-{}", std::process::id());
    let returned = sent.chars().rev().collect();
    [sent, returned]
}

#[test]
fn in_worker_mode_no_call_finds_what_an_earlier_call_of_its_node_was_sent_or_returned() {
    let dir = common::scratch("attack-same-node");
    let gate = dir.join("gate");
    let source = victim_or_scanner(&gate);
    // Requests of pages, of blocks past glibc's first mmap threshold
    // (which it raises as such blocks are freed: later ones land in the
    // heap), and of megabytes, whose tail the loader's lazy binding saved
    // from the vector registers onto the zygote's stack (`bind_now`).
    for padding in [16_000, 700_000, 6_000_000] {
        let secrets = sent_and_returned(&format!("worker-same-node-{padding}"));
        let padding = "p".repeat(padding);
        for (binary, isolation) in common::builds()
            .iter()
            .flat_map(|b| ISOLATIONS.map(|i| (b.clone(), i)))
        {
            let mut worker = Worker::zygote_of(&binary, &["--isolation", isolation]);
            for id in 0..3 {
                let kwargs = json!({"sent": secrets[0], "padding": padding});
                let reply = worker.call(&run(id, "both", &source, kwargs)).reply;
                assert_eq!(reply["result"], secrets[1].as_str(), "{reply}");
            }
            for (id, secret) in (10..).zip(&secrets) {
                let reply = worker
                    .call(&run(id, "both", &source, json!({"masked": masked(secret)})))
                    .reply;
                assert_eq!(
                    reply["result"],
                    json!([]),
                    "{}, {isolation}: an earlier call's {secret:?} is in a later call's memory: {reply}",
                    binary.display()
                );
            }
        }
    }
}

#[test]
fn through_the_agent_no_call_finds_what_other_calls_of_its_node_were_sent_or_returned() {
    for isolation in ISOLATIONS {
        no_call_of_a_node_finds_another_through_the_agent(isolation);
    }
}

fn no_call_of_a_node_finds_another_through_the_agent(isolation: &str) {
    let secrets = sent_and_returned("agent-same-node");
    let in_flight = format!("in-flight-secret-{}", std::process::id());
    let dir = common::scratch("attack-agent-same-node");
    let gate = dir.join("gate");
    let source = victim_or_scanner(&gate);
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(
        &engine.url,
        &["--parallel", "4", "--isolation", isolation],
        &[],
    );
    let connection = engine.next_connection(WAIT);
    let call = |call_id: &str, kwargs: Value| json!({"op": "run", "id": call_id, "call_id": call_id, "flow": "f", "node": "both", "source": source, "kwargs": kwargs, "env": {"CALL_SECRET": secrets[0]}});
    let padding = "p".repeat(16_000);
    for i in 0..3 {
        let (_, reply) = connection.reply_to(
            &call(
                &format!("v{i}"),
                json!({"sent": secrets[0], "padding": padding}),
            ),
            WAIT,
        );
        assert_eq!(reply["result"], secrets[1].as_str(), "{reply}");
    }
    // One more, held in flight while the scans run.
    connection.send(&call(
        "held",
        json!({"sent": in_flight, "padding": padding, "hold": true}),
    ));
    std::thread::sleep(std::time::Duration::from_millis(300));
    for (i, secret) in secrets.iter().chain([&in_flight]).enumerate() {
        let mut request = call(&format!("s{i}"), json!({"masked": masked(secret)}));
        request["env"] = json!({});
        let (_, reply) = connection.reply_to(&request, WAIT);
        assert_eq!(
            reply["result"],
            json!([]),
            "another call's {secret:?} is in this call's memory: {reply}"
        );
    }
    std::fs::write(&gate, "").unwrap();
    let (_, reply) = connection.reply("held", WAIT);
    assert_eq!(reply["ok"], true, "{reply}");
}
