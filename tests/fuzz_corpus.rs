//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) through the same harness code the fuzz
//! targets run (`tests/harness/`), so every `cargo test` checks them on stable Rust, without cargo-fuzz.
//!
//! Each harness checks its target's properties (listed in its module docs) and returns an error or panics
//! when one breaks; a missing or empty corpus directory fails the test too. A second test feeds each
//! harness inputs from a seeded generator, so stable CI explores a little beyond the corpus.
//!
//! Part of the `expandable_ops` and `split_ops` corpora is written from the scenarios in [`scenarios`]
//! and [`split_scenarios`], each aimed at one path; `CUVMM_WRITE_SEEDS=1 cargo test --test fuzz_corpus`
//! rewrites those files after a change to the input layout. The other files are inputs the fuzzer found, minimized with `cargo fuzz cmin`.
//!
//! The `pytorch_snapshot` and `rmm_csv` seeds are written by `fuzz/seeds/trace_readers.py` (seed_* files
//! must be read, bad_* refused).
#![cfg(feature = "lab")]

#[path = "harness/config_parse.rs"]
mod config_parse;
#[path = "harness/expandable_input.rs"]
mod expandable_input;
#[path = "harness/expandable_ops.rs"]
mod expandable_ops;
#[path = "harness/input.rs"]
mod input;
#[path = "harness/ops_common.rs"]
mod ops_common;
#[path = "harness/page_map.rs"]
mod page_map;
#[path = "harness/pytorch_snapshot.rs"]
mod pytorch_snapshot;
#[path = "harness/rmm_csv.rs"]
mod rmm_csv;
#[path = "harness/split_input.rs"]
mod split_input;
#[path = "harness/split_ops.rs"]
mod split_ops;
#[path = "harness/strategy_ops.rs"]
mod strategy_ops;
#[path = "harness/trace_replay.rs"]
mod trace_replay;

use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::lab::pytorch_model::Split;
use expandable_input::{Action, PAGE, Setup};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::{Path, PathBuf};

/// The files of `fuzz/corpus/<target>/`, sorted. Panics if the directory is missing or empty.
fn corpus(target: &str) -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target);
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
fn replay<T>(target: &str, harness: impl Fn(&[u8]) -> Result<T, String>) -> Vec<T> {
    replay_named(target, harness)
        .into_iter()
        .map(|(_, result)| result)
        .collect()
}

/// As [`replay`], each result with its file's name.
fn replay_named<T>(target: &str, harness: impl Fn(&[u8]) -> Result<T, String>) -> Vec<(String, T)> {
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

#[test]
fn expandable_ops_corpus() {
    let summaries = replay("expandable_ops", |data| {
        strategy_ops::summary::<Expandable<SimDriver>>(data).map_err(|f| f.to_string())
    });
    // The corpus must exercise what the target is for, not only decode.
    let total = |f: fn(&ops_common::Summary) -> usize| summaries.iter().map(f).sum::<usize>();
    assert!(total(|s| s.allocs) > 0, "no allocation succeeded");
    assert!(total(|s| s.ooms) > 0, "no allocation ran out of memory");
    assert!(total(|s| s.faults_fired) > 0, "no fault fired");
    assert!(
        total(|s| s.failed_by_fault) > 0,
        "no operation failed by a fault"
    );
}

#[test]
fn split_ops_corpus() {
    let summaries = replay("split_ops", |data| {
        strategy_ops::summary::<Split<SimDriver>>(data).map_err(|f| f.to_string())
    });
    // The corpus must exercise both modes, running out of memory and failing by faults.
    let total = |f: fn(&ops_common::Summary) -> usize| summaries.iter().map(f).sum::<usize>();
    for expandable in [false, true] {
        assert!(
            summaries
                .iter()
                .any(|s| s.expandable == expandable && s.allocs > 0),
            "no allocation succeeded with expandable_segments {expandable}"
        );
    }
    assert!(total(|s| s.ooms) > 0, "no allocation ran out of memory");
    assert!(total(|s| s.faults_fired) > 0, "no fault fired");
    assert!(
        total(|s| s.failed_by_fault) > 0,
        "no operation failed by a fault"
    );
}

#[test]
fn config_parse_corpus() {
    let outcomes = replay("config_parse", config_parse::run);
    for want in [
        config_parse::Outcome::Refused,
        config_parse::Outcome::AllocatorRefused,
        config_parse::Outcome::Used,
    ] {
        assert!(outcomes.contains(&want), "no corpus input gives {want:?}");
    }
}

#[test]
fn page_map_corpus() {
    let steps = replay("page_map", page_map::run);
    assert!(steps.iter().sum::<usize>() > 0, "no step applied");
}

#[test]
fn pytorch_snapshot_corpus() {
    // The seeds written by fuzz/seeds/trace_readers.py: seed_* are read, bad_* refused.
    let outcomes = replay_named("pytorch_snapshot", pytorch_snapshot::run);
    for (name, outcome) in &outcomes {
        let read = matches!(outcome, pytorch_snapshot::Outcome::Read { .. });
        if name.starts_with("seed_") || name.starts_with("bad_") {
            assert_eq!(read, name.starts_with("seed_"), "{name}: {outcome:?}");
        }
    }
    let devices = |name: &str| outcomes.iter().find(|(n, _)| n == name).map(|(_, o)| *o);
    assert!(
        matches!(
            devices("seed_two_devices"),
            Some(pytorch_snapshot::Outcome::Read {
                traces: 2,
                events: 4
            })
        ),
        "{:?}",
        devices("seed_two_devices")
    );
}

#[test]
fn rmm_csv_corpus() {
    let outcomes = replay_named("rmm_csv", rmm_csv::run);
    for (name, outcome) in &outcomes {
        let read = matches!(outcome, rmm_csv::Outcome::Read { .. });
        if name.starts_with("seed_") || name.starts_with("bad_") {
            assert_eq!(read, name.starts_with("seed_"), "{name}: {outcome:?}");
        }
    }
    let read =
        |f: fn(&rmm_csv::Outcome) -> usize| outcomes.iter().map(|(_, o)| f(o)).sum::<usize>();
    assert!(
        read(|o| match o {
            rmm_csv::Outcome::Read { failures, .. } => *failures,
            _ => 0,
        }) > 0
    );
    assert!(
        read(|o| match o {
            rmm_csv::Outcome::Read { seeded, .. } => *seeded,
            _ => 0,
        }) > 0
    );
}

/// Inputs from a seeded SplitMix64 generator: the same every run.
fn random_inputs(seed: u64, count: usize, len: usize) -> Vec<Vec<u8>> {
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

#[test]
fn seeded_random_inputs() {
    for data in random_inputs(1, 48, 480) {
        if let Err(failure) = strategy_ops::run::<Expandable<SimDriver>>(&data) {
            panic!("expandable_ops on {data:?}:\n{failure}");
        }
    }
    for data in random_inputs(2, 64, 96) {
        config_parse::run(&data).unwrap_or_else(|e| panic!("config_parse on {data:?}: {e}"));
    }
    for data in random_inputs(3, 48, 700) {
        page_map::run(&data).unwrap_or_else(|e| panic!("page_map on {data:?}: {e}"));
    }
    for data in random_inputs(4, 48, 360) {
        if let Err(failure) = strategy_ops::run::<Split<SimDriver>>(&data) {
            panic!("split_ops on {data:?}:\n{failure}");
        }
    }
    for mut data in random_inputs(4, 64, 300) {
        // Half of them start like a pickle, to get past the first opcode.
        if data.len() % 2 == 0 && !data.is_empty() {
            data[0] = 0x80;
        }
        pytorch_snapshot::run(&data)
            .unwrap_or_else(|e| panic!("pytorch_snapshot on {data:?}: {e}"));
    }
    for data in random_inputs(5, 64, 300) {
        // Bytes mapped onto the characters of a log, so that some rows come close to valid.
        const CHARS: &[u8] = b"0123456789abcdefx,,,\n-allocatefree failure";
        let text: Vec<u8> = data
            .iter()
            .map(|b| CHARS[*b as usize % CHARS.len()])
            .collect();
        rmm_csv::run(&text).unwrap_or_else(|e| panic!("rmm_csv on {text:?}: {e}"));
    }
}

/// The hand-written `expandable_ops` seeds: (file name, setup, operations).
fn scenarios() -> Vec<(&'static str, Setup, Vec<Action>)> {
    use Action::*;
    let setup = |pages, max_idle_bytes| Setup {
        pages,
        max_idle_bytes,
        small_size: 1024,
        chunk_pages: 1,
        partial_mappings: false,
    };
    // Eight 4-page chunks fill the device, each kept in use by its last page only.
    let mut stranded = Vec::new();
    for _ in 0..8 {
        stranded.extend([
            Alloc {
                size: 3 * PAGE,
                stream: 0,
            },
            Alloc {
                size: PAGE,
                stream: 0,
            },
        ]);
    }
    stranded.extend((0..8).map(|pick| Free { pick }));
    let alloc = |size, stream| Alloc { size, stream };
    let fault = |op, n, kind| Fault { op, n, kind };
    let (err, oom) = (FaultKind::Error, FaultKind::OutOfMemory);
    vec![
        (
            // Stream 1 and 2 grow on pages stream 0 left idle; a third big request runs out of memory.
            "seed_compaction_between_streams",
            setup(32, u64::MAX),
            vec![
                alloc(12 * PAGE, 0),
                alloc(12 * PAGE, 0),
                alloc(700, 0),
                Free { pick: 0 },
                Free { pick: 0 },
                alloc(12 * PAGE, 1),
                alloc(12 * PAGE, 2),
                alloc(10 * PAGE, 2),
                alloc(3000, 1),
                Free { pick: 1 },
                alloc(5 * PAGE, 0),
                EmptyCache,
            ],
        ),
        (
            // `create` runs out of memory: the cache is released and creation retried once; then a
            // plain error fails the request, and the next request succeeds.
            "seed_create_faults",
            setup(40, u64::MAX),
            vec![
                alloc(8 * PAGE, 0),
                Free { pick: 0 },
                fault(Op::Create, 1, oom),
                alloc(12 * PAGE, 1),
                fault(Op::Create, 1, err),
                alloc(3 * PAGE, 1),
                alloc(3 * PAGE, 1),
                fault(Op::Create, 2, oom),
                fault(Op::Create, 3, oom),
                alloc(9 * PAGE, 2),
                Free { pick: 0 },
            ],
        ),
        (
            // `map` and `set_access` fail in the middle of backing a block with pages.
            "seed_map_and_access_faults",
            setup(48, u64::MAX),
            vec![
                fault(Op::Map, 2, err),
                alloc(4 * PAGE, 0),
                fault(Op::SetAccess, 1, oom),
                alloc(4 * PAGE, 0),
                alloc(4 * PAGE, 0),
                alloc(512, 1),
                fault(Op::Map, 1, oom),
                alloc(6 * PAGE + 100, 1),
                Free { pick: 3 },
                Trim { pages: 2 },
            ],
        ),
        (
            // With a 2-page idle limit, frees give memory back, and `release`, `unmap`,
            // `synchronize` and `free_reservation` fail on the way.
            "seed_release_path_faults",
            setup(36, 2 * PAGE),
            vec![
                alloc(8 * PAGE, 0),
                alloc(1000, 0),
                alloc(5 * PAGE, 1),
                fault(Op::Release, 1, err),
                Free { pick: 0 },
                fault(Op::Unmap, 1, oom),
                Free { pick: 1 },
                fault(Op::Synchronize, 1, err),
                Trim { pages: 4 },
                fault(Op::FreeReservation, 1, err),
                Free { pick: 0 },
                EmptyCache,
                EmptyCache,
            ],
        ),
        (
            // Refused requests: double and unknown frees, size 0, sizes beyond the device; a failed
            // `reserve` and a failed `mem_info` while reporting out-of-memory.
            "seed_refusals",
            setup(64, 8 * PAGE),
            vec![
                BadFree { pick: 3 },
                alloc(2048, 0),
                Free { pick: 0 },
                BadFree { pick: 0 },
                alloc(0, 0),
                alloc(64 * PAGE + 1, 1),
                fault(Op::Reserve, 1, err),
                alloc(PAGE, 2),
                alloc(12 * PAGE, 2),
                alloc(12 * PAGE, 2),
                alloc(12 * PAGE, 2),
                alloc(12 * PAGE, 2),
                alloc(12 * PAGE, 2),
                fault(Op::MemInfo, 1, err),
                alloc(12 * PAGE, 0),
            ],
        ),
        (
            // Chunks whose idle pages a live page strands: lent to other streams (a `map` failing on
            // the way), returned by `empty_cache` and `trim`, lent again.
            "seed_lending",
            Setup {
                chunk_pages: 4,
                partial_mappings: true,
                ..setup(32, u64::MAX)
            },
            [
                stranded,
                vec![
                    alloc(12 * PAGE, 1),
                    fault(Op::Map, 3, err),
                    alloc(8 * PAGE, 2),
                    alloc(6 * PAGE, 2),
                    Free { pick: 8 },
                    Trim { pages: 3 },
                    alloc(5 * PAGE, 0),
                    Free { pick: 0 },
                    Free { pick: 0 },
                    EmptyCache,
                    alloc(9 * PAGE, 2),
                    fault(Op::Unmap, 1, err),
                    EmptyCache,
                ],
            ]
            .concat(),
        ),
    ]
}

/// The hand-written seeds on disk are exactly what their scenarios encode to, and decode back to them.
#[test]
fn written_seeds_match_their_scenarios() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/expandable_ops");
    let write = std::env::var_os("CUVMM_WRITE_SEEDS").is_some();
    for (name, setup, actions) in scenarios() {
        let bytes = expandable_input::encode(&setup, &actions);
        assert_eq!(expandable_input::decode(&bytes), (setup, actions), "{name}");
        let path = dir.join(name);
        if write {
            std::fs::write(&path, &bytes).expect("seed written");
        }
        let on_disk = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (CUVMM_WRITE_SEEDS=1 writes it)", path.display()));
        assert_eq!(on_disk, bytes, "{name} differs from its scenario");
    }
}

/// The hand-written `split_ops` seeds: (file name, setup, operations).
fn split_scenarios() -> Vec<(&'static str, split_input::Setup, Vec<split_input::Action>)> {
    use split_input::Action::*;
    use split_input::{MIB, Setup};
    let setup = |granules, expandable, max_split_mb, roundup, gc| Setup {
        granules,
        expandable,
        max_split_mb,
        roundup,
        gc,
    };
    let alloc = |size, stream| Alloc { size, stream };
    let fault = |op, n, kind| Fault { op, n, kind };
    let (err, oom) = (FaultKind::Error, FaultKind::OutOfMemory);
    vec![
        (
            // Small blocks split 2 MiB segments, a 5 MiB block splits a 20 MiB one, a 12 MiB block gets
            // its own; freed neighbours merge and are reused per stream; empty_cache frees whole segments.
            "seed_classic_split_and_merge",
            setup(64, false, None, false, false),
            vec![
                alloc(1000, 0),
                alloc(688_128, 0),
                alloc(1000, 1),
                alloc(5 * MIB, 0),
                alloc(3 * MIB, 0),
                alloc(12 * MIB, 1),
                Free { pick: 1 },
                Free { pick: 3 },
                alloc(2 * MIB, 0),
                alloc(10 * MIB, 1),
                Trim { mib: 4 },
                Free { pick: 0 },
                EmptyCache,
            ],
        ),
        (
            // max_split_size_mb:20 on a 48 MiB device: oversize blocks are not split, and a request that
            // does not fit is served after the cached oversize blocks are released; then out of memory.
            "seed_classic_oversize_release",
            setup(24, false, Some(20), false, false),
            vec![
                alloc(30 * MIB, 0),
                Free { pick: 0 },
                alloc(22 * MIB, 0),
                alloc(40 * MIB, 0),
                Free { pick: 0 },
                alloc(40 * MIB, 1),
                alloc(20 * MIB, 1),
                Free { pick: 0 },
                alloc(10 * MIB + 1, 0),
            ],
        ),
        (
            // cudaMalloc runs out of memory (the cache is released and the request retried once), then
            // fails outright; cudaFree fails while the cache is released.
            "seed_classic_malloc_faults",
            setup(40, false, None, false, false),
            vec![
                alloc(6 * MIB, 0),
                Free { pick: 0 },
                fault(Op::Malloc, 1, oom),
                alloc(30 * MIB, 1),
                fault(Op::Malloc, 1, err),
                alloc(512, 2),
                alloc(512, 2),
                fault(Op::Free, 1, err),
                Free { pick: 0 },
                EmptyCache,
                fault(Op::MemInfo, 1, err),
                alloc(70 * MIB, 0),
                EmptyCache,
            ],
        ),
        (
            // Expandable segments: a growth of three 20 MiB pages whose second map fails, one whose
            // set_access fails, creates that run out of memory or fail, and unmap, release, synchronize
            // and free_reservation failing while the cache is released.
            "seed_expandable_growth_faults",
            setup(80, true, None, false, false),
            vec![
                fault(Op::Map, 2, err),
                alloc(50 * MIB, 0),
                fault(Op::SetAccess, 1, err),
                alloc(50 * MIB, 0),
                alloc(50 * MIB, 0),
                alloc(3000, 1),
                fault(Op::Create, 1, oom),
                alloc(20 * MIB + 512, 1),
                fault(Op::Create, 2, err),
                alloc(45 * MIB, 2),
                Free { pick: 0 },
                fault(Op::Unmap, 2, err),
                EmptyCache,
                fault(Op::Release, 1, err),
                Trim { mib: 40 },
                fault(Op::Synchronize, 1, err),
                EmptyCache,
                Free { pick: 0 },
                fault(Op::FreeReservation, 1, err),
                EmptyCache,
                fault(Op::Reserve, 1, err),
                alloc(1000, 2),
            ],
        ),
        (
            // Garbage collection (threshold 0.6 of a 0.9 fraction) and roundup_power2_divisions:4 with
            // sizes at the rules' thresholds, in both modes' worth of requests; refused requests too.
            "seed_gc_roundup_thresholds",
            setup(48, false, Some(40), true, true),
            vec![
                alloc(MIB, 0),
                alloc(MIB + 512, 0),
                alloc(10 * MIB - 512, 0),
                alloc(10 * MIB + 1, 0),
                Free { pick: 1 },
                Free { pick: 1 },
                alloc(20 * MIB + 512, 0),
                alloc(40 * MIB + 1, 1),
                Free { pick: 0 },
                alloc(9 * MIB, 0),
                BadFree { pick: 0 },
                alloc(0, 0),
                alloc(96 * MIB + 1, 1),
                Free { pick: 0 },
                BadFree { pick: 7 },
            ],
        ),
    ]
}

/// The hand-written `split_ops` seeds on disk are exactly what their scenarios encode to, and decode
/// back to them.
#[test]
fn written_split_seeds_match_their_scenarios() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz/corpus/split_ops");
    let write = std::env::var_os("CUVMM_WRITE_SEEDS").is_some();
    for (name, setup, actions) in split_scenarios() {
        let bytes = split_input::encode(&setup, &actions);
        assert_eq!(split_input::decode(&bytes), (setup, actions), "{name}");
        let path = dir.join(name);
        if write {
            std::fs::create_dir_all(&dir).expect("corpus directory created");
            std::fs::write(&path, &bytes).expect("seed written");
        }
        let on_disk = std::fs::read(&path)
            .unwrap_or_else(|e| panic!("{}: {e} (CUVMM_WRITE_SEEDS=1 writes it)", path.display()));
        assert_eq!(on_disk, bytes, "{name} differs from its scenario");
    }
}
