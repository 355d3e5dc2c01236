//! Soak: 20,000 calls through `agent --parallel 2`, 1 in 10 cancelled and
//! 1 in 20 crashing (`os._exit`, a segfault), two in flight at all times.
//! Every call is answered exactly once, with its own result where it ran;
//! the zygote's memory and open fds stay flat (sampled every 1,000 calls,
//! with nothing in flight); no zombie is left behind.

mod common;

use std::time::{Duration, Instant};

use common::agent::{Agent, WAIT};
use common::engine::{Answer, Connection, Engine};
use serde_json::{Value, json};

const CALLS: usize = 20_000;
const SAMPLE_EVERY: usize = 1_000;
const IN_FLIGHT: usize = 2;

const SOURCE: &str = r#"
import ctypes, os, resource, time

def process(i, mode):
    if mode == "sleep":
        time.sleep(3600)
    if mode == "exit":
        os._exit(3)
    if mode == "segv":
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        ctypes.string_at(0)
    return {"i": i, "square": i * i, "zygote": os.getppid()}
"#;

/// What call `i` does: 1 in 10 is cancelled (it sleeps until it is), 1 in
/// 20 crashes, half of those by `os._exit(3)`, half by a segfault.
fn mode(i: usize) -> &'static str {
    if i % 10 == 3 {
        "sleep"
    } else if i % 40 == 7 {
        "exit"
    } else if i % 40 == 27 {
        "segv"
    } else {
        "ok"
    }
}

fn request(i: usize) -> Value {
    json!({"op": "run", "id": i, "call_id": format!("c{i}"), "flow": "soak", "node": "soak",
           "source": SOURCE, "kwargs": {"i": i, "mode": mode(i)}})
}

/// The index of the call a reply answers.
fn index_of(reply: &Value) -> usize {
    reply["call_id"]
        .as_str()
        .and_then(|c| c.strip_prefix('c'))
        .and_then(|i| i.parse().ok())
        .unwrap_or_else(|| panic!("a reply to no call of ours: {reply}"))
}

/// Checks the reply of call `i` for what its mode says it must be.
fn check(i: usize, reply: &Value, zygote: i64) {
    let message = reply["error"]["message"].as_str().unwrap_or("");
    match mode(i) {
        "ok" => {
            assert_eq!(reply["ok"], true, "call {i}: {reply}");
            let square = (i * i) as u64;
            assert_eq!(
                reply["result"],
                json!({"i": i, "square": square, "zygote": zygote}),
                "call {i}"
            );
        }
        "sleep" => {
            assert_eq!(reply["error"]["type"], "NodeCancelled", "call {i}: {reply}");
        }
        "exit" => {
            assert_eq!(reply["ok"], false, "call {i}: {reply}");
            assert!(message.contains("exited with code 3"), "call {i}: {reply}");
        }
        _ => {
            assert_eq!(reply["ok"], false, "call {i}: {reply}");
            assert!(message.contains("killed by SIGSEGV"), "call {i}: {reply}");
        }
    }
}

/// `VmRSS` of `pid`, in KiB.
fn rss_kib(pid: i32) -> usize {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("status");
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS")
}

/// What the open fds of `pid` point at (`pipe:[…]`, `anon_inode:[pidfd]`…).
fn open_fds(pid: i32) -> Vec<String> {
    let mut fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .expect("the fds of a process of ours")
        .filter_map(|entry| {
            let entry = entry.ok()?;
            let target = std::fs::read_link(entry.path()).ok()?;
            Some(format!(
                "{} -> {}",
                entry.file_name().to_string_lossy(),
                target.display()
            ))
        })
        .collect();
    fds.sort();
    fds
}

/// The most cgroup cells the zygote may hold: two calls in flight, two
/// standing by, two being reaped, and room to spare.
const MAX_CELLS: usize = 10;

/// How many cgroup cells (`…/call-N/…`) the fds hold open, and how many
/// fds are something else.
fn split_cells(fds: &[String]) -> (usize, usize) {
    let mut cells: Vec<&str> = fds
        .iter()
        .filter_map(|fd| fd.split_once(" -> ").map(|(_, target)| target))
        .filter(|target| target.starts_with("/sys/fs/cgroup/"))
        .filter_map(|target| target.rsplit_once('/').map(|(cell, _)| cell))
        .collect();
    let in_cells = cells.len();
    cells.sort_unstable();
    cells.dedup();
    (cells.len(), fds.len() - in_cells)
}

/// The state letters of the children of `pid`, for a failure's message.
fn children(pid: i32) -> String {
    format!("{:?}", common::children_of(pid))
}

/// Children of `parents` that are zombies, after up to `limit` for any
/// just killed to be reaped.
fn zombies(parents: &[i32], limit: Duration) -> Vec<(i32, i32)> {
    let start = Instant::now();
    loop {
        let found: Vec<(i32, i32)> = parents
            .iter()
            .flat_map(|&parent| {
                common::children_of(parent)
                    .into_iter()
                    .filter(|&(_, state)| state == 'Z')
                    .map(move |(pid, _)| (parent, pid))
            })
            .collect();
        if found.is_empty() || start.elapsed() > limit {
            return found;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Answers counted per call, as they arrive.
struct Tally {
    answers: Vec<u32>,
    zygote: i64,
}

impl Tally {
    /// Waits for the next reply (events and heartbeats skipped); its call.
    fn next(&mut self, connection: &Connection) -> usize {
        loop {
            let message = connection
                .recv(WAIT)
                .expect("a reply within a minute: no call may hang");
            if message.get("event").is_some() {
                continue;
            }
            let i = index_of(&message);
            self.answers[i] += 1;
            assert_eq!(self.answers[i], 1, "call {i} answered twice: {message}");
            check(i, &message, self.zygote);
            return i;
        }
    }
}

#[test]
fn twenty_thousand_calls_with_cancels_and_crashes_leave_nothing_behind() {
    let started = Instant::now();
    let engine = Engine::start(Answer::Welcome);
    let agent = Agent::start(
        &engine.url,
        &["--parallel", &IN_FLIGHT.to_string()],
        // Two log lines a call would be most of the agent's work.
        &[("RUST_LOG", "warn")],
    );
    let connection = engine.next_connection(WAIT);
    // The zygote, from a first call's parent.
    connection.send(
        &json!({"op": "run", "id": "z", "call_id": "z", "flow": "soak", "node": "soak",
                            "source": SOURCE, "kwargs": {"i": 0, "mode": "ok"}}),
    );
    let (_, first) = connection.reply("z", WAIT);
    let zygote = first["result"]["zygote"]
        .as_i64()
        .expect("the zygote's pid");
    let zygote_pid = zygote as i32;
    let agent_pid = agent.child.id() as i32;

    let mut tally = Tally {
        answers: vec![0; CALLS],
        zygote,
    };
    let mut samples: Vec<(usize, usize, Vec<String>, String)> = Vec::new();
    let mut outstanding = 0;
    for i in 0..CALLS {
        if outstanding == IN_FLIGHT {
            tally.next(&connection);
            outstanding -= 1;
        }
        connection.send(&request(i));
        if mode(i) == "sleep" {
            connection.send(&json!({"op": "cancel", "call_id": format!("c{i}")}));
        }
        outstanding += 1;
        if (i + 1) % SAMPLE_EVERY == 0 {
            // Nothing in flight, the last children reaped: then sample.
            while outstanding > 0 {
                tally.next(&connection);
                outstanding -= 1;
            }
            std::thread::sleep(Duration::from_millis(200));
            samples.push((
                i + 1,
                rss_kib(zygote_pid),
                open_fds(zygote_pid),
                children(zygote_pid),
            ));
        }
    }
    while outstanding > 0 {
        tally.next(&connection);
        outstanding -= 1;
    }
    // Nothing more comes: no call is answered twice, late.
    let deadline = Instant::now() + Duration::from_secs(1);
    while let Some(left) = deadline.checked_duration_since(Instant::now()) {
        let Some(message) = connection.recv(left) else {
            break;
        };
        assert!(
            message.get("event").is_some(),
            "a message after every call was answered: {message}"
        );
    }
    let unanswered = tally.answers.iter().filter(|&&n| n != 1).count();
    assert_eq!(unanswered, 0, "calls not answered exactly once");

    for (calls, rss, fds, children) in &samples {
        eprintln!(
            "after {calls} calls: zygote VmRSS {rss} KiB, {} fds, children {children}",
            fds.len()
        );
    }
    // Early: after 2,000 and 3,000 calls (the first thousand warms the
    // allocator up); late: the last two samples.
    let early_rss = samples[1].1.max(samples[2].1);
    let early = &samples[1];
    for (calls, rss, fds, children) in &samples[samples.len() - 2..] {
        // A leak of 1 KiB a call is 20 MB over the soak; noise is far less.
        assert!(
            *rss <= early_rss + 8 * 1024,
            "the zygote's RSS grew from {early_rss} KiB to {rss} KiB by {calls} calls"
        );
        // The cgroup cells (three files each) are a pool, as large as the
        // most calls the zygote ever held at once (in flight, standing by,
        // being reaped): it may grow by a cell once, never by the call.
        let (cells, others) = split_cells(fds);
        let (early_cells, early_others) = split_cells(&early.2);
        assert!(
            others <= early_others + 2 && cells <= MAX_CELLS,
            "the zygote's fds by {calls} calls ({others} and {cells} cells, against \
             {early_others} and {early_cells} cells after {} calls):\n{fds:#?}\n\
             children {children}\nafter {} calls:\n{:#?}\nchildren {}",
            early.0,
            early.0,
            early.2,
            early.3
        );
    }
    let zombies = zombies(&[agent_pid, zygote_pid], Duration::from_secs(5));
    assert!(zombies.is_empty(), "zombies (parent, pid): {zombies:?}");
    eprintln!("{CALLS} calls in {:.1} s", started.elapsed().as_secs_f64());
    drop(agent);
}
