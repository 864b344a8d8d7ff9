//! The classic split model against PyTorch's rules, one test per rule, with PyTorch's numbers.
//! `check_invariants()` runs after every step.

use cuvmm::config::Config;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver, Op, StreamId};
use cuvmm::history::TraceAction;
use cuvmm::size::{GIB, MIB};
use cuvmm::strategy::Snapshots;
use cuvmm::{Error, Strategy};
use cuvmm_lab::pytorch_model::{SegmentAction, SegmentEvent, Split};

const S: StreamId = StreamId::DEFAULT;

fn split(capacity: u64, conf: &str) -> Split<SimDriver> {
    let sim = SimDriver::new(SimConfig::default().with_capacity(capacity));
    let config = Config::from_alloc_conf(conf).expect("valid configuration");
    let mut a = Split::new(sim, config).expect("allocator");
    a.record_segment_events(true);
    a
}

fn alloc(a: &mut Split<SimDriver>, size: u64) -> u64 {
    let addr = a.alloc(size, S).expect("alloc");
    a.check_invariants().expect("invariants after alloc");
    addr
}

fn free(a: &mut Split<SimDriver>, addr: u64) {
    a.free(addr).expect("free");
    a.check_invariants().expect("invariants after free");
}

/// The segment events since the last call, as (action, size in MiB).
fn events(a: &mut Split<SimDriver>) -> Vec<(SegmentAction, u64)> {
    a.take_segment_events()
        .iter()
        .map(|e: &SegmentEvent| (e.action, e.size / MIB))
        .collect()
}

use SegmentAction::{SegmentAlloc as Alloc, SegmentFree as Free};

#[test]
fn requests_round_to_512_bytes() {
    let mut a = split(GIB, "");
    alloc(&mut a, 1);
    alloc(&mut a, 1200);
    assert_eq!(a.stats().allocated_bytes.current, 512 + 1536);
    assert_eq!(a.stats().requested_bytes.current, 1201);
    assert_eq!(a.name(), "classic");
}

#[test]
fn roundup_power2_divisions_round_large_requests_to_a_division() {
    // 5 MiB + 1 with 4 divisions lies between 4 and 8 MiB, whose quarters are 1 MiB: 6 MiB.
    let mut a = split(GIB, "roundup_power2_divisions:4");
    alloc(&mut a, 5 * MIB + 1);
    assert_eq!(a.stats().allocated_bytes.current, 6 * MIB);
    // The list form: 1 division (512 B rounding) below 8 MiB.
    let mut b = split(GIB, "roundup_power2_divisions:[8:1,>:4]");
    alloc(&mut b, 5 * MIB + 1);
    assert_eq!(b.stats().allocated_bytes.current, 5 * MIB + 512);
}

#[test]
fn small_requests_share_2_mib_segments() {
    let mut a = split(GIB, "");
    alloc(&mut a, 512 << 10);
    alloc(&mut a, 512 << 10);
    alloc(&mut a, MIB);
    assert_eq!(events(&mut a), vec![(Alloc, 2)]);
    alloc(&mut a, 512);
    assert_eq!(events(&mut a), vec![(Alloc, 2)]);
}

#[test]
fn large_requests_below_10_mib_share_20_mib_segments_larger_ones_round_to_2_mib() {
    let mut a = split(GIB, "");
    for _ in 0..4 {
        alloc(&mut a, 5 * MIB);
    }
    assert_eq!(events(&mut a), vec![(Alloc, 20)]);
    alloc(&mut a, 11 * MIB + 1);
    assert_eq!(events(&mut a), vec![(Alloc, 12)]);
    assert_eq!(a.stats().reserved_bytes.current, 32 * MIB);
}

#[test]
fn best_fit_takes_the_smallest_block_then_the_lowest_address() {
    let mut a = split(GIB, "");
    let big = alloc(&mut a, 12 * MIB);
    let small1 = alloc(&mut a, 10 * MIB);
    let small2 = alloc(&mut a, 10 * MIB);
    free(&mut a, big);
    free(&mut a, small2);
    free(&mut a, small1);
    // Two cached 10 MiB segments and one of 12 MiB: the lower 10 MiB one fits best.
    let got = alloc(&mut a, 9 * MIB + MIB / 2);
    assert_eq!(got, small1.min(small2));
    assert_eq!(events(&mut a), vec![(Alloc, 12), (Alloc, 10), (Alloc, 10)]);
}

#[test]
fn cached_blocks_serve_only_their_own_stream() {
    let mut a = split(GIB, "");
    let x = a.alloc(5 * MIB, StreamId(7)).unwrap();
    a.free(x).unwrap();
    let y = a.alloc(5 * MIB, StreamId(8)).unwrap();
    assert_ne!(x, y);
    assert_eq!(events(&mut a), vec![(Alloc, 20), (Alloc, 20)]);
    let z = a.alloc(5 * MIB, StreamId(7)).unwrap();
    assert_eq!(z, x);
    a.check_invariants().unwrap();
}

#[test]
fn large_blocks_keep_remainders_of_1_mib_or_less() {
    let mut a = split(GIB, "");
    // 19 MiB in a 20 MiB segment: the 1 MiB remainder stays part of the block.
    alloc(&mut a, 19 * MIB);
    assert_eq!(a.stats().allocated_bytes.current, 20 * MIB);
    // 18.5 MiB leaves 1.5 MiB: split off.
    let mut b = split(GIB, "");
    alloc(&mut b, 18 * MIB + MIB / 2);
    assert_eq!(b.stats().allocated_bytes.current, 18 * MIB + MIB / 2);
    assert_eq!(b.stats().inactive_split_bytes.current, 3 * MIB / 2);
}

#[test]
fn small_blocks_split_any_remainder() {
    let mut a = split(GIB, "");
    alloc(&mut a, MIB);
    alloc(&mut a, MIB - 1024);
    assert_eq!(a.stats().allocated_bytes.current, 2 * MIB - 1024);
    alloc(&mut a, 1024);
    assert_eq!(events(&mut a), vec![(Alloc, 2)]);
}

#[test]
fn requests_below_max_split_size_never_take_oversize_blocks() {
    let mut a = split(GIB, "max_split_size_mb:40");
    let big = alloc(&mut a, 60 * MIB);
    free(&mut a, big);
    let small = alloc(&mut a, 30 * MIB);
    assert_ne!(small, big);
    assert_eq!(events(&mut a), vec![(Alloc, 60), (Alloc, 30)]);
}

#[test]
fn oversize_requests_only_take_blocks_below_size_plus_max_non_split_rounding() {
    let mut a = split(GIB, "max_split_size_mb:40");
    let b80 = alloc(&mut a, 80 * MIB);
    free(&mut a, b80);
    // 80 MiB >= 50 + 20: refused, and the oversize block is not split.
    let b50 = alloc(&mut a, 50 * MIB);
    assert_ne!(b50, b80);
    free(&mut a, b50);
    // 50 MiB < 45 + 20: taken whole.
    let b45 = alloc(&mut a, 45 * MIB);
    assert_eq!(b45, b50);
    assert_eq!(a.stats().allocated_bytes.current, 50 * MIB);
    // A larger max_non_split_rounding lets a 45 MiB request take the 80 MiB block.
    let mut c = split(GIB, "max_split_size_mb:40,max_non_split_rounding_mb:40");
    let b80 = alloc(&mut c, 80 * MIB);
    free(&mut c, b80);
    assert_eq!(alloc(&mut c, 45 * MIB), b80);
}

#[test]
fn free_neighbours_merge() {
    let mut a = split(GIB, "");
    let x = alloc(&mut a, 5 * MIB);
    let y = alloc(&mut a, 5 * MIB);
    let _z = alloc(&mut a, 5 * MIB);
    free(&mut a, x);
    free(&mut a, y);
    // x and y merged into one 10 MiB block at x: a 10 MiB request fits there.
    assert_eq!(alloc(&mut a, 10 * MIB), x);
    assert_eq!(events(&mut a), vec![(Alloc, 20)]);
}

#[test]
fn out_of_memory_releases_the_cache_and_retries_once() {
    let mut a = split(40 * MIB, "");
    let x = alloc(&mut a, 12 * MIB);
    free(&mut a, x);
    alloc(&mut a, 30 * MIB);
    assert_eq!(events(&mut a), vec![(Alloc, 12), (Free, 12), (Alloc, 30)]);
    let s = a.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 0));
    assert_eq!(a.driver().counters().get(Op::Free), 1);
}

#[test]
fn out_of_memory_first_releases_just_enough_oversize_blocks() {
    let mut a = split(110 * MIB, "max_split_size_mb:40");
    let big = alloc(&mut a, 60 * MIB);
    free(&mut a, big);
    let small = alloc(&mut a, 20 * MIB);
    let _keep = alloc(&mut a, 4 * MIB);
    free(&mut a, small);
    // 30 MiB: the cached 20 MiB segment does not fit, the 60 MiB one is oversize; the device is full.
    // The oversize block goes first, and the retry after it succeeds: no full release, no counted retry.
    alloc(&mut a, 30 * MIB);
    assert_eq!(
        events(&mut a),
        vec![
            (Alloc, 60),
            (Alloc, 20),
            (Alloc, 20),
            (Free, 60),
            (Alloc, 30)
        ]
    );
    assert_eq!(a.stats().num_alloc_retries, 0);
}

#[test]
fn a_request_that_never_fits_is_out_of_memory_after_one_retry() {
    let mut a = split(64 * MIB, "");
    let x = alloc(&mut a, 40 * MIB);
    match a.alloc(30 * MIB, S) {
        Err(Error::OutOfMemory(oom)) => {
            assert!(oom.retried);
            assert_eq!(oom.allocated, 40 * MIB);
        }
        other => panic!("expected out of memory, got {other:?}"),
    }
    let s = a.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (1, 1));
    a.check_invariants().unwrap();
    free(&mut a, x);
    assert!(matches!(a.alloc(0, S), Err(Error::ZeroSize)));
    // Larger than the device: PyTorch tries it like any other, releasing its cache and retrying, and
    // counts and records the out-of-memory; the error says it never fits.
    a.record_history(Some(8)).unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 40 * MIB);
    assert!(matches!(a.alloc(65 * MIB, S), Err(Error::TooLarge { .. })));
    let s = a.stats();
    assert_eq!((s.num_alloc_retries, s.num_ooms), (2, 2));
    assert_eq!(s.reserved_bytes.current, 0);
    let traces = a.snapshot().unwrap().device_traces.concat();
    let oom = traces.iter().find(|t| t.action == TraceAction::Oom);
    assert_eq!(oom.map(|t| (t.size, t.stream)), Some((65 * MIB, S)));
    a.check_invariants().unwrap();
}

#[test]
fn empty_cache_frees_only_wholly_cached_segments() {
    let mut a = split(GIB, "");
    let x = alloc(&mut a, 5 * MIB);
    let y = alloc(&mut a, 5 * MIB);
    let z = alloc(&mut a, 30 * MIB);
    free(&mut a, x);
    free(&mut a, z);
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(events(&mut a), vec![(Alloc, 20), (Alloc, 30), (Free, 30)]);
    free(&mut a, y);
    a.empty_cache().unwrap();
    assert_eq!(events(&mut a), vec![(Free, 20)]);
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(a.driver().leak_report().is_empty());
}

#[test]
fn garbage_collection_frees_old_cached_blocks_once_over_the_threshold() {
    let mut a = split(100 * MIB, "garbage_collection_threshold:0.5");
    a.set_memory_fraction(1.0).unwrap();
    // Each large-pool search for a free block ages the cached blocks by one.
    let x = alloc(&mut a, 30 * MIB); // search 1
    let y = alloc(&mut a, 12 * MIB); // search 2
    free(&mut a, x); // cached at age base 2
    free(&mut a, y); // cached at age base 2
    // Search 3; 42 MiB held, under the 50 MiB threshold: growing does not collect.
    let z = alloc(&mut a, 40 * MIB);
    assert_eq!(events(&mut a), vec![(Alloc, 30), (Alloc, 12), (Alloc, 40)]);
    free(&mut a, z); // cached at age base 3
    // Search 4; 82 MiB held, 32 MiB over: ages are 2, 2 and 1, average 5/3, so the 12 and 30 MiB blocks
    // go (in size order) and reclaim 42 MiB; the younger 40 MiB block stays.
    alloc(&mut a, 50 * MIB);
    assert_eq!(events(&mut a), vec![(Free, 12), (Free, 30), (Alloc, 50)]);
    assert_eq!(a.stats().num_alloc_retries, 0);
}

#[test]
fn out_of_memory_releases_several_oversize_blocks_largest_first() {
    let mut a = split(150 * MIB, "max_split_size_mb:40");
    let x = alloc(&mut a, 60 * MIB);
    let y = alloc(&mut a, 50 * MIB);
    free(&mut a, x);
    free(&mut a, y);
    // No single cached block holds 70 MiB and the device is full: the largest oversize blocks go until
    // 70 MiB are freed (60, then 50), and the retry succeeds.
    alloc(&mut a, 70 * MIB);
    assert_eq!(
        events(&mut a),
        vec![
            (Alloc, 60),
            (Alloc, 50),
            (Free, 60),
            (Free, 50),
            (Alloc, 70)
        ]
    );
    assert_eq!(a.stats().num_alloc_retries, 0);
}

#[test]
fn garbage_collection_needs_a_memory_fraction_as_in_pytorch() {
    let mut a = split(100 * MIB, "garbage_collection_threshold:0.5");
    let x = alloc(&mut a, 45 * MIB);
    free(&mut a, x);
    alloc(&mut a, 50 * MIB);
    assert_eq!(events(&mut a), vec![(Alloc, 46), (Alloc, 50)]);
}

#[test]
fn a_memory_fraction_caps_what_the_allocator_holds() {
    let mut a = split(100 * MIB, "");
    a.set_memory_fraction(0.5).unwrap();
    alloc(&mut a, 40 * MIB);
    assert!(a.alloc(20 * MIB, S).unwrap_err().is_out_of_memory());
    assert!(a.set_memory_fraction(1.5).is_err());
}

#[test]
fn drop_gives_everything_back() {
    let mut a = split(GIB, "");
    alloc(&mut a, 5 * MIB);
    alloc(&mut a, 100);
    drop(a);
}
