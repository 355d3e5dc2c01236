//! The worker token and the host's credentials never reach node code, in
//! any mode (worker, sweep, agent), nor any output of a run at
//! `RUST_LOG=debug`.
//!
//! Every secret is set to a marker holding `fzsecret`; a node looks for it
//! in its own environment and in the `environ` and `cmdline` of itself and
//! every process above it (all readable to it: the same user), prints its
//! whole environment, fails, compiles; then everything the run wrote is
//! searched for the marker. The node's source never holds the marker's
//! text (it builds it as `'fz' 'secret'`).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use common::engine::{Answer, Engine};
use common::{Worker, ZYGOTE};
use serde_json::{Value, json};

const MARK: &str = "fzsecret";
const WORKER_TOKEN: &str = "fzsecret-worker-token-5e1c9";

/// The credentials set on every process under test: the worker token (the
/// agent's, and the pool's artifact token) and a sample of the denylist.
fn secrets() -> Vec<(&'static str, &'static str)> {
    vec![
        ("FLUKSIO_WORKER_TOKEN", WORKER_TOKEN),
        ("FLUKSIO_ARTIFACT_TOKEN", "fzsecret-artifact-token-9c4e2"),
        ("AWS_SECRET_ACCESS_KEY", "fzsecret-aws-8b2d4"),
        ("DATABASE_URL", "postgresql://app:fzsecret-db-3f7a1@db/app"),
        ("FIRST_SUPERUSER_PASSWORD", "fzsecret-superuser-77d1"),
        (
            "SENTRY_DSN",
            "https://fzsecret-sentry-1a2b@sentry.example/1",
        ),
        ("MY_API_TOKEN", "fzsecret-api-token-4c3d"),
        ("db_password", "fzsecret-db-password-e5f6"),
        ("RUST_LOG", "debug"),
    ]
}

/// Where a node finds the marker, and which denylisted names it sees.
const PROBE: &str = r#"import os
DENIED = ('FLUKSIO_WORKER_TOKEN', 'FLUKSIO_ARTIFACT_TOKEN', 'AWS_SECRET_ACCESS_KEY', 'DATABASE_URL',
          'FIRST_SUPERUSER_PASSWORD', 'SENTRY_DSN', 'MY_API_TOKEN', 'db_password')

def process(x=0):
    mark = 'fz' 'secret'
    found = ['os.environ[%s]' % k for k, v in os.environ.items() if mark in k or mark in v]
    pid, seen = os.getpid(), set()
    while pid > 1 and pid not in seen:
        seen.add(pid)
        for name in ('environ', 'cmdline'):
            try:
                with open('/proc/%d/%s' % (pid, name), 'rb') as f:
                    if mark.encode() in f.read():
                        found.append('/proc/%d/%s (%s)' % (pid, name, open('/proc/%d/comm' % pid).read().strip()))
            except OSError:
                pass
        try:
            pid = int(open('/proc/%d/stat' % pid).read().rsplit(')', 1)[1].split()[1])
        except (OSError, ValueError):
            break
    print(dict(os.environ))
    print(open('/proc/self/environ', 'rb').read())
    if x == 2:
        raise RuntimeError('a failing call, with the environment: %r' % dict(os.environ))
    return {'found': found, 'denied': sorted(k for k in DENIED if k in os.environ)}
"#;

fn clean() -> Value {
    json!({"found": [], "denied": []})
}

/// Collects everything `stream` writes, on a thread.
fn collect(mut stream: impl Read + Send + 'static, into: &Arc<Mutex<Vec<u8>>>) -> JoinHandle<()> {
    let into = Arc::clone(into);
    std::thread::spawn(move || {
        let mut buffer = [0u8; 1 << 16];
        while let Ok(n) = stream.read(&mut buffer) {
            if n == 0 {
                return;
            }
            into.lock().unwrap().extend_from_slice(&buffer[..n]);
        }
    })
}

fn assert_no_marker(output: &[u8], what: &str) {
    let text = String::from_utf8_lossy(output);
    assert!(
        !text.is_empty(),
        "{what} wrote nothing: is RUST_LOG=debug read?"
    );
    if let Some(at) = text.find(MARK) {
        let start = text[..at].rfind('\n').map_or(0, |i| i + 1);
        let end = text[at..].find('\n').map_or(text.len(), |i| at + i);
        panic!("a secret is in the output of {what}: {}", &text[start..end]);
    }
}

#[test]
fn worker_mode_hides_the_token_and_the_credentials() {
    let mut child = Command::new(ZYGOTE)
        .arg("worker")
        .envs(secrets())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the worker starts");
    let output = Arc::new(Mutex::new(Vec::new()));
    let err = collect(child.stderr.take().unwrap(), &output);
    let (send, replies) = std::sync::mpsc::channel::<String>();
    let stdout = child.stdout.take().unwrap();
    let copy = Arc::clone(&output);
    let out = std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { return };
            copy.lock().unwrap().extend_from_slice(line.as_bytes());
            copy.lock().unwrap().push(b'\n');
            let _ = send.send(line);
        }
    });
    let mut stdin = child.stdin.take().unwrap();
    let mut call = |request: Value| -> Value {
        writeln!(stdin, "{request}").unwrap();
        stdin.flush().unwrap();
        let line = replies.recv_timeout(common::LINE_TIMEOUT).expect("a reply");
        serde_json::from_str(&line).unwrap()
    };
    let compiled =
        call(json!({"id": 1, "op": "compile", "flow": "s", "node": "probe", "source": PROBE}));
    assert_eq!(compiled["ok"], true, "{compiled}");
    let reply = call(
        json!({"id": 2, "op": "run", "flow": "s", "node": "probe", "source": PROBE, "kwargs": {"x": 0}}),
    );
    assert_eq!(reply["result"], clean(), "{reply}");
    let failed = call(
        json!({"id": 3, "op": "run", "flow": "s", "node": "probe", "source": PROBE, "kwargs": {"x": 2}}),
    );
    assert_eq!(failed["error"]["type"], "RuntimeError", "{failed}");
    // A request's `env` is no way in either: worker mode ignores it.
    let reply = call(
        json!({"id": 4, "op": "run", "flow": "s", "node": "probe", "source": PROBE, "kwargs": {}, "env": {"SMUGGLED": "x"}}),
    );
    assert_eq!(reply["result"], clean(), "{reply}");
    drop(stdin);
    assert!(child.wait().unwrap().success());
    out.join().unwrap();
    err.join().unwrap();
    assert_no_marker(&output.lock().unwrap(), "fluksio-zygote worker");
}

#[test]
fn sweep_mode_hides_the_token_and_the_credentials() {
    let dir = common::scratch("secrets-sweep");
    let node = dir.join("probe.py");
    std::fs::write(&node, PROBE).unwrap();
    let result = Command::new(ZYGOTE)
        .arg("sweep")
        .arg(&node)
        .args(["--grid", "x=0..2", "-j", "1"])
        .envs(secrets())
        .stdin(Stdio::null())
        .output()
        .expect("the sweep runs");
    let stdout = String::from_utf8_lossy(&result.stdout);
    let points: Vec<Value> = stdout
        .lines()
        .filter_map(|line| serde_json::from_str(line).ok())
        .collect();
    assert_eq!(points.len(), 3, "{stdout}");
    for point in &points {
        if point["kwargs"]["x"] == 2 {
            assert_eq!(point["ok"], false, "{point}");
        } else {
            assert_eq!(point["result"], clean(), "{point}");
        }
    }
    let mut all = result.stdout.clone();
    all.extend_from_slice(&result.stderr);
    assert_no_marker(&all, "fluksio-zygote sweep");
}

/// Everything a process wrote, stdout and stderr together.
type Output = Arc<Mutex<Vec<u8>>>;

/// An agent with its token from the environment, as a batch job passes it.
fn agent(url: &str) -> (Child, Output, Vec<JoinHandle<()>>) {
    let mut child = Command::new(ZYGOTE)
        .args(["agent", "--url", url])
        .envs(secrets())
        .env("FLUKSIO_AGENT_HEARTBEAT_S", "0.3")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("the agent starts");
    let output = Arc::new(Mutex::new(Vec::new()));
    let readers = vec![
        collect(child.stdout.take().unwrap(), &output),
        collect(child.stderr.take().unwrap(), &output),
    ];
    (child, output, readers)
}

#[test]
fn agent_mode_hides_the_token_and_the_credentials() {
    let engine = Engine::start(Answer::Welcome);
    let (mut child, output, readers) = agent(&engine.url);
    let connection = engine.next_connection(Duration::from_secs(60));
    // The token is in use, where it belongs.
    assert_eq!(
        connection.headers.get("authorization").map(String::as_str),
        Some(format!("Bearer {WORKER_TOKEN}").as_str())
    );
    let wait = Duration::from_secs(60);
    let request = |op: &str, call_id: &str, x: i64| {
        json!({"op": op, "id": call_id, "call_id": call_id, "flow": "s", "node": "probe",
               "source": PROBE, "kwargs": {"x": x}, "env": {"FROM_THE_CALL": "1"}})
    };
    let (_, compiled) = connection.reply_to(&request("compile", "c", 0), wait);
    assert_eq!(compiled["ok"], true, "{compiled}");
    let (_, reply) = connection.reply_to(&request("run", "r", 0), wait);
    assert_eq!(reply["result"], clean(), "{reply}");
    let (_, failed) = connection.reply_to(&request("run", "f", 2), wait);
    assert_eq!(failed["error"]["type"], "RuntimeError", "{failed}");
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(child.id() as i32),
        nix::sys::signal::Signal::SIGTERM,
    )
    .unwrap();
    assert!(child.wait().unwrap().success());
    for reader in readers {
        reader.join().unwrap();
    }
    assert_no_marker(&output.lock().unwrap(), "fluksio-zygote agent");
}

/// `env` on a worker-contract request: `worker_main.py` never reads it, and
/// neither does `fluksio-zygote worker`, whatever it holds.
#[test]
fn worker_mode_ignores_a_request_env_as_the_reference_does() {
    let source = "import os\ndef process():\n    return os.environ.get('FZ_ENV_PROBE', 'unset')\n";
    for env in [json!({"FZ_ENV_PROBE": "from-the-request"}), json!(5)] {
        let request = json!({"id": 1, "op": "run", "flow": "t", "node": "env", "source": source, "kwargs": {}, "env": env});
        let ours = Worker::zygote(&[]).call(&request).reply;
        let reference = Worker::reference().call(&request).reply;
        assert_eq!(reference["result"], "unset", "{reference}");
        assert_eq!(ours, reference);
    }
}
