//! The engine's reference `PythonWorkerPool`, unchanged, driving
//! `fluksio-zygote` as its interpreter (`tests/pool_dropin.py` is the
//! script; the pool comes from `../shared/reference`).

mod common;

use std::path::Path;
use std::process::Command;

#[test]
fn the_reference_pool_drops_the_binary_in_as_its_interpreter() {
    drop_in(&[]);
}

/// The pool passes no flags: `FLUKSIO_ISOLATION=node` in its environment
/// gives it a child per node, reused as its own workers are.
#[test]
fn the_reference_pool_drives_a_child_per_node_set_by_the_environment() {
    drop_in(&[("FLUKSIO_ISOLATION", "node")]);
}

/// The pool's slots sharing one zygote (`FLUKSIO_SHARED_ZYGOTE=1`): a
/// timeout or a cancel kills the slot and its call, never the zygote.
#[test]
fn the_reference_pool_drives_slots_of_a_shared_zygote() {
    drop_in(&[
        ("FLUKSIO_SHARED_ZYGOTE", "1"),
        ("FLUKSIO_TEST_SCOPE", "pool-drop-in"),
        // Long enough for the pool to respawn a killed slot, short enough
        // for stop() to see the zygote go with the last.
        ("FLUKSIO_SHARED_ZYGOTE_LINGER_S", "2"),
    ]);
}

fn drop_in(env: &[(&str, &str)]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/pool_dropin.py");
    let output = Command::new(common::python())
        .envs(env.iter().copied())
        .arg(script)
        .arg(common::ZYGOTE)
        .arg(common::reference_dir())
        .output()
        .expect("python runs the drop-in script");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success() && stdout.trim_end().ends_with("all passed"),
        "the pool drop-in failed ({}):\n{stdout}\n--- stderr ---\n{stderr}",
        output.status
    );
}
