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
    /// Seen to have exited: its log is whole once its stderr closes.
    exited: bool,
}

impl Agent {
    pub fn start(url: &str, args: &[&str], env: &[(&str, &str)]) -> Agent {
        Agent::spawn(Command::new(ZYGOTE).envs(env.iter().copied()), url, args)
    }

    /// An agent that does not inherit these variables of the test's
    /// environment.
    pub fn start_without(url: &str, args: &[&str], removed: &[&str]) -> Agent {
        let mut command = Command::new(ZYGOTE);
        for name in removed {
            command.env_remove(name);
        }
        Agent::spawn(&mut command, url, args)
    }

    /// An agent that does not inherit `removed` of the test's environment,
    /// and has `env` set.
    pub fn start_with_only(
        url: &str,
        args: &[&str],
        removed: &[&str],
        env: &[(&str, &str)],
    ) -> Agent {
        let mut command = Command::new(ZYGOTE);
        for name in removed {
            command.env_remove(name);
        }
        Agent::spawn(command.envs(env.iter().copied()), url, args)
    }

    fn spawn(command: &mut Command, url: &str, args: &[&str]) -> Agent {
        let mut child = command
            .args(["agent", "--url", url, "--token", TOKEN])
            .args(args)
            .env("FLUKSIO_AGENT_HEARTBEAT_S", "0.3")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the agent starts");
        let stderr = lines(child.stderr.take().unwrap());
        Agent {
            child,
            stderr,
            exited: false,
        }
    }

    /// What it has logged so far; all of it, once it has exited (the
    /// reader may still be passing its last lines on).
    pub fn log(&self) -> String {
        let mut text = String::new();
        loop {
            let line = if self.exited {
                self.stderr.recv_timeout(Duration::from_secs(5)).ok()
            } else {
                self.stderr.try_recv().ok()
            };
            let Some(line) = line else { break };
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
                self.exited = true;
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

/// The session of `pid`.
pub fn session_of(pid: i32) -> Option<i32> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let (_, rest) = stat.rsplit_once(')')?;
    rest.split_whitespace().nth(3)?.parse().ok()
}

/// Waits until `node_zygote` has a lane: a child in its own session (its
/// calls and standby children each have a session of their own), seen
/// there twice.
pub fn wait_for_a_lane(node_zygote: i32) {
    let session = session_of(node_zygote);
    let in_session = || {
        super::children_of(node_zygote)
            .into_iter()
            .map(|(pid, _)| pid)
            .filter(|&pid| session_of(pid) == session)
            .collect::<Vec<i32>>()
    };
    let deadline = std::time::Instant::now() + WAIT;
    let mut seen = Vec::new();
    while std::time::Instant::now() < deadline {
        let now = in_session();
        if now.iter().any(|pid| seen.contains(pid)) {
            return;
        }
        seen = now;
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("node zygote {node_zygote} forked no lane");
}
