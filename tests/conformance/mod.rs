//! The conformance suite, written once against [`Driver`]: what keeps the simulator honest.
//!
//! It runs on [`SimDriver`](cuvmm::driver::sim::SimDriver) in every build (`tests/conformance_sim.rs`) and
//! on a real GPU through `CudaDriver` when one is present (`tests/conformance_cuda.rs`). It has four parts:
//!
//! - [`rules`]: CUDA's documented rules, each of which SimDriver enforces. A misuse must be rejected, with
//!   the simulator's own error kind or a `DriverError::Cuda` carrying the real `CUresult`, and must leave
//!   the device as it was (the next calls succeed, nothing leaks, free memory is back where it was).
//! - [`probes`]: rules where the simulator may be *stricter* than CUDA (its documentation is silent or
//!   looser). On the simulator they must be rejected; on a GPU the outcome is printed for the record
//!   (docs/gpu-results.md), not asserted.
//! - [`allocator_properties`]: the allocator's property test at small scale, on the driver under test:
//!   random alloc / free / empty_cache / trim on three streams, a byte pattern written into every
//!   allocation and checked before its free, `check_invariants()` after every step, and nothing held by
//!   the driver at the end.
//!
//! - [`capture`]: CUDA graph capture: the rules every driver obeys ([`capture::capture_rules`]) and what
//!   the calls that give memory back do during a capture ([`capture::capture_facts`]: refused by the
//!   simulator, recorded on a GPU).
//!
//! Memory checks allow half a page of slack, because a real driver's free-memory figure moves by small
//! amounts of its own; on the simulator the figures are exact anyway.
#![allow(dead_code)]

mod allocator;
pub mod capture;
mod partial_mappings;
mod probes;
mod sharing;

pub use allocator::allocator_properties;
use partial_mappings::map_from_offset;
pub use probes::probes;
use sharing::export_and_import;

use cuvmm::config::Budget;
use cuvmm::driver::sim::LeakReport;
use cuvmm::driver::{
    CopyDirection, CopyPlan, Driver, DriverError, EventId, HostCopy, HostPinning, Op, PhysHandle,
    PhysPage, StreamId, VaRange,
};
use cuvmm::expandable::Expandable;
use cuvmm::{Config, Error, Strategy as _};
use proptest::prelude::*;
use proptest::test_runner::{Config as RunnerConfig, TestRunner};
use std::collections::BTreeMap;
use std::fmt::Debug;

/// A driver under test: the trait, plus a view of what it still holds.
pub trait Subject: Driver + Debug + 'static {
    /// What the driver still holds (handles, mappings, reservations, allocations).
    fn held(&self) -> LeakReport;
}

/// One rule of the suite.
pub type Rule<D> = (&'static str, fn(&mut D));

/// Every rule, by name.
pub fn rules<D: Subject>() -> Vec<Rule<D>> {
    vec![
        ("map_set_access_unmap_round_trip", round_trip::<D>),
        (
            "sizes_and_addresses_must_be_multiples_of_the_granularity",
            aligned::<D>,
        ),
        (
            "mappings_must_lie_inside_a_reservation",
            inside_reservation::<D>,
        ),
        ("a_mapped_range_cannot_be_mapped_again", no_double_map::<D>),
        (
            "unmap_and_set_access_take_whole_mappings",
            whole_mappings::<D>,
        ),
        ("unknown_handles_are_rejected", unknown_handles::<D>),
        (
            "release_while_mapped_frees_at_unmap",
            release_while_mapped::<D>,
        ),
        (
            "free_reservation_needs_an_exact_empty_reservation",
            free_reservation::<D>,
        ),
        ("mem_info_accounts_for_created_memory", mem_info::<D>),
        ("beyond_the_device_is_out_of_memory", out_of_memory::<D>),
        ("malloc_and_free", malloc_and_free::<D>),
        ("events_complete_after_synchronize", events::<D>),
        (
            "bytes_stay_with_a_remapped_handle",
            bytes_move_with_handle::<D>,
        ),
        (
            "a_handle_maps_in_parts_only_where_the_driver_says_so",
            map_from_offset::<D>,
        ),
        (
            "an_exported_handle_imports_as_the_same_memory",
            export_and_import::<D>,
        ),
        (
            "copy_jobs_move_bytes_both_ways_and_keep_their_ranges_mapped",
            copy_jobs::<D>,
        ),
        ("counters_count_failed_calls_too", counters::<D>),
        (
            "add_peer_of_itself_is_a_no_op_and_of_no_device_an_error",
            peers::<D>,
        ),
    ]
}

/// Runs every rule on a fresh driver from `make`, printing each rule's name first (a failure's output
/// then says which rule broke), and checks that each leaves nothing held.
pub fn run_rules<D: Subject>(make: impl Fn() -> D) {
    for (name, rule) in rules::<D>() {
        eprintln!("conformance: {name}");
        let mut d = make();
        rule(&mut d);
        let held = d.held();
        assert!(held.is_empty(), "{name}: the driver still holds {held}");
    }
}

/// Accepts an error if it is the simulator's kind for the rule or a real CUDA error.
fn rejected<T: Debug>(what: &str, result: Result<T, DriverError>, kind: fn(&DriverError) -> bool) {
    match result {
        Ok(value) => panic!("{what}: accepted (-> {value:?}), but CUDA rejects it"),
        Err(e) if kind(&e) || matches!(e, DriverError::Cuda { .. }) => {}
        Err(e) => panic!("{what}: rejected with an unexpected error: {e}"),
    }
}

fn free_bytes<D: Driver>(d: &mut D) -> u64 {
    d.mem_info().expect("mem_info").free
}

/// Reserves `pages` pages and creates `handles` one-page handles.
fn setup<D: Driver>(d: &mut D, pages: u64, handles: usize) -> (VaRange, Vec<PhysHandle>) {
    let g = d.granularity();
    let r = d.reserve(pages * g).expect("reserve");
    let hs = (0..handles)
        .map(|_| d.create(g).expect("create one page"))
        .collect();
    (r, hs)
}

/// Releases `handles` and frees `r` (everything must already be unmapped).
fn teardown<D: Driver>(d: &mut D, r: VaRange, handles: &[PhysHandle]) {
    for &h in handles {
        d.release(h).expect("release");
    }
    d.free_reservation(r).expect("free_reservation");
}

/// Reads `len` bytes at `va` and checks that each is `value`.
fn expect_bytes<D: Driver>(d: &mut D, va: u64, len: usize, value: u8, what: &str) {
    let mut out = vec![!value; len];
    d.copy_to_host(va, &mut out).expect("copy_to_host");
    if let Some(at) = out.iter().position(|&b| b != value) {
        panic!(
            "{what}: byte {at} at {va:#x} is {:#04x}, expected {value:#04x}",
            out[at]
        );
    }
}

fn round_trip<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let free0 = free_bytes(d);
    let (r, hs) = setup(d, 4, 2);
    d.map(r.start, g, hs[0]).expect("map the first page");
    d.map(r.start + g, g, hs[1]).expect("map the second page");
    // One set_access, memset and unmap may each cover several whole mappings.
    d.set_access(r.start, 2 * g)
        .expect("set_access on two mappings");
    d.memset_d8(r.start, 2 * g, 0xAB)
        .expect("memset across two mappings");
    expect_bytes(d, r.start + g - 64, 128, 0xAB, "across the boundary");
    d.unmap(r.start, 2 * g).expect("unmap two mappings at once");
    teardown(d, r, &hs);
    let free1 = free_bytes(d);
    assert!(
        free1 + g / 2 >= free0,
        "free memory did not come back: {free0} -> {free1}"
    );
}

fn aligned<D: Subject>(d: &mut D) {
    let g = d.granularity();
    rejected("create(0)", d.create(0), |e| {
        matches!(e, DriverError::ZeroSize { .. })
    });
    rejected("create(granularity / 2)", d.create(g / 2), |e| {
        matches!(e, DriverError::NotAligned { .. })
    });
    rejected("reserve(granularity + 1)", d.reserve(g + 1), |e| {
        matches!(e, DriverError::NotAligned { .. })
    });
    let (r, hs) = setup(d, 4, 1);
    rejected(
        "map at half a page",
        d.map(r.start + g / 2, g, hs[0]),
        |e| matches!(e, DriverError::NotAligned { .. }),
    );
    d.map(r.start, g, hs[0]).expect("map after the failed map");
    rejected(
        "set_access on half a page",
        d.set_access(r.start, g / 2),
        |e| matches!(e, DriverError::NotAligned { .. }),
    );
    rejected("unmap of half a page", d.unmap(r.start, g / 2), |e| {
        matches!(e, DriverError::NotAligned { .. })
    });
    d.unmap(r.start, g).expect("unmap after the failed calls");
    teardown(d, r, &hs);
}

fn inside_reservation<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, hs) = setup(d, 2, 1);
    rejected("map past the end", d.map(r.end(), g, hs[0]), |e| {
        matches!(e, DriverError::OutsideReservation { .. })
    });
    rejected("map before the start", d.map(r.start - g, g, hs[0]), |e| {
        matches!(e, DriverError::OutsideReservation { .. })
    });
    rejected("set_access past the end", d.set_access(r.end(), g), |e| {
        matches!(
            e,
            DriverError::OutsideReservation { .. } | DriverError::NotMapped { .. }
        )
    });
    d.map(r.start + g, g, hs[0]).expect("map on the last page");
    d.unmap(r.start + g, g).expect("unmap");
    teardown(d, r, &hs);
}

fn no_double_map<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, mut hs) = setup(d, 4, 2);
    hs.push(d.create(2 * g).expect("create two pages"));
    d.map(r.start + g, g, hs[0]).expect("map");
    rejected(
        "map twice at one address",
        d.map(r.start + g, g, hs[1]),
        |e| matches!(e, DriverError::AlreadyMapped { .. }),
    );
    rejected(
        "map overlapping a mapping",
        d.map(r.start, 2 * g, hs[2]),
        |e| matches!(e, DriverError::AlreadyMapped { .. }),
    );
    d.set_access(r.start + g, g).expect("set_access");
    d.memset_d8(r.start + g, g, 0x3C).expect("memset");
    d.map(r.start + 2 * g, 2 * g, hs[2])
        .expect("map the two-page handle after the existing mapping");
    expect_bytes(
        d,
        r.start + g,
        256,
        0x3C,
        "the first mapping after failed maps",
    );
    d.unmap(r.start + g, g).expect("unmap the first");
    d.unmap(r.start + 2 * g, 2 * g).expect("unmap the second");
    teardown(d, r, &hs);
}

fn whole_mappings<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let r = d.reserve(2 * g).expect("reserve");
    let h = d.create(2 * g).expect("create two pages");
    d.map(r.start, 2 * g, h).expect("map");
    rejected(
        "set_access on half a mapping",
        d.set_access(r.start, g),
        |e| matches!(e, DriverError::PartialMapping { .. }),
    );
    rejected("unmap of the first half", d.unmap(r.start, g), |e| {
        matches!(e, DriverError::PartialMapping { .. })
    });
    rejected("unmap of the second half", d.unmap(r.start + g, g), |e| {
        matches!(e, DriverError::PartialMapping { .. })
    });
    d.set_access(r.start, 2 * g)
        .expect("set_access on the whole");
    d.memset_d8(r.start, 2 * g, 0x77).expect("memset");
    expect_bytes(d, r.start + 2 * g - 32, 32, 0x77, "the end of the mapping");
    d.unmap(r.start, 2 * g).expect("unmap the whole");
    teardown(d, r, &[h]);
}

fn unknown_handles<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, hs) = setup(d, 1, 1);
    d.release(hs[0]).expect("release");
    rejected("release twice", d.release(hs[0]), |e| {
        matches!(e, DriverError::UnknownHandle { .. })
    });
    rejected("map a released handle", d.map(r.start, g, hs[0]), |e| {
        matches!(e, DriverError::UnknownHandle { .. })
    });
    rejected(
        "release a handle never created",
        d.release(PhysHandle(hs[0].0 ^ 0x5a5a_0000)),
        |e| matches!(e, DriverError::UnknownHandle { .. }),
    );
    d.free_reservation(r).expect("free_reservation");
}

fn release_while_mapped<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let free0 = free_bytes(d);
    let (r, hs) = setup(d, 1, 1);
    d.map(r.start, g, hs[0]).expect("map");
    d.set_access(r.start, g).expect("set_access");
    d.memset_d8(r.start, g, 0x5A).expect("memset");
    d.release(hs[0]).expect("release while mapped is allowed");
    expect_bytes(d, r.start, 512, 0x5A, "a released but mapped handle");
    let held = free_bytes(d);
    assert!(
        held + g / 2 <= free0,
        "memory was freed at release, before the unmap: {free0} -> {held}"
    );
    rejected("map a released handle", d.map(r.start, g, hs[0]), |e| {
        matches!(
            e,
            DriverError::UnknownHandle { .. } | DriverError::AlreadyMapped { .. }
        )
    });
    d.unmap(r.start, g).expect("unmap");
    let back = free_bytes(d);
    assert!(
        back + g / 2 >= free0,
        "memory was not freed at the unmap: {free0} -> {back}"
    );
    d.free_reservation(r).expect("free_reservation");
}

fn free_reservation<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, hs) = setup(d, 2, 1);
    rejected(
        "free half a reservation",
        d.free_reservation(VaRange::new(r.start, g)),
        |e| matches!(e, DriverError::UnknownReservation { .. }),
    );
    d.map(r.start, g, hs[0]).expect("map");
    rejected("free a reservation in use", d.free_reservation(r), |e| {
        matches!(e, DriverError::ReservationInUse { .. })
    });
    d.unmap(r.start, g).expect("unmap");
    teardown(d, r, &hs);
    rejected("free a reservation twice", d.free_reservation(r), |e| {
        matches!(e, DriverError::UnknownReservation { .. })
    });
}

fn mem_info<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let info = d.mem_info().expect("mem_info");
    assert!(info.total > 0 && info.free <= info.total, "{info:?}");
    let hs: Vec<PhysHandle> = (0..4).map(|_| d.create(g).expect("create")).collect();
    let during = free_bytes(d);
    assert!(
        during + 4 * g <= info.free + g / 2,
        "4 pages created but free memory went {} -> {during}",
        info.free
    );
    for h in hs {
        d.release(h).expect("release");
    }
    let after = free_bytes(d);
    assert!(
        after + g / 2 >= info.free,
        "released memory did not come back: {} -> {after}",
        info.free
    );
}

fn out_of_memory<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let total = d.mem_info().expect("mem_info").total;
    let too_much = (total / g + 1) * g;
    match d.create(too_much) {
        Err(e) => assert!(e.is_out_of_memory(), "create beyond the device: {e}"),
        Ok(h) => {
            d.release(h).expect("release");
            panic!("create({too_much}) succeeded on a device of {total} bytes");
        }
    }
    match d.malloc(too_much) {
        Err(e) => assert!(e.is_out_of_memory(), "malloc beyond the device: {e}"),
        Ok(p) => {
            d.free(p).expect("free");
            panic!("malloc({too_much}) succeeded on a device of {total} bytes");
        }
    }
    // Still usable afterwards.
    let h = d.create(g).expect("create after out of memory");
    d.release(h).expect("release");
}

fn malloc_and_free<D: Subject>(d: &mut D) {
    rejected("malloc(0)", d.malloc(0), |e| {
        matches!(e, DriverError::ZeroSize { .. })
    });
    let p = d.malloc(1536).expect("malloc");
    assert_eq!(p % 256, 0, "cuMemAlloc pointers are at least 256 B aligned");
    d.memset_d8(p, 1536, 7).expect("memset");
    expect_bytes(d, p, 1536, 7, "malloc'd memory");
    let q = d.malloc(4096).expect("a second malloc");
    assert!(q >= p + 1536 || q + 4096 <= p, "allocations overlap");
    d.free(p).expect("free");
    rejected("free twice", d.free(p), |e| {
        matches!(e, DriverError::UnknownPointer { .. })
    });
    rejected("memset after free", d.memset_d8(p, 16, 1), |e| {
        matches!(e, DriverError::NotMapped { .. })
    });
    d.free(q).expect("free the second");
}

fn events<D: Subject>(d: &mut D) {
    let stream = StreamId(1);
    let e = d.record_event(stream).expect("record_event");
    d.synchronize(stream).expect("synchronize");
    assert!(
        d.event_complete(e).expect("event_complete"),
        "an event is complete once its stream is synchronized"
    );
    let on_default = d
        .record_event(StreamId::DEFAULT)
        .expect("record on the default stream");
    d.synchronize(StreamId::DEFAULT)
        .expect("synchronize the default stream");
    assert!(d.event_complete(on_default).expect("event_complete"));
    d.destroy_event(e).expect("destroy_event");
    d.destroy_event(on_default).expect("destroy_event");
    let unknown = |err: &DriverError| matches!(err, DriverError::UnknownEvent { .. });
    rejected("query a destroyed event", d.event_complete(e), unknown);
    rejected("destroy twice", d.destroy_event(e), unknown);
    rejected(
        "query an event never recorded",
        d.event_complete(EventId(u64::MAX)),
        unknown,
    );
}

fn bytes_move_with_handle<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, hs) = setup(d, 3, 1);
    d.map(r.start, g, hs[0]).expect("map at A");
    d.set_access(r.start, g).expect("set_access at A");
    d.memset_d8(r.start, g, 0x11).expect("memset at A");
    d.unmap(r.start, g).expect("unmap A");
    rejected(
        "read an unmapped page",
        d.copy_to_host(r.start, &mut [0; 8]),
        |e| matches!(e, DriverError::NotMapped { .. }),
    );
    d.map(r.start + 2 * g, g, hs[0]).expect("map at B");
    rejected(
        "read before set_access",
        d.copy_to_host(r.start + 2 * g, &mut [0; 8]),
        |e| matches!(e, DriverError::AccessDenied { .. }),
    );
    d.set_access(r.start + 2 * g, g).expect("set_access at B");
    expect_bytes(d, r.start + 2 * g, g as usize, 0x11, "a remapped handle");
    d.unmap(r.start + 2 * g, g).expect("unmap B");
    teardown(d, r, &hs);
}

/// A copy job to the host and back (a sleep's and a wake's), pinning each way a configuration can ask
/// for (registered memory, and `cuMemHostAlloc` from two threads): every byte arrives, in page-locked
/// memory where the driver has it, and an unmap of a range the job copies is refused until it is over.
/// Pieces pinned ahead by a job that copies nothing (a preparation's) take a later job's copies.
fn copy_jobs<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let (r, hs) = setup(d, 2, 2);
    for (i, &h) in hs.iter().enumerate() {
        d.map(r.start + i as u64 * g, g, h).expect("map");
    }
    d.set_access(r.start, 2 * g).expect("set_access");
    let copies = vec![
        HostCopy {
            va: r.start,
            len: g,
            piece: 0,
            offset: 0,
        },
        HostCopy {
            va: r.start + g,
            len: g / 2,
            piece: 1,
            offset: 0,
        },
        HostCopy {
            va: r.start + g + g / 2,
            len: g / 2,
            piece: 1,
            offset: g / 2,
        },
    ];
    let ways = [
        HostPinning::default(),
        HostPinning {
            register: false,
            threads: 2,
        },
    ];
    for (pinning, value) in ways.into_iter().zip([0x33u8, 0x44]) {
        d.memset_d8(r.start, 2 * g, value).expect("memset");
        let to_host = CopyPlan {
            direction: CopyDirection::ToHost,
            pieces: vec![g, g],
            allocate: vec![true, true],
            copies: copies.clone(),
            pinning,
        };
        let job = d.start_copies(to_host).expect("start_copies to the host");
        rejected("unmap under a copy job", d.unmap(r.start, g), |e| {
            matches!(e, DriverError::UnmapWhileInUse { .. })
        });
        let out = job.run(vec![None, None]);
        out.result.expect("copies to the host");
        let pieces: Vec<_> = out
            .pieces
            .into_iter()
            .map(|p| p.expect("a piece"))
            .collect();
        for piece in &pieces {
            assert!(
                piece.as_slice().iter().all(|&b| b == value),
                "copied to the host ({pinning:?})"
            );
            assert!(
                piece.is_pinned(),
                "a piece in pageable memory ({pinning:?})"
            );
        }
        d.memset_d8(r.start, 2 * g, 0).expect("memset");
        let from_host = CopyPlan {
            direction: CopyDirection::FromHost,
            pieces: vec![g, g],
            allocate: vec![false, false],
            copies: copies.clone(),
            pinning,
        };
        let job = d
            .start_copies(from_host)
            .expect("start_copies from the host");
        let out = job.run(pieces.into_iter().map(Some).collect());
        out.result.expect("copies from the host");
        expect_bytes(d, r.start, 2 * g as usize, value, "copied back");

        // Pinned ahead by a job of pieces and no copies (`prepare_sleep`'s), then copied into by another.
        let pin_only = CopyPlan {
            direction: CopyDirection::ToHost,
            pieces: vec![g, g],
            allocate: vec![true, true],
            copies: Vec::new(),
            pinning,
        };
        let job = d.start_copies(pin_only).expect("start_copies, pieces only");
        let out = job.run(vec![None, None]);
        out.result.expect("pinning ahead");
        let ahead: Vec<_> = (out.pieces.into_iter())
            .map(|p| p.expect("a piece pinned ahead"))
            .collect();
        assert!(
            ahead.iter().all(|p| p.is_pinned() && p.len() as u64 >= g),
            "pinned ahead, long enough ({pinning:?})"
        );
        let into_ahead = CopyPlan {
            direction: CopyDirection::ToHost,
            pieces: vec![g, g],
            allocate: vec![false, false],
            copies: copies.clone(),
            pinning,
        };
        let job = d
            .start_copies(into_ahead)
            .expect("start_copies into pieces pinned ahead");
        let out = job.run(ahead.into_iter().map(Some).collect());
        out.result.expect("copies into pieces pinned ahead");
        for piece in out.pieces {
            let piece = piece.expect("a piece");
            assert!(
                piece.as_slice()[..g as usize].iter().all(|&b| b == value),
                "copied into a piece pinned ahead ({pinning:?})"
            );
        }
    }
    d.unmap(r.start, 2 * g)
        .expect("unmap once the jobs are over");
    teardown(d, r, &hs);
}

fn counters<D: Subject>(d: &mut D) {
    let g = d.granularity();
    let before = d.counters();
    let _ = d.create(g / 2);
    let h = d.create(g).expect("create");
    d.release(h).expect("release");
    let after = d.counters();
    assert_eq!(after.get(Op::Create), before.get(Op::Create) + 2);
    assert_eq!(after.get(Op::Release), before.get(Op::Release) + 1);
    assert!(after.total() >= before.total() + 3);
}

/// Peers: adding the device itself does nothing (and access still works), adding a device the machine
/// does not have is an error.
fn peers<D: Subject>(d: &mut D) {
    let ordinal = d.ordinal();
    d.add_peer(ordinal).expect("add_peer of the device itself");
    let g = d.granularity();
    let (r, hs) = setup(d, 1, 1);
    d.map(r.start, g, hs[0]).expect("map");
    d.set_access(r.start, g)
        .expect("set_access after adding the device itself");
    d.memset_d8(r.start, g, 0x5C).expect("memset");
    rejected(
        "add_peer of a device the machine does not have",
        d.add_peer(1_000_000),
        |e| matches!(e, DriverError::PeerAccess { .. }),
    );
    d.set_access(r.start, g)
        .expect("set_access after the refused peer");
    d.unmap(r.start, g).expect("unmap");
    teardown(d, r, &hs);
}
