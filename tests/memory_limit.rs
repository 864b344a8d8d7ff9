//! `per_process_memory_fraction`: cuvmm's own memory limit, PyTorch's `set_per_process_memory_fraction`
//! (which does not reach a pluggable allocator). Reserved memory never passes it; past it a request is
//! served from idle memory or fails with out-of-memory, diagnosed with the limit, while the device still has
//! room; and the allocator goes on serving what fits.

mod common;

use common::expandable_with;
use cuvmm::config::Budget;
use cuvmm::strategy::Controls as _;
use cuvmm::{Config, Error, Strategy, StreamId};

const PAGE: u64 = 2 << 20;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);
/// A 128 MiB device.
const PAGES: u64 = 64;

fn limited(conf: &str) -> cuvmm::expandable::Expandable<cuvmm::driver::sim::SimDriver> {
    let config = Config::from_alloc_conf(conf).expect("valid configuration");
    expandable_with(PAGE, PAGES, config, false)
}

#[test]
fn the_key_is_a_fraction_of_the_device_and_bad_values_are_refused() {
    let config = Config::from_alloc_conf("per_process_memory_fraction:0.25").unwrap();
    assert_eq!(config.memory_limit, Some(Budget::Fraction(0.25)));
    assert_eq!(config.limit_bytes(64 * PAGE), Some(16 * PAGE));
    // The pressure budget never passes the limit; the garbage collection threshold is a fraction of it.
    let limit = config.limit_bytes(64 * PAGE);
    assert_eq!(config.budget_bytes(64 * PAGE, 64 * PAGE, limit), 16 * PAGE);
    let gc = Config::from_alloc_conf("garbage_collection_threshold:0.5").unwrap();
    assert_eq!(gc.budget_bytes(64 * PAGE, 64 * PAGE, None), 32 * PAGE);
    assert_eq!(
        gc.budget_bytes(64 * PAGE, 64 * PAGE, Some(16 * PAGE)),
        8 * PAGE
    );
    assert_eq!(Config::default().limit_bytes(64 * PAGE), None);
    for bad in ["0", "1.5", "-0.1", "x", ""] {
        let conf = format!("per_process_memory_fraction:{bad}");
        let err = Config::from_alloc_conf(&conf).expect_err(&conf);
        assert!(
            err.to_string().contains("per_process_memory_fraction"),
            "{conf}: {err}"
        );
    }
}

#[test]
fn reserved_memory_stops_at_the_limit_with_an_out_of_memory_that_names_it() {
    // 16 of the device's 64 pages.
    let mut a = limited("per_process_memory_fraction:0.25");
    let first = a.alloc(12 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    match a.alloc(8 * PAGE, S0) {
        Err(Error::OutOfMemory(oom)) => {
            assert_eq!(oom.allowed, Some(16 * PAGE));
            assert!(
                oom.device_free >= 40 * PAGE,
                "the device itself had room: {oom}"
            );
            assert!(oom.to_string().contains("allowed"), "{oom}");
        }
        other => panic!("expected out of memory at the limit, got {other:?}"),
    }
    a.check_invariants().unwrap();
    assert!(a.stats().reserved_bytes.current <= 16 * PAGE);
    // What fits under the limit is still served, and freed memory is used again.
    let small = a.alloc(3 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    a.free(first).unwrap();
    let again = a.alloc(8 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert!(a.stats().reserved_bytes.peak <= 16 * PAGE);
    a.free(again).unwrap();
    a.free(small).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn past_the_limit_idle_pages_of_another_stream_are_taken_instead() {
    let mut a = limited("per_process_memory_fraction:0.25,large_handle_mb:2");
    let other = a.alloc(10 * PAGE, S1).unwrap();
    a.free(other).unwrap();
    a.check_invariants().unwrap();
    // Stream 1's 10 idle pages are needed: the limit leaves room for 6 more only.
    let mine = a.alloc(14 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    let stats = a.stats();
    assert!(
        stats.reserved_bytes.peak <= 16 * PAGE,
        "{}",
        stats.reserved_bytes.peak
    );
    assert_eq!(stats.num_ooms, 0);
    a.free(mine).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn without_a_limit_the_same_requests_fit() {
    let mut a = limited("");
    let first = a.alloc(12 * PAGE, S0).unwrap();
    let second = a.alloc(8 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert!(a.stats().reserved_bytes.current > 16 * PAGE);
    a.free(first).unwrap();
    a.free(second).unwrap();
}

/// `set_per_process_memory_fraction` lowered under what is reserved (as PyTorch allows): the memory held
/// stays, nothing grows until reserved memory is back under the limit, and a limit raised again lets it
/// grow. The invariants hold throughout (they once took the memory held for a broken limit).
#[test]
fn a_limit_lowered_under_what_is_reserved_keeps_it_and_stops_growth() {
    let mut a = limited("large_handle_mb:2");
    let x = a.alloc(12 * PAGE, S0).unwrap();
    a.set_memory_fraction(0.125).unwrap(); // 8 pages
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 12 * PAGE, "kept");
    assert!(matches!(a.alloc(2 * PAGE, S1), Err(Error::OutOfMemory(_))));
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    let y = a.alloc(4 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert!(a.stats().reserved_bytes.current <= 12 * PAGE);
    a.free(y).unwrap();
    a.empty_cache().unwrap();
    assert!(a.alloc(10 * PAGE, S0).is_err(), "over the limit, now met");
    a.set_memory_fraction(1.0).unwrap();
    let z = a.alloc(20 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    a.free(z).unwrap();
}

/// Reserved bytes after stream 1 leaves `idle` pages idle and stream 0 then asks for `idle` pages: under the
/// budget growth takes new pages (2 x idle reserved), past it it reclaims stream 1's (idle reserved).
fn reserved_after_a_second_stream_asks(
    a: &mut cuvmm::expandable::Expandable<cuvmm::driver::sim::SimDriver>,
    idle: u64,
) -> u64 {
    let other = a.alloc(idle * PAGE, S1).unwrap();
    a.free(other).unwrap();
    let mine = a.alloc(idle * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    let reserved = a.stats().reserved_bytes.current;
    a.free(mine).unwrap();
    a.empty_cache().unwrap();
    reserved
}

/// The budget under which growth does not reclaim follows the limit the program sets, up and down: the
/// garbage collection threshold is a fraction of the memory the limit allows, as PyTorch's is of its
/// `allowed_memory_maximum`, and a limit raised above the configured one raises the budget with it.
#[test]
fn the_growth_budget_follows_the_limit_set_at_run_time() {
    // No limit: the threshold is half the device, 32 pages; 20 fit under it.
    let mut a = limited("large_handle_mb:2,garbage_collection_threshold:0.5");
    assert_eq!(reserved_after_a_second_stream_asks(&mut a, 10), 20 * PAGE);
    // A limit of 32 pages: the threshold is 16, so the second 10 pages are reclaimed.
    a.set_memory_fraction(0.5).unwrap();
    assert_eq!(reserved_after_a_second_stream_asks(&mut a, 10), 10 * PAGE);

    // Configured at 16 pages, raised to the whole device at run time: the budget is the device's.
    let mut b = limited("large_handle_mb:2,per_process_memory_fraction:0.25");
    assert_eq!(reserved_after_a_second_stream_asks(&mut b, 10), 10 * PAGE);
    b.set_memory_fraction(1.0).unwrap();
    assert_eq!(reserved_after_a_second_stream_asks(&mut b, 10), 20 * PAGE);
    b.check_invariants().unwrap();
}
