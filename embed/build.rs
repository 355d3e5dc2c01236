//! Bakes the interpreter this crate was built against into it.
//!
//! The issues this solves:
//! 1. `--python` defaults to the interpreter pyo3 linked against, and a
//!    different version is refused at start: both need to know, at run time,
//!    which one it was. Where it is a venv, its base interpreter too: `pip
//!    install .` and `uv tool install .` build in a throwaway venv.
//! 2. This crate's own tests link libpython: without an rpath to its
//!    directory the loader falls back to the system's `libpython3.X.so`
//!    (Debian's 3.11.2 beside pyenv's 3.11.7). The binary gets its rpath
//!    from the root crate's build script (link arguments reach only the
//!    package that asks for them).

fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
    let config = pyo3_build_config::get();
    let executable = config
        .executable()
        .expect("pyo3 found no Python executable: set PYO3_PYTHON to the interpreter to embed");
    println!("cargo:rustc-env=FLUKSIO_BUILD_PYTHON={executable}");
    // A build tool's isolated environment (pip's, uv's) is a venv that is
    // gone once the wheel is built: its base interpreter is what stays.
    let base = std::process::Command::new(executable)
        .args([
            "-S",
            "-c",
            "import os, sys; print(os.path.realpath(getattr(sys, '_base_executable', '') or sys.executable))",
        ])
        .output()
        .ok()
        .filter(|out| out.status.success())
        .map(|out| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|base| !base.is_empty())
        .unwrap_or_else(|| executable.to_string());
    println!("cargo:rustc-env=FLUKSIO_BUILD_BASE_PYTHON={base}");
    println!(
        "cargo:rustc-env=FLUKSIO_BUILD_PYTHON_VERSION={}.{}",
        config.version().major,
        config.version().minor
    );
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
}
