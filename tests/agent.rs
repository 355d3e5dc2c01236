//! `fluksio-zygote agent` against an engine written for the tests.

mod common;

use std::process::{Command, Stdio};
use std::time::Duration;

use common::ZYGOTE;
use common::agent::{Agent, TOKEN, WAIT, attached};
use common::engine::{Answer, Engine};
use serde_json::{Value, json};

fn run(call_id: &str, source: &str, kwargs: Value) -> Value {
    json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": call_id, "source": source, "kwargs": kwargs})
}

#[test]
fn a_run_round_trip_with_events_in_order() {
    let (_engine, _agent, connection) = attached();
    assert_eq!(connection.hello["op"], "hello");
    connection.send(&run("c1", "import fluksio\ndef process(n):\n    for i in range(n):\n        yield {'i': i}\n    fluksio.emit(done=True)\n    return n\n", json!({"n": 3})));
    let (events, reply) = connection.reply("c1", WAIT);
    let events = without_heartbeats(events);
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(reply["result"], 3, "{reply}");
    assert_eq!(reply["ok"], true);
}

fn compile(call_id: &str, source: &str) -> Value {
    json!({"op": "compile", "id": "c", "call_id": call_id, "flow": "f", "node": call_id, "source": source})
}

fn without_heartbeats(events: Vec<Value>) -> Vec<Value> {
    events
        .into_iter()
        .filter(|e| e["event"] != "heartbeat")
        .collect()
}

fn pids(message: &Value) -> Vec<i32> {
    message["outputs"]["pids"]
        .as_array()
        .expect("pids")
        .iter()
        .map(|p| p.as_i64().unwrap() as i32)
        .collect()
}

/// A node that reports its pid and a grandchild's, then sleeps.
const SLEEPER: &str = "import fluksio, os, subprocess, time\ndef process():\n    sleeper = subprocess.Popen(['sleep', '3600'])\n    fluksio.emit(pids=[os.getpid(), sleeper.pid, os.getppid()])\n    time.sleep(3600)\n";

fn all_gone(pids: &[i32]) {
    for &pid in pids {
        assert!(
            common::wait_gone(pid, Duration::from_secs(15)),
            "process {pid} outlived its call"
        );
    }
}

#[test]
fn hello_carries_every_field_of_protocol_3() {
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(
        &engine.url,
        &[
            "--name",
            "w1",
            "--labels",
            "gpu, cuda12",
            "--parallel",
            "3",
            "--service-host",
            "10.1.1.1",
            "--cpus",
            "7",
            "--gpus",
            "2",
            "--ram-mb",
            "1234",
        ],
        &[],
    );
    let connection = engine.next_connection(WAIT);
    let hello = &connection.hello;
    assert_eq!(hello["op"], "hello");
    assert_eq!(hello["protocol"], 3);
    assert!(hello["version"].as_str().is_some_and(|v| !v.is_empty()));
    assert_eq!(hello["name"], "w1");
    assert_eq!(hello["labels"], json!(["gpu", "cuda12"]));
    assert_eq!(hello["python"], common::python().display().to_string());
    assert_eq!(hello["max_parallel"], 3);
    assert_eq!(hello["service_host"], "10.1.1.1");
    assert_eq!(
        hello["inventory"],
        json!({"cpus": 7, "gpus": 2, "ram_mb": 1234})
    );
    let freeze = Command::new(common::python())
        .args(["-m", "pip", "freeze"])
        .output()
        .unwrap()
        .stdout;
    let digest = common::artifact_server::sha256_bytes(&freeze);
    assert_eq!(
        hello["venv_digest"],
        digest[..16],
        "sha256 of pip freeze, 16 hex"
    );
    assert_eq!(
        connection.headers.get("authorization"),
        Some(&format!("Bearer {TOKEN}"))
    );
    assert!(
        !connection.path.contains(TOKEN),
        "the token is not in the URL: {}",
        connection.path
    );

    let _agent = Agent::start(
        &engine.url,
        &[],
        &[
            ("SLURM_CPUS_ON_NODE", "5"),
            ("SLURM_MEM_PER_NODE", "999"),
            ("SLURM_JOB_GPUS", "0,1,2"),
        ],
    );
    let connection = engine.next_connection(WAIT);
    assert_eq!(
        connection.hello["inventory"],
        json!({"cpus": 5, "gpus": 3, "ram_mb": 999})
    );
    let hostname = nix::unistd::gethostname()
        .unwrap()
        .to_string_lossy()
        .into_owned();
    assert_eq!(connection.hello["name"], hostname);
}

#[test]
fn compile_and_errors_come_back_as_replies() {
    let (_engine, _agent, connection) = attached();
    connection.send(&compile(
        "k1",
        "print('loading')\ndef process():\n    return 1\n",
    ));
    let (_, reply) = connection.reply("k1", WAIT);
    assert_eq!(
        reply,
        json!({"id": "c", "call_id": "k1", "result": null, "ok": true, "logs": "loading\n"})
    );
    connection.send(&compile("k2", "def process(:\n"));
    let (_, reply) = connection.reply("k2", WAIT);
    assert_eq!(
        reply["error"]["short"],
        "SyntaxError: invalid syntax (line 1)"
    );
    connection.send(&json!({"op": "run", "id": 3, "call_id": "k3", "node": "n"}));
    let (_, reply) = connection.reply("k3", WAIT);
    assert_eq!(reply["error"]["type"], "ProtocolError", "{reply}");
    connection.send(&json!({"op": "nonsense", "call_id": "k4"}));
    connection.send(&run(
        "k5",
        "def process():\n    return 'still here'\n",
        json!({}),
    ));
    let (_, reply) = connection.reply("k5", WAIT);
    assert_eq!(reply["result"], "still here");
}

#[test]
fn heartbeats_while_a_call_runs_and_none_after() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run(
        "h1",
        "import time\ndef process():\n    time.sleep(1.5)\n    return 'slept'\n",
        json!({}),
    ));
    let (events, reply) = connection.reply("h1", WAIT);
    assert_eq!(reply["result"], "slept");
    let beats: Vec<_> = events
        .iter()
        .filter(|e| e["event"] == "heartbeat")
        .collect();
    assert!(beats.len() >= 2, "heartbeats every 0.3 s: {events:?}");
    assert!(
        beats
            .iter()
            .all(|b| **b == json!({"call_id": "h1", "event": "heartbeat"}))
    );
    assert!(
        connection.recv(Duration::from_secs(1)).is_none(),
        "no heartbeat after the reply"
    );
}

#[test]
fn cancel_kills_a_sleeping_node_and_what_it_started() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run("s1", SLEEPER, json!({})));
    let started = connection.until(WAIT, |m| m["event"] == "emit");
    let pids = pids(started.last().unwrap());
    connection.send(&json!({"op": "cancel", "call_id": "nobody"}));
    connection.send(&json!({"op": "cancel", "call_id": "s1"}));
    let (_, reply) = connection.reply("s1", WAIT);
    assert_eq!(reply["ok"], false);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("SIGKILL"),
        "{reply}"
    );
    all_gone(&pids[..2]);
    connection.send(&run("s2", "def process():\n    return 'next'\n", json!({})));
    assert_eq!(connection.reply("s2", WAIT).1["result"], "next");
}

#[test]
fn a_node_that_ends_its_process_says_how() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run(
        "e1",
        "import os\ndef process():\n    print('bye')\n    os._exit(3)\n",
        json!({}),
    ));
    let (_, reply) = connection.reply("e1", WAIT);
    assert_eq!(reply["error"]["type"], "RemoteError");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("exited with code 3"),
        "{reply}"
    );
    assert_eq!(reply["logs"], "bye\n");
    connection.send(&run(
        "e2",
        "import ctypes\ndef process():\n    ctypes.string_at(0)\n",
        json!({}),
    ));
    let (_, reply) = connection.reply("e2", WAIT);
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("killed by SIGSEGV"),
        "{reply}"
    );
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

fn http_get(port: u16, path: &str) -> Option<String> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(("127.0.0.1", port)).ok()?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: x\r\n\r\n").ok()?;
    let mut answer = String::new();
    stream.read_to_string(&mut answer).ok()?;
    Some(answer)
}

#[test]
fn serve_runs_a_real_server_with_its_weights_until_cancelled() {
    let dir = common::scratch("agent-serve");
    let store = common::artifact_server::ArtifactServer::start(&dir.join("store"), Some(TOKEN));
    std::fs::write(dir.join("weights.bin"), b"the weights, verified").unwrap();
    let digest = store.place(&dir.join("weights.bin"));
    let engine = Engine::start(Answer::Welcome);
    let cache = dir.join("cache");
    let _agent = Agent::start(
        &engine.url,
        &["--artifact-url", &store.url],
        &[("FLUKSIO_ARTIFACT_CACHE", cache.to_str().unwrap())],
    );
    let connection = engine.next_connection(WAIT);
    let port = free_port();
    let python = common::python().display().to_string();
    connection.send(&json!({
        "op": "serve", "call_id": "svc", "weights": digest,
        "argv": ["sh", "-c", "cd \"$(dirname \"$1\")\" && exec \"$2\" -m http.server \"$3\" --bind 127.0.0.1", "sh", "{weights}", python, port.to_string()],
    }));
    let hex = &digest[7..];
    let mut served = None;
    for _ in 0..300 {
        if let Some(answer) = http_get(port, &format!("/{hex}")) {
            served = Some(answer);
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let served = served.expect("the service answers on its port");
    assert!(served.ends_with("the weights, verified"), "{served}");
    let beat = connection.until(WAIT, |m| m["event"] == "heartbeat");
    assert_eq!(beat.last().unwrap()["call_id"], "svc");
    connection.send(&json!({"op": "cancel", "call_id": "svc"}));
    let (_, reply) = connection.reply("svc", WAIT);
    assert_eq!(
        reply,
        json!({"call_id": "svc", "ok": false, "error": {"type": "ServiceStopped", "message": "the service was stopped", "short": "the service was stopped", "traceback": ""}})
    );
    assert!(http_get(port, "/").is_none(), "the server is gone");

    connection.send(&json!({"op": "serve", "call_id": "svc2", "argv": ["sh", "-c", "echo starting; echo failing >&2; exit 4"]}));
    let (_, reply) = connection.reply("svc2", WAIT);
    assert_eq!(
        reply["error"]["message"],
        "the service exited with code 4: failing"
    );
    connection.send(
        &json!({"op": "serve", "call_id": "svc3", "argv": ["true"], "weights": "sha256:nope"}),
    );
    let (_, reply) = connection.reply("svc3", WAIT);
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("could not fetch"),
        "{reply}"
    );
}

#[test]
fn a_refusal_stops_the_agent_once() {
    let engine = Engine::start(Answer::Refuse("no room for this worker".into()));
    let mut agent = Agent::start(&engine.url, &[], &[]);
    assert_eq!(agent.wait(WAIT), Some(1));
    assert_eq!(engine.attempts(), 1, "no retry");
    assert!(agent.log().contains("no room for this worker"));
}

#[test]
fn a_401_at_the_handshake_stops_the_agent_once() {
    let engine = Engine::start(Answer::Status(401));
    let mut agent = Agent::start(&engine.url, &[], &[]);
    assert_eq!(agent.wait(WAIT), Some(1));
    assert_eq!(engine.attempts(), 1, "no retry");
    let log = agent.log();
    assert!(log.contains("401") && !log.contains(TOKEN), "{log}");
}

#[test]
fn a_dropped_socket_ends_the_calls_then_reconnects() {
    let (engine, _agent, connection) = attached();
    connection.send(&run("d1", SLEEPER, json!({})));
    let pids = pids(
        connection
            .until(WAIT, |m| m["event"] == "emit")
            .last()
            .unwrap(),
    );
    connection.drop_socket();
    all_gone(&pids[..2]);
    let again = engine.next_connection(WAIT);
    assert_eq!(again.hello["op"], "hello");
    again.send(&run(
        "d2",
        "def process():\n    return 'reconnected'\n",
        json!({}),
    ));
    assert_eq!(again.reply("d2", WAIT).1["result"], "reconnected");
    again.close();
    let third = engine.next_connection(Duration::from_secs(5));
    assert_eq!(
        third.hello["op"], "hello",
        "a clean close reconnects at once"
    );
}

#[test]
fn sigterm_ends_every_call_and_exits_0() {
    let engine = Engine::start(Answer::Welcome);
    let mut agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    connection.send(&run("t1", SLEEPER, json!({})));
    let pids = pids(
        connection
            .until(WAIT, |m| m["event"] == "emit")
            .last()
            .unwrap(),
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(agent.wait(WAIT), Some(0));
    all_gone(&pids);
}

#[test]
fn max_idle_stops_an_idle_agent() {
    let engine = Engine::start(Answer::Welcome);
    let mut agent = Agent::start(&engine.url, &["--max-idle", "1"], &[]);
    let connection = engine.next_connection(WAIT);
    connection.send(&run(
        "i1",
        "import time\ndef process():\n    time.sleep(1.5)\n    return 1\n",
        json!({}),
    ));
    assert_eq!(
        connection.reply("i1", WAIT).1["result"],
        1,
        "a running call is not idleness"
    );
    assert_eq!(agent.wait(WAIT), Some(0));
    assert!(agent.log().contains("nothing to do"));
}

#[test]
fn plain_text_off_this_machine_needs_insecure() {
    for args in [
        vec!["--url", "ws://10.1.2.3:9/api/v1/workers/attach"],
        vec![
            "--url",
            "ws://127.0.0.1:9/a",
            "--artifact-url",
            "http://10.1.2.3/artifacts",
        ],
    ] {
        let output = Command::new(ZYGOTE)
            .arg("agent")
            .args(&args)
            .args(["--token", TOKEN])
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(2));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            stderr.contains("is not encrypted") && stderr.contains("--insecure"),
            "{stderr}"
        );
    }
    let output = Command::new(ZYGOTE)
        .args(["agent", "--url", "ws://127.0.0.1:9/a"])
        .env_remove("FLUKSIO_WORKER_TOKEN")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stderr).contains("a token is required"));
    let mut agent = Agent::start(
        "ws://10.1.2.3:9/api/v1/workers/attach",
        &["--insecure"],
        &[],
    );
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        agent.child.try_wait().unwrap().is_none(),
        "--insecure lets it try:\n{}",
        agent.log()
    );
}

#[test]
fn node_code_sees_neither_credentials_nor_the_token() {
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(
        &engine.url,
        &[],
        &[
            ("SECRET_KEY", "hush"),
            ("MY_API_TOKEN", "t0k"),
            ("DATABASE_URL_RO", "db"),
            ("db_password", "pw"),
            ("KEEP_ME", "kept"),
        ],
    );
    let connection = engine.next_connection(WAIT);
    connection.send(&run(
        "env",
        "import os\ndef process(t):\n    zygote = os.getppid()\n    agent = int(open('/proc/%d/stat' % zygote).read().rsplit(')', 1)[1].split()[1])\n    raw = b''.join(open('/proc/%s/%s' % (p, f), 'rb').read() for p in ('self', zygote, agent) for f in ('environ', 'cmdline'))\n    return [sorted(k for k in os.environ if k in ('SECRET_KEY', 'MY_API_TOKEN', 'DATABASE_URL_RO', 'db_password', 'FLUKSIO_WORKER_TOKEN', 'FLUKSIO_ARTIFACT_TOKEN')), os.environ.get('KEEP_ME'), os.environ.get('FLUKSIO_ARTIFACT_URL'), raw.count(t.encode())]\n",
        json!({"t": TOKEN}),
    ));
    let (_, reply) = connection.reply("env", WAIT);
    let port = engine.port;
    assert_eq!(
        reply["result"],
        json!([
            [],
            "kept",
            format!("http://127.0.0.1:{port}/api/v1/artifacts"),
            0
        ]),
        "{reply}"
    );
}

#[test]
fn cuda_devices_are_read_in_the_agent_mask() {
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(&engine.url, &[], &[("CUDA_VISIBLE_DEVICES", "2,3")]);
    let connection = engine.next_connection(WAIT);
    let mut request = run(
        "cuda",
        "import os\ndef process():\n    return [os.environ['CUDA_VISIBLE_DEVICES'], os.environ['OMP_NUM_THREADS']]\n",
        json!({}),
    );
    request["env"] = json!({"CUDA_VISIBLE_DEVICES": "1", "OMP_NUM_THREADS": 4});
    let (_, reply) = connection.reply_to(&request, WAIT);
    assert_eq!(reply["result"], json!(["3", "4"]));
}

#[test]
fn a_dead_zygote_fails_its_calls_and_is_replaced() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run("z1", SLEEPER, json!({})));
    let pids = pids(
        connection
            .until(WAIT, |m| m["event"] == "emit")
            .last()
            .unwrap(),
    );
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pids[2]),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let (_, reply) = connection.reply("z1", WAIT);
    assert_eq!(reply["ok"], false);
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("zygote"),
        "{reply}"
    );
    all_gone(&pids);
    connection.send(&run(
        "z2",
        "import os\ndef process():\n    return os.getppid()\n",
        json!({}),
    ));
    let (_, reply) = connection.reply("z2", WAIT);
    assert!(
        reply["result"]
            .as_i64()
            .is_some_and(|p| p as i32 != pids[2]),
        "a new zygote: {reply}"
    );
}

#[test]
fn a_zygote_that_cannot_start_stops_the_agent_with_its_error() {
    let engine = Engine::start(Answer::Welcome);
    let mut agent = Agent::start(&engine.url, &["--preload", "no_such_module_anywhere"], &[]);
    // A start-up failure: exit 2, as in every mode.
    assert_eq!(agent.wait(WAIT), Some(2));
    let log = agent.log();
    assert!(
        log.contains("could not preload no_such_module_anywhere")
            && log.contains("ModuleNotFoundError"),
        "{log}"
    );
}

#[test]
fn calls_that_arrive_before_the_zygote_is_ready_wait_for_it() {
    let dir = common::scratch("agent-slow");
    std::fs::write(dir.join("slow_import.py"), "import time\ntime.sleep(2)\n").unwrap();
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(
        &engine.url,
        &["--preload", "slow_import"],
        &[("PYTHONPATH", dir.to_str().unwrap())],
    );
    let connection = engine.next_connection(WAIT);
    connection.send(&run(
        "w1",
        "import sys\ndef process():\n    return 'slow_import' in sys.modules\n",
        json!({}),
    ));
    assert_eq!(connection.reply("w1", WAIT).1["result"], true);
}

/// A certificate authority and a server certificate for 127.0.0.1 and
/// localhost, made with openssl: (ca.pem path, server chain, server key).
fn certificates(dir: &std::path::Path) -> (std::path::PathBuf, Vec<u8>, Vec<u8>) {
    let run = |args: &[&str]| {
        let status = Command::new("openssl")
            .args(args)
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success(), "openssl {args:?}");
    };
    run(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=fluksio test CA",
    ]);
    run(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        dir.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\n",
    )
    .unwrap();
    run(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
    (
        dir.join("ca.pem"),
        std::fs::read(dir.join("server.pem")).unwrap(),
        std::fs::read(dir.join("server.key")).unwrap(),
    )
}

#[test]
fn wss_verifies_the_engine_with_the_given_ca() {
    let dir = common::scratch("agent-tls");
    let (ca, chain, key) = certificates(&dir);
    let engine = Engine::start_with(Answer::Welcome, Some((chain, key)));
    let url = format!("wss://localhost:{}/api/v1/workers/attach", engine.port);
    let _agent = Agent::start(&url, &["--ca-cert", ca.to_str().unwrap()], &[]);
    let connection = engine.next_connection(WAIT);
    connection.send(&run(
        "tls",
        "def process():\n    return 'over tls'\n",
        json!({}),
    ));
    assert_eq!(connection.reply("tls", WAIT).1["result"], "over tls");

    // Without the CA the engine's certificate is not trusted: no session.
    let mut untrusting = Agent::start(&url, &[], &[]);
    assert!(
        engine.try_next_connection(Duration::from_secs(3)).is_none(),
        "an untrusted engine must not be attached to"
    );
    std::thread::sleep(Duration::from_millis(500));
    let log = untrusting.log();
    assert!(
        log.contains("retrying") && (log.contains("certificate") || log.contains("Certificate")),
        "{log}"
    );
    let _ = untrusting.child.kill();
}

/// What one worker answers to the same session: its hello, then the events
/// and reply of each request (timestamps and heartbeats aside).
fn scenario(engine: &Engine) -> (Value, Vec<(Vec<Value>, Value)>) {
    let connection = engine.next_connection(WAIT);
    let requests = [
        run(
            "r1",
            "def process(x):\n    print('hi')\n    return {'double': x * 2, 'f': 0.5}\n",
            json!({"x": 21}),
        ),
        run(
            "r2",
            "import fluksio\ndef process():\n    yield {'a': 1}\n    fluksio.emit(b=[1, 2])\n    return 'done'\n",
            json!({}),
        ),
        run("r3", "def process():\n    raise KeyError('k')\n", json!({})),
        compile("r4", "print('loading')\ndef process():\n    return 1\n"),
        run(
            "r5",
            "import os\ndef process():\n    return os.environ.get('FLUKSIO_ARTIFACT_URL')\n",
            json!({}),
        ),
    ];
    let answers = requests
        .iter()
        .map(|request| {
            let (events, reply) = connection.reply_to(request, WAIT);
            let events = without_heartbeats(events)
                .into_iter()
                .map(|mut e| {
                    e.as_object_mut().unwrap().remove("ts");
                    e
                })
                .collect();
            (events, reply)
        })
        .collect();
    (connection.hello.clone(), answers)
}

#[test]
fn hello_and_replies_match_the_reference_agent() {
    let theirs = {
        let engine = Engine::start(Answer::Welcome);
        let agent_py = common::reference_dir().join("fluksio_worker/agent.py");
        let mut child = Command::new(common::python())
            .arg(agent_py)
            .args([
                "--url",
                &engine.url,
                "--token",
                TOKEN,
                "--name",
                "same",
                "--labels",
                "a,b",
            ])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("agent.py starts (pip install websockets)");
        let seen = scenario(&engine);
        let _ = child.kill();
        let _ = child.wait();
        seen
    };
    let ours = {
        let engine = Engine::start(Answer::Welcome);
        let _agent = Agent::start(&engine.url, &["--name", "same", "--labels", "a,b"], &[]);
        scenario(&engine)
    };
    let (mut their_hello, mut our_hello) = (theirs.0, ours.0);
    // agent.py reports the installed fluksio-worker's version (none here).
    their_hello.as_object_mut().unwrap().remove("version");
    our_hello.as_object_mut().unwrap().remove("version");
    assert_eq!(our_hello, their_hello, "hello");
    for (index, (theirs, ours)) in theirs.1.iter().zip(&ours.1).enumerate() {
        let mut ours = ours.clone();
        if index == 4 {
            // Each engine listens on its own port.
            ours.1["result"] = theirs.1["result"].clone();
        }
        assert_eq!(&ours, theirs, "request {index}");
    }
}

#[test]
fn a_compile_stuck_loading_is_cancelled_and_the_agent_serves_on() {
    let engine = Engine::start(Answer::Welcome);
    let mut agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    connection.send(&compile(
        "stuck",
        "import time\ntime.sleep(3600)\ndef process():\n    return 1\n",
    ));
    // Let the trial start, then cancel it.
    std::thread::sleep(Duration::from_millis(800));
    connection.send(&json!({"op": "cancel", "call_id": "stuck"}));
    let (_, reply) = connection.reply("stuck", WAIT);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
    connection.send(&run(
        "after",
        "def process():\n    return 'served'\n",
        json!({}),
    ));
    assert_eq!(connection.reply("after", WAIT).1["result"], "served");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(agent.wait(WAIT), Some(0));
}

#[test]
fn a_cancel_right_behind_its_run_is_not_lost() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run(
        "quick",
        "import time\ndef process():\n    time.sleep(3600)\n",
        json!({}),
    ));
    connection.send(&json!({"op": "cancel", "call_id": "quick"}));
    let (_, reply) = connection.reply("quick", WAIT);
    assert_eq!(reply["error"]["type"], "NodeCancelled", "{reply}");
}

#[test]
fn calls_sharing_a_call_id_are_each_tracked() {
    let (_engine, _agent, connection) = attached();
    connection.send(&run("twin", SLEEPER, json!({})));
    connection.send(&run("twin", SLEEPER, json!({})));
    let mut pids_seen = Vec::new();
    while pids_seen.len() < 2 {
        let message = connection.recv(WAIT).expect("an emit");
        if message["event"] == "emit" {
            pids_seen.push(pids(&message));
        }
    }
    connection.send(&json!({"op": "cancel", "call_id": "twin"}));
    let replies = connection.until(WAIT, {
        let count = std::sync::atomic::AtomicUsize::new(0);
        move |m| {
            m.get("event").is_none() && count.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 1
        }
    });
    let replies: Vec<_> = replies
        .into_iter()
        .filter(|m| m.get("event").is_none())
        .collect();
    assert!(
        replies
            .iter()
            .all(|r| r["error"]["type"] == "NodeCancelled"),
        "{replies:?}"
    );
    for pids in pids_seen {
        all_gone(&pids[..2]);
    }
}

#[test]
fn a_call_ends_at_its_reply_even_if_a_detached_grandchild_holds_its_pipe() {
    let (_engine, _agent, connection) = attached();
    let source = "import os, time\ndef process():\n    pid = os.fork()\n    if pid == 0:\n        os.setsid()\n        time.sleep(30)\n        os._exit(0)\n    return pid\n";
    let (_, reply) = connection.reply_to(&run("fork", source, json!({})), WAIT);
    let escaped = reply["result"].as_i64().expect("the grandchild's pid") as i32;
    assert!(
        connection.recv(Duration::from_secs(1)).is_none(),
        "the call ended at its reply: no more heartbeats"
    );
    // It left its session on purpose; nothing can end it but a kill.
    let _ = nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(escaped),
        nix::sys::signal::Signal::SIGKILL,
    );
    connection.send(&run(
        "next",
        "def process():\n    return 'next'\n",
        json!({}),
    ));
    assert_eq!(connection.reply("next", WAIT).1["result"], "next");
}

#[test]
fn an_environment_name_that_cannot_be_one_is_refused() {
    let (_engine, _agent, connection) = attached();
    let mut request = run("badenv", "def process():\n    return 1\n", json!({}));
    request["env"] = json!({"": "x", "CUDA_VISIBLE_DEVICES": "0"});
    let (_, reply) = connection.reply_to(&request, WAIT);
    assert_eq!(reply["error"]["type"], "ProtocolError", "{reply}");
    assert!(
        reply["error"]["message"]
            .as_str()
            .unwrap()
            .contains("not an environment variable name")
    );
}

fn open_fds(pid: i32) -> usize {
    std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|d| d.count())
        .unwrap_or(0)
}

#[test]
fn hundreds_of_calls_leave_no_fd_or_process_behind() {
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    // Forty nodes in turn: more than the zygote keeps node zygotes for, so
    // they are ended and forked again as the calls go round.
    let source = "import os\ndef process(i):\n    yield {'i': i}\n    return os.getppid()\n";
    let mut call = |i: usize| {
        let mut request = run(&format!("m{i}"), source, json!({"i": i}));
        request["node"] = json!(format!("n{}", i % 40));
        connection.reply_to(&request, WAIT).1
    };
    let node_zygote = (0..20).map(&mut call).last().unwrap()["result"]
        .as_i64()
        .unwrap() as i32;
    let zygote = common::parent_of(node_zygote);
    let agent_pid = agent.child.id() as i32;
    assert_eq!(common::parent_of(zygote), agent_pid, "the agent's zygote");
    // Let the last call's child be reaped.
    std::thread::sleep(Duration::from_millis(300));
    let before = (
        open_fds(agent_pid),
        open_fds(zygote),
        common::children_of(zygote).len(),
    );
    for i in 20..320 {
        let reply = call(i);
        assert_eq!(reply["ok"], true, "{reply}");
    }
    // One node again and again: its zygote serves it, with no fd or child
    // more.
    let node_zygote = call(19)["result"].as_i64().unwrap() as i32;
    std::thread::sleep(Duration::from_millis(300));
    let node_fds = open_fds(node_zygote);
    let node_children = common::children_of(node_zygote).len();
    for k in 0..120 {
        assert_eq!(call(19 + 40 * (k % 3))["result"], node_zygote);
    }
    std::thread::sleep(Duration::from_millis(300));
    let after = (
        open_fds(agent_pid),
        open_fds(zygote),
        common::children_of(zygote).len(),
    );
    assert_eq!(
        after, before,
        "(agent fds, zygote fds, zygote children) after 421 more calls"
    );
    assert_eq!(
        (
            open_fds(node_zygote),
            common::children_of(node_zygote).len()
        ),
        (node_fds, node_children),
        "(fds, children) of a node's own zygote after 120 more of its calls"
    );
}

#[test]
fn a_long_compile_holds_up_no_other_nodes_calls() {
    let (_engine, _agent, connection) = attached();
    let dir = common::scratch("long-compile");
    let gate = dir.join("gate");
    connection.send(&compile("slow", &common::gated_source(&gate, "slow")));
    // Calls of other nodes, each forked and answered while it still loads.
    for i in 0..5 {
        let request = run(
            &format!("fast{i}"),
            "def process(i):\n    return i\n",
            json!({"i": i}),
        );
        let (seen, reply) = connection.reply_to(&request, WAIT);
        assert_eq!(reply["result"], i, "{reply}");
        // (Its heartbeats may come meanwhile; its reply may not.)
        assert!(
            seen.iter()
                .all(|m| m["call_id"] != "slow" || m.get("ok").is_none()),
            "the compile was answered before its module level ended: {seen:?}"
        );
    }
    std::fs::write(&gate, "").unwrap();
    let (_, reply) = connection.reply("slow", WAIT);
    assert_eq!(reply["ok"], true, "{reply}");
    let (_, reply) = connection.reply_to(
        &run("slow", &common::gated_source(&gate, "slow"), json!({})),
        WAIT,
    );
    assert_eq!(reply["result"], "slow", "{reply}");
}

/// A node whose module level leaves a mark (a line in `marks`) and whose
/// calls say who forked them, then wait for `gate`.
fn laned_source(marks: &std::path::Path, gate: &std::path::Path) -> String {
    format!(
        "import fluksio, os, time\nwith open({marks:?}, 'a') as f:\n    f.write(f'{{os.getpid()}}\\n')\ndef process(i):\n    fluksio.emit(pids=[os.getpid(), os.getppid()])\n    for _ in range(6000):\n        if os.path.exists({gate:?}):\n            break\n        time.sleep(0.01)\n    return os.getppid()\n"
    )
}

/// A call of node `wide` that has said who forked it: `(call_id, [pid, parent])`.
type Started = (String, Vec<i32>);

/// Sends calls `ids` of node `wide` and waits for each to say who forked
/// it, in the order they said it.
fn start_wide(
    connection: &common::engine::Connection,
    source: &str,
    ids: std::ops::Range<usize>,
) -> Vec<Started> {
    let count = ids.len();
    for i in ids {
        let mut request = run(&format!("w{i}"), source, json!({"i": i}));
        request["node"] = json!("wide");
        connection.send(&request);
    }
    let mut started = Vec::new();
    while started.len() < count {
        let message = connection.recv(WAIT).expect("a call starts");
        if message["event"] == "emit" {
            started.push((
                message["call_id"].as_str().unwrap().to_string(),
                pids(&message),
            ));
        }
    }
    started
}

/// The replies to `calls`, in whatever order they come: `call_id → reply`.
fn replies_to<'a>(
    connection: &common::engine::Connection,
    calls: impl IntoIterator<Item = &'a Started>,
) -> std::collections::HashMap<String, Value> {
    let mut waiting: std::collections::HashSet<String> =
        calls.into_iter().map(|(id, _)| id.clone()).collect();
    let mut replies = std::collections::HashMap::new();
    while !waiting.is_empty() {
        let message = connection
            .recv(WAIT)
            .unwrap_or_else(|| panic!("no reply to {waiting:?}"));
        let call_id = message["call_id"].as_str().unwrap_or_default().to_string();
        if message.get("event").is_none() && waiting.remove(&call_id) {
            replies.insert(call_id, message);
        }
    }
    replies
}

/// An agent (`--parallel 8 --lanes 2`) whose node `wide` has a lane: four
/// calls held in the node's zygote (three in flight keep its fork loop
/// busy: the fourth asks for a lane), then three more, sent once the lane
/// is there, which the lane forks while the zygote is busy.
struct Laned {
    _engine: Engine,
    agent: Agent,
    connection: common::engine::Connection,
    source: String,
    /// Holds `marks` and `gate`, removed when the test ends.
    _dir: common::Scratch,
    marks: std::path::PathBuf,
    gate: std::path::PathBuf,
    first: Vec<Started>,
    second: Vec<Started>,
    node_zygote: i32,
    /// The parents of the second calls that are not the node's zygote.
    lanes: std::collections::BTreeSet<i32>,
}

fn with_a_lane(name: &str) -> Laned {
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, &["--parallel", "8", "--lanes", "2"], &[]);
    let connection = engine.next_connection(WAIT);
    let dir = common::scratch(name);
    let (marks, gate) = (dir.join("marks"), dir.join("gate"));
    let source = laned_source(&marks, &gate);
    let first = start_wide(&connection, &source, 0..4);
    let node_zygote = first[0].1[1];
    assert!(first.iter().all(|(_, p)| p[1] == node_zygote), "{first:?}");
    common::agent::wait_for_a_lane(node_zygote);
    // (And for the zygote to have taken the lane's link.)
    std::thread::sleep(Duration::from_millis(200));
    let second = start_wide(&connection, &source, 4..7);
    let lanes = second
        .iter()
        .map(|(_, p)| p[1])
        .filter(|&parent| parent != node_zygote)
        .collect();
    Laned {
        _engine: engine,
        agent,
        connection,
        source,
        _dir: dir,
        marks,
        gate,
        first,
        second,
        node_zygote,
        lanes,
    }
}

impl Laned {
    fn lane(&self) -> i32 {
        *self
            .lanes
            .first()
            .unwrap_or_else(|| panic!("a call forked by a lane: {:?}", self.second))
    }

    /// One more call of the node, once the gate is open: its reply.
    fn call_after(&self) -> Value {
        let mut request = run("after", &self.source, json!({"i": 99}));
        request["node"] = json!("wide");
        self.connection.reply_to(&request, WAIT).1
    }
}

#[test]
fn a_nodes_calls_fork_from_lanes_of_its_zygote_as_its_calls_in_flight_grow() {
    let laned = with_a_lane("agent-lanes");
    let Laned {
        connection,
        node_zygote,
        ..
    } = &laned;
    assert_eq!(
        laned.lanes.len(),
        1,
        "one lane, as --lanes 2 allows: {:?}",
        laned.second
    );
    let lane = laned.lane();
    assert_eq!(
        common::parent_of(lane),
        *node_zygote,
        "a lane is a fork of the node's zygote"
    );
    let zygote = common::parent_of(*node_zygote);
    assert_eq!(common::parent_of(zygote), laned.agent.child.id() as i32);
    assert_eq!(
        std::fs::read_to_string(&laned.marks)
            .unwrap()
            .lines()
            .count(),
        2,
        "the node's module level ran in its trial and in its zygote, not again in the lane"
    );
    std::fs::write(&laned.gate, "").unwrap();
    let held: Vec<&Started> = laned.first.iter().chain(&laned.second).collect();
    let replies = replies_to(connection, held.iter().copied());
    for (call_id, pids) in &held {
        let reply = &replies[call_id];
        assert_eq!(reply["ok"], true, "{reply}");
        assert_eq!(reply["result"], pids[1], "{reply}");
    }
    // No more lanes than allowed, however many calls come.
    std::fs::remove_file(&laned.gate).unwrap();
    let third = start_wide(connection, &laned.source, 7..15);
    std::fs::write(&laned.gate, "").unwrap();
    assert!(
        third
            .iter()
            .all(|(_, p)| p[1] == *node_zygote || p[1] == lane),
        "{third:?}"
    );
    for reply in replies_to(connection, &third).values() {
        assert_eq!(reply["ok"], true, "{reply}");
    }
    let calls: Vec<i32> = held
        .iter()
        .copied()
        .chain(&third)
        .map(|(_, p)| p[0])
        .collect();
    // SIGTERM: the agent ends its zygote, which ends each node's zygote
    // and lanes.
    let node_zygote = *node_zygote;
    let mut laned = laned;
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(laned.agent.child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert_eq!(laned.agent.wait(WAIT), Some(0));
    drop(laned);
    all_gone(&calls);
    all_gone(&[lane, node_zygote, zygote]);
}

#[test]
fn a_killed_lane_ends_its_own_calls_and_the_node_goes_on() {
    let laned = with_a_lane("agent-lane-killed");
    let lane = laned.lane();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(lane),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let (in_lane, own): (Vec<&Started>, Vec<&Started>) =
        laned.second.iter().partition(|(_, p)| p[1] == lane);
    let replies = replies_to(&laned.connection, in_lane.iter().copied());
    for (call_id, pids) in in_lane {
        let reply = &replies[call_id];
        assert_eq!(reply["ok"], false, "{reply}");
        let message = reply["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains(&lane.to_string()),
            "the failure names the lane that ended: {reply}"
        );
        assert!(
            common::wait_gone(pids[0], Duration::from_secs(15)),
            "a killed lane's call {} outlived it",
            pids[0]
        );
    }
    // The node zygote's own calls were not touched, and answer.
    assert!(laned.first.iter().all(|(_, p)| !common::is_gone(p[0])));
    std::fs::write(&laned.gate, "").unwrap();
    let replies = replies_to(&laned.connection, laned.first.iter().chain(own));
    for reply in replies.values() {
        assert_eq!(reply["ok"], true, "{reply}");
    }
    // The node goes on: its next call is served.
    let reply = laned.call_after();
    assert_eq!(reply["ok"], true, "{reply}");
    let node_zygote = laned.node_zygote;
    drop(laned);
    all_gone(&[node_zygote]);
}

#[test]
fn a_killed_node_zygote_takes_its_lanes_and_their_calls_and_the_node_goes_on() {
    let laned = with_a_lane("agent-lane-parent-killed");
    let lane = laned.lane();
    let zygote = common::parent_of(laned.node_zygote);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(laned.node_zygote),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    let all: Vec<&Started> = laned.first.iter().chain(&laned.second).collect();
    let replies = replies_to(&laned.connection, all.iter().copied());
    for (call_id, pids) in &all {
        let reply = &replies[call_id];
        assert_eq!(reply["ok"], false, "{reply}");
        assert!(
            common::wait_gone(pids[0], Duration::from_secs(15)),
            "call {} outlived the zygote that forked it",
            pids[0]
        );
    }
    assert!(
        common::wait_gone(lane, Duration::from_secs(15)),
        "the lane {lane} outlived its node zygote"
    );
    // It came to the zygote (a subreaper) when its parent died, and was
    // reaped there: no zombie left.
    assert!(
        !common::children_of(zygote).contains(&(lane, 'Z')),
        "the lane {lane} is a zombie of the zygote {zygote}"
    );
    std::fs::write(&laned.gate, "").unwrap();
    let reply = laned.call_after();
    assert_eq!(reply["ok"], true, "{reply}");
    assert_ne!(
        reply["result"], laned.node_zygote,
        "a new node zygote serves it"
    );
}
