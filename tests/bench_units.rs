//! The unit tests of the comparison bench (`benches/compare`) and of what
//! the benches share (`benches/support`), under libtest. `tests/bench.rs`
//! runs the bench itself.

#[allow(dead_code)]
#[path = "../benches/compare/main.rs"]
mod compare;
