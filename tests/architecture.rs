//! The layout ARCHITECTURE.md promises, checked: no circle between the
//! files of `src/` or `embed/` (`tests/architecture/circles.py` reads the
//! paths each file names), and CPython's C API called from `embed/` alone.

use std::path::Path;
use std::process::Command;

fn circles(dir: &str) -> String {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let output = Command::new("python3")
        .arg(root.join("tests/architecture/circles.py"))
        .arg(root.join(dir))
        .output()
        .expect("python3 runs the circle check");
    assert!(output.status.success(), "{output:?}");
    String::from_utf8(output.stdout).unwrap()
}

#[test]
fn no_file_of_the_runtime_or_embed_reaches_back_to_one_that_reaches_it() {
    for dir in ["src", "embed/src"] {
        let report = circles(dir);
        assert!(
            report.lines().last() == Some("0 circles"),
            "files in {dir} that reach each other:\n{report}"
        );
    }
}

#[test]
fn only_embed_calls_cpythons_c_api() {
    let mut callers = Vec::new();
    let mut dirs = vec![Path::new(env!("CARGO_MANIFEST_DIR")).join("src")];
    while let Some(dir) = dirs.pop() {
        for entry in std::fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            if path.is_dir() {
                dirs.push(path);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = std::fs::read_to_string(&path).unwrap();
                let calls = text
                    .lines()
                    .filter(|line| !line.trim_start().starts_with("//"))
                    .any(|line| line.contains("pyo3::ffi") || line.contains("ffi::Py"));
                if calls {
                    callers.push(path.display().to_string());
                }
            }
        }
    }
    assert!(callers.is_empty(), "pyo3::ffi outside embed/: {callers:?}");
}
