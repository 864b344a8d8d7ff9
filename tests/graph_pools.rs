//! CUDA graph capture and private pools on the simulated device, which refuses what CUDA refuses during a
//! capture (an event query or synchronization of a capturing stream; in global mode such calls, and unmaps
//! and releases, from any thread) and counts every refusal.
//!
//! The scenarios are the failures seen with PyTorch on an H100 (issue 29), as the allocator sees them; the
//! property test interleaves captures with allocations, frees, `record_stream`, kernels and memory pressure
//! and checks after every step that no call was refused, no capture invalidated, no memory of a live pool
//! handed outside it, and that the segment events a trace tracker sees name each page's pool
//! (`harness/mapped_events.rs`).

mod common;
#[path = "harness/mapped_events.rs"]
mod mapped_events;

use common::{begin_capture, end_capture};
#[path = "graph_pools/model.rs"]
mod model;

use cuvmm::config::Compaction;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::snapshot::BlockState;
use cuvmm::strategy::{GraphPools, Peers, Snapshots, StreamUses};
use cuvmm::{Allocator, Config, Error, GraphPool, Strategy as _, StreamFilter, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;

const PAGE: u64 = 4096;
const PAGES: u64 = 32;
const ROUND: u64 = 512;

type Alloc = Expandable<SimDriver>;

fn new_alloc(config: Config) -> Alloc {
    common::expandable_with(
        PAGE,
        PAGES,
        Config {
            small_size: 1024,
            ..config
        },
        true,
    )
}

fn assert_capture_safe(a: &Alloc) {
    let d = a.driver();
    assert_eq!(
        d.capture_refusals(),
        0,
        "the allocator made a call CUDA refuses during capture"
    );
    assert_eq!(d.invalidated_captures(), 0, "a capture was invalidated");
}

fn overlaps(a: VaRange, b: VaRange) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

/// record_stream during a capture: a block read on a side stream, freed while the default stream captures.
/// Its free waits for no event during the capture (none may be queried) and its memory is not reused until
/// the side stream's work is done.
#[test]
fn a_free_of_a_block_used_on_another_stream_waits_until_the_capture_ends() {
    let mut a = new_alloc(Config::default());
    let (main, side, capture) = (StreamId(1), StreamId(2), StreamId(3));
    let x = a.alloc(8 * PAGE, main).unwrap();
    a.record_stream(x, side).unwrap();
    a.driver_mut()
        .launch(side, &[VaRange::new(x, 8 * PAGE)])
        .unwrap();
    let pool = GraphPool(1, 0);
    begin_capture(&mut a, capture, pool, CaptureMode::Global);
    a.free(x).unwrap();
    // Deferred: freed (no longer allocated, still active and waited for, as PyTorch's free counts it), and
    // not handed out again on its own stream.
    let stats = a.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (0, 8 * PAGE)
    );
    let snapshot = a.snapshot().unwrap();
    let state = (snapshot.segments.iter().flat_map(|s| &s.blocks)).find(|b| b.address == x);
    assert_eq!(state.map(|b| b.state), Some(BlockState::ActivePendingFree));
    let y = a.alloc(8 * PAGE, main).unwrap();
    assert!(!overlaps(
        VaRange::new(x, 8 * PAGE),
        VaRange::new(y, 8 * PAGE)
    ));
    assert!(
        matches!(a.free(x), Err(Error::DoubleFree { .. })),
        "a deferred free is a free"
    );
    a.check_invariants().unwrap();
    end_capture(&mut a, capture, pool);
    // Freed twice, or used again, before the deferred free ran: typed errors, and nothing breaks later.
    assert!(matches!(a.free(x), Err(Error::DoubleFree { .. })));
    assert!(matches!(
        a.record_stream(x, side),
        Err(Error::UnknownAddress { .. })
    ));
    a.check_invariants().unwrap();
    // After the capture the next allocation records the event; the side stream is still busy.
    let z = a.alloc(8 * PAGE, main).unwrap();
    assert!(!overlaps(
        VaRange::new(x, 8 * PAGE),
        VaRange::new(z, 8 * PAGE)
    ));
    assert_eq!(a.stats().active_bytes.current, 24 * PAGE, "x is pending");
    a.driver_mut().complete_stream(side);
    a.free(z).unwrap();
    let w = a.alloc(8 * PAGE, main).unwrap();
    assert_eq!(
        a.stats().active_bytes.current,
        16 * PAGE,
        "x's free completed"
    );
    a.check_invariants().unwrap();
    assert_capture_safe(&a);
    for addr in [y, w] {
        a.free(addr).unwrap();
    }
}

/// Two graphs captured back to back on one capture stream, each with its own pool: a temporary freed in the
/// first capture is not given to the second, and neither pool's memory goes anywhere else while it lives.
#[test]
fn graphs_captured_back_to_back_keep_their_memory_apart() {
    let mut a = new_alloc(Config::default());
    let capture = StreamId(5);
    let (g1, g2) = (GraphPool(1, 0), GraphPool(2, 0));
    begin_capture(&mut a, capture, g1, CaptureMode::Global);
    let t1 = a.alloc(3 * PAGE, capture).unwrap();
    let out1 = a.alloc(PAGE, capture).unwrap();
    a.free(t1).unwrap();
    end_capture(&mut a, capture, g1);
    begin_capture(&mut a, capture, g2, CaptureMode::Global);
    let t2 = a.alloc(3 * PAGE, capture).unwrap();
    a.free(t2).unwrap();
    end_capture(&mut a, capture, g2);
    assert!(!overlaps(
        VaRange::new(t1, 3 * PAGE),
        VaRange::new(t2, 3 * PAGE)
    ));
    // Eager work on the same stream gets neither pool's memory.
    let eager = a.alloc(3 * PAGE, capture).unwrap();
    for (addr, size) in [(t1, 3 * PAGE), (t2, 3 * PAGE), (out1, PAGE)] {
        assert!(!overlaps(
            VaRange::new(eager, 3 * PAGE),
            VaRange::new(addr, size)
        ));
    }
    // Pool memory shows: in the statistics, the snapshot, the summary.
    let stats = a.stats();
    assert_eq!(stats.graph_pools, 2);
    assert!(stats.graph_pool_bytes >= 4 * PAGE, "{stats:?}");
    let snapshot = a.snapshot().unwrap();
    assert!(snapshot.segments.iter().any(|s| s.graph_pool == g1));
    assert!(snapshot.segments.iter().any(|s| s.graph_pool == g2));
    a.check_invariants().unwrap();
    assert_capture_safe(&a);
}

/// Nothing of a live pool is unmapped, lent or compacted, even when memory runs short: a request that
/// could only be served by taking the pool's idle pages fails instead, and succeeds once the pool is
/// released.
#[test]
fn pressure_never_takes_a_live_pools_pages_and_a_released_pool_gives_them_back() {
    let mut a = new_alloc(Config::default());
    let capture = StreamId(7);
    let pool = GraphPool(0, 9);
    begin_capture(&mut a, capture, pool, CaptureMode::Global);
    let temp = a.alloc(20 * PAGE, capture).unwrap();
    a.driver_mut()
        .write(temp, &common::pattern(1, (20 * PAGE) as usize))
        .unwrap();
    a.free(temp).unwrap();
    end_capture(&mut a, capture, pool);
    // 20 of 32 pages are the pool's, idle: 16 pages elsewhere cannot be had without them.
    let err = a.alloc(16 * PAGE, StreamId(1)).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(
        err.to_string().contains("CUDA graphs' private pools"),
        "{err}"
    );
    let pages: Vec<u64> = (0..20).map(|p| temp + p * PAGE).collect();
    assert!(
        pages.iter().all(|&va| a.driver().is_accessible(va)),
        "a pool page was unmapped"
    );
    let kept = a.driver().read(temp, (20 * PAGE) as usize).unwrap();
    assert_eq!(
        kept,
        common::pattern(1, (20 * PAGE) as usize),
        "the graph's bytes moved"
    );
    a.empty_cache().unwrap();
    assert!(
        pages.iter().all(|&va| a.driver().is_accessible(va)),
        "empty_cache unmapped a pool page"
    );
    a.release_pool(pool).unwrap();
    let x = a.alloc(16 * PAGE, StreamId(1)).unwrap();
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(
        a.segments().is_empty(),
        "the released pool's segment was not freed"
    );
    assert_capture_safe(&a);
}

/// During a capture: no compaction, no release and retry (they wait and unmap), so an allocation that
/// needs them fails with out-of-memory rather than break the capture; empty_cache and trim are refused.
#[test]
fn during_a_capture_out_of_memory_is_reported_and_the_cache_is_left_alone() {
    let mut a = new_alloc(Config::default());
    let busy = StreamId(1);
    let x = a.alloc(24 * PAGE, busy).unwrap();
    a.free(x).unwrap();
    let capture = StreamId(2);
    let pool = GraphPool(3, 0);
    begin_capture(&mut a, capture, pool, CaptureMode::Global);
    let err = a.alloc(16 * PAGE, capture).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(err.to_string().contains("being captured"), "{err}");
    assert!(matches!(
        a.empty_cache(),
        Err(Error::CaptureUnderway { .. })
    ));
    assert!(matches!(a.trim(PAGE), Err(Error::CaptureUnderway { .. })));
    let small = a.alloc(4 * PAGE, capture).unwrap();
    a.check_invariants().unwrap();
    end_capture(&mut a, capture, pool);
    assert_capture_safe(&a);
    // After the capture the idle pages can be taken again.
    let y = a.alloc(16 * PAGE, busy).unwrap();
    a.free(y).unwrap();
    a.free(small).unwrap();
}

/// The pool operations refuse what makes no sense, with typed errors.
#[test]
fn pool_misuse_is_a_typed_error() {
    let mut a = new_alloc(Config::default());
    let pool = GraphPool(4, 0);
    let refused = |r: Result<(), Error>| matches!(r, Err(Error::GraphPool { .. }));
    assert!(refused(a.begin_allocate_to_pool(
        GraphPool::NONE,
        StreamFilter::Streams(vec![])
    )));
    assert!(refused(a.end_allocate_to_pool(pool)));
    assert!(refused(a.release_pool(pool)));
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![StreamId(1)]))
        .unwrap();
    assert!(refused(
        a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![]))
    ));
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
    assert!(refused(a.release_pool(pool)));
    a.check_invariants().unwrap();
}

/// A capture the allocator was not told of: with detection on (the facade's default), its allocations go
/// to a pool of their own, and nothing the capture forbids is called. Also through the facade's stream
/// caches: a buffer cached before the capture is not handed to it.
#[test]
fn a_capture_nobody_announced_gets_a_pool_of_its_own() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_granularity(PAGE)
            .with_capacity(PAGES * PAGE),
    );
    let config = Config {
        small_size: 1024,
        page_size: Some(PAGE),
        ..Config::default()
    };
    let alloc = Allocator::expandable(sim, config).unwrap();
    let s = StreamId(3);
    let before = alloc.alloc_on(512, s).unwrap();
    let old = before.ptr();
    drop(before);
    alloc.with_strategy(|a| {
        a.driver_mut()
            .begin_capture(s, CaptureMode::Global)
            .unwrap()
    });
    let inside = alloc.alloc_on(512, s).unwrap();
    assert_ne!(
        inside.ptr(),
        old,
        "a block of the common pool was baked into the graph"
    );
    let stats = alloc.stats();
    assert_eq!(stats.graph_pools, 1);
    alloc.with_strategy(|a| a.driver_mut().end_capture(s).unwrap());
    let inside_ptr = inside.ptr();
    drop(inside);
    let after = alloc.alloc_on(512, s).unwrap();
    assert_ne!(
        after.ptr(),
        inside_ptr,
        "the implicit pool's memory left it"
    );
    alloc.check_invariants().unwrap();
    alloc.with_strategy(|a| assert_capture_safe(a));
}

/// add_peer: every mapped range and every later one is accessible to the peer.
#[test]
fn a_peer_reaches_every_mapping_now_and_later() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_granularity(PAGE)
            .with_capacity(PAGES * PAGE)
            .with_devices(2),
    );
    let mut a = Expandable::new(
        sim,
        Config {
            page_size: Some(PAGE),
            ..Config::default()
        },
    )
    .unwrap();
    let x = a.alloc(3 * PAGE, StreamId(1)).unwrap();
    assert!(!a.driver().peer_access(x, 1));
    a.add_peer(1).unwrap();
    assert!((0..3).all(|p| a.driver().peer_access(x + p * PAGE, 1)));
    let y = a.alloc(5 * PAGE, StreamId(2)).unwrap();
    assert!((0..5).all(|p| a.driver().peer_access(y + p * PAGE, 1)));
    assert!(a.add_peer(5).is_err(), "a device the machine does not have");
    a.check_invariants().unwrap();
}
