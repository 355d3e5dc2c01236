//! Links the binary to the libpython it was built against.
//!
//! The issue this solves: without an rpath to libpython's directory, the
//! loader falls back to the system's `libpython3.X.so` (Debian's 3.11.2
//! beside pyenv's 3.11.7), and the two stdlibs get mixed.
//! `add_libpython_rpath_link_args` adds a RUNPATH, so the binary runs under
//! `env -i` with no `LD_LIBRARY_PATH`. Link arguments reach only the package
//! whose build script asks for them, so this one asks for the binary, its
//! tests and benches. Which interpreter that was, for `--python`'s default
//! and the version check, is baked in by `embed`'s build script.

fn main() {
    pyo3_build_config::add_libpython_rpath_link_args();
    println!("cargo:rerun-if-env-changed=PYO3_PYTHON");
}
