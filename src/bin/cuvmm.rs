//! The `cuvmm` command-line tool (in progress).
fn main() {}
