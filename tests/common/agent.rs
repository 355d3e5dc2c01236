//! An agent under test: started against a test engine, killed (its
//! whole session with it) when dropped.

use std::process::{Child, Command, Stdio};
use std::sync::mpsc::Receiver;
use std::time::Duration;

use super::ZYGOTE;
use super::engine::{Answer, Connection, Engine};

pub const TOKEN: &str = "worker-token-7f3a";
pub const WAIT: Duration = Duration::from_secs(60);

/// A running agent; killed (its whole session with it) when dropped.
pub struct Agent {
    pub child: Child,
    pub stderr: Receiver<String>,
}

impl Agent {
    pub fn start(url: &str, args: &[&str], env: &[(&str, &str)]) -> Agent {
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

    pub fn log(&self) -> String {
        let mut text = String::new();
        while let Ok(line) = self.stderr.try_recv() {
            text.push_str(&line);
            text.push('\n');
        }
        text
    }

    /// Waits for the exit; its code.
    pub fn wait(&mut self, limit: Duration) -> Option<i32> {
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

/// An engine, an agent with no extra flags attached to it, and the
/// connection it made.
pub fn attached() -> (Engine, Agent, Connection) {
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(&engine.url, &[], &[]);
    let connection = engine.next_connection(WAIT);
    (engine, agent, connection)
}
