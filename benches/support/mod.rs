//! What the benches share.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

/// `--name N` from the bench's arguments, or `default`.
pub fn flag(name: &str, default: usize) -> usize {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == name)
        .and_then(|at| args.get(at + 1)?.parse().ok())
        .unwrap_or(default)
}

pub const ZYGOTE: &str = env!("CARGO_BIN_EXE_fluksio-zygote");

/// The interpreter the zygote embeds, which the reference runs on too: asked
/// of the zygote itself, so both sides run the very same Python.
pub fn python() -> PathBuf {
    let output = Command::new(ZYGOTE)
        .arg("worker")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .and_then(|mut child| {
            let request = r#"{"id":0,"op":"run","flow":"b","node":"p","source":"import sys\ndef process():\n    return sys.executable\n"}"#;
            writeln!(child.stdin.take().expect("stdin"), "{request}")?;
            child.wait_with_output()
        })
        .expect("the zygote answers");
    let reply: serde_json::Value = serde_json::from_slice(&output.stdout).expect("a JSON reply");
    PathBuf::from(reply["result"].as_str().expect("a path"))
}
