//! The model of PyTorch's `expandable_segments:True`, rule by rule.

use cuvmm::config::Config;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver, Op, StreamId};
use cuvmm::pool::Pool;
use cuvmm::size::{GIB, MIB};
use cuvmm::{Error, Strategy};
use cuvmm_lab::pytorch_model::{SegmentAction, Split};

const S: StreamId = StreamId::DEFAULT;

fn expandable(capacity: u64) -> Split<SimDriver> {
    let sim = SimDriver::new(SimConfig::default().with_capacity(capacity));
    let config = Config::from_alloc_conf("expandable_segments:True").unwrap();
    let mut a = Split::new(sim, config).unwrap();
    a.record_segment_events(true);
    a
}

fn events(a: &mut Split<SimDriver>) -> Vec<(SegmentAction, u64)> {
    a.take_segment_events()
        .iter()
        .map(|e| (e.action, e.size / MIB))
        .collect()
}

fn alloc(a: &mut Split<SimDriver>, size: u64, stream: StreamId) -> u64 {
    let addr = a.alloc(size, stream).expect("alloc");
    a.check_invariants().expect("invariants");
    addr
}

use SegmentAction::{SegmentMap as Map, SegmentUnmap as Unmap};

#[test]
fn segments_reserve_one_and_an_eighth_of_the_device_in_pool_pages() {
    let mut a = expandable(GIB);
    assert_eq!(a.name(), "pytorch-expandable");
    alloc(&mut a, 5 * MIB, S);
    alloc(&mut a, 1000, S);
    let segments = a.segments();
    assert_eq!(segments.len(), 2);
    let large = segments.iter().find(|s| s.2 == Pool::Large).unwrap();
    let small = segments.iter().find(|s| s.2 == Pool::Small).unwrap();
    // 1.125 GiB in 20 MiB pages: 58 pages; in 2 MiB pages: 576.
    assert_eq!(large.0.size, (1152u64).div_ceil(20) * 20 * MIB);
    assert_eq!(small.0.size, 1152 * MIB);
    assert_eq!(events(&mut a), vec![(Map, 20), (Map, 2)]);
}

#[test]
fn growth_maps_one_handle_per_missing_page() {
    let mut a = expandable(GIB);
    for _ in 0..4 {
        alloc(&mut a, 5 * MIB, S);
    }
    alloc(&mut a, 30 * MIB, S);
    // 20 MiB mapped, then the 30 MiB request extends the segment by two more pages.
    assert_eq!(events(&mut a), vec![(Map, 20), (Map, 40)]);
    let c = a.driver().counters();
    assert_eq!((c.get(Op::Create), c.get(Op::Map)), (3, 3));
    assert_eq!(a.stats().reserved_bytes.current, 60 * MIB);
    // Blocks split any remainder of 512 B, in the large pool too.
    assert_eq!(a.stats().allocated_bytes.current, 50 * MIB);
}

#[test]
fn pages_are_unmapped_only_on_release_after_a_synchronize_and_never_reused() {
    let mut a = expandable(GIB);
    let x = alloc(&mut a, 30 * MIB, S);
    a.free(x).unwrap();
    assert_eq!(a.driver().counters().get(Op::Unmap), 0);
    assert_eq!(a.stats().reserved_bytes.current, 40 * MIB);
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    let c = a.driver().counters();
    assert_eq!((c.get(Op::Unmap), c.get(Op::Release)), (2, 2));
    assert!(c.get(Op::Synchronize) >= 1);
    assert_eq!(events(&mut a), vec![(Map, 40), (Unmap, 40)]);
    // The reservation is freed once nothing is mapped in it.
    assert!(a.segments().is_empty());
    assert!(a.driver().leak_report().is_empty());
    alloc(&mut a, 30 * MIB, S);
    assert_eq!(a.driver().counters().get(Op::Create), 4);
}

#[test]
fn out_of_memory_unmaps_cached_pages_and_retries() {
    let mut a = expandable(60 * MIB);
    let x = alloc(&mut a, 40 * MIB, StreamId(1));
    a.free(x).unwrap();
    // Another stream cannot use stream 1's pages: they are unmapped and the request retried.
    alloc(&mut a, 40 * MIB, StreamId(2));
    assert_eq!(events(&mut a), vec![(Map, 40), (Unmap, 40), (Map, 40)]);
    assert_eq!(a.stats().num_alloc_retries, 1);
    match a.alloc(40 * MIB, StreamId(3)) {
        Err(Error::OutOfMemory(_)) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    a.check_invariants().unwrap();
}

#[test]
fn best_fit_counts_the_unmapped_space_after_a_block() {
    let mut a = expandable(GIB);
    // Two segments (two streams would not share; one stream grows one segment): map, free, reuse.
    let x = alloc(&mut a, 5 * MIB, S);
    let y = alloc(&mut a, 5 * MIB, S);
    a.free(x).unwrap();
    // 25 MiB does not fit the 5 MiB hole, so it extends the free tail after y.
    let z = alloc(&mut a, 25 * MIB, S);
    assert_eq!(z, y + 5 * MIB);
    a.check_invariants().unwrap();
}
