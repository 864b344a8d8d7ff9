//! Helpers shared by the laboratory's integration tests.
#![allow(dead_code)]

pub mod snapshot;

/// Runs the `cuvmm` binary with `args` and waits for it.
pub fn cuvmm(args: &[&str]) -> std::process::Output {
    std::process::Command::new(env!("CARGO_BIN_EXE_cuvmm"))
        .args(args)
        .output()
        .expect("run cuvmm")
}

/// What a run printed on stderr.
pub fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}
