//! The nodes a zygote has compiled: each one's source, where it lives
//! (loaded in the zygote, loaded in each call's child, or in a zygote of
//! its own), and loading one into the zygote itself.

use std::collections::HashMap;

use fluksio_embed::capture;
use pyo3::prelude::*;

use super::assignment::{Assignment, Function, Task};
use super::node::{self, NodeKey};
use super::own::OwnZygote;
use super::recovery::ResumeNode;
use super::{reply, warmup};

/// Where a compiled node lives.
pub(super) enum Residence {
    /// Loaded in the zygote: every fork has it.
    Zygote(Py<PyAny>),
    /// Its loading starts a thread that does not stop at fork (or it failed
    /// to load in the zygote after a clean trial): each call's child loads it.
    EachChild,
    /// Its module level is heavy (`--node-zygote-mib`): a zygote of its own
    /// has it loaded and forks its calls, which are relayed there; this
    /// zygote, and every other node's fork, stays small.
    OwnZygote(OwnZygote),
}

struct Compiled {
    digest: String,
    source: String,
    residence: Residence,
    /// Why its warm-up was refused, where one was asked for (`warmup`).
    warmup_refused: Option<String>,
}

/// The zygote's compiled nodes, and the generation of the state every fork
/// copies.
#[derive(Default)]
pub(super) struct Nodes {
    compiled: HashMap<NodeKey, Compiled>,
    /// Bumped whenever the zygote's state changes (a node loaded or warmed
    /// up, modules learned): a child forked before then holds the old
    /// state, and is not used.
    generation: u64,
}

/// Whether the zygote can still fork safely after a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[must_use]
pub(super) enum Forks {
    Safely,
    /// A thread that does not stop at fork is running: the zygote must
    /// restart before it serves anything else.
    Unsafely,
}

impl Nodes {
    pub(super) fn generation(&self) -> u64 {
        self.generation
    }

    /// The zygote's state changed: standbys forked before do not have it.
    pub(super) fn bump(&mut self) {
        self.generation += 1;
    }

    /// The digest of the source node `key` was compiled from.
    pub(super) fn digest(&self, key: &NodeKey) -> Option<&str> {
        self.compiled
            .get(key)
            .map(|compiled| compiled.digest.as_str())
    }

    /// The function of node `key` where it is loaded in the zygote.
    pub(super) fn function<'py>(
        &self,
        py: Python<'py>,
        key: &NodeKey,
    ) -> Option<Bound<'py, PyAny>> {
        match &self.compiled.get(key)?.residence {
            Residence::Zygote(function) => Some(function.bind(py).clone()),
            Residence::EachChild | Residence::OwnZygote(_) => None,
        }
    }

    /// Why node `key`'s warm-up was refused, where one was asked for and
    /// it was.
    pub(super) fn warmup_refusal(&self, key: &NodeKey) -> Option<String> {
        self.compiled.get(key)?.warmup_refused.clone()
    }

    /// Node `key`'s own zygote, where it has one.
    pub(super) fn own_zygote(&mut self, key: &NodeKey) -> Option<&mut OwnZygote> {
        match &mut self.compiled.get_mut(key)?.residence {
            Residence::OwnZygote(own) => Some(own),
            Residence::Zygote(_) | Residence::EachChild => None,
        }
    }

    pub(super) fn has_own_zygote(&self, key: &NodeKey) -> bool {
        self.compiled
            .get(key)
            .is_some_and(|compiled| matches!(compiled.residence, Residence::OwnZygote(_)))
    }

    /// The nodes that have zygotes of their own.
    pub(super) fn with_own_zygote(&self) -> Vec<NodeKey> {
        self.compiled
            .iter()
            .filter(|(_, compiled)| matches!(compiled.residence, Residence::OwnZygote(_)))
            .map(|(key, _)| key.clone())
            .collect()
    }

    /// Forgets a node in a zygote of its own, and ends that zygote.
    pub(super) fn end_own_zygote(&mut self, key: &NodeKey) {
        if let Some(Compiled {
            residence: Residence::OwnZygote(own),
            ..
        }) = self.compiled.remove(key)
        {
            own.end();
        }
    }

    /// In a node's own zygote, just forked: its parent's node zygotes are
    /// its parent's. Forgotten, never dropped.
    pub(super) fn forget_own_zygotes(&mut self) {
        for key in self.with_own_zygote() {
            std::mem::forget(self.compiled.remove(&key));
        }
    }

    /// The functions of the nodes loaded in the zygote.
    pub(super) fn loaded_functions(&self) -> impl Iterator<Item = &Py<PyAny>> {
        self.compiled
            .values()
            .filter_map(|compiled| match &compiled.residence {
                Residence::Zygote(function) => Some(function),
                Residence::EachChild | Residence::OwnZygote(_) => None,
            })
    }

    /// How a child resolves its node, from its copy of the zygote's table.
    pub(super) fn function_for(&self, assignment: &Assignment) -> Function<'_> {
        if !matches!(assignment.task, Task::Run | Task::Resident) {
            return Function::LoadHere { quiet: false };
        }
        match self.compiled.get(&assignment.key) {
            Some(compiled) if compiled.digest == assignment.digest => match &compiled.residence {
                Residence::Zygote(function) => Function::Loaded(function),
                Residence::EachChild | Residence::OwnZygote(_) => {
                    Function::LoadHere { quiet: true }
                }
            },
            _ => Function::LoadHere { quiet: false },
        }
    }

    /// Node `key` as compiled from `source`, in place of what it was (an
    /// own zygote it had is ended).
    pub(super) fn remember(
        &mut self,
        key: &NodeKey,
        source: &str,
        digest: &str,
        residence: Residence,
    ) {
        Python::attach(|py| node::publish(py, key, source, digest));
        self.end_own_zygote(key);
        self.compiled.insert(
            key.clone(),
            Compiled {
                digest: digest.to_string(),
                source: source.to_string(),
                residence,
                warmup_refused: None,
            },
        );
        self.generation += 1;
    }

    /// Loads a node whose trial went cleanly into the zygote itself, checks
    /// the zygote can still fork safely, then warms the node up there.
    /// `warm`: the `--warmup` keyword arguments (`None`: the node's own, if
    /// it asks), or why its warm-up is refused.
    pub(super) fn load_into_zygote(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        source: &str,
        digest: &str,
        warm: Result<Option<&str>, &str>,
    ) -> Forks {
        // Its output was reported by the trial; here it goes nowhere.
        let loaded = capture::quietly(py, || node::load_in_zygote(py, key, source, digest));
        let residence = match loaded {
            Ok(function) => Residence::Zygote(function.unbind()),
            Err(error) => {
                tracing::warn!(
                    "node {key} loaded in its trial but not in the zygote ({}); it is loaded in \
                     each call's child instead",
                    reply::error_line(py, &error)
                );
                Residence::EachChild
            }
        };
        let function = match &residence {
            Residence::Zygote(function) => Some(function.clone_ref(py)),
            _ => None,
        };
        self.remember(key, source, digest, residence);
        if !super::threads::forks_safely(py) {
            tracing::error!(
                "loading node {key} into the zygote left a thread running that does not stop at \
                 fork, though its trial did not; restarting the zygote with the node loaded in \
                 each call's child instead"
            );
            if let Some(compiled) = self.compiled.get_mut(key) {
                compiled.residence = Residence::EachChild;
            }
            return Forks::Unsafely;
        }
        let (refused, forks) = match (warm, function) {
            (Err(why), _) => (Some(why.to_string()), Forks::Safely),
            (Ok(explicit), Some(function)) => self.warm_up(py, key, function.bind(py), explicit),
            (Ok(_), None) => (None, Forks::Safely),
        };
        if let Some(why) = &refused {
            tracing::warn!("node {key}: its warm-up was refused ({why}); its calls start cold");
        }
        if let Some(compiled) = self.compiled.get_mut(key) {
            compiled.warmup_refused = refused;
        }
        forks
    }

    /// Runs node `key`'s warm-up here, if one is asked for; why not, if it
    /// was refused. One that left a thread or a CUDA context here (its
    /// trial did not) restarts the zygote.
    fn warm_up(
        &mut self,
        py: Python<'_>,
        key: &NodeKey,
        function: &Bound<'_, PyAny>,
        explicit: Option<&str>,
    ) -> (Option<String>, Forks) {
        let kwargs = match warmup::kwargs(py, function, explicit) {
            Ok(Some(kwargs)) => kwargs,
            Ok(None) => return (None, Forks::Safely),
            Err(why) => return (Some(why), Forks::Safely),
        };
        let warmed =
            capture::quietly(py, || Ok(warmup::run(py, function, &kwargs))).unwrap_or(Ok(()));
        match warmed {
            Ok(()) => {
                // What it built stays; standbys forked before it do not have it.
                self.generation += 1;
                tracing::debug!(node = %key, "warmed up in the zygote");
                (None, Forks::Safely)
            }
            Err(refusal) => {
                if !refusal.poisoned {
                    return (Some(refusal.why), Forks::Safely);
                }
                tracing::error!(
                    "node {key}'s warm-up left the zygote unable to fork safely ({}), though its \
                     trial did not; restarting the zygote",
                    refusal.why
                );
                (Some(refusal.why), Forks::Unsafely)
            }
        }
    }

    /// What a restarted zygote needs to carry on where this one stopped.
    pub(super) fn resume(&self) -> Vec<ResumeNode> {
        self.compiled
            .iter()
            .map(|(key, compiled)| ResumeNode {
                flow: key.flow.clone(),
                node: key.node.clone(),
                source: compiled.source.clone(),
                in_zygote: matches!(compiled.residence, Residence::Zygote(_)),
            })
            .collect()
    }
}
