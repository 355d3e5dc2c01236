//! `fluksio-zygote worker`: the worker contract on stdin/stdout.
//!
//! What the engine's `PythonWorkerPool` speaks with `worker_main.py`: one
//! JSON request per line on stdin, events and exactly one reply per request
//! on stdout, one request at a time. Here every call runs in a child forked
//! from the zygote, so a crash, an `os._exit` or a `sys.exit` in a node
//! costs that child, and the next call starts from the zygote's state.
//!
//! Before anything else runs, the two streams are moved to private fds:
//! fd 1 then points at stderr (a stray `write(1)` from a node or a native
//! library lands in the log, not in the protocol) and fd 0 at /dev/null (a
//! node reading `sys.stdin` cannot swallow the next request).

use std::os::fd::RawFd;
use std::process::ExitCode;

use pyo3::prelude::*;

use crate::fds;
use crate::output::CallOutput;
use crate::protocol;
use crate::zygote::channel::write_all;
use crate::zygote::{self, Zygote, ZygoteOptions, recovery};

/// How `worker` is run.
#[derive(Debug, Clone)]
pub struct WorkerOptions {
    pub zygote: ZygoteOptions,
    /// A request line longer than this is refused, and the worker goes on.
    pub max_request_bytes: usize,
}

/// Serves requests until stdin closes. Exit code 0 then; 2 if the zygote
/// could not start.
pub fn run(options: &WorkerOptions) -> ExitCode {
    let resume = recovery::take();
    let streams = match &resume {
        Some(resume) => Ok((resume.request_fd, resume.reply_fd)),
        None => take_stdio(),
    };
    let (request_fd, reply_fd) = match streams {
        Ok(streams) => streams,
        Err(error) => {
            eprintln!("fluksio-zygote: could not set up stdin and stdout: {error}");
            return ExitCode::from(2);
        }
    };
    fds::claim(request_fd);
    fds::claim(reply_fd);
    zygote::heavy::run(
        &options.zygote,
        zygote::print_startup_error,
        |py, zygote| {
            let mut requests = RequestReader::new(request_fd, options.max_request_bytes);
            let mut pending = None;
            if let Some(resume) = resume {
                zygote.restore_nodes(py, resume.nodes);
                requests.push_front(resume.unread);
                pending = resume.pending.map(String::into_bytes);
            }
            let mut replies = Replies {
                fd: reply_fd,
                broken: false,
            };
            serve(py, zygote, &mut requests, &mut replies, pending)
        },
    )
}

fn serve(
    py: Python<'_>,
    zygote: &mut Zygote,
    requests: &mut RequestReader,
    replies: &mut Replies,
    mut pending: Option<Vec<u8>>,
) -> ExitCode {
    while !replies.broken {
        let line = match pending.take() {
            Some(line) => line,
            None => match requests.next(zygote) {
                Next::Line(line) => line,
                Next::TooLong(size) => {
                    let refusal = protocol::ProtocolError::too_long(size, requests.max);
                    replies.reply(&refusal.reply());
                    continue;
                }
                Next::Eof => {
                    zygote.shutdown();
                    return ExitCode::SUCCESS;
                }
                Next::Failed(error) => {
                    eprintln!("fluksio-zygote: could not read stdin: {error}");
                    return ExitCode::FAILURE;
                }
            },
        };
        if line.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        // The line and what was read behind it (requests sent ahead) are
        // no child's to see.
        let _held = (
            crate::scrub::Held::new(&line),
            crate::scrub::Held::new(requests.unserved()),
        );
        let request = match protocol::parse_worker_request(&line) {
            Ok(request) => request,
            Err(refusal) => {
                replies.reply(&refusal.reply());
                continue;
            }
        };
        let _held_request = request.held();
        if let Err(must) = zygote.serve(py, &request, replies) {
            // The new image starts its own children: the old ones must not
            // linger (a standby waits on an eventfd, which never closes).
            zygote.shutdown();
            let resume = recovery::Resume {
                nodes: zygote.resume_nodes(),
                pending: (!must.answered).then(|| String::from_utf8_lossy(&line).into_owned()),
                unread: requests.unread(),
                request_fd: requests.fd,
                reply_fd: replies.fd,
            };
            let error = recovery::reexec(&resume);
            eprintln!("fluksio-zygote: could not restart the zygote: {error}");
            return ExitCode::FAILURE;
        }
    }
    ExitCode::SUCCESS
}

/// Moves the request stream to a private fd with /dev/null on fd 0, and the
/// reply stream to a private fd with stderr on fd 1.
pub(crate) fn take_stdio() -> std::io::Result<(RawFd, RawFd)> {
    let private = |fd: RawFd| -> std::io::Result<RawFd> {
        // SAFETY: F_DUPFD_CLOEXEC makes a new fd; no existing one changes.
        let new = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 3) };
        if new < 0 {
            return Err(std::io::Error::last_os_error());
        }
        Ok(new)
    };
    let request_fd = private(0)?;
    let reply_fd = private(1)?;
    let null = std::fs::File::open("/dev/null")?;
    // SAFETY: dup2 onto the standard fds, which this process owns.
    unsafe {
        if libc::dup2(std::os::fd::AsRawFd::as_raw_fd(&null), 0) < 0 || libc::dup2(2, 1) < 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    Ok((request_fd, reply_fd))
}

/// The reply stream: every line a call produces, in order.
struct Replies {
    fd: RawFd,
    /// The reader went away: nothing more can be answered.
    broken: bool,
}

impl Replies {
    fn send(&mut self, line: &[u8]) {
        if self.broken {
            return;
        }
        if line.len() >= 1 << 20 {
            // A reply of megabytes: written a MiB at a time, where the
            // engine's end is a pipe the system lets us deepen.
            crate::lines::widen_pipe(self.fd);
        }
        if write_all(self.fd, line).is_err() {
            self.broken = true;
        }
    }
}

impl CallOutput for Replies {
    fn event(&mut self, line: &[u8]) {
        self.send(line);
    }

    fn reply(&mut self, line: &[u8]) {
        self.send(line);
    }
}

/// What reading the next request gave.
pub(crate) enum Next {
    Line(Vec<u8>),
    /// A line over the limit, skipped whole; its size in bytes.
    TooLong(usize),
    Eof,
    Failed(std::io::Error),
}

/// Request lines from the private stdin, each at most `max` bytes.
pub(crate) struct RequestReader {
    fd: RawFd,
    max: usize,
    buffer: Vec<u8>,
    /// Where the next line starts in `buffer`.
    start: usize,
    /// How far past `start` is known to hold no newline.
    scanned: usize,
    eof: bool,
}

impl RequestReader {
    pub(crate) fn new(fd: RawFd, max: usize) -> RequestReader {
        RequestReader {
            fd,
            max,
            buffer: Vec::new(),
            start: 0,
            scanned: 0,
            eof: false,
        }
    }

    /// Puts bytes back in front, as if not yet read.
    fn push_front(&mut self, bytes: Vec<u8>) {
        let mut joined = bytes;
        joined.extend_from_slice(&self.buffer[self.start..]);
        self.buffer = joined;
        self.start = 0;
        self.scanned = 0;
    }

    /// What has been read and not yet served.
    fn unread(&self) -> Vec<u8> {
        self.unserved().to_vec()
    }

    fn unserved(&self) -> &[u8] {
        &self.buffer[self.start..]
    }

    /// The next line; while none is there, `zygote` reaps its children.
    fn next(&mut self, zygote: &mut Zygote) -> Next {
        self.next_with(&mut |input| zygote.wait_for_input(input))
    }

    /// The next line; `wait` blocks until the request fd is readable.
    pub(crate) fn next_with(
        &mut self,
        wait: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> Next {
        let mut skipped: Option<usize> = None;
        loop {
            let window = &self.buffer[self.start + self.scanned..];
            if let Some(at) = newline(window) {
                let end = self.start + self.scanned + at;
                let length = end - self.start;
                let next = match skipped {
                    Some(before) => Next::TooLong(before + length),
                    // One read brought the whole line and more: still too long.
                    None if length > self.max => Next::TooLong(length),
                    None => Next::Line(self.buffer[self.start..end].to_vec()),
                };
                // The line is taken (or refused): its bytes go now, not at
                // the next read, so no child forked while it is served
                // finds them here.
                self.buffer[self.start..=end].fill(0);
                self.start = end + 1;
                self.scanned = 0;
                return next;
            }
            self.scanned = self.buffer.len() - self.start;
            if self.scanned > self.max {
                // Too long to keep: forget it, keep counting to its end.
                *skipped.get_or_insert(0) += self.scanned;
                self.buffer[self.start..].fill(0);
                self.buffer.truncate(self.start);
                self.scanned = 0;
            }
            if self.eof {
                let rest = self.buffer[self.start..].to_vec();
                self.buffer[self.start..].fill(0);
                self.start = self.buffer.len();
                self.scanned = 0;
                return match (skipped, rest.is_empty()) {
                    (Some(before), _) => Next::TooLong(before + rest.len()),
                    // A last line without a newline is still a line.
                    (None, false) => Next::Line(rest),
                    (None, true) => Next::Eof,
                };
            }
            // SAFETY: the request fd stays open for the worker's lifetime.
            let input = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
            if let Err(error) = wait(input).and_then(|()| self.fill()) {
                return Next::Failed(error);
            }
        }
    }

    fn fill(&mut self) -> std::io::Result<()> {
        // Zeroed as they go: the requests served (their kwargs) must not
        // stay in memory every later call's child is forked with.
        if self.start > 0 && self.start == self.buffer.len() {
            crate::scrub::clear(&mut self.buffer);
            self.start = 0;
        } else if self.start > (1 << 20) {
            crate::scrub::drain_front(&mut self.buffer, self.start);
            self.start = 0;
        }
        self.buffer.reserve(1 << 16);
        loop {
            let spare = self.buffer.spare_capacity_mut();
            // SAFETY: reading into spare capacity; set_len covers only what
            // the kernel wrote.
            let n = unsafe { libc::read(self.fd, spare.as_mut_ptr().cast(), spare.len()) };
            if n >= 0 {
                // SAFETY: as above.
                unsafe { self.buffer.set_len(self.buffer.len() + n as usize) };
                self.eof = n == 0;
                return Ok(());
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }
}

/// Where the first newline in `bytes` is: libc's `memchr`, which is as fast
/// in a debug build as in a release one (a gigabyte-long line is scanned
/// whole, in whatever build serves it).
fn newline(bytes: &[u8]) -> Option<usize> {
    // SAFETY: memchr reads at most `bytes.len()` bytes from its start.
    let found = unsafe { libc::memchr(bytes.as_ptr().cast(), b'\n' as i32, bytes.len()) };
    (!found.is_null()).then(|| found as usize - bytes.as_ptr() as usize)
}
