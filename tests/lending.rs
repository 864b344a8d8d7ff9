//! Lending (`src/expandable/supply/lending.rs`): under memory pressure, the idle pages of a chunk that a live
//! block still touches are mapped a second time where a request needs them, instead of running out of
//! memory. The bytes must be the chunk's own memory, nothing may be lost or held twice, and everything must
//! come back when the blocks are freed.

mod common;

use common::pattern;
use cuvmm::driver::Forward;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, Op, PhysPage, StreamId};
use cuvmm::expandable::Expandable;
use cuvmm::{Config, Error, Strategy};

const PAGE: u64 = 2 << 20;
/// A 20 MiB chunk: the default large-pool handle.
const CHUNK_PAGES: u64 = 10;
const S1: StreamId = StreamId(1);
const S2: StreamId = StreamId(2);

/// A device of exactly one chunk, whose pages 4 and 5 stream 1 keeps in use. Stream 2 then needs 8
/// pages in a row: only the chunk's 8 idle pages can give them, and not in place (no 8 of them are in a
/// row), nor unmapped (the chunk is mapped whole), so they are lent.
#[test]
fn a_chunks_idle_pages_are_lent_where_a_request_needs_them() {
    let mut a = lending(PAGE, CHUNK_PAGES, Config::default(), true);
    let kept = keep_the_middle(&mut a);
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, CHUNK_PAGES * PAGE);
    let other = a.alloc(8 * PAGE, S2).unwrap();
    a.check_invariants().unwrap();
    let stats = a.stats();
    assert_eq!(stats.lent_bytes, 8 * PAGE);
    assert_eq!(
        stats.reserved_bytes.current,
        CHUNK_PAGES * PAGE,
        "no new memory"
    );
    assert_eq!(stats.num_ooms, 0);
    assert_eq!(
        stats.num_synchronizations, 0,
        "stream 1 was idle: no blocking"
    );
    assert_eq!(a.driver().counters().get(Op::Create), 1);
    // Each block holds its own bytes.
    let (kept_bytes, other_bytes) = (pattern(1, 2 * PAGE as usize), pattern(2, 8 * PAGE as usize));
    a.driver_mut().write(kept, &kept_bytes).unwrap();
    a.driver_mut().write(other, &other_bytes).unwrap();
    assert_eq!(a.driver().read(kept, kept_bytes.len()).unwrap(), kept_bytes);
    assert_eq!(
        a.driver().read(other, other_bytes.len()).unwrap(),
        other_bytes
    );
    // And the chunk's memory is what stream 2 uses: its 8 idle pages, read at home, are stream 2's pages.
    let page = |base: u64, i: u64| a.driver().read(base + i * PAGE, PAGE as usize).unwrap();
    let home = kept - 4 * PAGE;
    let mut at_home: Vec<Vec<u8>> = (0..CHUNK_PAGES)
        .filter(|i| !(4..6).contains(i))
        .map(|i| page(home, i))
        .collect();
    let mut lent: Vec<Vec<u8>> = (0..8).map(|i| page(other, i)).collect();
    at_home.sort();
    lent.sort();
    assert_eq!(at_home, lent);

    // Freed and the cache emptied: the lent pages go home; the chunk stays, one of its blocks is live.
    a.free(other).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().lent_bytes, 0);
    assert_eq!(a.stats().reserved_bytes.current, CHUNK_PAGES * PAGE);
    assert_eq!(a.driver().read(kept, kept_bytes.len()).unwrap(), kept_bytes);

    // Lent again; then the chunk's own block freed first: the chunk cannot go while its pages are lent.
    let other = a.alloc(8 * PAGE, S2).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().lent_bytes, 8 * PAGE);
    a.free(kept).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, CHUNK_PAGES * PAGE);
    assert_eq!(
        a.driver().read(other, other_bytes.len()).unwrap().len(),
        other_bytes.len()
    );
    a.free(other).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert_eq!(a.stats().lent_bytes, 0);
    assert!(a.segments().is_empty());
    let leaks = a.driver().leak_report();
    assert!(leaks.is_empty(), "{leaks:?}");
}

/// A lent page may serve several requests in turn, on several streams, with pages unmapped and mapped
/// again; the invariants hold after every step and the device ends empty.
#[test]
fn lent_pages_move_between_streams_and_all_come_back() {
    let mut a = lending(PAGE, 2 * CHUNK_PAGES, Config::default(), true);
    // Two chunks, each kept in use by a one-page block at its start.
    let k1 = a.alloc(11 * PAGE, S1).unwrap();
    let mut live = vec![k1];
    let mut most_lent = 0;
    a.check_invariants().unwrap();
    for round in 0..12u64 {
        let stream = StreamId(2 + round % 3);
        let pages = 1 + round % 4;
        match a.alloc(pages * PAGE, stream) {
            Ok(addr) => {
                let bytes = pattern(round, (pages * PAGE) as usize);
                a.driver_mut().write(addr, &bytes).unwrap();
                assert_eq!(a.driver().read(addr, bytes.len()).unwrap(), bytes);
                live.push(addr);
            }
            Err(Error::OutOfMemory(_)) => {}
            Err(err) => panic!("{err}"),
        }
        a.check_invariants().unwrap();
        most_lent = most_lent.max(a.stats().lent_bytes);
        if live.len() > 3 {
            let addr = live.remove(1 + (round as usize % (live.len() - 1)));
            a.free(addr).unwrap();
            a.check_invariants().unwrap();
        }
        if round % 4 == 3 {
            a.empty_cache().unwrap();
            a.check_invariants().unwrap();
        }
    }
    assert!(a.stats().reserved_bytes.peak <= 2 * CHUNK_PAGES * PAGE);
    assert!(most_lent > 0, "no page was lent");
    for addr in live {
        a.free(addr).unwrap();
        a.check_invariants().unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(a.driver().leak_report().is_empty());
}

/// Under `compaction:eager` and with single-page handles there are no chunks, so nothing is lent.
#[test]
fn without_chunks_nothing_is_lent() {
    let config = Config::from_alloc_conf("large_handle_mb:2").unwrap();
    let mut a = lending(PAGE, CHUNK_PAGES, config, false);
    let kept = a.alloc(2 * PAGE, S1).unwrap();
    let other = a.alloc(8 * PAGE, S2).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().lent_bytes, 0);
    a.free(other).unwrap();
    a.free(kept).unwrap();
    a.check_invariants().unwrap();
}

/// A driver that says it maps parts of handles but maps only whole ones (the trait's default `map_from`):
/// lending is tried once, the driver refuses, the lent pages go home and lending stays off; the request
/// then fails as it would have without lending, with an out-of-memory error, and nothing is lost.
#[test]
fn a_driver_without_partial_mappings_turns_lending_off() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(CHUNK_PAGES * PAGE)
            .with_granularity(PAGE),
    );
    let mut a = Expandable::new(WholeOnly(sim), Config::default()).unwrap();
    let kept = keep_the_middle(&mut a);
    match a.alloc(8 * PAGE, S2) {
        Err(Error::OutOfMemory(_)) => {}
        other => panic!("expected out of memory, got {other:?}"),
    }
    a.check_invariants().unwrap();
    assert_eq!(a.stats().lent_bytes, 0);
    // The 8 idle pages are still there for stream 1.
    let more = a.alloc(4 * PAGE, S1).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, CHUNK_PAGES * PAGE);
    a.free(more).unwrap();
    a.free(kept).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

/// Maps a chunk on stream 1 and keeps only its pages 4 and 5 in use; returns that block.
fn keep_the_middle<D: Driver>(a: &mut Expandable<D>) -> u64 {
    let first = a.alloc(4 * PAGE, S1).unwrap();
    let kept = a.alloc(2 * PAGE, S1).unwrap();
    assert_eq!(kept, first + 4 * PAGE);
    a.free(first).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, CHUNK_PAGES * PAGE);
    kept
}

/// The simulator, without `map_from`: only whole handles can be mapped.
#[derive(Debug)]
struct WholeOnly(SimDriver);

impl Forward for WholeOnly {
    type Inner = SimDriver;
    fn inner(&self) -> &SimDriver {
        &self.0
    }
    fn inner_mut(&mut self) -> &mut SimDriver {
        &mut self.0
    }
    fn maps_parts_of_handles(&self) -> bool {
        true // but `map_from` refuses an offset, as the trait's default does
    }
    fn map_from(&mut self, va: u64, size: u64, page: PhysPage) -> Result<(), DriverError> {
        if page.offset != 0 {
            return Err(DriverError::Unsupported { op: Op::Map });
        }
        self.0.map(va, size, page.handle)
    }
}

/// An allocator on a simulated device of `pages` pages that maps parts of handles, as lending needs
/// (`SimConfig::partial_mappings`; CUDA does not, and there cuvmm never lends).
fn lending(page: u64, pages: u64, config: Config, backing_store: bool) -> Expandable<SimDriver> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(page * pages)
            .with_granularity(page)
            .with_backing_store(backing_store)
            .with_partial_mappings(true),
    );
    Expandable::new(sim, config).expect("valid configuration")
}
