//! `--isolation reset`: a node whose residents cannot be put back, call
//! after call, gets a fresh fork per call instead for a while.
//!
//! A resident retired after its call is replaced by a fresh one, which
//! takes its snapshot before the next call: a fork, the set-up and a copy
//! of every writable page. A node that leaves something behind in every
//! call (tqdm's monitor thread, an fd kept in a module) paid that on every
//! call: 37 ms a call where `--isolation call` takes 5 (tqdm, numpy
//! preloaded). After [`RETIRED_IN_A_ROW`] such calls its calls get a fresh
//! fork each, as under `--isolation call`, for a stretch of calls that
//! doubles each time its residents fail again; then a resident is tried
//! once more.

use std::collections::HashMap;

use super::node::NodeKey;

/// Residents retired in a row, each after its call, before a node's calls
/// fall back to fresh forks.
const RETIRED_IN_A_ROW: u32 = 3;
/// The first stretch of fresh forks; each next one is twice as long.
const FIRST_STRETCH: u32 = 16;
const LONGEST_STRETCH: u32 = 1024;

/// Each node's run of residents that could not be put back.
#[derive(Default)]
pub(super) struct Fallbacks {
    by_node: HashMap<NodeKey, Streak>,
}

#[derive(Default)]
struct Streak {
    /// Residents retired in a row, each after one call.
    retired: u32,
    /// Calls still to get a fresh fork.
    fresh_left: u32,
    /// Calls of the next stretch of fresh forks (0: the first's).
    next_stretch: u32,
}

impl Fallbacks {
    /// A resident of node `key` could not be put back after its call, or
    /// take its snapshot (`why`).
    pub(super) fn retired(&mut self, key: &NodeKey, why: &str) {
        let streak = self.by_node.entry(key.clone()).or_default();
        if streak.fresh_left > 0 {
            // One that served a call before the stretch began.
            return;
        }
        streak.retired += 1;
        if streak.retired < RETIRED_IN_A_ROW {
            return;
        }
        let stretch = streak.next_stretch.max(FIRST_STRETCH);
        streak.fresh_left = stretch;
        streak.next_stretch = (stretch * 2).min(LONGEST_STRETCH);
        // One more retired after the stretch starts the next.
        streak.retired = RETIRED_IN_A_ROW - 1;
        tracing::info!(
            node = %key,
            "its residents could not be put back after {RETIRED_IN_A_ROW} calls in a row \
             (the last: {why}); its next {stretch} calls get a fresh fork each, as under \
             --isolation call, then a resident is tried again"
        );
    }

    /// A resident of node `key` was put back: its calls go on being served
    /// by residents.
    pub(super) fn put_back(&mut self, key: &NodeKey) {
        self.by_node.remove(key);
    }

    /// Whether node `key`'s next call gets a fresh fork rather than a
    /// resident (counted as one of its stretch).
    pub(super) fn fresh_fork_instead(&mut self, key: &NodeKey) -> bool {
        match self.by_node.get_mut(key) {
            Some(streak) if streak.fresh_left > 0 => {
                streak.fresh_left -= 1;
                true
            }
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fresh_forks_come_after_residents_fail_in_a_row_for_stretches_that_double() {
        let key = NodeKey {
            flow: "f".into(),
            node: "n".into(),
        };
        let mut fallbacks = Fallbacks::default();
        let fresh_run = |fallbacks: &mut Fallbacks| {
            std::iter::from_fn(|| fallbacks.fresh_fork_instead(&key).then_some(())).count() as u32
        };
        // Two retired, one put back: the run starts again.
        fallbacks.retired(&key, "a thread");
        fallbacks.retired(&key, "a thread");
        fallbacks.put_back(&key);
        fallbacks.retired(&key, "a thread");
        fallbacks.retired(&key, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 0);
        fallbacks.retired(&key, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), FIRST_STRETCH);
        // The resident tried after it fails too: at once a stretch twice
        // as long. One that served before the stretch and fails within it
        // does not count.
        fallbacks.retired(&key, "a thread");
        fallbacks.retired(&key, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 2 * FIRST_STRETCH);
        for _ in 0..10 {
            fallbacks.retired(&key, "a thread");
            fresh_run(&mut fallbacks);
        }
        fallbacks.retired(&key, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), LONGEST_STRETCH);
        // Put back once: from the start.
        fallbacks.put_back(&key);
        fallbacks.retired(&key, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 0);
    }
}
