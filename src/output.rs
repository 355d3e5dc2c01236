//! Where a call's lines go: the one thing a front end gives the call
//! pipeline. The worker writes them to its stdout, a pool slot's zygote
//! sends them as link frames, `run` and `sweep` write a results stream.
//! Events come in the order the child wrote them, then exactly one reply.

use nix::unistd::Pid;

/// Where a call's lines go as they are read.
pub trait CallOutput {
    /// An event line (`yield`, `emit`), in the order the child wrote it.
    fn event(&mut self, line: &[u8]);
    /// The reply: the last line of the call.
    fn reply(&mut self, line: &[u8]);
    /// A child was forked for the call (a trial, then the run, say).
    fn started(&mut self, _pid: Pid) {}
}
