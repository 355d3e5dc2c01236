//! Where a node's calls run: the one policy every mode asks, in the order
//! a request meets it.
//!
//! 1. Which zygote forks the node's calls: this one, or a zygote of the
//!    node's own (`app`), which a node with many calls in flight gets lanes
//!    of (`server::lanes`).
//! 2. How the node is kept in the zygote that forks it: loaded there, or
//!    loaded in each call's child (a node whose load starts a thread that
//!    does not stop at fork).
//! 3. Which child serves each run: a fresh one, or the node's resident
//!    (`resident`).

use super::assignment::TrialVerdict;
use super::resident::Isolation;

/// Which nodes get a zygote of their own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum NodeZygotes {
    /// None: this is a node's own zygote (or a lane of one), or a sweep's.
    #[default]
    None,
    /// Every node, on its first request, before any of its code runs here:
    /// this zygote runs no node code, so no compile holds up another node's
    /// calls and its forks stay as cheap as its preloads (the agent's
    /// zygote, a shared zygote).
    Every,
    /// A node whose module level leaves `--node-zygote-mib` or more, as its
    /// trial finds: the others stay as cheap to fork as before (the worker).
    Heavy,
}

/// Where a node lives once its trial has run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Home {
    /// In a zygote of its own, its calls relayed there.
    OwnZygote,
    /// Loaded in this zygote: every fork has it.
    Here,
    /// Loaded in each call's child.
    EachChild,
    /// It did not load; its trial's reply says why.
    Nowhere,
}

/// The policy of one zygote.
#[derive(Debug, Clone, Copy, Default)]
pub struct Placement {
    pub node_zygotes: NodeZygotes,
    pub isolation: Isolation,
}

impl Placement {
    /// Whether a node's requests go to a zygote of its own untried, before
    /// any of its code runs here.
    pub fn own_zygote_first(&self) -> bool {
        self.node_zygotes == NodeZygotes::Every
    }

    /// Where a node whose trial ended with `verdict` lives. A resident
    /// keeps a node's module state, so under `--isolation node` a heavy
    /// node stays here, in its resident.
    pub fn home(&self, verdict: Option<TrialVerdict>) -> Home {
        match verdict {
            Some(TrialVerdict::LoadedHeavy)
                if self.node_zygotes == NodeZygotes::Heavy && self.isolation == Isolation::Call =>
            {
                Home::OwnZygote
            }
            Some(TrialVerdict::Loaded | TrialVerdict::LoadedHeavy) => Home::Here,
            Some(TrialVerdict::LoadedButForkUnsafe) => Home::EachChild,
            // Each resident makes its own context once and keeps it; a
            // fresh child per call would make one per call (seconds each),
            // so there it is refused, with the reasons (`trial`).
            Some(TrialVerdict::LoadedWithCuda) if self.isolation == Isolation::Node => {
                Home::EachChild
            }
            Some(TrialVerdict::LoadedWithCuda | TrialVerdict::Failed) | None => Home::Nowhere,
        }
    }

    /// Whether a run is served by its node's resident child, where this
    /// zygote follows the call itself: under `--isolation node` and
    /// `reset`.
    pub fn resident(&self, handed_over: bool) -> bool {
        matches!(self.isolation, Isolation::Node | Isolation::Reset) && !handed_over
    }

    /// Whether a run whose lines a link's owner reads is served by its
    /// node's resident: under `--isolation reset`, whose resident is put
    /// back before anyone else's call, with a pipe of each call's own.
    /// (Under `--isolation node` such a run gets a fresh child: a resident
    /// that keeps a call's state is a worker's, one caller's.)
    pub fn resident_for_link(&self) -> bool {
        self.isolation == Isolation::Reset
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_heavy_node_gets_its_own_zygote_only_where_the_policy_says() {
        let heavy = Some(TrialVerdict::LoadedHeavy);
        let placement = |node_zygotes, isolation| Placement {
            node_zygotes,
            isolation,
        };
        assert_eq!(
            placement(NodeZygotes::Heavy, Isolation::Call).home(heavy),
            Home::OwnZygote
        );
        assert_eq!(
            placement(NodeZygotes::Heavy, Isolation::Node).home(heavy),
            Home::Here
        );
        assert_eq!(
            placement(NodeZygotes::None, Isolation::Call).home(heavy),
            Home::Here
        );
        let worker = placement(NodeZygotes::Heavy, Isolation::Call);
        assert_eq!(
            worker.home(Some(TrialVerdict::LoadedButForkUnsafe)),
            Home::EachChild
        );
        assert_eq!(worker.home(Some(TrialVerdict::Failed)), Home::Nowhere);
        let cuda = Some(TrialVerdict::LoadedWithCuda);
        assert_eq!(worker.home(cuda), Home::Nowhere);
        assert_eq!(
            placement(NodeZygotes::Heavy, Isolation::Node).home(cuda),
            Home::EachChild
        );
        assert!(!worker.own_zygote_first());
        assert!(placement(NodeZygotes::Every, Isolation::Call).own_zygote_first());
        let in_turn = placement(NodeZygotes::None, Isolation::Node);
        assert!(in_turn.resident(false));
        assert!(!in_turn.resident(true));
        assert!(!worker.resident(false));
    }
}
