//! The worker's zygote, whose heavy nodes (`--node-zygote-mib`) get
//! zygotes of their own: each is forked to serve the worker contract over
//! its link (`server`), and the node's calls are relayed to it (`own`).
//!
//! Above both the zygote and the link server: the zygote forks a node's
//! own zygote through the hook set here, never naming the server that
//! zygote runs, which itself drives a zygote.

use std::process::ExitCode;

use pyo3::prelude::*;

use super::app::{NodeZygote, Preload};
use super::node::NodeKey;
use super::placement::NodeZygotes;
use super::server::{self, Contract};
use super::{StartupError, Zygote, ZygoteOptions};

/// [`super::run`], for the worker: a node whose module level is heavy gets
/// a zygote of its own.
pub fn run(
    options: &ZygoteOptions,
    failed: impl FnOnce(&StartupError),
    serve: impl FnOnce(Python<'_>, &mut Zygote) -> ExitCode,
) -> ExitCode {
    let heavy_nodes = options.node_zygote_mib.is_some();
    super::run(options, failed, |py, zygote| {
        if heavy_nodes {
            zygote.set_node_zygotes(NodeZygotes::Heavy);
        }
        zygote.spawn_own = Some(spawn_own);
        serve(py, zygote)
    })
}

/// Forks node `key` a zygote of its own, which loads `preload` and serves
/// the worker contract over its link.
fn spawn_own(
    py: Python<'_>,
    zygote: &mut Zygote,
    key: &NodeKey,
    preload: Preload<'_>,
) -> std::io::Result<NodeZygote> {
    server::spawn_node_zygote(py, zygote, key, Contract::Worker, Some(preload), None)
}
