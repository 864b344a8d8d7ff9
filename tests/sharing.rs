//! Sharing an allocation with another process (`Allocator::share`, `open_shared`, `close_shared`), on the
//! simulated device: the importer here is the same device, which CUDA allows too (a process may import its
//! own exports), so the bytes seen through both mappings can be compared. The descriptors' journey between
//! processes is cuvmm-torch's (`cuvmm-torch/src/transport.rs`), tested there.

mod common;

use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::sharing::{SharedMemory, SharingError};
use cuvmm::{Allocator, Config, Error, Strategy as _, StreamId};

const PAGE: u64 = 4096;
const PAGES: u64 = 256;

type Alloc = Expandable<SimDriver>;

fn new_alloc() -> Alloc {
    // Large requests in 20-page chunks (the default `large_handle` is 20 MiB; here 20 pages).
    let config = Config {
        small_size: 1024,
        large_handle: 20 * PAGE,
        ..Config::default()
    };
    common::expandable_with(PAGE, PAGES, config, true)
}

/// Maps `shared` back in this allocator; returns where the allocation appears.
fn open(a: &mut Alloc, shared: &SharedMemory) -> (u64, u64) {
    let parts: Vec<_> = shared.parts.iter().map(|p| p.borrowed()).collect();
    let base = a.open_shared(&parts).expect("opens");
    a.check_invariants().unwrap();
    (base, base + shared.offset)
}

fn write(a: &mut Alloc, addr: u64, id: u64, size: u64) {
    let bytes = common::pattern(id, size as usize);
    a.driver_mut().write(addr, &bytes).expect("writable");
}

fn holds(a: &Alloc, addr: u64, id: u64, size: u64) -> bool {
    a.driver().read(addr, size as usize).expect("readable") == common::pattern(id, size as usize)
}

/// A small allocation that shares its page with others: the importer maps the whole page, sees the bytes
/// the exporter wrote, and the exporter sees the importer's writes.
#[test]
fn an_import_sees_the_exporters_bytes_and_the_exporter_sees_its_writes() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let before = a.alloc(700, s).unwrap();
    let x = a.alloc(900, s).unwrap();
    write(&mut a, before, 1, 700);
    write(&mut a, x, 2, 900);
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
    assert!(holds(&a, seen, 2, 900), "the importer sees the allocation");
    assert!(
        holds(&a, base + (before - (x - shared.offset)), 1, 700),
        "and its page"
    );
    write(&mut a, seen, 3, 900);
    assert!(
        holds(&a, x, 3, 900),
        "the exporter sees the importer's writes"
    );

    drop(shared); // the exporter's descriptors
    a.close_shared(base).unwrap();
    a.check_invariants().unwrap();
    assert!(holds(&a, x, 3, 900), "closing the import leaves the memory");
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
    write(&mut a, x, 4, 30 * PAGE);
    let shared = a.share(x).unwrap();
    assert!(
        shared
            .parts
            .iter()
            .all(|p| p.handle_size == 20 * PAGE && p.size == 20 * PAGE)
    );
    assert_eq!(shared.parts.len(), 2);
    let (base, seen) = open(&mut a, &shared);
    assert!(holds(&a, seen, 4, 30 * PAGE));
    a.close_shared(base).unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
}

/// The memory an import maps outlives the exporter's handles: freed and given back by the exporter, it
/// stays until the import is closed, then returns to the device.
#[test]
fn imported_memory_stays_until_the_import_is_closed() {
    let mut a = new_alloc();
    let x = a.alloc(3 * PAGE, StreamId(1)).unwrap();
    write(&mut a, x, 5, 3 * PAGE);
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
    assert!(holds(&a, seen, 5, 3 * PAGE), "the import keeps the bytes");
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
fn free_unknown_and_tagged_addresses_are_refused() {
    let mut a = new_alloc();
    let x = a.alloc(2 * PAGE, StreamId(1)).unwrap();
    assert!(matches!(a.share(x + 8), Err(Error::UnknownAddress { .. })));
    assert!(matches!(
        a.share(1 << 50),
        Err(Error::UnknownAddress { .. })
    ));
    a.free(x).unwrap();
    assert!(matches!(a.share(x), Err(Error::UnknownAddress { .. })));
    let kv = a.alloc_tagged(2 * PAGE, StreamId(1), "kv").unwrap();
    match a.share(kv) {
        Err(Error::Sharing(SharingError::Tagged { tag, .. })) => assert_eq!(tag, "kv"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        a.open_shared(&[]),
        Err(Error::Sharing(SharingError::Empty))
    ));
    a.check_invariants().unwrap();
    a.free(kv).unwrap();
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
