//! Saving and loading a 1 GiB artifact, side by side in one run: the
//! reference `worker_main.py`'s Python implementation against ours, each
//! called by the same node inside its own worker, and `sha256sum` of the
//! same file as the floor (every save hashes, every load verifies).
//!
//!     cargo bench --bench artifacts              # 1 GiB, best of 3
//!     cargo bench --bench artifacts -- --mib 256 --runs 5

mod support;

use support::{ZYGOTE, flag, python};

#[path = "../tests/common/artifact_server.rs"]
mod artifact_server;

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Instant;

use artifact_server::ArtifactServer;

const REFERENCE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../shared/reference/fluksio_worker/worker_main.py"
);

/// What each run times, inside the node, around the one call.
const NODE: &str = "import fluksio, os, time
def process(op, path=None, ref=None):
    start = time.perf_counter()
    out = fluksio.save_artifact(path) if op == 'save' else fluksio.load_artifact(ref)
    return [time.perf_counter() - start, out]
";

fn main() {
    let (mib, runs) = (flag("--mib", 1024), flag("--runs", 3));
    // On tmpfs where there is one: the disk's writeback would otherwise
    // decide the figures (the same 1 GiB copy took 0.3 s or 3 s on this VM).
    let base = if Path::new("/dev/shm").is_dir() {
        PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let work = base.join(format!("fz-bench-artifacts-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    std::fs::create_dir_all(&work).unwrap();
    let file = work.join("artifact.bin");
    write_file(&file, mib);
    let python = python();

    let sha256sum = best(runs, || {
        let start = Instant::now();
        let status = Command::new("sha256sum")
            .arg(&file)
            .stdout(Stdio::null())
            .status()
            .unwrap();
        assert!(status.success());
        start.elapsed().as_secs_f64()
    });

    // Interleaved, run by run, and each run after a `sync`: a gigabyte of
    // dirty pages left by one side would throttle the other's writes.
    let sides = [
        (
            "reference (Python)",
            vec![python.display().to_string(), REFERENCE.into()],
        ),
        ("fluksio-zygote", vec![ZYGOTE.into(), "worker".into()]),
    ];
    let server = ArtifactServer::start(&fresh(&work.join("server")), None);
    let mut rows = vec![[f64::INFINITY; 3]; sides.len()];
    for _ in 0..runs {
        for (row, (_, command)) in rows.iter_mut().zip(&sides) {
            let store = fresh(&work.join("store"));
            settle();
            let env = [("FLUKSIO_ARTIFACT_DIR", store.display().to_string())];
            row[0] = row[0].min(
                timed(
                    command,
                    &env,
                    serde_json::json!({"op": "save", "path": file}),
                )
                .0,
            );
            settle();
            let env = [("FLUKSIO_ARTIFACT_URL", server.url.clone())];
            let (seconds, reference) = timed(
                command,
                &env,
                serde_json::json!({"op": "save", "path": file}),
            );
            row[1] = row[1].min(seconds);
            let cache = fresh(&work.join("cache"));
            settle();
            let env = [
                ("FLUKSIO_ARTIFACT_URL", server.url.clone()),
                ("FLUKSIO_ARTIFACT_CACHE", cache.display().to_string()),
            ];
            row[2] = row[2].min(
                timed(
                    command,
                    &env,
                    serde_json::json!({"op": "load", "ref": reference}),
                )
                .0,
            );
        }
    }

    let rate = |seconds: f64| mib as f64 / seconds;
    println!(
        "{mib} MiB in {}, best of {runs}; sha256sum of the same file: {:.2} s = {:.0} MiB/s (the floor)",
        work.display(),
        sha256sum,
        rate(sha256sum)
    );
    println!();
    println!(
        "| operation | reference MiB/s | fluksio-zygote MiB/s | ours / reference | ours / sha256sum |"
    );
    println!("| --- | ---: | ---: | ---: | ---: |");
    let (theirs, ours) = (&rows[0], &rows[1]);
    for (name, t, o) in [
        ("save a file, directory store", theirs[0], ours[0]),
        (
            "save a file, HTTP store (PUT to 127.0.0.1)",
            theirs[1],
            ours[1],
        ),
        (
            "load, HTTP store (GET, cache; only ours verifies)",
            theirs[2],
            ours[2],
        ),
    ] {
        println!(
            "| {name} | {:.0} | {:.0} | {:.2}× | {:.2}× |",
            rate(t),
            rate(o),
            t / o,
            sha256sum / o
        );
    }
    let _ = std::fs::remove_dir_all(&work);
}

/// Runs the node once in a fresh worker; the seconds it timed, and its result.
fn timed(
    command: &[String],
    env: &[(&str, String)],
    kwargs: serde_json::Value,
) -> (f64, serde_json::Value) {
    let mut child = Command::new(&command[0])
        .args(&command[1..])
        .envs(env.iter().map(|(k, v)| (*k, v.as_str())))
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("the worker starts");
    let request = serde_json::json!({"id": 1, "op": "run", "flow": "b", "node": "art", "source": NODE, "kwargs": kwargs});
    let mut stdin = child.stdin.take().unwrap();
    writeln!(stdin, "{request}").unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    drop(stdin);
    child.wait().unwrap();
    let reply: serde_json::Value = serde_json::from_str(&line).expect("a reply");
    assert_eq!(reply["ok"], true, "{reply}");
    (
        reply["result"][0].as_f64().unwrap(),
        reply["result"][1].clone(),
    )
}

fn best(runs: usize, mut run: impl FnMut() -> f64) -> f64 {
    (0..runs).map(|_| run()).fold(f64::INFINITY, f64::min)
}

/// Writes back every dirty page, so the next run starts level.
fn settle() {
    let _ = Command::new("sync").status();
}

fn fresh(dir: &Path) -> PathBuf {
    let _ = std::fs::remove_dir_all(dir);
    std::fs::create_dir_all(dir).unwrap();
    dir.to_path_buf()
}

/// `mib` MiB of bytes that do not compress, written once.
fn write_file(path: &Path, mib: usize) {
    let mut out = std::io::BufWriter::new(std::fs::File::create(path).unwrap());
    let mut state: u64 = 0x9e3779b97f4a7c15;
    let mut block = vec![0u8; 1 << 20];
    for _ in 0..mib {
        for chunk in block.chunks_mut(8) {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            chunk.copy_from_slice(&state.to_le_bytes());
        }
        out.write_all(&block).unwrap();
    }
}
