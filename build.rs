//! Bakes the interpreter this binary was built against into it.
//!
//! The issues this solves:
//! 1. Without an rpath to libpython's directory, the loader falls back to the
//!    system's `libpython3.X.so` (Debian's 3.11.2 beside pyenv's 3.11.7), and
//!    the two stdlibs get mixed. `add_libpython_rpath_link_args` adds a
//!    RUNPATH, so the binary runs under `env -i` with no `LD_LIBRARY_PATH`.
//! 2. `--python` defaults to that same interpreter, and a different version is
//!    refused at start: both need to know, at run time, which one it was.
//!    Where it is a venv, its base interpreter too: `pip install .` and `uv
//!    tool install .` build in a throwaway venv.

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
