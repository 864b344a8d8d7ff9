//! Placement inside free blocks: which free block and which address a request gets, by the pages it would
//! need mapped.

use super::*;
use crate::driver::PhysHandle;

const PAGE: u64 = 4096;
const BASE: u64 = 1 << 30;

/// A segment of `pages` pages whose pages `mapped` are mapped (and idle: no block uses them).
fn segment(pages: u64, mapped: Range<usize>) -> Segment {
    let mut seg = Segment::new(
        VaRange::new(BASE, pages * PAGE),
        StreamId::DEFAULT,
        Pool::Large,
        Kind::Mixed,
        PAGE,
    );
    for page in mapped.clone() {
        seg.pages.map(page, PhysHandle(page as u64 + 1));
    }
    seg.pages.set_accessible(mapped);
    seg
}

fn page(n: u64) -> u64 {
    BASE + n * PAGE
}

#[test]
fn a_request_goes_where_the_mapped_pages_of_a_free_block_are() {
    let seg = segment(64, 20..36);
    // At the block's start all 16 pages would be missing; at page 20, none.
    assert_eq!(seg.placement(BASE, 64 * PAGE, 16 * PAGE), (0, page(20)));
    assert_eq!(
        seg.mapped_fit(16 * PAGE, 8, false),
        Some((0, 64 * PAGE, page(20)))
    );
    // Longer than the run: the window ends where the run ends or starts where it starts, and the lowest
    // address wins the tie.
    assert_eq!(seg.placement(BASE, 64 * PAGE, 24 * PAGE), (8, page(12)));
}

#[test]
fn on_whole_pages_a_request_skips_the_partial_pages_of_its_free_block() {
    // A live block of half a page at the start: the free block after it begins mid-page 0.
    let mut seg = segment(16, 0..4);
    seg.carve(BASE, PAGE / 2, PAGE / 2);
    // Packed, 2 pages go at the free block's start and touch pages 0..3, 3 of them mapped (page 0 shared).
    assert_eq!(
        seg.mapped_fit(2 * PAGE, 8, false),
        Some((0, 15 * PAGE + PAGE / 2, page(0) + PAGE / 2))
    );
    // On whole pages they start at page 1 and touch pages 1 and 2 only.
    assert_eq!(
        seg.mapped_fit(2 * PAGE, 8, true),
        Some((0, 15 * PAGE + PAGE / 2, page(1)))
    );
    // A free block with no whole page in it fits nothing on whole pages.
    seg.carve(page(1), 15 * PAGE, 15 * PAGE);
    assert_eq!(seg.mapped_fit(PAGE / 4, 8, true), None);
}

#[test]
fn small_requests_and_small_savings_stay_at_the_block_start() {
    // Under 8 pages, a placement inside the block is never worth splitting it.
    let seg = segment(64, 20..36);
    assert_eq!(seg.placement(BASE, 64 * PAGE, 4 * PAGE), (4, BASE));
    // 16 pages: the start needs 1 page, page 20 none; saving 1 page is less than 16 / 8.
    let mut seg = segment(64, 20..36);
    for p in 0..15 {
        seg.pages.map(p, PhysHandle(100 + p as u64));
    }
    assert_eq!(seg.placement(BASE, 64 * PAGE, 16 * PAGE), (1, BASE));
}

#[test]
fn carving_inside_a_free_block_leaves_free_blocks_on_both_sides() {
    let mut seg = segment(64, 20..36);
    let (_, _, addr) = seg.mapped_fit(16 * PAGE, 8, false).unwrap();
    seg.carve(addr, 16 * PAGE, 16 * PAGE - 100);
    let blocks: Vec<(u64, u64, bool)> = seg
        .blocks()
        .map(|(a, b)| (a, b.size, b.is_live()))
        .collect();
    assert_eq!(
        blocks,
        [
            (BASE, 20 * PAGE, false),
            (page(20), 16 * PAGE, true),
            (page(36), 28 * PAGE, false)
        ]
    );
    assert_eq!(seg.free_index().len(), 2);
    assert_eq!(seg.pages.idle_count(), 0);
    // Freed, it merges back into one free block.
    let FreeOutcome::Freed { size, at, .. } = seg.check_free(page(20)) else {
        panic!("the block is live");
    };
    seg.free_live(at, page(20), size);
    assert_eq!(seg.blocks().count(), 1);
    assert_eq!(seg.pages.idle_count(), 16);
}

#[test]
fn a_larger_block_with_idle_pages_beats_the_best_fits_that_need_pages() {
    // Nine free blocks of 16 pages, unmapped, separated by live one-page blocks, then a free block of 40
    // pages whose pages 180..196 are mapped and idle.
    let mut seg = segment(220, 180..196);
    for i in 0..9 {
        seg.carve(page(i * 17 + 16), PAGE, PAGE);
    }
    // The 8 best fits by size are unmapped 16-page blocks; the idle run points at the larger block.
    assert_eq!(
        seg.mapped_fit(16 * PAGE, 8, false),
        Some((0, 67 * PAGE, page(180)))
    );
}

#[test]
fn only_idle_pages_of_a_mostly_unmapped_block_count_as_cached() {
    let mut seg = segment(64, 0..8);
    // A live block on page 0: page 0 is touched, pages 1..8 idle, the rest of the block unmapped.
    seg.carve(BASE, 1024, 1024);
    let block = 64 * PAGE - 1024;
    assert_eq!(seg.cached_fit(PAGE, 8), Some((block, page(1))));
    assert_eq!(seg.cached_fit(7 * PAGE, 8), Some((block, page(1))));
    assert_eq!(seg.cached_fit(7 * PAGE + 512, 8), None);
}
