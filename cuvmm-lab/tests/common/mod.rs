//! Helpers shared by the laboratory's integration tests.
#![allow(dead_code)]

pub mod snapshot;

use std::path::{Path, PathBuf};

/// `../shared/traces`: the real traces, beside the repository (see its README).
pub fn shared_traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../shared/traces")
}

/// The files of `../shared/traces` whose names end with one of `suffixes`, sorted; None, after saying
/// why, where the folder is absent or holds none.
pub fn shared_trace_files(suffixes: &[&str]) -> Option<Vec<PathBuf>> {
    let dir = shared_traces_dir();
    let Ok(read) = std::fs::read_dir(&dir) else {
        println!("skipped: {} is absent", dir.display());
        return None;
    };
    let mut files: Vec<PathBuf> = read
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| suffixes.iter().any(|s| p.to_string_lossy().ends_with(s)))
        .collect();
    files.sort();
    if files.is_empty() {
        println!(
            "skipped: no {} file in {}",
            suffixes.join(" or "),
            dir.display()
        );
        return None;
    }
    Some(files)
}

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
