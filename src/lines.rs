//! The lines of a call's pipe, split as they arrive, in time linear in
//! their size, each at most `--max-reply-mb`.
//!
//! A call's child writes events and then one reply, each a JSON line, down
//! a pipe; whoever reads the call (the worker's zygote, the agent, a sweep)
//! splits them here. Two things matter for a reply of hundreds of
//! megabytes, which arrives in tens of thousands of pipe reads:
//!
//! - every byte is searched for the newline once: how far a partial line is
//!   known to hold none is remembered, so the search goes on from there
//!   (`memchr`, the same speed in a debug build), and the bytes of handed
//!   over lines are dropped once, before the next read;
//! - a line over the limit is not kept: past the limit its bytes are counted
//!   and dropped until its newline, so the reader's memory stays within the
//!   limit and a read, and the call gets a reply that says how big the line
//!   was, rather than a reader that grows until the machine runs out.

use std::sync::atomic::{AtomicUsize, Ordering};

/// The default `--max-reply-mb`. A reply is held whole twice on its way
/// (here, and as the engine's one message), and the engine's pool then
/// parses it into Python objects several times its size: a GiB of JSON is
/// already several GiB of engine memory. Past that an artifact is the way
/// (`fluksio.save_artifact`), which streams, and costs the engine nothing.
/// It is twice the request limit (`--max-request-mb`, 512): results are
/// often bigger than their inputs.
pub const DEFAULT_MAX_REPLY_MB: usize = 1024;

/// The environment variable that sets the limit where no flag can be
/// passed (the engine's pool starts the worker without flags).
pub const MAX_REPLY_ENV: &str = "FLUKSIO_MAX_REPLY_MB";

/// The limit, in bytes, of this process: set once at start from the
/// command line, read by every reader of a call's lines.
static MAX_LINE: AtomicUsize = AtomicUsize::new(DEFAULT_MAX_REPLY_MB << 20);

/// Sets the limit of a line a call may send, in MiB (0: the default).
pub fn set_max_reply_mb(mb: usize) {
    let mb = if mb == 0 { DEFAULT_MAX_REPLY_MB } else { mb };
    MAX_LINE.store(mb.saturating_mul(1 << 20), Ordering::Relaxed);
}

/// The limit, in MiB, as `--max-reply-mb` takes it (for a child process).
pub fn max_reply_mb() -> usize {
    MAX_LINE.load(Ordering::Relaxed) >> 20
}

fn max_line() -> usize {
    MAX_LINE.load(Ordering::Relaxed)
}

/// The error type of a call whose reply or event was over the limit.
pub const TOO_LARGE: &str = "ReplyTooLarge";

/// A line over the limit: how long it was (its newline not counted), and
/// whether it was an event (else the reply).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TooLarge {
    pub bytes: usize,
    pub event: bool,
    /// The limit it was over, in bytes.
    pub limit: usize,
}

impl TooLarge {
    /// What the call's error reply says: how big, the limit, what to do.
    pub fn message(&self) -> String {
        let what = if self.event {
            "an event the node sent"
        } else {
            "the node's reply"
        };
        format!(
            "{what} was {} MB, over this worker's limit of {} MB for one reply or event: \
             return large data as an artifact (fluksio.save_artifact(data, name, media_type) \
             returns a reference to return instead), or raise the limit with --max-reply-mb \
             (FLUKSIO_MAX_REPLY_MB)",
            megabytes(self.bytes),
            megabytes(self.limit)
        )
    }

    /// The reply line a reader sends for the call.
    pub fn reply(&self, id: &serde_json::value::RawValue, call_id: &str) -> Vec<u8> {
        crate::protocol::failure_reply(id, call_id, TOO_LARGE, &self.message(), "")
    }
}

/// MiB to one decimal, for a message: `2`, `2.5`.
fn megabytes(bytes: usize) -> String {
    let mb = (bytes as f64 / (1 << 20) as f64 * 10.0).round() / 10.0;
    if mb.fract() == 0.0 {
        format!("{mb:.0}")
    } else {
        format!("{mb:.1}")
    }
}

/// What the buffer holds next.
#[derive(Debug, PartialEq, Eq)]
pub enum Piece<'a> {
    /// A whole line, its newline included.
    Line(&'a [u8]),
    /// A line over the limit ended: none of it was kept.
    TooLarge(TooLarge),
}

/// The bytes read from a call's pipe that are not yet handed over as lines.
#[derive(Debug)]
pub struct LineBuffer {
    buffer: Vec<u8>,
    /// Where the next line starts in `buffer`.
    start: usize,
    /// How far past `start` is known to hold no newline.
    scanned: usize,
    /// The line being read is over the limit: how many of its bytes were
    /// counted (and dropped) so far, and whether it is an event.
    dropping: Option<(usize, bool)>,
    max: usize,
    /// Whether the pipe read was made a MiB deep.
    widened: bool,
}

/// How much room a read gets once a line is past it.
const READ_CHUNK: usize = 1 << 20;

/// A buffer this large is given back once it is empty, rather than kept
/// for the next call's lines.
const KEEP_CAPACITY: usize = 4 << 20;

impl Default for LineBuffer {
    fn default() -> LineBuffer {
        LineBuffer::with_limit(max_line())
    }
}

impl LineBuffer {
    /// A buffer for lines of at most the process's `--max-reply-mb`.
    pub fn new() -> LineBuffer {
        LineBuffer::default()
    }

    /// A buffer for lines of at most `max` bytes (their newline not counted).
    pub fn with_limit(max: usize) -> LineBuffer {
        LineBuffer {
            buffer: Vec::new(),
            start: 0,
            scanned: 0,
            dropping: None,
            max,
            widened: false,
        }
    }

    /// The vector to read into, with room for a read in its spare capacity:
    /// what was handed over is dropped first, and the next read's bytes go
    /// after what is left (append only, into the spare capacity).
    pub fn for_read(&mut self) -> &mut Vec<u8> {
        self.forget_handed_over();
        // A pipe read brings at most what the pipe holds (64 KiB unless
        // raised); past a MiB of one line, room for a MiB at a time.
        let want = if self.buffer.len() >= READ_CHUNK {
            READ_CHUNK
        } else {
            64 * 1024
        };
        self.buffer.reserve(want);
        &mut self.buffer
    }

    /// One `read(2)` of `fd` appended, EINTR retried: the bytes read, 0 at
    /// the end of the file. Into spare capacity: nothing is zeroed or
    /// copied twice, which matters for a reply of megabytes.
    pub fn read_fd(&mut self, fd: std::os::fd::RawFd) -> std::io::Result<usize> {
        if !self.widened && self.buffer.len() - self.start >= READ_CHUNK {
            // A line of megabytes: a MiB per read rather than 64 KiB, a
            // sixteenth of the wake-ups on both sides of the pipe.
            self.widened = true;
            widen_pipe(fd);
        }
        let buffer = self.for_read();
        loop {
            let spare = buffer.spare_capacity_mut();
            // SAFETY: reading into the vector's spare capacity, at most its
            // length; set_len below covers only the bytes read.
            let n = unsafe { libc::read(fd, spare.as_mut_ptr().cast(), spare.len()) };
            if n >= 0 {
                // SAFETY: the kernel initialised these n bytes.
                unsafe { buffer.set_len(buffer.len() + n as usize) };
                return Ok(n as usize);
            }
            let error = std::io::Error::last_os_error();
            if error.kind() != std::io::ErrorKind::Interrupted {
                return Err(error);
            }
        }
    }

    /// Everything in the buffer, lines handed over included: a call's
    /// output, held across a fork (`crate::scrub`).
    pub fn held(&self) -> crate::scrub::Held {
        crate::scrub::Held::new(&self.buffer)
    }

    /// Zeroes and drops the lines handed over; what is left of a line
    /// moves to the front.
    pub fn forget_handed_over(&mut self) {
        // Lines handed over are zeroed as they go: a call's output must not
        // stay in memory later children are forked with.
        if self.start > 0 {
            if self.start == self.buffer.len() {
                crate::scrub::clear(&mut self.buffer);
                if self.buffer.capacity() > KEEP_CAPACITY {
                    self.buffer = Vec::new();
                }
                self.start = 0;
            } else {
                // Only the partial line after the last newline moves, once.
                crate::scrub::drain_front(&mut self.buffer, self.start);
                self.start = 0;
            }
        }
    }

    /// Drops everything, the half line and the record of one over the limit
    /// included; a big allocation goes back to the allocator.
    pub fn clear(&mut self) {
        crate::scrub::clear(&mut self.buffer);
        if self.buffer.capacity() > KEEP_CAPACITY {
            self.buffer = Vec::new();
        }
        self.start = 0;
        self.scanned = 0;
        self.dropping = None;
    }

    /// Bytes held (read, not yet handed over).
    pub fn len(&self) -> usize {
        self.buffer.len() - self.start
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The next whole line, or the end of one over the limit; `None` until
    /// more is read. Each byte is searched once, whatever the sizes of the
    /// reads.
    pub fn next_piece(&mut self) -> Option<Piece<'_>> {
        if let Some((counted, event)) = self.dropping {
            let rest = &self.buffer[self.start..];
            return match newline(rest) {
                Some(at) => {
                    self.start += at + 1;
                    self.dropping = None;
                    Some(Piece::TooLarge(TooLarge {
                        bytes: counted + at,
                        event,
                        limit: self.max,
                    }))
                }
                None => {
                    self.dropping = Some((counted + rest.len(), event));
                    self.buffer.truncate(self.start);
                    None
                }
            };
        }
        let from = self.start + self.scanned;
        match newline(&self.buffer[from..]) {
            Some(at) => {
                let begin = self.start;
                let end = from + at + 1;
                self.start = end;
                self.scanned = 0;
                let line = &self.buffer[begin..end];
                if line.len() - 1 > self.max {
                    return Some(Piece::TooLarge(TooLarge {
                        bytes: line.len() - 1,
                        event: crate::protocol::is_event(line),
                        limit: self.max,
                    }));
                }
                Some(Piece::Line(line))
            }
            None => {
                self.scanned = self.buffer.len() - self.start;
                if self.scanned > self.max {
                    // Over the limit: count the rest, keep none of it.
                    let event = crate::protocol::is_event(&self.buffer[self.start..]);
                    self.dropping = Some((self.scanned, event));
                    self.buffer.truncate(self.start);
                    self.scanned = 0;
                }
                None
            }
        }
    }
}

impl LineBuffer {
    /// The next whole line taken off without its newline (`Err` with its
    /// size for one over the limit), its bytes zeroed at once: a request
    /// must not wait in memory for the next read while children fork.
    pub fn take_line(&mut self) -> Option<Result<Vec<u8>, usize>> {
        let begin = self.start;
        let taken = match self.next_piece()? {
            Piece::Line(line) => Ok(line[..line.len() - 1].to_vec()),
            Piece::TooLarge(too_large) => Err(too_large.bytes),
        };
        let end = self.start;
        crate::scrub::wipe(&mut self.buffer[begin.min(end)..end]);
        Some(taken)
    }

    /// At the end of the stream, after every whole line was taken: what is
    /// left, a last line without its newline (empty if none), zeroed here;
    /// `Err` with its size if it is over the limit.
    pub fn take_rest(&mut self) -> Result<Vec<u8>, usize> {
        let rest = self.buffer[self.start..].to_vec();
        crate::scrub::wipe(&mut self.buffer[self.start..]);
        self.start = self.buffer.len();
        self.scanned = 0;
        match self.dropping.take() {
            Some((counted, _)) => Err(counted + rest.len()),
            None => Ok(rest),
        }
    }

    /// Puts `bytes` back in front of what is left, as if not yet split.
    pub fn push_front(&mut self, bytes: &[u8]) {
        self.buffer
            .splice(self.start..self.start, bytes.iter().copied());
        self.scanned = 0;
    }

    /// What was read and not yet taken.
    pub fn pending(&self) -> &[u8] {
        &self.buffer[self.start..]
    }
}

/// What reading a request gave.
pub enum Next {
    Line(Vec<u8>),
    /// A line over the limit, skipped whole; its size in bytes.
    TooLong(usize),
    Eof,
    Failed(std::io::Error),
}

/// Request lines of the worker contract from a stream (a worker's or a
/// slot's private stdin), each at most `max` bytes, split as a call's lines
/// are; a last line without its newline still counts.
pub struct RequestReader {
    pub fd: std::os::fd::RawFd,
    pub max: usize,
    lines: LineBuffer,
    eof: bool,
}

impl RequestReader {
    pub fn new(fd: std::os::fd::RawFd, max: usize) -> RequestReader {
        RequestReader {
            fd,
            max,
            lines: LineBuffer::with_limit(max),
            eof: false,
        }
    }

    /// Puts bytes back in front, as if not yet read.
    pub fn push_front(&mut self, bytes: &[u8]) {
        self.lines.push_front(bytes);
    }

    /// What has been read and not yet served (requests sent ahead).
    pub fn unserved(&self) -> &[u8] {
        self.lines.pending()
    }

    /// The next line; `wait` blocks until the request fd is readable.
    pub fn next_with(
        &mut self,
        wait: &mut dyn FnMut(std::os::fd::BorrowedFd<'_>) -> std::io::Result<()>,
    ) -> Next {
        loop {
            match self.lines.take_line() {
                Some(Ok(line)) => return Next::Line(line),
                Some(Err(size)) => return Next::TooLong(size),
                None => {}
            }
            if self.eof {
                return match self.lines.take_rest() {
                    Err(size) => Next::TooLong(size),
                    Ok(rest) if rest.is_empty() => Next::Eof,
                    Ok(rest) => Next::Line(rest),
                };
            }
            // SAFETY: the request fd stays open for the reader's lifetime.
            let input = unsafe { std::os::fd::BorrowedFd::borrow_raw(self.fd) };
            match wait(input).and_then(|()| self.lines.read_fd(self.fd)) {
                Ok(read) => self.eof = read == 0,
                Err(error) => return Next::Failed(error),
            }
        }
    }
}

/// Makes the pipe `fd` holds a MiB deep (`F_SETPIPE_SZ`), where the
/// system allows it (`/proc/sys/fs/pipe-max-size`); else it stays as it is.
pub fn widen_pipe(fd: std::os::fd::RawFd) {
    // SAFETY: fcntl on an fd the caller holds; a failure changes nothing.
    unsafe { libc::fcntl(fd, libc::F_SETPIPE_SZ, READ_CHUNK as libc::c_int) };
}

/// Where the first newline in `bytes` is.
pub fn newline(bytes: &[u8]) -> Option<usize> {
    memchr::memchr(b'\n', bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Requests split off a pipe: a line over the limit is skipped whole
    /// and counted, a last line without its newline still counts, and a
    /// line taken leaves no byte of itself behind.
    #[test]
    fn requests_are_taken_whole_or_refused_with_their_size() {
        let (read, write) = nix::unistd::pipe().unwrap();
        let long = "x".repeat(50);
        let input = format!("first\n{long}\nsecond\n{long}\nlast");
        nix::unistd::write(&write, input.as_bytes()).unwrap();
        drop(write);
        let mut requests = RequestReader::new(std::os::fd::AsRawFd::as_raw_fd(&read), 10);
        let mut wait = |_: std::os::fd::BorrowedFd<'_>| Ok(());
        let mut next = || match requests.next_with(&mut wait) {
            Next::Line(line) => format!("line {}", String::from_utf8(line).unwrap()),
            Next::TooLong(size) => format!("too long {size}"),
            Next::Eof => "eof".to_string(),
            Next::Failed(error) => format!("failed {error}"),
        };
        assert_eq!(next(), "line first");
        assert_eq!(next(), "too long 50");
        assert_eq!(next(), "line second");
        assert_eq!(next(), "too long 50");
        assert_eq!(next(), "line last");
        assert_eq!(next(), "eof");
    }

    #[test]
    fn a_taken_line_is_zeroed_at_once() {
        let mut buffer = LineBuffer::with_limit(100);
        buffer.for_read().extend_from_slice(b"secret\nnext");
        assert_eq!(buffer.take_line(), Some(Ok(b"secret".to_vec())));
        assert!(!buffer.buffer.windows(6).any(|w| w == b"secret"));
        assert_eq!(buffer.pending(), b"next");
        buffer.push_front(b"again\n");
        assert_eq!(buffer.take_line(), Some(Ok(b"again".to_vec())));
        assert_eq!(buffer.take_rest(), Ok(b"next".to_vec()));
    }

    fn feed(buffer: &mut LineBuffer, bytes: &[u8]) -> Vec<String> {
        buffer.for_read().extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(piece) = buffer.next_piece() {
            out.push(match piece {
                Piece::Line(line) => String::from_utf8_lossy(line).into_owned(),
                Piece::TooLarge(t) => format!("too large: {} event={}", t.bytes, t.event),
            });
        }
        out
    }

    #[test]
    fn lines_split_across_reads() {
        let mut buffer = LineBuffer::with_limit(100);
        assert_eq!(feed(&mut buffer, b"ab"), Vec::<String>::new());
        assert_eq!(feed(&mut buffer, b"c\nde\nf"), vec!["abc\n", "de\n"]);
        assert_eq!(feed(&mut buffer, b"\n"), vec!["f\n"]);
        assert!(buffer.is_empty());
    }

    #[test]
    fn a_line_over_the_limit_is_counted_not_kept() {
        let mut buffer = LineBuffer::with_limit(10);
        assert_eq!(feed(&mut buffer, b"ok\n0123456"), vec!["ok\n"]);
        assert_eq!(feed(&mut buffer, b"789abcdef"), Vec::<String>::new());
        assert_eq!(buffer.len(), 0, "nothing of it is kept");
        assert_eq!(
            feed(&mut buffer, b"ghij\nnext\n"),
            vec!["too large: 20 event=false", "next\n"]
        );
        // Whole in one read, and an event.
        let event = format!("{{\"event\": \"{}\"}}\n", "x".repeat(20));
        assert_eq!(
            feed(&mut buffer, event.as_bytes()),
            vec![format!("too large: {} event=true", event.len() - 1)]
        );
        // At the limit exactly is fine.
        assert_eq!(feed(&mut buffer, b"0123456789\n"), vec!["0123456789\n"]);
        // Over it behind a whole line in the same read, then across reads.
        assert_eq!(feed(&mut buffer, b"ok\n0123456789ab"), vec!["ok\n"]);
        assert_eq!(feed(&mut buffer, b"cd"), Vec::<String>::new());
        assert_eq!(
            feed(&mut buffer, b"e\nend\n"),
            vec!["too large: 15 event=false", "end\n"]
        );
    }

    #[test]
    fn the_message_says_how_big_and_what_to_do() {
        let message = TooLarge {
            bytes: 12 << 20,
            event: false,
            limit: 8 << 20,
        }
        .message();
        assert!(message.contains("was 12 MB"), "{message}");
        assert!(message.contains("limit of 8 MB"), "{message}");
        assert!(message.contains("save_artifact"), "{message}");
        assert!(message.contains("--max-reply-mb"), "{message}");
    }
}
