//! What the zygote tells a call's child: its assignment (the task, the
//! node, the kwargs and environment), sent on the child's control pipe
//! once the child stands by, and the eventfd that wakes it for it. Also the
//! exit codes a trial's child answers with.

use std::os::fd::{FromRawFd, OwnedFd, RawFd};

use pyo3::prelude::*;

use super::channel;
use super::node::NodeKey;
use crate::link::Frame;

/// How a trial ended, told by its exit code once its reply is sent: the
/// code is ours to choose there, and needs no second channel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TrialVerdict {
    /// Loaded, and the zygote can fork with it loaded.
    Loaded,
    /// Loaded, but a thread it started does not stop at fork: load it in
    /// each call's child instead.
    LoadedButForkUnsafe,
    /// Loaded, and its module level left more memory than
    /// `--node-zygote-mib`: it gets a zygote of its own (`super::app`).
    LoadedHeavy,
    /// The source did not load; the reply says why.
    Failed,
    /// Loaded, and its load made a CUDA context (or opened the driver for
    /// one), which no fork of it could use (`super::device`).
    LoadedWithCuda,
}

impl TrialVerdict {
    const LOADED: i32 = 0;
    const FORK_UNSAFE: i32 = 118;
    const FAILED: i32 = 119;
    const HEAVY: i32 = 120;
    const CUDA: i32 = 121;

    pub(super) fn exit_code(self) -> i32 {
        match self {
            TrialVerdict::Loaded => Self::LOADED,
            TrialVerdict::LoadedButForkUnsafe => Self::FORK_UNSAFE,
            TrialVerdict::Failed => Self::FAILED,
            TrialVerdict::LoadedHeavy => Self::HEAVY,
            TrialVerdict::LoadedWithCuda => Self::CUDA,
        }
    }

    /// The verdict of a trial that replied and then exited with `code`.
    pub fn from_exit_code(code: i32) -> Option<TrialVerdict> {
        match code {
            Self::LOADED => Some(TrialVerdict::Loaded),
            Self::FORK_UNSAFE => Some(TrialVerdict::LoadedButForkUnsafe),
            Self::FAILED => Some(TrialVerdict::Failed),
            Self::HEAVY => Some(TrialVerdict::LoadedHeavy),
            Self::CUDA => Some(TrialVerdict::LoadedWithCuda),
            _ => None,
        }
    }
}

/// What the child is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Task {
    /// `compile` with `keep: false`: does the source load? Nothing kept.
    Check,
    /// Before the zygote loads a node: does it load, and can the zygote
    /// still fork safely with it loaded? The answer is the exit code.
    Trial,
    /// Call the node with the assignment's keyword arguments.
    Run,
    /// A run whose child stays, serving the node's later calls in turn
    /// (`--isolation node`): its module state lives on, as in a reused
    /// `worker_main.py`.
    Resident,
}

/// Where the node's function comes from.
pub enum Function<'a> {
    /// Loaded in the zygote; every fork has it.
    Loaded(&'a Py<PyAny>),
    /// Loaded here. `quiet`: its output was already reported once (at
    /// compile), so it is not captured again.
    LoadHere { quiet: bool },
}

/// One call, as the zygote hands it to a child: sent down the child's
/// control pipe, since a standby child is forked before its call exists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Assignment {
    pub task: Task,
    /// The request's `id`, as the JSON text it arrived as.
    pub id: String,
    pub call_id: String,
    pub key: NodeKey,
    pub source: String,
    /// md5 of `source`, hex.
    pub digest: String,
    /// `Run` only: the keyword arguments as JSON text.
    pub kwargs: Option<String>,
    /// Environment applied before any node code runs.
    pub env: Vec<(String, String)>,
}

impl Assignment {
    /// The node it is for, and nothing of its call: how a resident that
    /// is put back after each call (`--isolation reset`) is set up. Its
    /// env is the runtime's alone: the thread variables a call that brings
    /// none of its own is given now, which the resident sets before its
    /// snapshot (`child::PresetEnv`).
    pub fn without_call(&self) -> Assignment {
        Assignment {
            id: "null".into(),
            call_id: String::new(),
            kwargs: None,
            env: super::threads::env_for(&[]),
            ..self.clone()
        }
    }

    /// Its copies of the call's kwargs and env, held while it is in memory
    /// (`crate::scrub`): a child forked meanwhile wipes them.
    pub fn held(&self) -> Vec<crate::scrub::Held> {
        crate::scrub::hold_call_data(self.kwargs.as_deref(), &self.env)
    }

    /// Length-prefixed fields: no escaping, no second JSON parse of a
    /// payload of megabytes.
    pub fn encode(&self) -> Vec<u8> {
        let task = match self.task {
            Task::Check => "check",
            Task::Trial => "trial",
            Task::Run => "run",
            Task::Resident => "resident",
        };
        let mut fields: Vec<&str> = vec![
            task,
            &self.id,
            &self.call_id,
            &self.key.flow,
            &self.key.node,
            &self.source,
            &self.digest,
            self.kwargs.as_deref().unwrap_or(""),
            if self.kwargs.is_some() { "1" } else { "0" },
        ];
        for (key, value) in &self.env {
            fields.push(key);
            fields.push(value);
        }
        let mut bytes = Vec::with_capacity(fields.iter().map(|f| f.len() + 8).sum());
        for field in fields {
            bytes.extend_from_slice(&(field.len() as u64).to_le_bytes());
            bytes.extend_from_slice(field.as_bytes());
        }
        bytes
    }

    pub fn decode(mut bytes: &[u8]) -> Option<Assignment> {
        let mut fields = Vec::new();
        while !bytes.is_empty() {
            let (len, rest) = bytes.split_at_checked(8)?;
            let len = u64::from_le_bytes(len.try_into().ok()?) as usize;
            let (field, rest) = rest.split_at_checked(len)?;
            fields.push(String::from_utf8(field.to_vec()).ok()?);
            bytes = rest;
        }
        if fields.len() < 9 || fields.len() % 2 == 0 {
            return None;
        }
        let mut fields = fields.into_iter();
        let mut next = || fields.next().unwrap_or_default();
        let task = match next().as_str() {
            "check" => Task::Check,
            "trial" => Task::Trial,
            "run" => Task::Run,
            "resident" => Task::Resident,
            _ => return None,
        };
        let (id, call_id, flow, node, source, digest) =
            (next(), next(), next(), next(), next(), next());
        let kwargs = next();
        let kwargs = (next() == "1").then_some(kwargs);
        // The rest are pairs (the count is odd with them: checked above); an
        // empty name is a name like any other here.
        let mut rest: Vec<String> = fields.collect();
        let mut env = Vec::with_capacity(rest.len() / 2);
        while rest.len() >= 2 {
            let value = rest.pop().unwrap_or_default();
            let key = rest.pop().unwrap_or_default();
            env.push((key, value));
        }
        env.reverse();
        Some(Assignment {
            task,
            id,
            call_id,
            key: NodeKey { flow, node },
            source,
            digest,
            kwargs,
            env,
        })
    }
}

/// A standby's wake-up call: an eventfd, not the control pipe itself. A
/// pipe wakes its reader as a "sync" wake-up, which places it on the
/// writer's CPU on the guess that the writer is about to sleep; the zygote
/// is about to fork the next standby instead, and the call would wait for
/// that fork to finish. An eventfd wake-up goes to an idle CPU.
pub fn wake_up_call() -> std::io::Result<std::os::fd::OwnedFd> {
    // SAFETY: eventfd returns a new fd or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a new fd the kernel just returned.
    Ok(unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) })
}

/// Wakes the standby holding `go`'s other copy.
pub fn wake(go: &impl std::os::fd::AsRawFd) {
    let one: u64 = 1;
    // SAFETY: an 8-byte write from a live u64 to an eventfd.
    unsafe { libc::write(go.as_raw_fd(), (&one as *const u64).cast(), 8) };
}

/// Blocks until the zygote calls. A standby that is not wanted any more is
/// killed by the zygote (an eventfd has no end to wait for).
pub fn wait_for_call(go: &impl std::os::fd::AsRawFd) {
    let mut count: u64 = 0;
    loop {
        // SAFETY: an 8-byte read into a live u64 from an eventfd.
        let n = unsafe { libc::read(go.as_raw_fd(), (&mut count as *mut u64).cast(), 8) };
        if n == 8 {
            return;
        }
        if n < 0 && std::io::Error::last_os_error().kind() == std::io::ErrorKind::Interrupted {
            continue;
        }
        crate::process::exit_now(0);
    }
}

/// Writes `assignment` down a child's control pipe, in an `Assign` frame
/// of the link's: a resident child reads one assignment after another from
/// the same pipe. Closing the pipe ends the child.
pub fn send_assignment(
    control: &impl std::os::fd::AsRawFd,
    assignment: &Assignment,
) -> std::io::Result<()> {
    let frame = Frame::Assign {
        assignment: assignment.encode(),
    };
    channel::write_all(control.as_raw_fd(), &frame.bytes())
}

/// A child waiting for its assignment; exits quietly if none comes (the
/// zygote closed the pipe: a standby not wanted).
pub fn receive(control: RawFd) -> Assignment {
    match next_assignment(control) {
        Some(assignment) => assignment,
        None => crate::process::exit_now(0),
    }
}

/// The next assignment on `control`; `None` once the zygote closed it (a
/// resident retired). A garbled one ends the child.
pub fn next_assignment(control: RawFd) -> Option<Assignment> {
    // SAFETY: the control pipe's read end is this child's, open while it reads.
    let control = unsafe { std::os::fd::BorrowedFd::borrow_raw(control) };
    // A pipe cut short is a zygote gone: as good as closed.
    match crate::link::read_frame(control).ok()?? {
        Frame::Assign { assignment } => match Assignment::decode(&assignment) {
            Some(assignment) => Some(assignment),
            None => crate::process::exit_now(1),
        },
        _ => crate::process::exit_now(1),
    }
}

/// In a reset resident: its next call, and where the call's owner reads it
/// itself (a link's, `zygote::server`), the pipe its lines go down; `None`
/// once the zygote closed the control socket. A garbled one ends the child.
pub fn next_call(
    control: RawFd,
    space: &mut crate::link::ReceiveSpace,
) -> Option<(Assignment, Option<OwnedFd>)> {
    use crate::link::{Received, Receiver};
    // SAFETY: the control socket is this child's, open while it reads.
    let control = unsafe { std::os::fd::BorrowedFd::borrow_raw(control) };
    // The zygote sends nothing past a call's assignment until this child
    // says it is put back, so nothing read here belongs to a later call.
    let mut receiver = Receiver::default();
    let mut pipe = None;
    loop {
        match receiver.next_frame() {
            Ok(Some(Frame::Pipe { pipe: given, .. })) => pipe = Some(given),
            Ok(Some(Frame::Assign { assignment })) => {
                return match Assignment::decode(&assignment) {
                    Some(assignment) => Some((assignment, pipe)),
                    None => crate::process::exit_now(1),
                };
            }
            Ok(Some(_)) | Err(_) => crate::process::exit_now(1),
            // Blocking: this is where the zygote sees it wait for a call.
            Ok(None) => match receiver.receive_into(control, space) {
                Ok(Received::Data) => {}
                Ok(Received::WouldBlock) => crate::process::exit_now(1),
                Ok(Received::Closed) | Err(_) => return None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_assignment_survives_its_wire_form() {
        let assignment = Assignment {
            task: Task::Run,
            id: "[1, \"x\"]".into(),
            call_id: "r:f.n".into(),
            key: NodeKey {
                flow: "f".into(),
                node: "n".into(),
            },
            source: "def process(x):\n    return x\n".into(),
            digest: "0123456789abcdef0123456789abcdef".into(),
            kwargs: Some("{\"x\": \"\"}".into()),
            env: vec![
                ("CUDA_VISIBLE_DEVICES".into(), "1".into()),
                ("EMPTY".into(), "".into()),
            ],
        };
        assert_eq!(
            Assignment::decode(&assignment.encode()),
            Some(assignment.clone())
        );
        let check = Assignment {
            task: Task::Check,
            kwargs: None,
            env: vec![],
            ..assignment
        };
        assert_eq!(Assignment::decode(&check.encode()), Some(check));
        assert_eq!(Assignment::decode(b"\x05\x00"), None);
    }
}
