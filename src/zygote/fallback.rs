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
//! once more. `FLUKSIO_RESET_FALLBACK_AFTER` sets how many in a row (`0`:
//! never fall back, every call a resident).

use std::collections::HashMap;

use super::node::NodeKey;

/// Residents retired in a row, each after one call, before a node's calls
/// fall back to fresh forks, unless [`FALLBACK_AFTER_ENV`] says.
const RETIRED_IN_A_ROW: u32 = 3;
/// Sets [`RETIRED_IN_A_ROW`]; `0`: never.
pub const FALLBACK_AFTER_ENV: &str = "FLUKSIO_RESET_FALLBACK_AFTER";
/// The first stretch of fresh forks; each next one is twice as long.
const FIRST_STRETCH: u32 = 16;
const LONGEST_STRETCH: u32 = 1024;

/// Which resident an outcome is of: its node, its source, and how many
/// stretches its node had begun when it was forked. One forked before the
/// stretch now under way says nothing of how the node fares since (a
/// sweep's calls in flight, a spare idle through a stretch).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tag {
    pub(super) key: NodeKey,
    pub(super) digest: String,
    pub(super) stretches: u32,
}

/// Each node's run of residents that could not be put back.
pub(super) struct Fallbacks {
    by_node: HashMap<NodeKey, Streak>,
    /// Residents retired in a row that start a stretch (`None`: never).
    after: Option<u32>,
}

impl Default for Fallbacks {
    fn default() -> Fallbacks {
        let after = match std::env::var(FALLBACK_AFTER_ENV) {
            Err(_) => Some(RETIRED_IN_A_ROW),
            Ok(text) => match text.trim().parse::<u32>() {
                Ok(0) => None,
                Ok(n) => Some(n),
                Err(_) => {
                    tracing::warn!(
                        "{FALLBACK_AFTER_ENV}={text:?} is not a count of residents; \
                         falling back after {RETIRED_IN_A_ROW}"
                    );
                    Some(RETIRED_IN_A_ROW)
                }
            },
        };
        Fallbacks {
            by_node: HashMap::new(),
            after,
        }
    }
}

#[derive(Default)]
struct Streak {
    /// The source the run is of: another starts it over.
    digest: String,
    /// Residents retired in a row, each after one call.
    retired: u32,
    /// Calls still to get a fresh fork.
    fresh_left: u32,
    /// Calls of the next stretch of fresh forks (0: the first's).
    next_stretch: u32,
    /// Stretches begun, ever.
    stretches: u32,
}

impl Fallbacks {
    /// Stretches node `key` has begun: what a resident forked now is
    /// tagged with.
    pub(super) fn stretches(&self, key: &NodeKey) -> u32 {
        self.by_node.get(key).map_or(0, |streak| streak.stretches)
    }

    /// Resident `tag` could not be put back after its call, or take its
    /// snapshot (`why`).
    pub(super) fn retired(&mut self, tag: &Tag, why: &str) {
        let Some(after) = self.after else {
            return;
        };
        let Some(streak) = self.current(tag) else {
            return;
        };
        streak.retired += 1;
        if streak.retired < after {
            return;
        }
        let stretch = streak.next_stretch.max(FIRST_STRETCH);
        streak.fresh_left = stretch;
        streak.next_stretch = (stretch * 2).min(LONGEST_STRETCH);
        streak.stretches += 1;
        // One more retired after the stretch starts the next.
        streak.retired = after - 1;
        tracing::info!(
            node = %tag.key,
            "its residents could not be put back after {after} calls in a row \
             (the last: {why}); its next {stretch} calls get a fresh fork each, as under \
             --isolation call, then a resident is tried again"
        );
    }

    /// Resident `tag` was put back: its node's calls go on being served by
    /// residents, and a later run of failures starts from the first
    /// stretch.
    pub(super) fn put_back(&mut self, tag: &Tag) {
        if let Some(streak) = self.current(tag) {
            streak.retired = 0;
            streak.next_stretch = 0;
        }
    }

    /// Whether node `key`'s next call, of source `digest`, gets a fresh
    /// fork rather than a resident (counted as one of its stretch).
    pub(super) fn fresh_fork_instead(&mut self, key: &NodeKey, digest: &str) -> bool {
        match self.by_node.get_mut(key) {
            Some(streak) if streak.digest == digest && streak.fresh_left > 0 => {
                streak.fresh_left -= 1;
                true
            }
            _ => false,
        }
    }

    /// The streak `tag` counts in: none if it was forked before the
    /// stretch under way began; a new one for a source not seen before.
    fn current(&mut self, tag: &Tag) -> Option<&mut Streak> {
        let streak = self.by_node.entry(tag.key.clone()).or_default();
        if streak.digest != tag.digest {
            *streak = Streak {
                digest: tag.digest.clone(),
                stretches: streak.stretches,
                ..Streak::default()
            };
        }
        (tag.stretches >= streak.stretches).then_some(streak)
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
        let tag = |fallbacks: &Fallbacks, digest: &str| Tag {
            key: key.clone(),
            digest: digest.into(),
            stretches: fallbacks.stretches(&key),
        };
        let fresh_run = |fallbacks: &mut Fallbacks| {
            std::iter::from_fn(|| fallbacks.fresh_fork_instead(&key, "a").then_some(())).count()
                as u32
        };
        // Two retired, one put back: the run starts again.
        let a = tag(&fallbacks, "a");
        fallbacks.retired(&a, "a thread");
        fallbacks.retired(&a, "a thread");
        fallbacks.put_back(&a);
        fallbacks.retired(&a, "a thread");
        fallbacks.retired(&a, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 0);
        fallbacks.retired(&a, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), FIRST_STRETCH);
        // One forked before the stretch says nothing, failed or put back.
        fallbacks.retired(&a, "a thread");
        fallbacks.put_back(&a);
        // The resident tried after it fails too: at once a stretch twice
        // as long.
        let b = tag(&fallbacks, "a");
        fallbacks.retired(&b, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 2 * FIRST_STRETCH);
        for _ in 0..10 {
            fallbacks.retired(&tag(&fallbacks, "a"), "a thread");
            fresh_run(&mut fallbacks);
        }
        fallbacks.retired(&tag(&fallbacks, "a"), "a thread");
        assert_eq!(fresh_run(&mut fallbacks), LONGEST_STRETCH);
        // Put back once: from the start.
        let c = tag(&fallbacks, "a");
        fallbacks.put_back(&c);
        fallbacks.retired(&c, "a thread");
        assert_eq!(fresh_run(&mut fallbacks), 0);
        // Another source starts over, and gets no stretch of the old one's.
        fallbacks.retired(&c, "a thread");
        fallbacks.retired(&c, "a thread");
        assert!(!fallbacks.fresh_fork_instead(&key, "b"));
        let d = tag(&fallbacks, "b");
        fallbacks.retired(&d, "a thread");
        fallbacks.retired(&d, "a thread");
        assert!(!fallbacks.fresh_fork_instead(&key, "b"));
        fallbacks.retired(&d, "a thread");
        assert!(fallbacks.fresh_fork_instead(&key, "b"));
    }
}
