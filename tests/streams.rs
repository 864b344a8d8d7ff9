//! Streams in the expandable allocator, path by path: record_stream, frees parked until events complete,
//! draining on empty_cache and under memory pressure, unmapping that waits for the owning stream, and
//! borrowing free blocks across streams.

mod common;

use cuvmm::config::Compaction;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::driver::{Op, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::snapshot::BlockState;
use cuvmm::strategy::{Snapshots as _, StreamUses};
use cuvmm::{Allocator, Config, Error, Strategy, StreamId};

const PAGE: u64 = 1 << 16;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

/// A simulated device of `pages` pages.
fn device(pages: u64) -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(pages * PAGE)
            .with_granularity(PAGE),
    )
}

/// An allocator on a device of `pages` pages, with a backing store, configured by `config`.
fn allocator(pages: u64, config: Config) -> Expandable<SimDriver> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(pages * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    Expandable::new(
        sim,
        Config {
            small_size: 1024,
            ..config
        },
    )
    .unwrap()
}

/// `compaction:eager`: single-page handles, and cross-stream borrowing whether or not memory is short.
fn eager() -> Config {
    Config::default().with_compaction(Compaction::Eager)
}

fn range(addr: u64, size: u64) -> VaRange {
    VaRange::new(addr, size)
}

/// Frees everything given, empties the cache, and checks that the device holds nothing.
fn finish(mut alloc: Expandable<SimDriver>, live: &[u64]) {
    for &addr in live {
        alloc.free(addr).unwrap();
    }
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    assert_eq!(
        (stats.active_bytes.current, stats.reserved_bytes.current),
        (0, 0)
    );
    assert!(alloc.driver().leak_report().is_empty());
}

#[test]
fn a_block_used_on_another_stream_is_reused_only_after_its_event() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(4 * PAGE, S0).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(a, 4 * PAGE)])
        .unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.free(a).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(
        stats.active_bytes.current,
        4 * PAGE,
        "pending bytes stay active"
    );
    assert_eq!(
        stats.requested_bytes.current,
        4 * PAGE,
        "and requested, as PyTorch's (its free_block)"
    );
    let snapshot = alloc.snapshot().unwrap();
    let pending = (snapshot.segments.iter().flat_map(|s| &s.blocks)).find(|b| b.address == a);
    assert_eq!(
        pending.map(|b| (b.state, b.requested_size)),
        Some((BlockState::ActivePendingFree, 4 * PAGE))
    );
    assert_eq!(alloc.driver().pending_events(S1), 1);
    alloc.check_invariants().unwrap();

    // The work on S1 has not run: the same request must get other memory.
    let b = alloc.alloc(4 * PAGE, S0).unwrap();
    assert!(
        b >= a + 4 * PAGE || b + 4 * PAGE <= a,
        "handed out a pending block"
    );
    alloc.free(b).unwrap();
    assert_eq!(
        alloc.free(a).unwrap_err().to_string(),
        Error::DoubleFree { addr: a }.to_string()
    );

    // Once S1 ran, the next allocation polls the event and the block is free again.
    alloc.driver_mut().advance(S1, 1);
    let c = alloc.alloc(4 * PAGE, S0).unwrap();
    assert_eq!(c, a, "the block came back");
    assert_eq!(alloc.driver().pending_events(S1), 0);
    assert_eq!(alloc.stats().active_bytes.current, 4 * PAGE);
    alloc.check_invariants().unwrap();
    finish(alloc, &[c]);
}

#[test]
fn record_stream_on_the_own_stream_changes_nothing() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(PAGE, S1).unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(alloc.stats().active_bytes.current, 0);
    assert_eq!(alloc.driver_counters().get(Op::RecordEvent), 0);
    finish(alloc, &[]);
}

#[test]
fn record_stream_needs_a_live_block_start() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(2 * PAGE, S0).unwrap();
    for bad in [a + 512, a + 2 * PAGE, 0x10] {
        assert!(
            matches!(alloc.record_stream(bad, S1), Err(Error::UnknownAddress { addr }) if addr == bad),
            "{bad:#x}"
        );
    }
    // Twice the same stream is recorded once: one event at the free.
    alloc.record_stream(a, S1).unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.record_stream(a, S2).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(alloc.driver_counters().get(Op::RecordEvent), 2);
    assert!(matches!(
        alloc.record_stream(a, S1),
        Err(Error::UnknownAddress { .. })
    ));
    alloc.check_invariants().unwrap();
    finish(alloc, &[]);
}

#[test]
fn a_block_waits_for_every_stream_that_used_it() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(3 * PAGE, S0).unwrap();
    for s in [S1, S2] {
        alloc.driver_mut().launch(s, &[range(a, PAGE)]).unwrap();
        alloc.record_stream(a, s).unwrap();
    }
    alloc.free(a).unwrap();
    alloc.driver_mut().advance(S1, 1);
    let b = alloc.alloc(3 * PAGE, S0).unwrap();
    assert_ne!(b, a, "S2 has not finished");
    alloc.driver_mut().advance(S2, 1);
    let c = alloc.alloc(3 * PAGE, S0).unwrap();
    assert_eq!(c, a);
    finish(alloc, &[b, c]);
}

#[test]
fn a_parked_free_is_traced_with_its_requested_bytes_when_it_completes() {
    use cuvmm::history::TraceAction::{self, FreeCompleted, FreeRequested};
    // PyTorch's free_block records FREE_COMPLETED with the block's requested size, whether the free completed
    // at once or after the events of the streams that used the block.
    let mut alloc = allocator(16, Config::default());
    alloc.record_history(Some(64)).unwrap();
    let frees = |alloc: &Expandable<SimDriver>| -> Vec<(TraceAction, u64, u64)> {
        let traces = alloc.snapshot().unwrap().device_traces.concat();
        (traces.iter())
            .filter(|t| matches!(t.action, FreeRequested | FreeCompleted))
            .map(|t| (t.action, t.addr, t.size))
            .collect()
    };
    let requested = 3 * PAGE + 1000;
    let now = alloc.alloc(requested, S0).unwrap();
    alloc.free(now).unwrap();
    let parked = alloc.alloc(requested, S0).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(parked, 4 * PAGE)])
        .unwrap();
    alloc.record_stream(parked, S1).unwrap();
    alloc.free(parked).unwrap();
    assert_eq!(
        frees(&alloc),
        [
            (FreeRequested, now, requested),
            (FreeCompleted, now, requested),
            (FreeRequested, parked, requested),
        ]
    );
    alloc.driver_mut().advance(S1, 1);
    alloc.empty_cache().unwrap();
    assert_eq!(
        frees(&alloc)[3..],
        [(FreeCompleted, parked, requested)],
        "completed after its event, with the bytes asked for"
    );
    finish(alloc, &[]);
}

#[test]
fn empty_cache_synchronizes_pending_streams_and_frees_everything() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(5 * PAGE, S0).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(a, 5 * PAGE)])
        .unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.free(a).unwrap();
    let syncs = alloc.stats().num_synchronizations;
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.driver().pending_work(S1), 0);
    assert!(alloc.stats().num_synchronizations > syncs);
    assert_eq!(alloc.stats().active_bytes.current, 0);
    assert_eq!(alloc.stats().reserved_bytes.current, 0);
    finish(alloc, &[]);
}

#[test]
fn trim_releases_what_is_idle_now_and_does_not_wait() {
    let mut alloc = allocator(16, eager());
    let a = alloc.alloc(4 * PAGE, S0).unwrap();
    alloc.driver_mut().launch(S1, &[range(a, PAGE)]).unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(
        alloc.trim(u64::MAX).unwrap(),
        0,
        "pending pages are not idle"
    );
    assert_eq!(
        alloc.driver().pending_work(S1),
        1,
        "trim does not synchronize"
    );
    alloc.driver_mut().advance(S1, 1);
    // The next allocation polls the event: the block is free, its pages idle.
    let b = alloc.alloc(512, S0).unwrap();
    assert_eq!(alloc.trim(u64::MAX).unwrap(), 3 * PAGE);
    finish(alloc, &[b]);
}

#[test]
fn out_of_memory_drains_pending_frees_before_giving_up() {
    let mut alloc = allocator(8, Config::default());
    let a = alloc.alloc(6 * PAGE, S0).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(a, 6 * PAGE)])
        .unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.free(a).unwrap();
    // Only 2 pages are free on the device; the 6 pending ones must be waited for and reused.
    let b = alloc.alloc(7 * PAGE, S2).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(alloc.driver().pending_work(S1), 0);
    alloc.check_invariants().unwrap();
    finish(alloc, &[b]);
}

#[test]
fn idle_pages_are_unmapped_only_after_their_stream_finished() {
    let mut alloc = allocator(8, Config::default());
    let a = alloc.alloc(6 * PAGE, S0).unwrap();
    alloc.driver_mut().write(a, b"in flight").unwrap();
    // S0 still has a kernel on `a` queued when the program frees it (stream-ordered: no event needed).
    alloc
        .driver_mut()
        .launch(S0, &[range(a, 6 * PAGE)])
        .unwrap();
    alloc.free(a).unwrap();
    let syncs = alloc.stats().num_synchronizations;
    // S2 needs pages: the idle ones are moved, after S0 is synchronized (the device refuses otherwise).
    let b = alloc.alloc(6 * PAGE, S2).unwrap();
    assert_eq!(alloc.driver().pending_work(S0), 0);
    assert!(alloc.stats().num_synchronizations > syncs);
    assert_eq!(
        alloc.stats().num_device_alloc,
        6,
        "the idle pages were reused"
    );
    finish(alloc, &[b]);
}

#[test]
fn a_failed_event_record_leaves_the_block_live() {
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(2 * PAGE, S0).unwrap();
    alloc.record_stream(a, S1).unwrap();
    alloc.record_stream(a, S2).unwrap();
    alloc
        .driver_mut()
        .fail_nth(Op::RecordEvent, 2, FaultKind::Error);
    assert!(matches!(alloc.free(a), Err(Error::Driver(_))));
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 2 * PAGE);
    assert_eq!(
        alloc.driver().pending_events(S1),
        0,
        "the first event was destroyed"
    );
    alloc.free(a).unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    assert_eq!(alloc.stats().active_bytes.current, 2 * PAGE);
    alloc.check_invariants().unwrap();
    finish(alloc, &[]);
}

#[test]
fn dropping_the_allocator_waits_for_streams_with_pending_work() {
    let mut sim = device(16);
    {
        let mut alloc = Expandable::new(&mut sim, Config::default()).unwrap();
        let a = alloc.alloc(2 * PAGE, S0).unwrap();
        let b = alloc.alloc(2 * PAGE, S0).unwrap();
        alloc
            .driver_mut()
            .launch(S1, &[range(a, 1), range(b, 1)])
            .unwrap();
        alloc.record_stream(a, S1).unwrap();
        alloc.record_stream(b, S1).unwrap();
        alloc.free(a).unwrap();
        assert_eq!(alloc.stats().active_bytes.current, 4 * PAGE);
        // `b` is still live with a use on S1 and `a` pending: teardown must not unmap under S1's work.
    }
    assert_eq!(sim.pending_work(S1), 0);
    let leaks = sim.leak_report();
    assert!(leaks.is_empty(), "{leaks}");
}

#[test]
fn device_buffers_record_streams() {
    let alloc = Allocator::expandable(device(16), Config::default()).unwrap();
    let buffer = alloc.alloc_on(3 * PAGE, S0).unwrap();
    let addr = buffer.ptr();
    alloc.with_strategy(|s| s.driver_mut().launch(S1, &[range(addr, PAGE)]).unwrap());
    buffer.record_stream(S1).unwrap();
    drop(buffer);
    let stats = alloc.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (0, 3 * PAGE)
    );
    alloc.with_strategy(|s| s.driver_mut().complete_stream(S1));
    let again = alloc.alloc_on(3 * PAGE, S0).unwrap();
    assert_eq!(again.ptr(), addr);
    drop(again);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    assert!(alloc.take_deferred_errors().is_empty());
}

/// The stream whose segment holds `addr`.
fn segment_stream(alloc: &Expandable<SimDriver>, addr: u64) -> StreamId {
    alloc
        .segments()
        .into_iter()
        .find(|(va, ..)| va.contains(addr))
        .map(|(_, stream, _)| stream)
        .expect("address in a segment")
}

#[test]
fn with_cross_stream_reuse_an_idle_streams_free_block_serves_another_stream() {
    let mut alloc = allocator(16, eager().with_cross_stream_reuse(true));
    let a = alloc.alloc(4 * PAGE, S1).unwrap();
    let guard = alloc.alloc(PAGE, S1).unwrap();
    alloc.free(a).unwrap();
    let calls = alloc.driver_counters();
    let b = alloc.alloc(4 * PAGE, S2).unwrap();
    assert_eq!(b, a, "S1 is idle: its cached free block is borrowed");
    let after = alloc.driver_counters();
    for op in [
        Op::Create,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::Synchronize,
    ] {
        assert_eq!(after.get(op), calls.get(op), "{op} called");
    }
    assert_eq!(segment_stream(&alloc, b), S1);
    alloc.check_invariants().unwrap();

    // S2 still has work on the borrowed block when it is freed: S1 may not reuse it before that work ran.
    alloc.driver_mut().launch(S2, &[range(b, PAGE)]).unwrap();
    alloc.free(b).unwrap();
    let stats = alloc.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (PAGE, 5 * PAGE),
        "the guard is allocated, the borrowed block pending"
    );
    let c = alloc.alloc(4 * PAGE, S1).unwrap();
    assert_ne!(c, a);
    alloc.driver_mut().advance(S2, 1);
    let d = alloc.alloc(4 * PAGE, S1).unwrap();
    assert_eq!(d, a, "back to its own stream once S2 finished");
    finish(alloc, &[c, d, guard]);
}

#[test]
fn the_unmapped_frontier_of_another_streams_segment_is_not_borrowed() {
    let mut alloc = allocator(16, eager().with_cross_stream_reuse(true));
    let a = alloc.alloc(4 * PAGE, S1).unwrap();
    // Freed, `a` merges with the rest of S1's reservation: a free block mostly unmapped, whose first four
    // pages are idle. Those may be borrowed, with no driver call; the unmapped rest may not.
    alloc.free(a).unwrap();
    let maps = alloc.driver_counters().get(Op::Map);
    let b = alloc.alloc(4 * PAGE, S2).unwrap();
    assert_eq!((b, segment_stream(&alloc, b)), (a, S1));
    assert_eq!(alloc.driver_counters().get(Op::Map), maps);
    let c = alloc.alloc(PAGE, S2).unwrap();
    assert_eq!(segment_stream(&alloc, c), S2);
    alloc.check_invariants().unwrap();
    finish(alloc, &[b, c]);
}

#[test]
fn a_busy_streams_free_blocks_are_not_borrowed() {
    let mut alloc = allocator(16, eager().with_cross_stream_reuse(true));
    let a = alloc.alloc(4 * PAGE, S1).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(a, 4 * PAGE)])
        .unwrap();
    alloc.free(a).unwrap();
    let b = alloc.alloc(4 * PAGE, S2).unwrap();
    assert_eq!(segment_stream(&alloc, b), S2, "S1 still has queued work");
    finish(alloc, &[b]);
}

#[test]
fn a_busy_streams_better_fit_gives_way_to_an_idle_streams_block() {
    let mut alloc = allocator(32, eager().with_cross_stream_reuse(true));
    // S1's cached block fits 4 pages best but S1 is busy; S0's larger cached block is borrowed instead.
    let a = alloc.alloc(4 * PAGE, S1).unwrap();
    let a_guard = alloc.alloc(PAGE, S1).unwrap();
    let c = alloc.alloc(6 * PAGE, S0).unwrap();
    let c_guard = alloc.alloc(PAGE, S0).unwrap();
    alloc
        .driver_mut()
        .launch(S1, &[range(a, 4 * PAGE)])
        .unwrap();
    alloc.free(a).unwrap();
    alloc.free(c).unwrap();
    let events = alloc.driver_counters().get(Op::RecordEvent);
    let b = alloc.alloc(4 * PAGE, S2).unwrap();
    assert_eq!((b, segment_stream(&alloc, b)), (c, S0));
    assert_eq!(
        alloc.driver_counters().get(Op::RecordEvent) - events,
        2,
        "each stream is checked once"
    );
    alloc.check_invariants().unwrap();
    finish(alloc, &[b, a_guard, c_guard]);
}

#[test]
fn without_cross_stream_reuse_blocks_stay_in_their_streams_segments() {
    let mut alloc = allocator(16, Config::default().with_cross_stream_reuse(false));
    let a = alloc.alloc(4 * PAGE, S1).unwrap();
    let guard = alloc.alloc(PAGE, S1).unwrap();
    alloc.free(a).unwrap();
    let b = alloc.alloc(4 * PAGE, S2).unwrap();
    assert_eq!(segment_stream(&alloc, b), S2);
    assert_eq!(alloc.driver_counters().get(Op::RecordEvent), 0);
    finish(alloc, &[b, guard]);
}

#[test]
fn dropping_the_allocator_after_its_streams_were_destroyed_names_none_of_them() {
    let (sa, sb) = (StreamId(21), StreamId(22));
    let mut sim = device(16);
    {
        let mut alloc = Expandable::new(&mut sim, Config::default()).unwrap();
        let a = alloc.alloc(2 * PAGE, sa).unwrap();
        let b = alloc.alloc(2 * PAGE, sa).unwrap();
        let c = alloc.alloc(PAGE, sb).unwrap();
        let work = [range(a, 1), range(b, 1), range(c, 1)];
        alloc.driver_mut().launch(sb, &work).unwrap();
        alloc.driver_mut().launch(sa, &work[..2]).unwrap();
        alloc.record_stream(a, sb).unwrap();
        alloc.record_stream(b, sb).unwrap();
        alloc.free(a).unwrap();
        alloc.free(c).unwrap();
        // A program drops its streams before the allocator (Rust drops a stream made after it first), with
        // work still queued on them: the allocator's drop must wait for that work without naming them.
        assert!(alloc.driver_mut().destroy_stream(sa));
        assert!(alloc.driver_mut().destroy_stream(sb));
        alloc.check_invariants().unwrap();
    }
    assert_eq!((sim.pending_work(sa), sim.pending_work(sb)), (0, 0));
    let leaks = sim.leak_report();
    assert!(leaks.is_empty(), "{leaks}");
    assert_eq!(sim.live_events(), 0, "every event destroyed");
}

#[test]
fn empty_cache_after_the_streams_were_destroyed_names_none_of_them() {
    let (sa, sb) = (StreamId(31), StreamId(32));
    let mut alloc = allocator(16, Config::default());
    let a = alloc.alloc(2 * PAGE, sa).unwrap();
    let b = alloc.alloc(PAGE, sb).unwrap();
    let work = [range(a, 1), range(b, 1)];
    alloc.driver_mut().launch(sb, &work).unwrap();
    alloc.driver_mut().launch(sa, &work[..1]).unwrap();
    alloc.record_stream(a, sb).unwrap();
    alloc.free(a).unwrap();
    alloc.free(b).unwrap();
    // Threads that made their own streams have ended: their freed memory is cached, a free is parked behind
    // an event, and work is still queued on both destroyed streams.
    assert!(alloc.driver_mut().destroy_stream(sa));
    assert!(alloc.driver_mut().destroy_stream(sb));
    assert_eq!(alloc.stats().active_bytes.current, 2 * PAGE);
    alloc.empty_cache().unwrap();
    let sim = alloc.driver();
    assert_eq!((sim.pending_work(sa), sim.pending_work(sb)), (0, 0));
    assert_eq!(
        alloc.stats().num_synchronizations,
        1,
        "one wait, for the device"
    );
    finish(alloc, &[]);
}
