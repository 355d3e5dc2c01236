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
use crate::lines::{Next, RequestReader};
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
                requests.push_front(&resume.unread);
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
            None => match requests.next_with(&mut |input| zygote.wait_for_input(input)) {
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
                unread: requests.unserved().to_vec(),
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
    use std::os::fd::IntoRawFd;
    let request_fd = crate::fds::keep_stream(0)?.into_raw_fd();
    let reply_fd = crate::fds::keep_stream(1)?.into_raw_fd();
    crate::fds::shield_standard_streams(true)?;
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
