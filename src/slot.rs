//! A pool slot: `fluksio-zygote worker --shared-zygote`, a thin process of a
//! zygote it shares with the other slots on this machine.
//!
//! The issues this solves:
//! 1. The engine's pool starts N workers: with a zygote each, N copies of
//!    the preloads (hundreds of MB each with torch), where one would do.
//! 2. The pool ends a call that timed out, or is cancelled, by SIGKILLing
//!    the worker it spawned. With a private zygote that costs a cold start
//!    (every preload imported again); with a shared one it costs the call's
//!    child only, and the slot the pool respawns connects to the zygote,
//!    still warm.
//!
//! So a slot speaks the worker contract on its stdin/stdout, as any worker,
//! and hands each request to the shared zygote over a Unix socket (the
//! agent's link protocol, `crate::link`): the zygote forks the call's child
//! and hands the slot its line pipe, and the slot relays the child's lines
//! to the pool. The zygote is found by a socket whose name is a digest of
//! everything that shapes it (the binary, its flags, the environment), so
//! slots started alike share one, and slots started differently do not.
//! The first slot starts it (under a lock, so two first slots start one);
//! it ends when its last slot has gone. A slot SIGKILLed ends exactly its
//! own call: the zygote kills the runs of a link that closes.

use std::fs::File;
use std::io::Read;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, RawFd};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::process::{Command, ExitCode, Stdio};

use nix::poll::{PollFd, PollFlags, PollTimeout, poll};
use serde_json::value::RawValue;
use sha2::{Digest, Sha256};

use crate::end::End;
use crate::link;
use crate::link::client::{Client, LinkLost};
use crate::output::CallOutput;
use crate::protocol;
use crate::worker::WorkerOptions;

/// Turns a worker into a slot of a shared zygote, for the pool (which
/// passes no flags).
pub const SHARED_ZYGOTE_ENV: &str = "FLUKSIO_SHARED_ZYGOTE";

/// The fd a starting zygote reports its start-up on: `ready`, or its error.
const STATUS_FD: RawFd = 3;

/// Serves the worker contract through the shared zygote until stdin closes.
pub fn run(options: &WorkerOptions, args: &[String]) -> ExitCode {
    let (request_fd, reply_fd) = match crate::worker::take_stdio() {
        Ok(streams) => streams,
        Err(error) => {
            eprintln!("fluksio-zygote: could not set up stdin and stdout: {error}");
            return ExitCode::from(2);
        }
    };
    let place = Place::for_zygote(args);
    let mut slot = Slot {
        place,
        args: args.to_vec(),
        link: None,
        reply_fd,
    };
    if let Err(why) = slot.connect() {
        eprintln!("fluksio-zygote: {why}");
        return ExitCode::from(2);
    }
    let mut requests = crate::lines::RequestReader::new(request_fd, options.max_request_bytes);
    loop {
        let next = requests.next_with(&mut |input| wait_readable(input));
        let line = match next {
            crate::lines::Next::Line(line) => line,
            crate::lines::Next::TooLong(size) => {
                let refusal = protocol::ProtocolError::too_long(size, options.max_request_bytes);
                slot.write(&refusal.reply());
                continue;
            }
            crate::lines::Next::Eof => return ExitCode::SUCCESS,
            crate::lines::Next::Failed(error) => {
                eprintln!("fluksio-zygote: could not read stdin: {error}");
                return ExitCode::FAILURE;
            }
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // Refused here as the worker refuses it; the id and call_id are
        // kept for a reply the slot may have to write itself.
        let request = match protocol::parse_worker_request(&line) {
            Ok(request) => request,
            Err(refusal) => {
                slot.write(&refusal.reply());
                continue;
            }
        };
        slot.serve(&line, &request.id, &request.call_id);
    }
}

fn wait_readable(fd: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut fds = [PollFd::new(fd, PollFlags::POLLIN)];
    match poll(&mut fds, PollTimeout::NONE) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Where the shared zygote for these flags and this environment listens.
struct Place {
    socket: PathBuf,
    lock: PathBuf,
    log: PathBuf,
}

impl Place {
    fn for_zygote(args: &[String]) -> Place {
        let mut digest = Sha256::new();
        let exe = std::env::current_exe().unwrap_or_default();
        digest.update(exe.as_os_str().as_encoded_bytes());
        // A rebuilt binary is another zygote.
        if let Ok(modified) = std::fs::metadata(&exe).and_then(|m| m.modified()) {
            digest.update(format!("{modified:?}"));
        }
        for arg in args {
            digest.update(arg.as_bytes());
            digest.update([0]);
        }
        let mut env: Vec<(String, String)> = std::env::vars().collect();
        env.sort();
        for (key, value) in env {
            digest.update(key.as_bytes());
            digest.update([b'=']);
            digest.update(value.as_bytes());
            digest.update([0]);
        }
        let name: String = digest
            .finalize()
            .iter()
            .take(10)
            .map(|b| format!("{b:02x}"))
            .collect();
        let dir = runtime_dir();
        Place {
            socket: dir.join(format!("{name}.sock")),
            lock: dir.join(format!("{name}.lock")),
            log: dir.join(format!("{name}.log")),
        }
    }
}

/// `$XDG_RUNTIME_DIR/fluksio-zygote`, else `/tmp/fluksio-zygote-UID`: a
/// directory of this user's alone (0700), or another user could listen in
/// its place.
fn runtime_dir() -> PathBuf {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt};
    // SAFETY: getuid has no preconditions.
    let uid = unsafe { libc::getuid() };
    let dir = match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(runtime) => PathBuf::from(runtime).join("fluksio-zygote"),
        None => std::env::temp_dir().join(format!("fluksio-zygote-{uid}")),
    };
    let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
    match std::fs::metadata(&dir) {
        Ok(meta) if meta.uid() == uid && meta.mode() & 0o077 == 0 => dir,
        // Not ours, or open to others: a private one per process instead.
        _ => {
            let own =
                std::env::temp_dir().join(format!("fluksio-zygote-{uid}-{}", std::process::id()));
            let _ = std::fs::DirBuilder::new().mode(0o700).create(&own);
            own
        }
    }
}

struct Slot {
    place: Place,
    /// The zygote's flags, for starting one.
    args: Vec<String>,
    /// The link to the shared zygote, while it serves.
    link: Option<(UnixStream, Client)>,
    reply_fd: RawFd,
}

impl Slot {
    /// Connects to the shared zygote, starting it if none listens.
    fn connect(&mut self) -> Result<(), String> {
        let lock = File::create(&self.place.lock)
            .map_err(|e| format!("could not open {}: {e}", self.place.lock.display()))?;
        // SAFETY: flock on an fd this function owns; released when it closes.
        unsafe { libc::flock(lock.as_raw_fd(), libc::LOCK_EX) };
        let stream = match UnixStream::connect(&self.place.socket) {
            Ok(stream) => stream,
            Err(_) => {
                self.start_zygote()?;
                UnixStream::connect(&self.place.socket).map_err(|e| {
                    format!(
                        "could not reach the shared zygote at {}: {e}",
                        self.place.socket.display()
                    )
                })?
            }
        };
        drop(lock);
        let mut client = Client::default();
        match client.wait_ready(stream.as_fd()) {
            Ok(()) => {
                self.link = Some((stream, client));
                Ok(())
            }
            Err(link::NotReady::Failed(message)) => Err(message),
            Err(_) => Err(format!(
                "the shared zygote at {} closed the link before it was ready",
                self.place.socket.display()
            )),
        }
    }

    /// Starts the shared zygote, a process of its own session that is
    /// nobody's child here, and waits until it listens (or says why not).
    fn start_zygote(&self) -> Result<(), String> {
        let (status_read, status_write) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC)
            .map_err(|e| format!("could not make a pipe: {e}"))?;
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.place.log)
            .map_err(|e| format!("could not open {}: {e}", self.place.log.display()))?;
        let exe = std::env::current_exe().map_err(|e| e.to_string())?;
        let mut command = Command::new(exe);
        command
            .arg("zygote")
            .arg("--listen")
            .arg(&self.place.socket)
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::from(log));
        // Nobody's child: it outlives the slot that started it.
        crate::process::Start {
            fds: vec![(status_write.as_raw_fd(), 3)],
            detached: true,
            ..Default::default()
        }
        .on(&mut command);
        let mut intermediate = command
            .spawn()
            .map_err(|e| format!("could not start the shared zygote: {e}"))?;
        let _ = intermediate.wait();
        drop(status_write);
        let mut status = String::new();
        let _ = File::from(status_read).read_to_string(&mut status);
        match status.trim() {
            "ready" => Ok(()),
            "" => Err(format!(
                "the shared zygote ended before it was ready; its log: {}",
                self.place.log.display()
            )),
            why => Err(why.to_string()),
        }
    }

    fn write(&self, line: &[u8]) {
        let mut line = line.to_vec();
        if !line.ends_with(b"\n") {
            line.push(b'\n');
        }
        let _ = crate::zygote::channel::write_all(self.reply_fd, &line);
    }

    /// Serves one request: its lines relayed, exactly one reply.
    fn serve(&mut self, line: &[u8], id: &RawValue, call_id: &str) {
        if self.link.is_none()
            && let Err(why) = self.connect()
        {
            let message = format!("the shared zygote could not be started: {why}");
            self.write(&End::Lost(message.to_string()).reply(id, call_id, ""));
            return;
        }
        let (stream, client) = self.link.as_mut().expect("connected above");
        let mut out = Writer(self.reply_fd);
        let called = client.call(stream.as_fd(), line.to_vec(), (id, call_id), &mut out);
        if let Err(LinkLost(mut unanswered)) = called {
            self.link = None;
            let why = "the shared zygote ended during the call (its log says why); the call's \
                       process ended with it";
            unanswered.lost(why.to_string(), &mut out);
        }
    }
}

/// The slot's stdout, as a call's output.
struct Writer(RawFd);

impl CallOutput for Writer {
    fn event(&mut self, line: &[u8]) {
        let _ = crate::zygote::channel::write_all(self.0, line);
    }

    fn reply(&mut self, line: &[u8]) {
        let _ = crate::zygote::channel::write_all(self.0, line);
    }
}

/// The zygote side of a start: says `ready`, or why not, on the status fd
/// a slot gave it, and closes it.
pub fn report_status(message: Option<&str>) {
    // SAFETY: fstat of fd 3 only reads its type: a pipe when a slot started
    // this zygote (anything else is left alone).
    let is_pipe = unsafe {
        let mut stat: libc::stat = std::mem::zeroed();
        libc::fstat(STATUS_FD, &mut stat) == 0 && (stat.st_mode & libc::S_IFMT) == libc::S_IFIFO
    };
    if !is_pipe {
        return;
    }
    let text = match message {
        None => "ready\n".to_string(),
        Some(why) => format!("{why}\n"),
    };
    crate::fds::forget(STATUS_FD);
    // SAFETY: the status pipe is this process's; closed once written.
    let mut status = unsafe { File::from_raw_fd(STATUS_FD) };
    let _ = std::io::Write::write_all(&mut status, text.as_bytes());
}
