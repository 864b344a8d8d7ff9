//! Replays the committed fuzz corpora of the laboratory's targets (`fuzz/corpus/<target>/`: `split_ops`,
//! `pytorch_snapshot`, `rmm_csv`, `kineto_json`) through the same harness code the fuzz targets run
//! (`cuvmm-lab/tests/harness/`, with the generic parts of `tests/harness/`), so every `cargo test` checks
//! them on stable Rust, without cargo-fuzz. The library's targets are in `tests/fuzz_corpus.rs`.
//!
//! Each harness checks its target's properties (listed in its module docs) and returns an error or panics
//! when one breaks; a missing or empty corpus directory fails the test too. A second test feeds each
//! harness inputs from a seeded generator, so stable CI explores a little beyond the corpus.
//!
//! Part of the `split_ops` corpus is written from the scenarios in [`split_scenarios`], each aimed at one
//! path; `CUVMM_WRITE_SEEDS=1 cargo test -p cuvmm-lab --test fuzz_corpus` rewrites those files after a change
//! to the input layout. The `pytorch_snapshot`, `rmm_csv` and `kineto_json` seeds are written by
//! `fuzz/seeds/trace_readers.py` (seed_* files must be read, bad_* refused).

#[path = "../../tests/harness/corpus.rs"]
mod corpus;
#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "harness/kineto_json.rs"]
mod kineto_json;
#[path = "../../tests/harness/ops_common.rs"]
mod ops_common;
#[path = "harness/pytorch_snapshot.rs"]
mod pytorch_snapshot;
#[path = "harness/rmm_csv.rs"]
mod rmm_csv;
#[path = "harness/split_input.rs"]
mod split_input;
#[path = "harness/split_ops.rs"]
mod split_ops;
#[path = "../../tests/harness/strategy_ops.rs"]
mod strategy_ops;
#[path = "harness/trace_replay.rs"]
mod trace_replay;

use corpus::{corpus_dir, random_inputs, replay, replay_named};
use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimDriver};
use cuvmm_lab::pytorch_model::Split;

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

/// The seeds written by `fuzz/seeds/trace_readers.py`: each `seed_*` file is read, each `bad_*` refused.
fn check_seeds<O: std::fmt::Debug>(outcomes: &[(String, O)], read: impl Fn(&O) -> bool) {
    for (name, outcome) in outcomes {
        if name.starts_with("seed_") || name.starts_with("bad_") {
            assert_eq!(
                read(outcome),
                name.starts_with("seed_"),
                "{name}: {outcome:?}"
            );
        }
    }
}

#[test]
fn pytorch_snapshot_corpus() {
    let outcomes = replay_named("pytorch_snapshot", pytorch_snapshot::run);
    check_seeds(&outcomes, |o| {
        matches!(o, pytorch_snapshot::Outcome::Read { .. })
    });
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
    check_seeds(&outcomes, |o| matches!(o, rmm_csv::Outcome::Read { .. }));
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

#[test]
fn kineto_json_corpus() {
    let outcomes = replay_named("kineto_json", kineto_json::run);
    check_seeds(&outcomes, |o| {
        matches!(o, kineto_json::Outcome::Read { .. })
    });
    let outcome = |name: &str| outcomes.iter().find(|(n, _)| n == name).map(|(_, o)| *o);
    // Six events, one free of a block allocated before and the memory never freed seeded first, and one
    // free not recorded put in: nine.
    assert_eq!(
        outcome("seed_today"),
        Some(kineto_json::Outcome::Read {
            traces: 1,
            events: 9
        })
    );
    assert!(matches!(
        outcome("seed_two_devices"),
        Some(kineto_json::Outcome::Read { traces: 2, .. })
    ));
}

#[test]
fn seeded_random_inputs() {
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
    for data in random_inputs(6, 64, 300) {
        // As given (the programs they describe), and again as JSON text.
        kineto_json::run(&data).unwrap_or_else(|e| panic!("kineto_json on {data:?}: {e}"));
        let mut text = data.clone();
        if let Some(first) = text.first_mut() {
            *first = b'{';
        }
        kineto_json::run(&text).unwrap_or_else(|e| panic!("kineto_json on {text:?}: {e}"));
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
    let dir = corpus_dir().join("split_ops");
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
