//! Targeted tests of the expandable allocator's growth, hysteresis and out-of-memory paths.

mod common;

use cuvmm::driver::Op;
use cuvmm::driver::sim::FaultKind;
use cuvmm::{Config, Error, Strategy, StreamId};

const PAGE: u64 = 1 << 16;
const S: StreamId = StreamId::DEFAULT;

#[test]
fn free_then_alloc_of_the_same_size_costs_no_driver_call() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let a = alloc.alloc(3 * PAGE + 100, S).unwrap();
    alloc.free(a).unwrap();
    let calls = alloc.driver_counters().total();
    let b = alloc.alloc(3 * PAGE + 100, S).unwrap();
    assert_eq!(b, a, "best fit should return the same block");
    assert_eq!(
        alloc.driver_counters().total(),
        calls,
        "a cached, mapped block needed a driver call"
    );
}

#[test]
fn idle_limit_releases_the_excess() {
    let sim = cuvmm::driver::sim::SimDriver::new(
        cuvmm::driver::sim::SimConfig::default()
            .with_capacity(16 * PAGE)
            .with_granularity(PAGE),
    );
    let mut alloc =
        cuvmm::expandable::Expandable::new(sim, Config::default().with_max_idle_bytes(2 * PAGE))
            .unwrap();
    let a = alloc.alloc(6 * PAGE, S).unwrap();
    assert_eq!(alloc.stats().reserved_bytes.current, 6 * PAGE);
    alloc.free(a).unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.idle_mapped_bytes + stats.idle_handle_bytes, 2 * PAGE);
    assert_eq!(stats.reserved_bytes.current, 2 * PAGE);
    assert_eq!(stats.num_device_free, 4);
    alloc.check_invariants().unwrap();
}

#[test]
fn one_out_of_memory_is_retried_after_releasing_the_cache() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    alloc
        .driver_mut()
        .fail_nth(Op::Create, 2, FaultKind::OutOfMemory);
    let a = alloc.alloc(4 * PAGE, S).expect("the retry should succeed");
    let stats = alloc.stats();
    assert_eq!(stats.num_alloc_retries, 1);
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(stats.reserved_bytes.current, 4 * PAGE);
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_second_out_of_memory_fails_cleanly_and_the_allocator_goes_on() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let keep = alloc.alloc(2 * PAGE, S).unwrap();
    alloc
        .driver_mut()
        .fail_nth(Op::Create, 2, FaultKind::OutOfMemory);
    alloc
        .driver_mut()
        .fail_nth(Op::Create, 3, FaultKind::OutOfMemory);
    let err = alloc.alloc(4 * PAGE, S).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("expected out-of-memory, got {err}")
    };
    assert!(oom.retried);
    assert_eq!(oom.requested, 4 * PAGE);
    assert_eq!(oom.allocated, 2 * PAGE);
    assert!(
        err.to_string()
            .starts_with("CUDA out of memory. Tried to allocate 256.00 KiB."),
        "{err}"
    );
    let stats = alloc.stats();
    assert_eq!((stats.num_ooms, stats.num_alloc_retries), (1, 1));
    assert_eq!(
        stats.reserved_bytes.current,
        2 * PAGE,
        "handles of the failed attempt were kept"
    );
    alloc.check_invariants().unwrap();
    let b = alloc
        .alloc(4 * PAGE, S)
        .expect("the next request is served");
    alloc.free(b).unwrap();
    alloc.free(keep).unwrap();
    alloc.empty_cache().unwrap();
    assert!(alloc.driver().leak_report().is_empty());
}

#[test]
fn a_failed_map_keeps_its_handle_and_leaks_nothing() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    alloc.driver_mut().fail_nth(Op::Map, 3, FaultKind::Error);
    let err = alloc.alloc(5 * PAGE, S).unwrap_err();
    assert!(
        matches!(
            err,
            Error::Driver(cuvmm::DriverError::Injected { op: Op::Map, .. })
        ),
        "{err}"
    );
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    let a = alloc.alloc(5 * PAGE, S).unwrap();
    assert_eq!(
        alloc.stats().num_device_alloc,
        5,
        "handles made before the failure were not reused"
    );
    alloc.free(a).unwrap();
    alloc.empty_cache().unwrap();
    assert!(alloc.driver().leak_report().is_empty());
}

#[test]
fn a_failed_set_access_is_repaired_by_the_next_allocation() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    alloc
        .driver_mut()
        .fail_nth(Op::SetAccess, 1, FaultKind::Error);
    assert!(alloc.alloc(2 * PAGE, S).is_err());
    alloc.check_invariants().unwrap();
    let a = alloc.alloc(2 * PAGE, S).unwrap();
    alloc.check_invariants().unwrap();
    alloc.free(a).unwrap();
}

#[test]
fn small_and_large_requests_use_separate_segments() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let small = alloc.alloc(1000, S).unwrap();
    let large = alloc.alloc(2000, S).unwrap();
    let segments = alloc.segments();
    assert_eq!(segments.len(), 2);
    let seg_of = |addr: u64| {
        segments
            .iter()
            .position(|(va, ..)| va.contains(addr))
            .unwrap()
    };
    assert_ne!(seg_of(small), seg_of(large));
    let other_stream = alloc.alloc(1000, StreamId(5)).unwrap();
    assert_eq!(alloc.segments().len(), 3);
    for addr in [small, large, other_stream] {
        alloc.free(addr).unwrap();
    }
}

#[test]
fn empty_cache_and_trim_give_memory_back() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let a = alloc.alloc(8 * PAGE, S).unwrap();
    let b = alloc.alloc(PAGE, S).unwrap();
    alloc.free(a).unwrap();
    assert_eq!(alloc.trim(3 * PAGE).unwrap(), 3 * PAGE);
    assert_eq!(alloc.stats().reserved_bytes.current, 6 * PAGE);
    alloc.empty_cache().unwrap();
    let stats = alloc.stats();
    // Only the page under `b` stays (and the page it shares with the freed block, if any).
    assert!(
        stats.reserved_bytes.current <= 2 * PAGE,
        "{}",
        stats.reserved_bytes.current
    );
    assert_eq!(stats.idle_mapped_bytes + stats.idle_handle_bytes, 0);
    alloc.free(b).unwrap();
    alloc.empty_cache().unwrap();
    assert!(alloc.driver().leak_report().is_empty());
}

#[test]
fn a_mapped_free_block_is_preferred_to_a_tighter_unmapped_one() {
    let mut alloc = common::expandable(PAGE, 32, 1024, false);
    let y = alloc.alloc(5 * PAGE, S).unwrap();
    let sep1 = alloc.alloc(PAGE, S).unwrap();
    let x = alloc.alloc(4 * PAGE, S).unwrap();
    let sep2 = alloc.alloc(PAGE, S).unwrap();
    alloc.free(x).unwrap();
    alloc.free(y).unwrap();
    // Release the 4 highest idle pages: exactly x's, so x's hole is the tighter fit but unmapped.
    assert_eq!(alloc.trim(4 * PAGE).unwrap(), 4 * PAGE);
    let calls = alloc.driver_counters().total();
    let z = alloc.alloc(4 * PAGE, S).unwrap();
    assert_eq!(
        z, y,
        "the mapped 5-page hole should serve the 4-page request"
    );
    assert_eq!(
        alloc.driver_counters().total(),
        calls,
        "serving from mapped pages needs no driver call"
    );
    for addr in [z, sep1, sep2] {
        alloc.free(addr).unwrap();
    }
    alloc.check_invariants().unwrap();
}

#[test]
fn a_free_that_happened_is_ok_even_if_releasing_idle_memory_fails() {
    let sim = cuvmm::driver::sim::SimDriver::new(
        cuvmm::driver::sim::SimConfig::default()
            .with_capacity(16 * PAGE)
            .with_granularity(PAGE),
    );
    let config = Config::default().with_max_idle_bytes(PAGE);
    let mut alloc = cuvmm::expandable::Expandable::new(sim, config).unwrap();
    let a = alloc.alloc(4 * PAGE, S).unwrap();
    let b = alloc.alloc(PAGE, S).unwrap();
    // The unmap fails, and so does the second try that settles it (`src/expandable/settle.rs`).
    alloc.driver_mut().fail_nth(Op::Unmap, 1, FaultKind::Error);
    alloc.driver_mut().fail_nth(Op::Unmap, 2, FaultKind::Error);
    alloc
        .free(a)
        .expect("the block is free even though trimming the excess failed");
    assert!(matches!(alloc.free(a), Err(Error::DoubleFree { .. })));
    alloc.check_invariants().unwrap();
    assert!(
        alloc.stats().idle_mapped_bytes > PAGE,
        "the failed release kept the pages idle"
    );
    // The next free retries the release and gets back under the limit.
    alloc.free(b).unwrap();
    let stats = alloc.stats();
    assert!(stats.idle_mapped_bytes + stats.idle_handle_bytes <= PAGE);
    alloc.check_invariants().unwrap();
}

#[test]
fn an_absurd_va_factor_is_refused() {
    let sim = cuvmm::driver::sim::SimDriver::new(
        cuvmm::driver::sim::SimConfig::default()
            .with_capacity(16 * PAGE)
            .with_granularity(PAGE),
    );
    let err = cuvmm::expandable::Expandable::new(sim, Config::default().with_va_factor(1_841_615))
        .unwrap_err();
    assert!(err.to_string().contains("va_factor"), "{err}");
}
