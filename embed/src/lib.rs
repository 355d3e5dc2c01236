//! fluksio-embed: CPython, embedded, for a process that forks it.
//!
//! This crate owns the interpreter: which one it is and how it starts
//! ([`interpreter`]: `PyConfig`, the version checks, the interpreter the
//! binary was built against), how it forks ([`fork`]: CPython's bracketing
//! of `fork(2)`, the thread census that says whether a fork was safe, a
//! call's child's session and death signal), where node output goes
//! ([`capture`]: `sys.stdout`/`sys.stderr` into a shared log buffer that
//! outlives a crash), what a child writes out before `_exit` ([`finish`]),
//! the `fluksio` module node code imports ([`module`]), and driving a
//! generator node one yield at a time ([`generator`]).
//!
//! Its API is safe: a caller holds the GIL through pyo3's `Python` and
//! `Bound` tokens, starts the interpreter with
//! [`interpreter::InterpreterConfig::initialize`] and then uses
//! `Python::attach`, forks with [`fork::fork`], captures with a
//! [`capture::LogBuffer`], and reaches back into the runtime only where the
//! runtime handed it a hook: [`fork::ForkHooks`] for its part of each fork,
//! [`module::Host`] for what `fluksio`'s functions do outside Python. It
//! depends on nothing of the runtime (its calls, the wire, containment):
//! dependencies point from the runtime to here, never back.
//!
//! The rule: nothing outside this crate calls CPython's C API
//! (`pyo3::ffi`). Every such call is here, each `unsafe` block with a
//! `// SAFETY:` line saying what holds; the runtime uses pyo3's safe API and
//! what this crate offers.

// The rule above, checked by clippy.
#![warn(clippy::undocumented_unsafe_blocks)]

pub mod capture;
pub mod finish;
pub mod fork;
pub mod generator;
pub mod interpreter;
pub mod module;
pub mod objects;
