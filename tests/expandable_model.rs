//! Model-based property test of the expandable allocator (sharded-slab style).
//!
//! Weighted random sequences of alloc / free / empty_cache / trim / release_stranded over three streams and
//! two granularities are applied to the allocator and to a `BTreeMap` model of live allocations, under
//! `compaction:pressure` (the default) and `compaction:eager` (whole-page requests in segments apart).
//! Properties checked after every step:
//! - live allocations never overlap and are 512 B aligned;
//! - `allocated_bytes`, `requested_bytes` (with the blocks freed and waiting for another stream, which the
//!   snapshot lists) and `allocation` equal the model's sums;
//! - all of ARCHITECTURE.md's invariants hold (`check_invariants()`);
//! - `release_stranded()` gives back no page of a live block (none with single pages), reserved memory falls
//!   by what it says, and `empty_cache()` after it leaves no idle page anywhere;
//! - an allocation fails with out-of-memory only if the pages the live blocks could touch do not fit:
//!   idle physical pages are always found and reused (compaction), wherever they are;
//! - at the end, after freeing everything and `empty_cache()`: nothing mapped, no handle held, no
//!   reservation left, and the simulated driver reports no leak.

mod common;

use cuvmm::config::Compaction;
use cuvmm::strategy::{Controls as _, Snapshots as _};
use cuvmm::{Config, Error, Strategy as _, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;

const ROUND: u64 = 512;

#[derive(Debug, Clone)]
enum Action {
    Alloc {
        size: u64,
        stream: u64,
    },
    Free {
        pick: usize,
    },
    EmptyCache,
    Trim {
        pages: u64,
    },
    /// `release_stranded()`, then `empty_cache()`.
    ReleaseStranded,
}

fn action(max_size: u64) -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0u32..=20, 1u64..=1 << 20, 0u64..3).prop_map(move |(shift, frac, stream)| {
            // Log-uniform sizes from 1 byte to `max_size`.
            let size = (((max_size >> shift).max(1) * frac) >> 20).max(1);
            Action::Alloc { size, stream }
        }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        1 => Just(Action::EmptyCache),
        1 => (0u64..8).prop_map(|pages| Action::Trim { pages }),
        1 => Just(Action::ReleaseStranded),
    ]
}

/// Runs `actions` on a device of `pages` pages of `granularity` bytes. `chunk_pages`: pages per large-pool
/// handle (at 1, single pages; above, chunks, whose idle pages are lent when memory runs short; chunks are
/// mapped under `compaction:pressure` only).
fn run(
    granularity: u64,
    pages: u64,
    chunk_pages: u64,
    actions: Vec<Action>,
    compaction: Compaction,
) {
    run_with_margin(granularity, pages, chunk_pages, actions, compaction, 0);
}

/// [`run`] with `margin_pages` of the device to leave free (`device_margin_mb`): the device is as good as
/// that much smaller, for what fits and what is reserved.
fn run_with_margin(
    granularity: u64,
    pages: u64,
    chunk_pages: u64,
    actions: Vec<Action>,
    compaction: Compaction,
    margin_pages: u64,
) {
    let config = Config {
        small_size: 16 * ROUND,
        large_handle: chunk_pages * granularity,
        ..Config::default()
    }
    .with_compaction(compaction)
    .with_device_margin(margin_pages * granularity);
    let mut alloc = common::expandable_with(granularity, pages, config, false);
    let capacity = granularity * (pages - margin_pages);
    let mut model: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for action in actions {
        match action {
            Action::Alloc { size, stream } => {
                let rounded = size.next_multiple_of(ROUND);
                // Each live block touches at most its own pages plus one partial page at each end.
                let bound: u64 = model
                    .values()
                    .chain(std::iter::once(&(size, 0)))
                    .map(|&(s, _)| s.next_multiple_of(ROUND).div_ceil(granularity) + 2)
                    .sum::<u64>()
                    * granularity;
                match alloc.alloc(size, StreamId(stream)) {
                    Ok(addr) => {
                        assert_eq!(addr % ROUND, 0, "misaligned {addr:#x}");
                        if let Some((&prev, &(psize, _))) = model.range(..=addr).next_back() {
                            assert!(
                                prev + psize.next_multiple_of(ROUND) <= addr,
                                "overlap {prev:#x} / {addr:#x}"
                            );
                        }
                        if let Some((&next, _)) = model.range(addr..).next() {
                            assert!(addr + rounded <= next, "overlap {addr:#x} / {next:#x}");
                        }
                        model.insert(addr, (size, stream));
                    }
                    Err(Error::OutOfMemory(oom)) => {
                        assert!(
                            bound > capacity,
                            "OOM for {size} B though live pages fit: {oom}"
                        );
                    }
                    Err(err) => panic!("alloc({size}) failed: {err}"),
                }
            }
            Action::Free { pick } => {
                if model.is_empty() {
                    continue;
                }
                let addr = *model.keys().nth(pick % model.len()).unwrap();
                alloc.free(addr).expect("free of a live allocation");
                model.remove(&addr);
            }
            Action::EmptyCache => alloc.empty_cache().expect("empty_cache"),
            Action::Trim { pages } => {
                let idle_before = alloc.stats().idle_mapped_bytes + alloc.stats().idle_handle_bytes;
                let released = alloc.trim(pages * granularity).expect("trim");
                assert!(
                    released <= idle_before,
                    "trim released {released} of {idle_before} idle bytes"
                );
                // Idle pages of a chunk that a live block still touches cannot be given back (a chunk is
                // unmapped whole): with chunks, `released` has no lower bound but what was asked.
                assert!(
                    chunk_pages > 1 || released >= (pages * granularity).min(idle_before),
                    "trim released too little"
                );
            }
            Action::ReleaseStranded => {
                let before = alloc.stats();
                let released = alloc.release_stranded().expect("release_stranded");
                let after = alloc.stats();
                // Frees that wait (a block borrowed from another stream's segment) are settled first:
                // their pages may go too, never a live block's.
                assert!(
                    released
                        <= (before.reserved_bytes.current)
                            .saturating_sub(before.allocated_bytes.current),
                    "gave back {released} B"
                );
                assert!(chunk_pages > 1 || released == 0, "split single pages");
                assert_eq!(
                    after.reserved_bytes.current,
                    before.reserved_bytes.current - released
                );
                // No idle page is left in a chunk a live block touches: the cache then gives back every
                // idle page (the simulator, as CUDA, maps no part of a handle, so nothing is lent).
                alloc.empty_cache().expect("empty_cache");
                assert_eq!(
                    alloc.stats().idle_mapped_bytes,
                    0,
                    "idle pages left stranded"
                );
            }
        }
        alloc
            .check_invariants()
            .unwrap_or_else(|v| panic!("invariant broken: {v}"));
        let stats = alloc.stats();
        let rounded: u64 = model
            .values()
            .map(|&(s, _)| s.next_multiple_of(ROUND))
            .sum();
        let requested: u64 = model.values().map(|&(s, _)| s).sum();
        assert_eq!(stats.allocated_bytes.current, rounded);
        // A block freed on a stream other than its segment's waits for events (pending): its requested
        // bytes count until then, as PyTorch's.
        let pending = alloc.snapshot().unwrap().pending_requested_bytes();
        assert_eq!(stats.requested_bytes.current, requested + pending);
        assert_eq!(stats.allocation.current, model.len() as u64);
        assert!(stats.reserved_bytes.current <= capacity);
    }
    for addr in std::mem::take(&mut model).into_keys() {
        alloc.free(addr).expect("free at the end");
    }
    alloc.empty_cache().expect("final empty_cache");
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.reserved_bytes.current, 0);
    assert_eq!(stats.segment.current, 0);
    assert!(alloc.segments().is_empty());
    let leaks = alloc.driver().leak_report();
    assert!(leaks.is_empty(), "driver reports leaks: {leaks:?}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    #[test]
    fn small_pages(actions in prop::collection::vec(action(24 * 4096), 1..250)) {
        run(4096, 64, 1, actions, Compaction::Pressure);
    }

    #[test]
    fn small_pages_eager(actions in prop::collection::vec(action(24 * 4096), 1..250)) {
        run(4096, 64, 1, actions, Compaction::Eager);
    }

    #[test]
    fn large_pages(actions in prop::collection::vec(action(20 << 16), 1..250)) {
        run(1 << 16, 48, 1, actions, Compaction::Pressure);
    }

    #[test]
    fn large_pages_eager(actions in prop::collection::vec(action(20 << 16), 1..250)) {
        run(1 << 16, 48, 1, actions, Compaction::Eager);
    }

    #[test]
    fn chunks_of_four_pages(actions in prop::collection::vec(action(20 << 16), 1..250)) {
        run(1 << 16, 48, 4, actions, Compaction::Pressure);
    }

    #[test]
    fn small_pages_with_a_device_margin(actions in prop::collection::vec(action(24 * 4096), 1..250)) {
        run_with_margin(4096, 64, 1, actions, Compaction::Pressure, 13);
    }

    #[test]
    fn chunks_with_a_device_margin(actions in prop::collection::vec(action(20 << 16), 1..250)) {
        run_with_margin(1 << 16, 48, 4, actions, Compaction::Pressure, 7);
    }
}
