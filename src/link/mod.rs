//! The link: frames over a Unix socket between a process that owns calls
//! and a zygote that forks them. The one wire between the runtime's
//! processes: the agent and its zygote, pool slots and their shared zygote,
//! a zygote and a node's own zygote or its lanes, a sweep and its lanes; and
//! down a call's control pipe, its assignment.
//!
//! The owner may have threads, so it never forks node code; the zygote
//! does, and hands each run's line pipe and a pidfd of its child to the
//! owner across the socket (SCM_RIGHTS). The owner then reads the call's
//! lines itself, and can kill the call's process exactly, whatever the
//! zygote is busy with.
//!
//! A frame is `[u32 length][u8 kind][u64 ticket][payload]`; the owner picks
//! the tickets, one per request. File descriptors travel with the frame that
//! names them, in the same `sendmsg`, and are taken in order on receipt.

pub mod client;
pub mod follow;

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};

use nix::sys::socket::{ControlMessage, ControlMessageOwned, MsgFlags, recvmsg, sendmsg};

use crate::process::ChildEnd;

/// The most a frame may carry: its length is a u32.
pub const MAX_PAYLOAD: usize = u32::MAX as usize - 16;

/// What travels on the link.
#[derive(Debug)]
pub enum Frame {
    /// Owner → zygote: serve this request line (of the worker contract).
    Call { ticket: u64, request: Vec<u8> },
    /// The zygote started: its preloads imported, ready for calls.
    Ready,
    /// The zygote could not start; the message says why. It exits next.
    Failed { message: String },
    /// A child was forked for the call; with a pidfd to kill it by.
    Started {
        ticket: u64,
        pid: i32,
        pidfd: OwnedFd,
    },
    /// The run's events and reply come on this pipe, read by the owner.
    Pipe { ticket: u64, pipe: OwnedFd },
    /// A line the zygote read (or wrote) itself for the call.
    Line { ticket: u64, line: Vec<u8> },
    /// The run's child ended (reaped); what it printed, for a reply the
    /// owner writes if the child wrote none.
    Ended {
        ticket: u64,
        end: ChildEnd,
        logs: String,
    },
    /// The zygote has nothing more to say about the call.
    Done { ticket: u64 },
    /// Zygote → a node's own zygote: whoever sent the call is gone; end
    /// its run, if it has one.
    Abandon { ticket: u64 },
    /// The process serving the call is gone, with the call's child, and
    /// nothing more comes: the call's reply is a failure saying why.
    Lost { ticket: u64, message: String },
    /// Zygote → a node's own zygote: its calls keep its fork loop busy;
    /// fork a lane of itself (`zygote::server`).
    ForkLane,
    /// A zygote → a call's child, down the child's control pipe: the
    /// call's assignment (`zygote::assignment` encodes its fields).
    Assign { assignment: Vec<u8> },
    /// A node's own zygote → the zygote: the lane it forked, the lane's end
    /// of a link to be served over, and a pidfd of it (opened by its
    /// parent, so it names the lane even if it has died since).
    Lane {
        pid: i32,
        link: OwnedFd,
        pidfd: OwnedFd,
    },
}

const CALL: u8 = 1;
const READY: u8 = 2;
const FAILED: u8 = 3;
const STARTED: u8 = 4;
const PIPE: u8 = 5;
const LINE: u8 = 6;
const ENDED: u8 = 7;
const DONE: u8 = 8;
const ABANDON: u8 = 9;
const LOST: u8 = 10;
const FORK_LANE: u8 = 11;
const LANE: u8 = 12;
const ASSIGN: u8 = 13;

/// An `Ended` code at or below `-OVER_MEMORY_LIMIT` is a memory-limit kill.
const OVER_MEMORY_LIMIT: i32 = 1000;

impl Frame {
    /// The call a frame is about, if it is about one.
    pub fn ticket(&self) -> Option<u64> {
        match self {
            Frame::Call { ticket, .. }
            | Frame::Started { ticket, .. }
            | Frame::Pipe { ticket, .. }
            | Frame::Line { ticket, .. }
            | Frame::Ended { ticket, .. }
            | Frame::Done { ticket }
            | Frame::Abandon { ticket }
            | Frame::Lost { ticket, .. } => Some(*ticket),
            Frame::Ready
            | Frame::Failed { .. }
            | Frame::ForkLane
            | Frame::Lane { .. }
            | Frame::Assign { .. } => None,
        }
    }

    /// The fds a frame carries, in order.
    pub fn fds(&self) -> Vec<RawFd> {
        match self {
            Frame::Started { pidfd, .. } => vec![pidfd.as_raw_fd()],
            Frame::Pipe { pipe, .. } => vec![pipe.as_raw_fd()],
            Frame::Lane { link, pidfd, .. } => vec![link.as_raw_fd(), pidfd.as_raw_fd()],
            _ => Vec::new(),
        }
    }

    /// Whether nothing more comes about its call after this frame.
    pub fn is_last(&self) -> bool {
        matches!(
            self,
            Frame::Ended { .. } | Frame::Done { .. } | Frame::Lost { .. }
        )
    }

    /// The same frame about the call the receiver knows as `ticket`.
    pub fn with_ticket(self, ticket: u64) -> Frame {
        match self {
            Frame::Call { request, .. } => Frame::Call { ticket, request },
            Frame::Started { pid, pidfd, .. } => Frame::Started { ticket, pid, pidfd },
            Frame::Pipe { pipe, .. } => Frame::Pipe { ticket, pipe },
            Frame::Line { line, .. } => Frame::Line { ticket, line },
            Frame::Ended { end, logs, .. } => Frame::Ended { ticket, end, logs },
            Frame::Done { .. } => Frame::Done { ticket },
            Frame::Abandon { .. } => Frame::Abandon { ticket },
            Frame::Lost { message, .. } => Frame::Lost { ticket, message },
            other => other,
        }
    }

    /// The bytes of a frame that carries no fd (what an owner sends).
    pub fn bytes(&self) -> Vec<u8> {
        let (bytes, fds) = self.encode();
        debug_assert!(fds.is_empty(), "a frame with an fd goes through `send`");
        bytes
    }

    /// The frame's bytes and the fds that go with them.
    fn encode(&self) -> (Vec<u8>, Vec<RawFd>) {
        let (kind, ticket, mut payload) = match self {
            Frame::Call { ticket, request } => (CALL, *ticket, request.clone()),
            Frame::Ready => (READY, 0, Vec::new()),
            Frame::Failed { message } => (FAILED, 0, message.as_bytes().to_vec()),
            Frame::Started { ticket, pid, .. } => (STARTED, *ticket, pid.to_le_bytes().to_vec()),
            Frame::Pipe { ticket, .. } => (PIPE, *ticket, Vec::new()),
            Frame::Line { ticket, line } => (LINE, *ticket, line.clone()),
            Frame::Ended { ticket, end, logs } => {
                // Exit codes are 0..=255 and signals 1..=64: an end over a
                // memory limit is written below both, as -(1000 + MiB).
                let code = match end {
                    ChildEnd::Exited(code) => *code,
                    ChildEnd::Signaled(signal) => -(*signal as i32),
                    ChildEnd::OverMemoryLimit(mib) => {
                        -(OVER_MEMORY_LIMIT + (*mib).min(i32::MAX as u64 / 2) as i32)
                    }
                };
                let mut payload = code.to_le_bytes().to_vec();
                payload.extend_from_slice(logs.as_bytes());
                (ENDED, *ticket, payload)
            }
            Frame::Done { ticket } => (DONE, *ticket, Vec::new()),
            Frame::Abandon { ticket } => (ABANDON, *ticket, Vec::new()),
            Frame::Lost { ticket, message } => (LOST, *ticket, message.as_bytes().to_vec()),
            Frame::ForkLane => (FORK_LANE, 0, Vec::new()),
            Frame::Assign { assignment } => (ASSIGN, 0, assignment.clone()),
            Frame::Lane { pid, .. } => (LANE, 0, pid.to_le_bytes().to_vec()),
        };
        let mut bytes = Vec::with_capacity(13 + payload.len());
        bytes.extend_from_slice(&((9 + payload.len()) as u32).to_le_bytes());
        bytes.push(kind);
        bytes.extend_from_slice(&ticket.to_le_bytes());
        bytes.append(&mut payload);
        (bytes, self.fds())
    }

    fn decode(body: &[u8], fds: &mut VecDeque<OwnedFd>) -> Result<Frame, String> {
        if body.len() < 9 {
            return Err("a frame shorter than its header".into());
        }
        let ticket = u64::from_le_bytes(body[1..9].try_into().expect("8 bytes"));
        let payload = &body[9..];
        let fd = |fds: &mut VecDeque<OwnedFd>| {
            fds.pop_front().ok_or("a frame without its file descriptor")
        };
        let number = |payload: &[u8]| -> Result<i32, String> {
            Ok(i32::from_le_bytes(
                payload
                    .get(..4)
                    .ok_or("a short frame")?
                    .try_into()
                    .expect("4 bytes"),
            ))
        };
        Ok(match body[0] {
            CALL => Frame::Call {
                ticket,
                request: payload.to_vec(),
            },
            READY => Frame::Ready,
            FAILED => Frame::Failed {
                message: String::from_utf8_lossy(payload).into_owned(),
            },
            STARTED => Frame::Started {
                ticket,
                pid: number(payload)?,
                pidfd: fd(fds)?,
            },
            PIPE => Frame::Pipe {
                ticket,
                pipe: fd(fds)?,
            },
            LINE => Frame::Line {
                ticket,
                line: payload.to_vec(),
            },
            ENDED => {
                let code = number(payload)?;
                let end = if code >= 0 {
                    ChildEnd::Exited(code)
                } else if code <= -OVER_MEMORY_LIMIT {
                    ChildEnd::OverMemoryLimit((-(code as i64) - OVER_MEMORY_LIMIT as i64) as u64)
                } else {
                    ChildEnd::Signaled(
                        nix::sys::signal::Signal::try_from(-code).map_err(|e| e.to_string())?,
                    )
                };
                Frame::Ended {
                    ticket,
                    end,
                    logs: String::from_utf8_lossy(&payload[4..]).into_owned(),
                }
            }
            DONE => Frame::Done { ticket },
            ABANDON => Frame::Abandon { ticket },
            LOST => Frame::Lost {
                ticket,
                message: String::from_utf8_lossy(payload).into_owned(),
            },
            FORK_LANE => Frame::ForkLane,
            ASSIGN => Frame::Assign {
                assignment: payload.to_vec(),
            },
            LANE => Frame::Lane {
                pid: number(payload)?,
                link: fd(fds)?,
                pidfd: fd(fds)?,
            },
            other => return Err(format!("an unknown frame kind {other}")),
        })
    }
}

/// Sends one frame, whole, with its fd. Blocks until the socket took it.
pub fn send(socket: BorrowedFd<'_>, frame: &Frame) -> std::io::Result<()> {
    let (bytes, fds) = frame.encode();
    if bytes.len() > MAX_PAYLOAD {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "a frame over 4 GiB",
        ));
    }
    let mut sent = 0;
    while sent < bytes.len() {
        // The fds ride with the frame's first bytes only.
        let control = if sent == 0 && !fds.is_empty() {
            vec![ControlMessage::ScmRights(&fds)]
        } else {
            vec![]
        };
        match sendmsg::<()>(
            socket.as_raw_fd(),
            &[IoSlice::new(&bytes[sent..])],
            &control,
            MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(n) => sent += n,
            Err(nix::errno::Errno::EINTR) => continue,
            Err(nix::errno::Errno::EAGAIN) => wait_writable(socket)?,
            Err(error) => return Err(error.into()),
        }
    }
    Ok(())
}

/// Blocks for a fresh link's first frame: `Ready`, or why not. What came
/// after it stays in `receiver`.
pub fn wait_ready(link: BorrowedFd<'_>, receiver: &mut Receiver) -> Result<(), NotReady> {
    loop {
        if let Some(ready) = receiver.ready() {
            return ready;
        }
        if !receiver.receive_waiting(link) {
            return Err(NotReady::Closed);
        }
    }
}

/// Reads one whole frame from a blocking pipe (no fds cross a pipe);
/// `None` at the pipe's end.
pub fn read_frame(pipe: BorrowedFd<'_>) -> std::io::Result<Option<Frame>> {
    use std::io::Read;
    // SAFETY: the fd stays open for the borrow; ManuallyDrop never closes it.
    let mut file =
        std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(pipe.as_raw_fd()) });
    let mut length = [0u8; 4];
    match file.read_exact(&mut length) {
        Ok(()) => {}
        Err(error) if error.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(error) => return Err(error),
    }
    let mut body = vec![0u8; u32::from_le_bytes(length) as usize];
    file.read_exact(&mut body)?;
    Frame::decode(&body, &mut VecDeque::new())
        .map(Some)
        .map_err(|why| std::io::Error::new(std::io::ErrorKind::InvalidData, why))
}

fn wait_writable(socket: BorrowedFd<'_>) -> std::io::Result<()> {
    let mut fds = [nix::poll::PollFd::new(
        socket,
        nix::poll::PollFlags::POLLOUT,
    )];
    match nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE) {
        Ok(_) | Err(nix::errno::Errno::EINTR) => Ok(()),
        Err(error) => Err(error.into()),
    }
}

/// Why the zygote on a fresh link is not ready to serve.
#[derive(Debug)]
pub enum NotReady {
    /// It could not start, and said why.
    Failed(String),
    /// Its first frame was something else.
    Said(Frame),
    /// The link closed (it ended as it started), or could not be read.
    Closed,
}

impl Receiver {
    /// What a fresh link's first frame says, once it has arrived: `None`
    /// while it has not. Every owner of a link waits for this first.
    pub fn ready(&mut self) -> Option<Result<(), NotReady>> {
        match self.next_frame() {
            Ok(Some(Frame::Ready)) => Some(Ok(())),
            Ok(Some(Frame::Failed { message })) => Some(Err(NotReady::Failed(message))),
            Ok(Some(other)) => Some(Err(NotReady::Said(other))),
            Ok(None) => None,
            Err(_) => Some(Err(NotReady::Closed)),
        }
    }
}

/// Frames as they arrive on a socket: bytes and fds, reassembled.
#[derive(Default)]
pub struct Receiver {
    buffer: Vec<u8>,
    fds: VecDeque<OwnedFd>,
    closed: bool,
    /// In a process that forks (a zygote relaying a node zygote's frames):
    /// an fd that arrived is claimed until its frame is whole and taken,
    /// so no child forked meanwhile holds it (`crate::fds`).
    claiming: bool,
}

/// Where one `recvmsg` lands: its bytes and its control message.
pub struct ReceiveSpace {
    chunk: Box<[u8]>,
    cmsg: Vec<u8>,
}

impl ReceiveSpace {
    pub fn new() -> ReceiveSpace {
        ReceiveSpace {
            chunk: vec![0u8; 1 << 16].into_boxed_slice(),
            cmsg: nix::cmsg_space!([RawFd; 16]),
        }
    }
}

impl Default for ReceiveSpace {
    fn default() -> ReceiveSpace {
        ReceiveSpace::new()
    }
}

/// What one read from the socket gave.
pub enum Received {
    /// Some bytes (perhaps no whole frame yet).
    Data,
    /// Nothing to read now (a non-blocking socket).
    WouldBlock,
    /// The other end closed the link.
    Closed,
}

impl Receiver {
    /// A receiver whose fds are claimed while they wait for their frame.
    pub fn claiming() -> Receiver {
        Receiver {
            claiming: true,
            ..Receiver::default()
        }
    }

    /// What has arrived and is not yet a whole frame taken.
    pub fn pending(&self) -> &[u8] {
        &self.buffer
    }

    /// One read of `socket`, waiting for it if there is nothing yet; false
    /// once it closed (or could not be read).
    pub fn receive_waiting(&mut self, socket: BorrowedFd<'_>) -> bool {
        match self.receive(socket) {
            Ok(Received::Data) => true,
            Ok(Received::WouldBlock) => {
                let mut fds = [nix::poll::PollFd::new(socket, nix::poll::PollFlags::POLLIN)];
                let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::NONE);
                true
            }
            Ok(Received::Closed) | Err(_) => false,
        }
    }

    /// One `recvmsg`: bytes into the buffer, fds into the queue.
    pub fn receive(&mut self, socket: BorrowedFd<'_>) -> std::io::Result<Received> {
        self.receive_into(socket, &mut ReceiveSpace::new())
    }

    /// [`Receiver::receive`] through `space`, made beforehand: a reset
    /// resident waits with nothing left to allocate or fault in (its
    /// memory was just put back), so the zygote finds it at its wait at once.
    pub fn receive_into(
        &mut self,
        socket: BorrowedFd<'_>,
        space: &mut ReceiveSpace,
    ) -> std::io::Result<Received> {
        if self.closed {
            return Ok(Received::Closed);
        }
        let ReceiveSpace { chunk, cmsg } = space;
        let (read, fds) = loop {
            let mut iov = [std::io::IoSliceMut::new(chunk)];
            match recvmsg::<()>(
                socket.as_raw_fd(),
                &mut iov,
                Some(&mut *cmsg),
                MsgFlags::MSG_CMSG_CLOEXEC,
            ) {
                Ok(message) => {
                    let mut fds = Vec::new();
                    for control in message.cmsgs().map_err(std::io::Error::from)? {
                        if let ControlMessageOwned::ScmRights(received) = control {
                            // SAFETY: the kernel just installed these fds in
                            // this process; nothing else owns them.
                            fds.extend(
                                received
                                    .into_iter()
                                    .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                            );
                        }
                    }
                    break (message.bytes, fds);
                }
                Err(nix::errno::Errno::EINTR) => continue,
                Err(nix::errno::Errno::EAGAIN) => return Ok(Received::WouldBlock),
                Err(error) => return Err(error.into()),
            }
        };
        if self.claiming {
            for fd in &fds {
                crate::fds::claim(fd.as_raw_fd());
            }
        }
        self.fds.extend(fds);
        if read == 0 {
            self.closed = true;
            return Ok(Received::Closed);
        }
        self.buffer.extend_from_slice(&chunk[..read]);
        Ok(Received::Data)
    }

    /// The next whole frame, if one has arrived.
    pub fn next_frame(&mut self) -> Result<Option<Frame>, String> {
        if self.buffer.len() < 4 {
            return Ok(None);
        }
        let length = u32::from_le_bytes(self.buffer[..4].try_into().expect("4 bytes")) as usize;
        if self.buffer.len() < 4 + length {
            return Ok(None);
        }
        let queued = self.fds.len();
        let frame = Frame::decode(&self.buffer[4..4 + length], &mut self.fds);
        if self.claiming {
            // Taken into the frame: its owner's now.
            for fd in frame.iter().flat_map(Frame::fds) {
                crate::fds::forget(fd);
            }
            debug_assert!(self.fds.len() <= queued);
        }
        // A call's request must not stay behind in the zygote's memory.
        crate::scrub::drain_front(&mut self.buffer, 4 + length);
        frame.map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn frames_and_their_fds_cross_in_order() {
        let (left, right) = UnixStream::pair().unwrap();
        let (pipe_read, _pipe_write) = nix::unistd::pipe().unwrap();
        let (other_read, _other_write) = nix::unistd::pipe().unwrap();
        let (lane_link, _lane_other) = UnixStream::pair().unwrap();
        let (lane_pidfd, _lane_pidfd_write) = nix::unistd::pipe().unwrap();
        let frames = [
            Frame::Ready,
            Frame::Pipe {
                ticket: 7,
                pipe: pipe_read,
            },
            Frame::Line {
                ticket: 7,
                line: b"{\"id\": 1}".repeat(20_000),
            },
            Frame::Started {
                ticket: 8,
                pid: 1234,
                pidfd: other_read,
            },
            Frame::Ended {
                ticket: 7,
                end: ChildEnd::Signaled(nix::sys::signal::Signal::SIGSEGV),
                logs: "é\n".into(),
            },
            Frame::Done { ticket: 8 },
            Frame::ForkLane,
            Frame::Lane {
                pid: 4321,
                link: lane_link.into(),
                pidfd: lane_pidfd,
            },
        ];
        let sender = std::thread::spawn(move || {
            for frame in &frames {
                send(left.as_fd_borrowed(), frame).unwrap();
            }
        });
        let mut receiver = Receiver::default();
        let mut got = Vec::new();
        while got.len() < 8 {
            match receiver.next_frame().unwrap() {
                Some(frame) => got.push(frame),
                None => {
                    receiver.receive(std::os::fd::AsFd::as_fd(&right)).unwrap();
                }
            }
        }
        sender.join().unwrap();
        assert!(matches!(got[0], Frame::Ready));
        assert!(matches!(got[1], Frame::Pipe { ticket: 7, .. }));
        assert!(matches!(&got[2], Frame::Line { ticket: 7, line } if line.len() == 180_000));
        assert!(matches!(
            got[3],
            Frame::Started {
                ticket: 8,
                pid: 1234,
                ..
            }
        ));
        assert!(
            matches!(&got[4], Frame::Ended { end: ChildEnd::Signaled(nix::sys::signal::Signal::SIGSEGV), logs, .. } if logs == "é\n")
        );
        assert!(matches!(got[5], Frame::Done { ticket: 8 }));
        assert!(matches!(got[6], Frame::ForkLane));
        assert!(matches!(got[7], Frame::Lane { pid: 4321, .. }));
    }

    #[test]
    fn a_claiming_receiver_claims_an_fd_until_its_frame_is_taken() {
        let (left, right) = UnixStream::pair().unwrap();
        let (pipe_read, _pipe_write) = nix::unistd::pipe().unwrap();
        let frame = Frame::Pipe {
            ticket: 3,
            pipe: pipe_read,
        };
        let (bytes, fds) = frame.encode();
        // The fd and the frame's first byte, then the rest later.
        sendmsg::<()>(
            left.as_raw_fd(),
            &[IoSlice::new(&bytes[..1])],
            &[ControlMessage::ScmRights(&fds)],
            MsgFlags::empty(),
            None,
        )
        .unwrap();
        let mut receiver = Receiver::claiming();
        receiver.receive(std::os::fd::AsFd::as_fd(&right)).unwrap();
        assert!(receiver.next_frame().unwrap().is_none(), "half a frame");
        let waiting = receiver.fds[0].as_raw_fd();
        assert!(
            crate::fds::is_claimed(waiting),
            "an fd waiting for its frame is the zygote's: no child forked now keeps it"
        );
        nix::sys::socket::send(left.as_raw_fd(), &bytes[1..], MsgFlags::empty()).unwrap();
        receiver.receive(std::os::fd::AsFd::as_fd(&right)).unwrap();
        let Some(Frame::Pipe { pipe, .. }) = receiver.next_frame().unwrap() else {
            panic!("the pipe frame");
        };
        assert!(!crate::fds::is_claimed(pipe.as_raw_fd()));
    }

    trait Borrowed {
        fn as_fd_borrowed(&self) -> BorrowedFd<'_>;
    }

    impl Borrowed for UnixStream {
        fn as_fd_borrowed(&self) -> BorrowedFd<'_> {
            std::os::fd::AsFd::as_fd(self)
        }
    }
}
