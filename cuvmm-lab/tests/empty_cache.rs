//! `torch.cuda.empty_cache()` inferred from PyTorch snapshots and replayed by every allocator.
//!
//! Synthetic snapshots (pickled as PyTorch writes them) cover a burst of releases after frees, a partial
//! burst (a segment still holding a live block is kept), releases PyTorch's own logic explains (an
//! out-of-memory retry, garbage collection) that must not become an `empty_cache`, and a burst of
//! `segment_unmap` with expandable segments. Snapshots that cuvmm's models write while replaying the
//! `batched-inference` workload close the loop: the reader finds every `empty_cache` the workload made.

mod common;

use common::snapshot::{block, dict, entry};
use cuvmm_lab::experiments::fidelity::fidelity;
use cuvmm_lab::replay::allocators;
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::load;
use cuvmm_lab::trace::pytorch::{self, TraceOp, writer};
use cuvmm_lab::workload;
use serde_pickle::Value as V;
use std::path::PathBuf;

/// A large-pool segment on stream 0.
fn segment(addr: i64, size: i64, expandable: bool, blocks: Vec<V>) -> V {
    common::snapshot::segment(addr, size, "large", expandable, blocks)
}

fn write(name: &str, snapshot: &V) -> PathBuf {
    common::snapshot::write("empty-cache", name, snapshot)
}

const MIB: i64 = 1 << 20;
const BASE: i64 = 0x7f00_4000_0000;
const W: i64 = BASE;
const A: i64 = BASE + 64 * MIB;
const B: i64 = BASE + 128 * MIB;

/// `alloc` then, for `freed`, `free_requested` and `free_completed` as PyTorch records them.
fn alloc(addr: i64, size: i64) -> V {
    entry("alloc", addr, size)
}

fn free(addr: i64, size: i64) -> Vec<V> {
    vec![
        entry("free_requested", addr, size),
        entry("free_completed", addr, size),
    ]
}

/// The weights: a 20 MiB segment whose one block was allocated before recording and stays live.
fn weights() -> V {
    segment(
        W,
        20 * MIB,
        false,
        vec![block(W, 20 * MIB, 20 * MIB, "active_allocated")],
    )
}

fn snapshot(segments: Vec<V>, events: Vec<V>, settings: Option<Vec<(&str, V)>>) -> V {
    let mut top = vec![
        ("segments", V::List(segments)),
        ("device_traces", V::List(vec![V::List(events)])),
    ];
    if let Some(settings) = settings {
        top.push(("allocator_settings", dict(settings)));
    }
    dict(top)
}

fn empty_caches(ops: &[TraceOp]) -> usize {
    ops.iter().filter(|op| **op == TraceOp::EmptyCache).count()
}

/// Two activations in segments of their own, both freed, then a burst that releases both segments, then
/// the same 40 MiB again, in a new segment. The burst has the shape of an out-of-memory retry (a new
/// segment right after it, and 90 + 40 MiB is more than PyTorch ever held), but the freed 40 MiB segment
/// would have served the request without any `cudaMalloc`: it was `empty_cache`.
#[test]
fn a_burst_after_frees_is_one_empty_cache() {
    let mut events = vec![
        entry("segment_alloc", A, 40 * MIB),
        alloc(A, 40 * MIB),
        entry("segment_alloc", B, 30 * MIB),
        alloc(B, 30 * MIB),
    ];
    events.extend(free(A, 40 * MIB));
    events.extend(free(B, 30 * MIB));
    // PyTorch releases the cached blocks smallest first.
    events.push(entry("segment_free", B, 30 * MIB));
    events.push(entry("segment_free", A, 40 * MIB));
    events.push(entry("segment_alloc", A, 40 * MIB));
    events.push(alloc(A, 40 * MIB));
    events.extend(free(A, 40 * MIB));
    let final_a = segment(A, 40 * MIB, false, vec![block(A, 40 * MIB, 0, "inactive")]);
    let path = write(
        "burst.pickle",
        &snapshot(vec![weights(), final_a], events, None),
    );
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 1, "{:?}", trace.ops);
    assert!(!trace.oom_releases);
    // Right after the frees, before the next request.
    let at = trace.ops.iter().position(|op| *op == TraceOp::EmptyCache);
    assert_eq!(at, Some(4));
    // The plain trace every allocator replays carries it too.
    let plain = &load::load(&path, None).unwrap()[0];
    assert_eq!(plain.empty_cache_count(), 1);
    assert_eq!(plain.events[5], Event::EmptyCache);
    let report = fidelity(&path, None).unwrap();
    assert_eq!(report.ground_truth.segment_events, 5);
    assert_eq!(report.model.segment_events, 5);
    assert_eq!(report.segment_event_match, 1.0);
    assert_eq!(report.peak_reserved_error, 0.0);
}

/// A partial burst: the 40 MiB activation is still live when the cache is emptied, so only the free
/// 30 MiB segment goes; the model's `empty_cache` keeps the live one too.
#[test]
fn a_partial_burst_keeps_the_segments_that_hold_live_blocks() {
    let mut events = vec![
        entry("segment_alloc", A, 40 * MIB),
        alloc(A, 40 * MIB),
        entry("segment_alloc", B, 30 * MIB),
        alloc(B, 30 * MIB),
    ];
    events.extend(free(B, 30 * MIB));
    events.push(entry("segment_free", B, 30 * MIB));
    events.extend(free(A, 40 * MIB));
    let final_a = segment(A, 40 * MIB, false, vec![block(A, 40 * MIB, 0, "inactive")]);
    let path = write(
        "partial.pickle",
        &snapshot(vec![weights(), final_a], events, None),
    );
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 1, "{:?}", trace.ops);
    let report = fidelity(&path, None).unwrap();
    assert_eq!(report.ground_truth.segment_events, 3);
    assert_eq!(report.model.segment_events, 3);
    assert_eq!(report.segment_event_match, 1.0);
    assert_eq!(report.peak_reserved_error, 0.0);

    // Freeing the segment that holds the live block is no rule of PyTorch's: not an empty_cache.
    let mut events = vec![
        entry("segment_alloc", A, 40 * MIB),
        alloc(A, 40 * MIB),
        entry("segment_free", A, 40 * MIB),
    ];
    events.extend(free(A, 40 * MIB));
    let path = write("live.pickle", &snapshot(vec![weights()], events, None));
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 0, "{:?}", trace.ops);
}

/// Releases PyTorch makes on its own are not `empty_cache`: a burst followed by an `oom` entry, a burst
/// before a new segment for a request nothing freed could serve and the device could not have held
/// (out-of-memory retry), and with `garbage_collection_threshold` set, a burst of large segments before a
/// new segment (garbage collection). Without the threshold, the last one is `empty_cache`: the device
/// held more than that before, so the `cudaMalloc` needed no release.
#[test]
fn releases_pytorch_explains_are_not_empty_cache() {
    // An oom entry after the burst.
    let mut events = vec![entry("segment_alloc", A, 40 * MIB), alloc(A, 40 * MIB)];
    events.extend(free(A, 40 * MIB));
    events.push(entry("segment_free", A, 40 * MIB));
    events.push(entry("oom", 0, 100 * MIB));
    let path = write("oom.pickle", &snapshot(vec![weights()], events, None));
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 0, "{:?}", trace.ops);
    assert!(trace.oom_releases);
    assert_eq!(load::load(&path, None).unwrap()[0].empty_cache_count(), 0);

    // The retry of a 50 MiB request after 40 MiB were released: 20 + 40 + 50 MiB is more than the 70
    // MiB PyTorch ever held.
    let retry = |settings| {
        let mut events = vec![entry("segment_alloc", A, 40 * MIB), alloc(A, 40 * MIB)];
        events.extend(free(A, 40 * MIB));
        events.push(entry("segment_free", A, 40 * MIB));
        events.push(entry("segment_alloc", B, 50 * MIB));
        events.push(alloc(B, 50 * MIB));
        let final_b = segment(
            B,
            50 * MIB,
            false,
            vec![block(B, 50 * MIB, 50 * MIB, "active_allocated")],
        );
        snapshot(vec![weights(), final_b], events, settings)
    };
    let path = write("retry.pickle", &retry(None));
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 0, "{:?}", trace.ops);
    assert!(trace.oom_releases);
    let report = fidelity(&path, None).unwrap();
    assert_eq!(report.segment_event_match, 1.0);

    // A 50 MiB request after the free 40 MiB segment was released (the 30 MiB one is live), then 60 MiB
    // more: 20 + 40 + 30 + 50 MiB is within the 160 MiB PyTorch held later. `keep_b_free` frees the
    // 30 MiB block too, which the burst then leaves cached: no `empty_cache` would.
    let c = BASE + 256 * MIB;
    let e = BASE + 384 * MIB;
    let gc = |settings, keep_b_free: bool| {
        let mut events = vec![
            entry("segment_alloc", A, 40 * MIB),
            alloc(A, 40 * MIB),
            entry("segment_alloc", B, 30 * MIB),
            alloc(B, 30 * MIB),
        ];
        if keep_b_free {
            events.extend(free(B, 30 * MIB));
        }
        events.extend(free(A, 40 * MIB));
        events.push(entry("segment_free", A, 40 * MIB));
        events.push(entry("segment_alloc", c, 50 * MIB));
        events.push(alloc(c, 50 * MIB));
        events.push(entry("segment_alloc", e, 60 * MIB));
        events.push(alloc(e, 60 * MIB));
        let live = |addr, size| {
            segment(
                addr,
                size,
                false,
                vec![block(addr, size, size, "active_allocated")],
            )
        };
        let final_b = if keep_b_free {
            segment(B, 30 * MIB, false, vec![block(B, 30 * MIB, 0, "inactive")])
        } else {
            live(B, 30 * MIB)
        };
        snapshot(
            vec![weights(), final_b, live(c, 50 * MIB), live(e, 60 * MIB)],
            events,
            settings,
        )
    };
    let threshold = || Some(vec![("garbage_collection_threshold", V::F64(0.6))]);
    for keep_b_free in [false, true] {
        let path = write("gc.pickle", &gc(threshold(), keep_b_free));
        let trace = pytorch::load(&path, None).unwrap();
        assert_eq!(empty_caches(&trace.ops), 0, "{:?}", trace.ops);
        assert!(!trace.oom_releases);
    }
    // Without the threshold the burst that releases every free segment was `empty_cache`.
    let path = write("no_gc.pickle", &gc(None, false));
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 1, "{:?}", trace.ops);
    assert!(!trace.oom_releases);
    let report = fidelity(&path, None).unwrap();
    assert_eq!(report.ground_truth.segment_events, 5);
    assert_eq!(report.segment_event_match, 1.0);
    assert_eq!(report.peak_reserved_error, 0.0);
    // One that leaves a free segment cached is no rule of PyTorch's then.
    let path = write("no_gc_partial.pickle", &gc(None, true));
    let trace = pytorch::load(&path, None).unwrap();
    assert_eq!(empty_caches(&trace.ops), 0, "{:?}", trace.ops);
    assert!(!trace.oom_releases);
}

/// With expandable segments the cache is given back by unmapping: a burst of `segment_unmap` is
/// `empty_cache` by the same rule.
#[test]
fn an_expandable_segments_burst_of_unmaps_is_one_empty_cache() {
    // Three blocks mapped in turn; the middle one stays live, so the two free ones are unmapped apart,
    // smallest first, as PyTorch's `release_cached_blocks` goes through its pool.
    let mut events = vec![
        entry("segment_map", A, 40 * MIB),
        alloc(A, 40 * MIB),
        entry("segment_map", A + 40 * MIB, 20 * MIB),
        alloc(A + 40 * MIB, 20 * MIB),
        entry("segment_map", A + 60 * MIB, 20 * MIB),
        alloc(A + 60 * MIB, 20 * MIB),
    ];
    events.extend(free(A, 40 * MIB));
    events.extend(free(A + 60 * MIB, 20 * MIB));
    events.push(entry("segment_unmap", A + 60 * MIB, 20 * MIB));
    events.push(entry("segment_unmap", A, 40 * MIB));
    events.push(entry("segment_map", A, 40 * MIB));
    events.push(alloc(A, 40 * MIB));
    let final_a = segment(
        A,
        60 * MIB,
        true,
        vec![
            block(A, 40 * MIB, 40 * MIB, "active_allocated"),
            block(A + 40 * MIB, 20 * MIB, 20 * MIB, "active_allocated"),
        ],
    );
    let path = write(
        "expandable.pickle",
        &snapshot(
            vec![final_a],
            events,
            Some(vec![("expandable_segments", V::Bool(true))]),
        ),
    );
    let trace = pytorch::load(&path, None).unwrap();
    assert!(trace.expandable);
    assert_eq!(empty_caches(&trace.ops), 1, "{:?}", trace.ops);
    assert!(!trace.oom_releases);
    assert_eq!(load::load(&path, None).unwrap()[0].empty_cache_count(), 1);
    let report = fidelity(&path, None).unwrap();
    assert_eq!(report.mode, "pytorch-expandable");
    assert_eq!(report.ground_truth.segment_events, 6);
    assert_eq!(
        report.segment_event_match, 1.0,
        "{:?}",
        report.details.model_events
    );
    assert_eq!(report.peak_reserved_error, 0.0);
}

/// cuvmm's PyTorch models replay `batched-inference` (60 batches, `empty_cache` after each) with their
/// history on; the snapshot they write reads back with an `empty_cache` at each place the workload made
/// one, and the model reproduces its own segment events from it.
#[test]
fn every_empty_cache_of_a_workload_is_found_in_the_models_snapshot() {
    let source = workload::generate("batched-inference", workload::DEFAULT_SEED).unwrap();
    let made = source.empty_cache_count();
    assert!(made >= 10, "{made}");
    for allocator in ["classic", "pytorch-expandable"] {
        let mut strategy = allocators::build(allocator, 80 << 30, 2 << 20).unwrap();
        (strategy.snapshots().unwrap())
            .record_history(Some(usize::MAX))
            .unwrap();
        let result = replay(strategy.as_mut(), &source, &ReplayOptions::default()).unwrap();
        assert_eq!(result.ooms, 0);
        let path = write(&format!("{allocator}.pickle"), &V::None);
        let snapshot = strategy.snapshots().unwrap().snapshot().unwrap();
        writer::write_file(&path, &snapshot).unwrap();
        let trace = pytorch::load(&path, None).unwrap();
        assert_eq!(trace.expandable, allocator == "pytorch-expandable");
        assert_eq!(empty_caches(&trace.ops), made, "{allocator}");
        assert!(!trace.oom_releases, "{allocator}");
        let plain = &load::load(&path, None).unwrap()[0];
        assert_eq!(plain.empty_cache_count(), made, "{allocator}");
        // The same requests, in the same order, with the releases at the same places.
        let shape = |t: &cuvmm_lab::trace::Trace| -> Vec<u8> {
            t.events
                .iter()
                .map(|e| match e {
                    Event::Alloc { .. } => b'a',
                    Event::Free { .. } => b'f',
                    Event::RecordStream { .. } => b'r',
                    Event::EmptyCache => b'e',
                })
                .collect()
        };
        assert!(shape(plain) == shape(&source), "{allocator}");
        let report = fidelity(&path, None).unwrap();
        assert!(report.ground_truth.segment_events > 2 * made, "{allocator}");
        assert_eq!(report.segment_event_match, 1.0, "{allocator}");
        assert_eq!(report.peak_reserved_error, 0.0, "{allocator}");
    }
}

/// Every allocator replays `empty_cache` and pays for growing again after it: the same requests make more
/// driver calls with the cache emptied between them, and still need no more memory.
#[test]
fn every_allocator_grows_again_after_empty_cache() {
    let gib = 1 << 30;
    let trace = |empty: bool| {
        let mut t = cuvmm_lab::trace::Trace::new("t");
        let stream = cuvmm::driver::StreamId::DEFAULT;
        for (id, size) in [(0, gib), (1, 3 * gib / 2)] {
            t.events.push(Event::Alloc { id, size, stream });
            t.events.push(Event::Free { id });
            if empty {
                t.events.push(Event::EmptyCache);
            }
        }
        t
    };
    for name in allocators::ALLOCATORS {
        let run = |t: &cuvmm_lab::trace::Trace| {
            let mut strategy = allocators::build(name, 80 << 30, 2 << 20).unwrap();
            let options = ReplayOptions {
                check_invariants_every: Some(1),
                ..ReplayOptions::default()
            };
            let result = replay(strategy.as_mut(), t, &options).unwrap();
            (result, strategy.stats().reserved_bytes.current)
        };
        let (kept, kept_reserved) = run(&trace(false));
        let (emptied, emptied_reserved) = run(&trace(true));
        assert!(
            emptied.driver_calls.total() > kept.driver_calls.total(),
            "{name}: {:?} vs {:?}",
            emptied.driver_calls,
            kept.driver_calls
        );
        assert!(
            emptied.peak_reserved_bytes <= kept.peak_reserved_bytes,
            "{name}"
        );
        assert_eq!(
            emptied_reserved, 0,
            "{name}: the last empty_cache gave everything back"
        );
        assert!(kept_reserved > 0, "{name}");
    }
}
