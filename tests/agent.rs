//! `fluksio-zygote agent` against an engine written for the tests.

mod common;

use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use common::engine::{Answer, Engine};
use common::ZYGOTE;
use serde_json::{Value, json};

const TOKEN: &str = "worker-token-7f3a";
const WAIT: Duration = Duration::from_secs(60);

/// A running agent; killed (its whole session with it) when dropped.
struct Agent {
    child: Child,
    stderr: Receiver<String>,
}

impl Agent {
    fn start(url: &str, args: &[&str], env: &[(&str, &str)]) -> Agent {
        let mut child = Command::new(ZYGOTE)
            .args(["agent", "--url", url, "--token", TOKEN])
            .args(args)
            .envs(env.iter().copied())
            .env("FLUKSIO_AGENT_HEARTBEAT_S", "0.3")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the agent starts");
        let stderr = lines(child.stderr.take().unwrap());
        Agent { child, stderr }
    }

    fn log(&self) -> String {
        let mut text = String::new();
        while let Ok(line) = self.stderr.try_recv() {
            text.push_str(&line);
            text.push('\n');
        }
        text
    }

    /// Waits for the exit; its code.
    fn wait(&mut self, limit: Duration) -> Option<i32> {
        let start = std::time::Instant::now();
        while start.elapsed() < limit {
            if let Some(status) = self.child.try_wait().unwrap() {
                return status.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        panic!("the agent did not exit within {limit:?}:\n{}", self.log());
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn lines(stream: impl std::io::Read + Send + 'static) -> Receiver<String> {
    let (send, receive) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(stream).lines() {
            let Ok(line) = line else { return };
            eprintln!("agent: {line}");
            if send.send(line).is_err() {
                return;
            }
        }
    });
    receive
}

fn run(call_id: &str, source: &str, kwargs: Value) -> Value {
    json!({"op": "run", "id": 1, "call_id": call_id, "flow": "f", "node": call_id, "source": source, "kwargs": kwargs})
}

#[test]
fn a_run_round_trip_with_events_in_order() {
    let engine = Engine::start(Answer::Welcome);
    let _agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    assert_eq!(connection.hello["op"], "hello");
    connection.send(&run("c1", "import fluksio\ndef process(n):\n    for i in range(n):\n        yield {'i': i}\n    fluksio.emit(done=True)\n    return n\n", json!({"n": 3})));
    let (events, reply) = connection.reply("c1", WAIT);
    let events: Vec<_> = events.into_iter().filter(|e| e["event"] != "heartbeat").collect();
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(reply["result"], 3, "{reply}");
    assert_eq!(reply["ok"], true);
}
