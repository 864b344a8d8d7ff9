//! Reading the committed fuzz corpora (`fuzz/corpus/<target>/` of the workspace) and replaying them through a
//! harness, and a seeded source of inputs beyond them: what the library's and the laboratory's
//! `fuzz_corpus.rs` tests share.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// `fuzz/corpus/` of the workspace (the library's folder, which the laboratory's crate sits in).
pub fn corpus_dir() -> PathBuf {
    let here = Path::new(env!("CARGO_MANIFEST_DIR"));
    let root = if here.join("fuzz").is_dir() {
        here
    } else {
        here.parent().expect("a crate of the workspace")
    };
    root.join("fuzz/corpus")
}

/// The files of `fuzz/corpus/<target>/`, sorted. Panics if the directory is missing or empty.
pub fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = corpus_dir().join(target);
    let entries = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("corpus directory {} is missing: {e}", dir.display()));
    let mut files: Vec<PathBuf> = entries
        .map(|entry| entry.expect("readable corpus entry").path())
        .filter(|path| path.is_file())
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "corpus directory {} is empty",
        dir.display()
    );
    files
}

/// Runs `harness` on every file of `target`'s corpus and panics listing every failure, panics included.
pub fn replay<T>(target: &str, harness: impl Fn(&[u8]) -> Result<T, String>) -> Vec<T> {
    replay_named(target, harness)
        .into_iter()
        .map(|(_, result)| result)
        .collect()
}

/// As [`replay`], each result with its file's name.
pub fn replay_named<T>(
    target: &str,
    harness: impl Fn(&[u8]) -> Result<T, String>,
) -> Vec<(String, T)> {
    let mut results = Vec::new();
    let mut failures = Vec::new();
    for path in corpus(target) {
        let data = std::fs::read(&path).expect("readable corpus file");
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        match catch_unwind(AssertUnwindSafe(|| harness(&data))) {
            Ok(Ok(result)) => results.push((name, result)),
            Ok(Err(message)) => failures.push(format!("{}: {message}", path.display())),
            Err(_) => failures.push(format!("{}: panicked (message above)", path.display())),
        }
    }
    assert!(
        failures.is_empty(),
        "{} of the {target} corpus failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    results
}

/// Inputs from a seeded SplitMix64 generator: the same every run.
pub fn random_inputs(seed: u64, count: usize, len: usize) -> Vec<Vec<u8>> {
    let mut state = seed;
    let mut next = move || {
        state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        (z ^ (z >> 31)) as u8
    };
    (0..count)
        .map(|i| (0..len * (i % 4 + 1) / 4).map(|_| next()).collect())
        .collect()
}
