//! Sharing an allocation with another process (`Allocator::share`, `open_shared`, `close_shared`), on the
//! simulated device: the importer here is the same device, which CUDA allows too (a process may import its
//! own exports), so the bytes seen through both mappings can be compared. The descriptors' journey between
//! processes is cuvmm-torch's (`cuvmm-torch/src/transport.rs`), tested there.

mod common;

use common::{holds_pattern, write_pattern};
use cuvmm::strategy::Sharing;

use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::sharing::{SharedMemory, SharingError};
use cuvmm::{Allocator, Config, Error, Strategy as _, StreamId};

const PAGE: u64 = 4096;
const PAGES: u64 = 256;

type Alloc = Expandable<SimDriver>;

/// Large requests in 20-page chunks (the default `large_handle` is 20 MiB; here 20 pages).
fn chunked() -> Config {
    Config {
        small_size: 1024,
        large_handle: 20 * PAGE,
        ..Config::default()
    }
}

fn new_alloc() -> Alloc {
    common::expandable_with(PAGE, PAGES, chunked(), true)
}

/// A device of `pages` pages with a backing store, mapping parts of handles if `partial_mappings`.
fn device(pages: u64, partial_mappings: bool) -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(pages * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true)
            .with_partial_mappings(partial_mappings),
    )
}

/// Maps `shared` back in this allocator; returns where the allocation appears.
fn open(a: &mut Alloc, shared: &SharedMemory) -> (u64, u64) {
    let parts: Vec<_> = shared.parts.iter().map(|p| p.borrowed()).collect();
    let base = a.open_shared(&parts).expect("opens");
    a.check_invariants().unwrap();
    (base, base + shared.offset)
}

/// A small allocation that shares its page with others: the importer maps the whole page, sees the bytes
/// the exporter wrote, and the exporter sees the importer's writes.
#[test]
fn an_import_sees_the_exporters_bytes_and_the_exporter_sees_its_writes() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let before = a.alloc(700, s).unwrap();
    let x = a.alloc(900, s).unwrap();
    write_pattern(&mut a, before, 1, 700);
    write_pattern(&mut a, x, 2, 900);
    let used = a.driver().used_bytes();

    let shared = a.share(x).unwrap();
    a.check_invariants().unwrap();
    assert_eq!(shared.parts.len(), 1, "one page holds it");
    assert_eq!(
        (shared.range_size(), shared.parts[0].handle_size),
        (PAGE, PAGE)
    );
    assert_eq!(
        shared.offset,
        x % PAGE,
        "the allocation's place in its page"
    );
    assert!(shared.size >= 900);

    let (base, seen) = open(&mut a, &shared);
    assert_ne!(base, x - shared.offset, "mapped at an address of its own");
    assert_eq!(a.driver().used_bytes(), used, "an import takes no memory");
    assert!(
        holds_pattern(&a, seen, 2, 900),
        "the importer sees the allocation"
    );
    assert!(
        holds_pattern(&a, base + (before - (x - shared.offset)), 1, 700),
        "and its page"
    );
    write_pattern(&mut a, seen, 3, 900);
    assert!(
        holds_pattern(&a, x, 3, 900),
        "the exporter sees the importer's writes"
    );

    drop(shared); // the exporter's descriptors
    a.close_shared(base).unwrap();
    a.check_invariants().unwrap();
    assert!(
        holds_pattern(&a, x, 3, 900),
        "closing the import leaves the memory"
    );
    assert!(matches!(
        a.close_shared(base),
        Err(Error::Sharing(SharingError::NotOpen { .. }))
    ));
    a.free(x).unwrap();
    a.free(before).unwrap();
}

/// A large allocation over whole chunks and part of another: every chunk it touches is shared whole.
#[test]
fn a_large_allocation_is_shared_as_the_whole_chunks_it_touches() {
    let mut a = new_alloc();
    let x = a.alloc(30 * PAGE, StreamId(1)).unwrap();
    write_pattern(&mut a, x, 4, 30 * PAGE);
    let shared = a.share(x).unwrap();
    assert!(
        shared
            .parts
            .iter()
            .all(|p| p.handle_size == 20 * PAGE && p.size == 20 * PAGE)
    );
    assert_eq!(shared.parts.len(), 2);
    let (base, seen) = open(&mut a, &shared);
    assert!(holds_pattern(&a, seen, 4, 30 * PAGE));
    a.close_shared(base).unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
}

/// A handle is exported once: blocks on one chunk, shared one by one, all hand out its one descriptor
/// (one export call, one descriptor open however many shares); the allocator keeps it while it holds the
/// handle, and once the handle is released, a share exports the new one afresh. An import through the kept
/// descriptor sees the later block's bytes.
#[test]
fn blocks_on_one_handle_share_one_descriptor_until_the_handle_is_released() {
    use std::sync::Arc;
    let mut a = new_alloc();
    let exports = |a: &Alloc| cuvmm::Driver::counters(a.driver()).get(Op::Export);
    let blocks: Vec<u64> = (0..6)
        .map(|_| a.alloc(3 * PAGE, StreamId(1)).unwrap())
        .collect();
    let shares: Vec<SharedMemory> = blocks.iter().map(|&b| a.share(b).unwrap()).collect();
    a.check_invariants().unwrap();
    assert!(
        shares.iter().all(|s| s.parts.len() == 1),
        "each on the one chunk"
    );
    let first = &shares[0].parts[0].fd;
    assert!(
        shares.iter().all(|s| Arc::ptr_eq(&s.parts[0].fd, first)),
        "every share hands out the chunk's one descriptor"
    );
    assert_eq!(exports(&a), 1, "exported once");
    write_pattern(&mut a, blocks[5], 9, 3 * PAGE);
    let (base, seen) = open(&mut a, &shares[5]);
    assert!(holds_pattern(&a, seen, 9, 3 * PAGE));
    a.close_shared(base).unwrap();

    drop(shares);
    for b in blocks {
        a.free(b).unwrap();
    }
    a.empty_cache().unwrap();
    // The descriptor went with the handle (`ExportOutlivesHandle` otherwise).
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0, "the chunk is released");
    let x = a.alloc(3 * PAGE, StreamId(1)).unwrap();
    let again = a.share(x).unwrap();
    assert_eq!(exports(&a), 2, "the new chunk is exported afresh");
    write_pattern(&mut a, x, 10, 3 * PAGE);
    let (base, seen) = open(&mut a, &again);
    assert!(
        holds_pattern(&a, seen, 10, 3 * PAGE),
        "the new export is the new memory's"
    );
    a.close_shared(base).unwrap();
    a.free(x).unwrap();
    a.check_invariants().unwrap();
}

/// The memory an import maps outlives the exporter's handles: freed and given back by the exporter, it
/// stays until the import is closed, then returns to the device.
#[test]
fn imported_memory_stays_until_the_import_is_closed() {
    let mut a = new_alloc();
    let x = a.alloc(3 * PAGE, StreamId(1)).unwrap();
    write_pattern(&mut a, x, 5, 3 * PAGE);
    let shared = a.share(x).unwrap();
    let range = shared.range_size();
    assert_eq!(range, 20 * PAGE, "the chunk it lies in");
    let (base, seen) = open(&mut a, &shared);
    drop(shared);
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(
        a.stats().reserved_bytes.current,
        0,
        "the exporter holds nothing"
    );
    assert!(
        holds_pattern(&a, seen, 5, 3 * PAGE),
        "the import keeps the bytes"
    );
    assert_eq!(a.driver().used_bytes(), range, "and the memory");
    a.close_shared(base).unwrap();
    assert_eq!(
        a.driver().used_bytes(),
        0,
        "closed, the memory is the device's again"
    );
    a.check_invariants().unwrap();
}

/// What cannot be shared is refused with a typed error, and the allocator stays whole.
#[test]
fn free_and_unknown_addresses_are_refused() {
    let mut a = new_alloc();
    let x = a.alloc(2 * PAGE, StreamId(1)).unwrap();
    assert!(matches!(a.share(x + 8), Err(Error::UnknownAddress { .. })));
    assert!(matches!(
        a.share(1 << 50),
        Err(Error::UnknownAddress { .. })
    ));
    a.free(x).unwrap();
    assert!(matches!(a.share(x), Err(Error::UnknownAddress { .. })));
    assert!(matches!(
        a.open_shared(&[]),
        Err(Error::Sharing(SharingError::Empty))
    ));
    a.check_invariants().unwrap();
}

/// Tagged memory is shared too: the importer's mapping keeps the pages across the exporter's sleep, with
/// the bytes they had, and their memory goes back to the device once it is closed; the exporter wakes with
/// its own bytes.
#[test]
fn tagged_memory_is_shared_and_an_import_outlives_a_sleep() {
    let mut a = new_alloc();
    let kv = a.alloc_tagged(3 * PAGE, StreamId(1), "kv").unwrap();
    write_pattern(&mut a, kv, 7, 3 * PAGE);
    let shared = a.share(kv).unwrap();
    let (base, seen) = open(&mut a, &shared);
    drop(shared);
    let used = a.driver().used_bytes();
    assert!(a.sleep("kv", true).unwrap() > 0);
    assert!(
        holds_pattern(&a, seen, 7, 3 * PAGE),
        "the import keeps the bytes"
    );
    assert_eq!(
        a.driver().used_bytes(),
        used,
        "and the memory, until it is closed"
    );
    a.close_shared(base).unwrap();
    assert!(
        a.driver().used_bytes() < used,
        "closed, the slept memory is the device's again"
    );
    a.wake("kv").unwrap();
    assert!(holds_pattern(&a, kv, 7, 3 * PAGE), "woken with its bytes");
    a.check_invariants().unwrap();
    a.free(kv).unwrap();
    a.check_invariants().unwrap();
}

/// An import that fails part way (the second part's map, then its import) undoes what it did: nothing of
/// it stays on the device, and the allocator goes on.
#[test]
fn a_failed_import_leaves_nothing_behind() {
    for (op, n) in [(Op::Map, 2), (Op::Import, 2), (Op::SetAccess, 1)] {
        let mut a = new_alloc();
        let x = a.alloc(30 * PAGE, StreamId(1)).unwrap();
        let shared = a.share(x).unwrap();
        let parts: Vec<_> = shared.parts.iter().map(|p| p.borrowed()).collect();
        let reservations = a.driver().leak_report().reservations.len();
        a.driver_mut().fail_nth(op, n, FaultKind::Error);
        assert!(a.open_shared(&parts).is_err(), "{op}");
        let report = a.driver().leak_report();
        assert_eq!(
            report.reservations.len(),
            reservations,
            "{op}: no range left"
        );
        a.check_invariants().unwrap();
        let (base, _) = open(&mut a, &shared);
        a.close_shared(base).unwrap();
        a.free(x).unwrap();
    }
}

/// Through the facade: a buffer freed into a stream cache is free, so sharing it is refused; an import
/// left open is closed when the allocator goes, and the device is left with nothing.
#[test]
fn the_facade_shares_live_buffers_only_and_closes_imports_on_drop() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(PAGE * PAGES)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let mut device = sim;
    {
        let a = Allocator::expandable(&mut device, Config::default()).unwrap();
        let live = a.alloc_raw(5000, StreamId(3)).unwrap();
        let shared = a.share(live).unwrap();
        let parts: Vec<_> = shared.parts.iter().map(|p| p.borrowed()).collect();
        let base = a.open_shared(&parts).unwrap();
        assert!(base != 0);
        let freed = a.alloc_raw(5000, StreamId(3)).unwrap();
        a.free_raw(freed).unwrap();
        assert!(matches!(a.share(freed), Err(Error::UnknownAddress { .. })));
        a.free_raw(live).unwrap();
        a.check_invariants().unwrap();
    }
    let report = device.leak_report();
    assert!(report.is_empty(), "{report:?}");
}

/// Pages lent under pressure (mapped a second time from their offset in a chunk whose other pages a live
/// block keeps): a block on them is shared as those pieces of the chunk, and the importer sees its bytes;
/// the chunk's own block is shared as the whole chunk.
#[test]
fn a_block_on_lent_pages_is_shared_as_pieces_of_the_chunk() {
    let mut a = Expandable::new(device(20, true), chunked()).unwrap();
    let first = a.alloc(8 * PAGE, StreamId(1)).unwrap();
    let kept = a.alloc(4 * PAGE, StreamId(1)).unwrap();
    a.free(first).unwrap();
    let other = a.alloc(16 * PAGE, StreamId(2)).unwrap();
    assert_eq!(
        a.stats().lent_bytes,
        16 * PAGE,
        "the chunk's idle pages are lent"
    );
    write_pattern(&mut a, kept, 6, 4 * PAGE);
    write_pattern(&mut a, other, 7, 16 * PAGE);

    let shared = a.share(other).unwrap();
    assert_eq!(shared.parts.len(), 16, "one piece per lent page");
    assert!(
        shared
            .parts
            .iter()
            .all(|p| p.handle_size == 20 * PAGE && p.size == PAGE)
    );
    assert!(shared.parts.iter().any(|p| p.handle_offset != 0));
    let (base, seen) = open(&mut a, &shared);
    assert!(
        holds_pattern(&a, seen, 7, 16 * PAGE),
        "the importer sees the lent pages' bytes"
    );
    a.close_shared(base).unwrap();

    let shared = a.share(kept).unwrap();
    assert_eq!(shared.parts.len(), 1, "the chunk whole");
    assert_eq!(shared.offset, 8 * PAGE);
    let (base, seen) = open(&mut a, &shared);
    assert!(holds_pattern(&a, seen, 6, 4 * PAGE));
    a.close_shared(base).unwrap();
    a.check_invariants().unwrap();
    a.free(other).unwrap();
    a.free(kept).unwrap();
}

mod interleaved {
    //! Sharing interleaved with allocations, frees, writes and memory pressure (compaction; with partial
    //! mappings on, lending may happen, which `a_block_on_lent_pages_is_shared_as_pieces_of_the_chunk` pins
    //! down): an import always sees its live allocation's latest bytes,
    //! which proves a live block's pages never move while it is shared; the invariants hold after every
    //! step; and once everything is closed and freed, the device holds nothing.

    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Step {
        Alloc(u64),
        Free(usize),
        Write(usize),
        Share(usize),
        Close(usize),
        EmptyCache,
    }

    fn step() -> impl Strategy<Value = Step> {
        prop_oneof![
            4 => prop_oneof![1u64..3000, PAGE..12 * PAGE, 20 * PAGE..45 * PAGE].prop_map(Step::Alloc),
            2 => any::<usize>().prop_map(Step::Free),
            2 => any::<usize>().prop_map(Step::Write),
            3 => any::<usize>().prop_map(Step::Share),
            2 => any::<usize>().prop_map(Step::Close),
            1 => Just(Step::EmptyCache),
        ]
    }

    /// A live allocation: address, size, and the id of the pattern last written.
    struct Live {
        addr: u64,
        size: u64,
        id: u64,
    }

    /// An open import: its range's start, where the allocation appears, and which allocation (its address,
    /// while it is live).
    struct Open {
        base: u64,
        seen: u64,
        of: Option<u64>,
    }

    fn run(steps: Vec<Step>, partial_mappings: bool) {
        let mut device = device(160, partial_mappings);
        {
            let mut a = Expandable::new(&mut device, chunked()).unwrap();
            let (mut live, mut open): (Vec<Live>, Vec<Open>) = (Vec::new(), Vec::new());
            let mut next_id = 1;
            for step in steps {
                match step {
                    Step::Alloc(size) => {
                        if let Ok(addr) = a.alloc(size, StreamId(1)) {
                            let bytes = common::pattern(next_id, size as usize);
                            a.driver_mut().write(addr, &bytes).unwrap();
                            live.push(Live {
                                addr,
                                size,
                                id: next_id,
                            });
                            next_id += 1;
                        }
                    }
                    Step::Free(i) if !live.is_empty() => {
                        let gone = live.swap_remove(i % live.len());
                        a.free(gone.addr).unwrap();
                        for o in open.iter_mut().filter(|o| o.of == Some(gone.addr)) {
                            o.of = None; // its bytes are the device's to reuse now
                        }
                    }
                    Step::Write(i) if !live.is_empty() => {
                        let n = live.len();
                        let block = &mut live[i % n];
                        block.id = next_id;
                        next_id += 1;
                        let bytes = common::pattern(block.id, block.size as usize);
                        a.driver_mut().write(block.addr, &bytes).unwrap();
                    }
                    Step::Share(i) if !live.is_empty() => {
                        let block = &live[i % live.len()];
                        let shared = a.share(block.addr).unwrap();
                        let parts: Vec<_> = shared.parts.iter().map(|p| p.borrowed()).collect();
                        match a.open_shared(&parts) {
                            Ok(base) => open.push(Open {
                                base,
                                seen: base + shared.offset,
                                of: Some(block.addr),
                            }),
                            // The importer's address space is the only thing it can run out of.
                            Err(err) => panic!("open_shared: {err}"),
                        }
                    }
                    Step::Close(i) if !open.is_empty() => {
                        let o = open.swap_remove(i % open.len());
                        a.close_shared(o.base).unwrap();
                    }
                    Step::EmptyCache => a.empty_cache().unwrap(),
                    _ => {}
                }
                a.check_invariants().unwrap();
                for o in &open {
                    let Some(block) = o.of.and_then(|addr| live.iter().find(|b| b.addr == addr))
                    else {
                        continue;
                    };
                    let seen = a.driver().read(o.seen, block.size as usize).unwrap();
                    assert!(
                        seen == common::pattern(block.id, block.size as usize),
                        "the import at {:#x} no longer sees the allocation at {:#x}",
                        o.base,
                        block.addr
                    );
                }
            }
            for o in open {
                a.close_shared(o.base).unwrap();
            }
            for block in live {
                a.free(block.addr).unwrap();
            }
            a.empty_cache().unwrap();
            a.check_invariants().unwrap();
        }
        let report = device.leak_report();
        assert!(report.is_empty(), "{report:?}");
        assert_eq!(device.used_bytes(), 0);
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(96))]

        #[test]
        fn imports_see_live_allocations_through_pressure(steps in prop::collection::vec(step(), 1..60)) {
            run(steps, false);
        }

        #[test]
        fn imports_see_live_allocations_with_partial_mappings(steps in prop::collection::vec(step(), 1..60)) {
            run(steps, true);
        }
    }
}
