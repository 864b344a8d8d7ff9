//! Driver calls that fail *after* they took effect (`AfterEffect`), one kind at a time, on cuvmm's
//! allocator: the call that saw the failure may fail, but the allocator's page map and counters still say
//! what the device holds, later requests are served with memory that is really there, and at the end
//! nothing leaks. Each of the first five failed before `src/expandable/settle.rs`; `tests/fault_sweep.rs`
//! sweeps every call of random sequences the same way.

use cuvmm::config::Compaction;
use cuvmm::driver::after_effect::AfterEffect;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{DriverError, Op, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::StreamUses;
use cuvmm::{Config, Error, Strategy, StreamId};

const PAGE: u64 = 1 << 16;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

type Alloc = Expandable<AfterEffect<SimDriver>>;

/// cuvmm on a 32-page simulated device with a byte store, behind the after-effect wrapper.
fn allocator() -> Alloc {
    allocator_with(Compaction::Pressure)
}

/// The same allocator with `compaction` (`Eager` borrows another stream's cached block at once, which is the
/// path that asks, by an event, whether that stream is idle).
fn allocator_with(compaction: Compaction) -> Alloc {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(32 * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let config = Config {
        small_size: 1024,
        ..Config::default().with_compaction(compaction)
    };
    Expandable::new(AfterEffect::new(sim), config).unwrap()
}

fn sim(a: &Alloc) -> &SimDriver {
    a.driver().inner()
}

/// Invariants hold and `reserved_bytes` is what the device holds.
fn assert_consistent(a: &Alloc) {
    a.check_invariants().expect("invariants hold");
    assert_eq!(a.stats().reserved_bytes.current, sim(a).used_bytes());
}

/// `size` bytes on `stream` are served, and every page of them holds what is written there.
fn assert_serves(a: &mut Alloc, size: u64, stream: StreamId) -> u64 {
    let addr = a.alloc(size, stream).expect("the next request is served");
    for offset in (0..size).step_by(PAGE as usize) {
        let bytes = (addr + offset).to_le_bytes();
        let sim = a.driver_mut().inner_mut();
        sim.write(addr + offset, &bytes)
            .unwrap_or_else(|e| panic!("page at +{offset} is not backed: {e}"));
        assert_eq!(sim.read(addr + offset, 8).unwrap(), bytes);
    }
    assert_consistent(a);
    addr
}

/// Frees `live`, empties the cache, and checks that the device holds nothing.
fn assert_gives_everything_back(mut a: Alloc, live: &[u64]) {
    for &addr in live {
        a.free(addr).unwrap();
    }
    a.empty_cache().expect("empty_cache");
    assert_consistent(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert_eq!(sim(&a).live_events(), 0, "events left undestroyed");
    let leaks = sim(&a).leak_report();
    assert!(leaks.is_empty(), "{leaks}");
}

fn is_injected(err: &Error, op: Op) -> bool {
    matches!(err, Error::Driver(DriverError::Injected { op: o, .. }) if *o == op)
}

/// A block used on `S1` too, freed: parked until the event recorded on `S1` completes. `S1`'s work is
/// then completed, so the next poll finds the event complete and destroys it.
fn park_and_complete(a: &mut Alloc) {
    let x = a.alloc(4 * PAGE, S0).unwrap();
    (a.driver_mut().inner_mut())
        .launch(S1, &[VaRange::new(x, 4 * PAGE)])
        .unwrap();
    a.record_stream(x, S1).unwrap();
    a.free(x).unwrap();
    assert_eq!(sim(a).live_events(), 1);
    a.driver_mut().inner_mut().complete_stream(S1);
}

/// The regression of issue 15: the destroy of a completed event fails after destroying it. The request
/// that polled it reports the failure; every later one is served (before, each failed with
/// `UnknownEvent`, because the event stayed queued and was queried again).
#[test]
fn an_event_destroyed_by_a_failing_destroy_does_not_fail_later_requests() {
    let mut a = allocator();
    park_and_complete(&mut a);
    a.driver_mut().fail_nth_after_effect(Op::DestroyEvent, 1);
    let err = a.alloc(PAGE, S0).unwrap_err();
    assert!(is_injected(&err, Op::DestroyEvent), "{err:?}");
    assert_consistent(&a);
    assert_eq!(sim(&a).live_events(), 0, "the failing destroy destroyed it");
    assert_eq!(
        a.stats().active_bytes.current,
        0,
        "the block was freed: its event completed"
    );
    let live: Vec<u64> = (0..4).map(|_| assert_serves(&mut a, PAGE, S0)).collect();
    assert_gives_everything_back(a, &live);
}

/// The same on the path that asks whether another stream is idle (borrowing a cached block): the event
/// kept after its failing destroy is destroyed again at the next poll, where `UnknownEvent` says the first
/// destroy had worked (before, that error failed every later request).
#[test]
fn an_event_kept_after_a_failing_destroy_that_worked_is_forgotten_at_the_next_poll() {
    let mut a = allocator_with(Compaction::Eager);
    let own = a.alloc(4 * PAGE, S0).unwrap();
    let fence = a.alloc(PAGE, S0).unwrap();
    a.free(own).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::DestroyEvent, 1);
    let err = a.alloc(4 * PAGE, S1).unwrap_err();
    assert!(is_injected(&err, Op::DestroyEvent), "{err:?}");
    assert_eq!(sim(&a).live_events(), 0);
    let live: Vec<u64> = (0..3).map(|_| assert_serves(&mut a, PAGE, S1)).collect();
    assert_gives_everything_back(a, &[live, vec![fence]].concat());
}

/// A release that released and then failed: the handle is booked as released (before, it stayed in the
/// pool, counted in `reserved_bytes`, and every map it was given to failed with `UnknownHandle`).
#[test]
fn a_handle_released_by_a_failing_release_is_not_kept() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.free(x).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::Release, 2);
    a.empty_cache()
        .expect("the release is settled: the handle is gone");
    assert_consistent(&a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    let y = assert_serves(&mut a, 4 * PAGE, S0);
    assert_gives_everything_back(a, &[y]);
}

/// An unmap that unmapped and then failed: the pages are booked as unmapped (before, the page map kept them
/// mapped and idle, and the next block there was handed out on unmapped memory).
#[test]
fn pages_unmapped_by_a_failing_unmap_are_not_handed_out_unbacked() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.free(x).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::Unmap, 1);
    a.trim(4 * PAGE)
        .expect("the unmap is settled: the pages are unmapped");
    assert_consistent(&a);
    assert_eq!(sim(&a).mapping_count(), 0);
    let y = assert_serves(&mut a, 4 * PAGE, S0);
    assert_gives_everything_back(a, &[y]);
}

/// A map that mapped and then failed, half way through a growth: undone, so the request after it maps
/// the same pages (before, the page stayed mapped behind the allocator's back and every map there failed
/// with `AlreadyMapped`).
#[test]
fn a_page_mapped_by_a_failing_map_is_unmapped_again() {
    let mut a = allocator();
    a.driver_mut().fail_nth_after_effect(Op::Map, 2);
    let err = a.alloc(3 * PAGE, S0).unwrap_err();
    assert!(is_injected(&err, Op::Map), "{err:?}");
    assert_consistent(&a);
    assert_eq!(
        sim(&a).mapping_count() as u64 * PAGE,
        a.stats().reserved_bytes.current - a.stats().idle_handle_bytes,
        "the device maps what the page map says"
    );
    let y = assert_serves(&mut a, 3 * PAGE, S0);
    assert_gives_everything_back(a, &[y]);
}

/// A reservation freed by a failing `free_reservation`: its segment is dropped (before, it was kept and
/// every later request placed in it failed to map, outside any reservation).
#[test]
fn a_reservation_freed_by_a_failing_free_is_not_used_again() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.free(x).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::FreeReservation, 1);
    a.empty_cache().expect("the free is settled");
    assert_eq!(sim(&a).reservation_count(), 0);
    assert_eq!(a.stats().segment.current, 0);
    let y = assert_serves(&mut a, 4 * PAGE, S0);
    assert_gives_everything_back(a, &[y]);
}

/// After a failure that needs nothing settled, the allocator serves the next request and gives
/// everything back.
fn assert_goes_on(mut a: Alloc, mut live: Vec<u64>) {
    assert_consistent(&a);
    live.push(assert_serves(&mut a, 8 * PAGE, S0));
    assert_gives_everything_back(a, &live);
}

// The calls whose failure after their effect needs nothing from the allocator: a creating call leaves
// nothing (the driver gives it back), and repeating `set_access`, `synchronize` or an event query is
// harmless. Each fails the operation it happens in, and the allocator goes on.

#[test]
fn a_failing_reserve_or_create_leaves_nothing() {
    for op in [Op::Reserve, Op::Create] {
        let mut a = allocator();
        a.driver_mut().fail_nth_after_effect(op, 1);
        let err = a.alloc(4 * PAGE, S0).unwrap_err();
        assert!(is_injected(&err, op), "{op}: {err:?}");
        assert_eq!(sim(&a).used_bytes(), 0, "{op}");
        assert_goes_on(a, vec![]);
    }
}

#[test]
fn a_failing_set_access_that_worked_is_repeated_by_the_next_request() {
    let mut a = allocator();
    a.driver_mut().fail_nth_after_effect(Op::SetAccess, 1);
    let err = a.alloc(4 * PAGE, S0).unwrap_err();
    assert!(is_injected(&err, Op::SetAccess), "{err:?}");
    assert_goes_on(a, vec![]);
}

#[test]
fn a_failing_event_record_leaves_no_event_and_the_block_live() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.record_stream(x, S1).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::RecordEvent, 1);
    let err = a.free(x).unwrap_err();
    assert!(is_injected(&err, Op::RecordEvent), "{err:?}");
    assert_eq!(sim(&a).live_events(), 0, "the event was given back");
    assert_goes_on(a, vec![x]);
}

#[test]
fn a_failing_event_query_keeps_the_event_queued() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.record_stream(x, S1).unwrap();
    a.free(x).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::QueryEvent, 1);
    let err = a.alloc(PAGE, S0).unwrap_err();
    assert!(is_injected(&err, Op::QueryEvent), "{err:?}");
    assert_eq!(sim(&a).live_events(), 1, "queried again at the next poll");
    assert_goes_on(a, vec![]);
}

#[test]
fn a_failing_synchronize_keeps_the_pages_mapped() {
    let mut a = allocator();
    let x = a.alloc(4 * PAGE, S0).unwrap();
    a.free(x).unwrap();
    a.driver_mut().fail_nth_after_effect(Op::Synchronize, 1);
    let err = a.trim(4 * PAGE).unwrap_err();
    assert!(is_injected(&err, Op::Synchronize), "{err:?}");
    assert_eq!(sim(&a).mapping_count(), 4);
    assert_goes_on(a, vec![]);
}
