//! Replays the committed fuzz corpora (`fuzz/corpus/<target>/`) through the same harness code the fuzz
//! targets run (`tests/harness/`), so every `cargo test` checks them on stable Rust, without cargo-fuzz.
//!
//! Each harness checks its target's properties (listed in its module docs) and returns an error or panics
//! when one breaks; a missing or empty corpus directory fails the test too. A second test feeds each
//! harness inputs from a seeded generator, so stable CI explores a little beyond the corpus.
//!
//! The library's targets are here (`expandable_ops`, `config_parse`, `page_map`); the laboratory's
//! (`split_ops`, `pytorch_snapshot`, `rmm_csv`, `kineto_json`) are in `cuvmm-lab/tests/fuzz_corpus.rs`.
//!
//! Part of the `expandable_ops` corpus is written from the scenarios in [`scenarios`], each aimed at one
//! path; `CUVMM_WRITE_SEEDS=1 cargo test --test fuzz_corpus` rewrites those files after a change to the
//! input layout. The other files are inputs the fuzzer found, minimized with `cargo fuzz cmin`.

#[path = "harness/config_parse.rs"]
mod config_parse;
#[path = "harness/corpus.rs"]
mod corpus;
#[path = "harness/expandable_input.rs"]
mod expandable_input;
#[path = "harness/expandable_ops.rs"]
mod expandable_ops;
#[path = "harness/input.rs"]
mod input;
#[path = "harness/mapped_events.rs"]
mod mapped_events;
#[path = "harness/ops_common.rs"]
mod ops_common;
#[path = "harness/page_map.rs"]
mod page_map;
#[path = "harness/strategy_ops.rs"]
mod strategy_ops;

use corpus::{corpus_dir, random_inputs, replay};
use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimDriver};
use cuvmm::expandable::Expandable;
use expandable_input::{Action, PAGE, Setup};

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
        split: false,
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
                stranded.clone(),
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
        (
            // `compaction:split` on a device full of chunks that one live page each strands: a request
            // on another stream splits them (a `create` of the single pages failing first, so the chunk
            // is mapped whole again), then with the split's `unmap`, `release`, `map` and `set_access`
            // failing in turn, each time on chunks stranded anew; every live block's bytes read back.
            "seed_split",
            Setup {
                chunk_pages: 4,
                split: true,
                ..setup(32, u64::MAX)
            },
            [
                stranded.clone(),
                vec![
                    fault(Op::Create, 1, err),
                    alloc(12 * PAGE, 1),
                    alloc(12 * PAGE, 1),
                ],
                (0..9).map(|_| Free { pick: 0 }).collect(),
                vec![EmptyCache],
                stranded.clone(),
                vec![fault(Op::Unmap, 1, err), alloc(12 * PAGE, 2)],
                vec![fault(Op::Release, 1, err), alloc(12 * PAGE, 2)],
                vec![fault(Op::Map, 2, err), alloc(12 * PAGE, 2)],
                vec![fault(Op::SetAccess, 1, oom), alloc(12 * PAGE, 1)],
                (0..12).map(|_| Free { pick: 0 }).collect(),
                vec![EmptyCache],
                stranded.clone(),
                vec![alloc(12 * PAGE, 1), alloc(4 * PAGE, 2), alloc(40 * PAGE, 0)],
            ]
            .concat(),
        ),
        (
            // Blocks on one chunk shared (one export, the same descriptor after), the chunks stranded and
            // split under `compaction:split` (a shared segment's chunks are kept whole), everything freed
            // and given back, and the new memory shared afresh.
            "seed_share",
            Setup {
                chunk_pages: 4,
                split: true,
                ..setup(32, u64::MAX)
            },
            [
                vec![
                    alloc(1500, 0),
                    alloc(2 * PAGE, 0),
                    Share { pick: 0 },
                    Share { pick: 1 },
                ],
                stranded.clone(),
                vec![
                    Share { pick: 2 },
                    ReleaseStranded,
                    Share { pick: 3 },
                    alloc(12 * PAGE, 1),
                ],
                (0..12).map(|_| Free { pick: 0 }).collect(),
                vec![
                    EmptyCache,
                    alloc(3 * PAGE, 2),
                    Share { pick: 0 },
                    Share { pick: 0 },
                ],
            ]
            .concat(),
        ),
    ]
    .into_iter()
    .chain(release_stranded_scenarios(&stranded))
    .collect()
}

/// The program's own `release_stranded` under the default policy, once cleanly, then with a failure in
/// each driver call it makes, the device stranded again before each (the synchronization, the chunk's
/// unmap and release in the first seed; the single pages' create, map and access in the second); then
/// the request that needs the stranded pages.
fn release_stranded_scenarios(stranded: &[Action]) -> Vec<(&'static str, Setup, Vec<Action>)> {
    use Action::*;
    let (err, oom) = (FaultKind::Error, FaultKind::OutOfMemory);
    let seed = |name, faults: [(Op, u64, FaultKind); 3]| {
        let setup = Setup {
            pages: 32,
            max_idle_bytes: u64::MAX,
            small_size: 1024,
            chunk_pages: 4,
            partial_mappings: false,
            split: false,
        };
        let mut actions = [stranded, &[ReleaseStranded, ReleaseStranded]].concat();
        for (op, n, kind) in faults {
            // Everything freed and given back, then the device stranded again.
            actions.extend((0..8).map(|_| Free { pick: 0 }));
            actions.push(EmptyCache);
            actions.extend_from_slice(stranded);
            actions.extend([Fault { op, n, kind }, ReleaseStranded]);
        }
        actions.extend([
            ReleaseStranded,
            Alloc {
                size: 12 * PAGE,
                stream: 1,
            },
        ]);
        (name, setup, actions)
    };
    vec![
        seed(
            "seed_release_stranded",
            [
                (Op::Synchronize, 1, err),
                (Op::Unmap, 1, err),
                (Op::Release, 1, err),
            ],
        ),
        seed(
            "seed_release_stranded_remap",
            [
                (Op::Create, 1, oom),
                (Op::Map, 2, err),
                (Op::SetAccess, 1, err),
            ],
        ),
    ]
}

/// The hand-written seeds on disk are exactly what their scenarios encode to, and decode back to them.
#[test]
fn written_seeds_match_their_scenarios() {
    let dir = corpus_dir().join("expandable_ops");
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

/// The `release_stranded` seeds reach what they are for: every fault they arm fires inside a
/// `release_stranded`, and the allocator keeps its live bytes through each (the harness reads them back).
#[test]
fn release_stranded_seeds_fire_their_faults() {
    for (name, setup, actions) in scenarios()
        .into_iter()
        .filter(|(name, ..)| name.starts_with("seed_release_stranded"))
    {
        let armed = (actions.iter())
            .filter(|a| matches!(a, Action::Fault { .. }))
            .count();
        let bytes = expandable_input::encode(&setup, &actions);
        let summary = strategy_ops::summary::<Expandable<SimDriver>>(&bytes).unwrap();
        assert_eq!(summary.faults_fired, armed, "{name}: {summary:?}");
        // A failed synchronization fails the call before anything moved; once the chunk is unmapped a
        // failed call is repeated (`supply/split.rs`), so the second seed's calls all recover.
        let failed = if name == "seed_release_stranded" {
            1
        } else {
            0
        };
        assert_eq!(summary.failed_by_fault, failed, "{name}: {summary:?}");
    }
}
