//! Regression tests for what the fault sweep (`tests/fault_sweep.rs`) and the `split_ops` fuzz target
//! found: each failed before its fix. A driver call that fails must leave the allocator consistent
//! (`check_invariants()`, `reserved_bytes` equal to what the device holds), and what it could not give
//! back must be given back by a later `empty_cache`, so the device ends with nothing leaked.

use cuvmm::config::Config;
use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::DeviceBytes;
use cuvmm::{Error, Strategy, StreamId};
use cuvmm_lab::pytorch_model::{SegmentAction, Split};

const MIB: u64 = 1 << 20;
/// Three of the model's 20 MiB large pages.
const THREE_PAGES: u64 = 50 * MIB;

/// PyTorch's expandable segments (or the classic model) on a 256 MiB device with the byte store on.
fn split(expandable: bool) -> Split<SimDriver> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(256 * MIB)
            .with_granularity(2 * MIB)
            .with_backing_store(true),
    );
    let config = Config {
        expandable_segments: expandable,
        ..Config::default()
    };
    Split::new(sim, config).expect("valid configuration")
}

/// The allocator is consistent and holds exactly what the device says it holds.
fn assert_consistent(a: &Split<SimDriver>) {
    a.check_invariants().expect("invariants hold");
    assert_eq!(a.stats().reserved_bytes.current, a.driver().used_bytes());
}

/// Frees nothing more, empties the cache and checks that the device holds nothing.
fn assert_gives_everything_back(a: &mut Split<SimDriver>) {
    a.empty_cache().expect("empty_cache without faults");
    assert_consistent(a);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(a.segments().is_empty(), "{:?}", a.segments());
    let leaks = a.driver().leak_report();
    assert!(leaks.is_empty(), "{leaks}");
}

/// A new allocation of three pages works and holds its bytes.
fn assert_serves(a: &mut Split<SimDriver>) {
    let addr = a.alloc(THREE_PAGES, StreamId(0)).expect("the next request");
    a.memset(addr, THREE_PAGES, 0xab).expect("memset");
    let mut out = [0u8; 64];
    a.copy_to_host(addr + THREE_PAGES - 64, &mut out)
        .expect("read back");
    assert!(out.iter().all(|&b| b == 0xab));
    a.free(addr).expect("free");
    assert_consistent(a);
}

#[test]
fn a_map_failing_halfway_through_a_growth_gives_every_page_back() {
    let mut a = split(true);
    a.driver_mut().fail_nth(Op::Map, 2, FaultKind::Error);
    let err = a.alloc(THREE_PAGES, StreamId(0)).unwrap_err();
    assert!(matches!(err, Error::Driver(_)), "{err:?}");
    assert_consistent(&a);
    assert_eq!(a.driver().used_bytes(), 0, "created handles were kept");
    assert_eq!(
        a.driver().mapping_count(),
        0,
        "the first page stayed mapped"
    );
    assert_serves(&mut a);
    assert_gives_everything_back(&mut a);
}

#[test]
fn a_failed_set_access_unmaps_the_growth() {
    let mut a = split(true);
    a.driver_mut().fail_nth(Op::SetAccess, 1, FaultKind::Error);
    assert!(a.alloc(THREE_PAGES, StreamId(0)).is_err());
    assert_consistent(&a);
    assert_eq!(a.driver().mapping_count(), 0);
    assert_serves(&mut a);
    assert_gives_everything_back(&mut a);
}

#[test]
fn an_unmap_failing_part_way_books_the_pages_already_unmapped() {
    let mut a = split(true);
    let addr = a.alloc(THREE_PAGES, StreamId(0)).unwrap();
    a.free(addr).unwrap();
    a.driver_mut().fail_nth(Op::Unmap, 2, FaultKind::Error);
    assert!(a.empty_cache().is_err());
    assert_consistent(&a);
    assert_eq!(a.driver().mapping_count(), 2, "one of three pages unmapped");
    assert_serves(&mut a);
    assert_gives_everything_back(&mut a);
}

#[test]
fn a_page_whose_release_fails_is_released_by_the_next_empty_cache() {
    let mut a = split(true);
    let addr = a.alloc(THREE_PAGES, StreamId(0)).unwrap();
    a.free(addr).unwrap();
    a.driver_mut().fail_nth(Op::Release, 2, FaultKind::Error);
    assert!(a.empty_cache().is_err());
    assert_consistent(&a);
    assert_eq!(
        a.stats().reserved_bytes.current,
        20 * MIB,
        "the stranded page"
    );
    assert_serves(&mut a);
    assert_gives_everything_back(&mut a);
}

#[test]
fn a_reservation_whose_free_fails_is_freed_by_the_next_empty_cache() {
    let mut a = split(true);
    let addr = a.alloc(THREE_PAGES, StreamId(0)).unwrap();
    a.free(addr).unwrap();
    a.driver_mut()
        .fail_nth(Op::FreeReservation, 1, FaultKind::Error);
    assert!(a.empty_cache().is_err());
    assert_consistent(&a);
    assert_eq!(a.segments().len(), 1, "the segment is kept, not lost");
    assert_gives_everything_back(&mut a);
}

#[test]
fn a_failed_cuda_free_records_no_segment_free() {
    let mut a = split(false);
    a.record_segment_events(true);
    let addr = a.alloc(5 * MIB, StreamId(0)).unwrap();
    a.free(addr).unwrap();
    a.driver_mut().fail_nth(Op::Free, 1, FaultKind::Error);
    assert!(a.empty_cache().is_err());
    let frees = |a: &mut Split<SimDriver>| {
        a.take_segment_events()
            .iter()
            .filter(|e| e.action == SegmentAction::SegmentFree)
            .count()
    };
    assert_eq!(frees(&mut a), 0, "the segment was not freed");
    assert_consistent(&a);
    a.empty_cache().unwrap();
    assert_eq!(frees(&mut a), 1);
    assert_gives_everything_back(&mut a);
}

#[test]
fn cuvmm_destroys_an_event_later_when_destroying_it_failed() {
    const PAGE: u64 = 64 << 10;
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(64 * PAGE)
            .with_granularity(PAGE),
    );
    // Eager compaction borrows whether or not memory is short.
    let eager = Config::default().with_compaction(cuvmm::config::Compaction::Eager);
    let mut a = Expandable::new(sim, eager).unwrap();
    // A cached block of stream 0, all its pages mapped (a live block ends it), that stream 1 may borrow
    // once stream 0 is idle: finding out records an event on stream 0, queries and destroys it.
    let own = a.alloc(4 * PAGE, StreamId(0)).unwrap();
    let fence = a.alloc(PAGE, StreamId(0)).unwrap();
    a.free(own).unwrap();
    a.driver_mut()
        .fail_nth(Op::DestroyEvent, 1, FaultKind::Error);
    assert!(a.alloc(4 * PAGE, StreamId(1)).is_err());
    assert_eq!(a.driver().live_events(), 1);
    let next = a.alloc(PAGE, StreamId(1)).expect("the next request");
    assert_eq!(
        a.driver().live_events(),
        0,
        "the event was destroyed at the next poll"
    );
    a.free(next).unwrap();
    a.free(fence).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert!(a.driver().leak_report().is_empty());
}
