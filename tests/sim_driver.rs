//! SimDriver against CUDA's rules: each misuse is its own typed error and leaves the device as it was;
//! bytes belong to physical memory; faults, events, counters and the latency model behave as documented.

use cuvmm::driver::sim::{FaultKind, LatencyModel, LeakReport, SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, EventId, MemInfo, Op, PhysHandle, StreamId, VaRange};
use cuvmm::size::{KIB, MIB};

const G: u64 = 64 * KIB;

/// A device with a 64 KiB granularity, 1 MiB of memory and a backing store.
fn device() -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_granularity(G)
            .with_capacity(16 * G)
            .with_backing_store(true),
    )
}

/// Everything observable about a device's memory, to prove a failed call changed nothing.
#[derive(Debug, PartialEq)]
struct State {
    report: LeakReport,
    used: u64,
    handles: usize,
    mappings: usize,
    reservations: usize,
    accessible: Vec<bool>,
}

impl State {
    fn of(d: &SimDriver) -> Self {
        let report = d.leak_report();
        let accessible = report
            .mappings
            .iter()
            .map(|m| d.is_accessible(m.start))
            .collect();
        Self {
            used: d.used_bytes(),
            handles: d.handle_count(),
            mappings: d.mapping_count(),
            reservations: d.reservation_count(),
            accessible,
            report,
        }
    }
}

/// Runs a call that must fail, checks that it changed nothing but the counters, and returns its error.
fn fails<T: std::fmt::Debug>(
    d: &mut SimDriver,
    call: impl FnOnce(&mut SimDriver) -> Result<T, DriverError>,
) -> DriverError {
    let before = State::of(d);
    let calls = d.counters().total();
    let err = call(d).expect_err("the call must fail");
    assert_eq!(
        State::of(d),
        before,
        "failed call changed the device: {err}"
    );
    assert_eq!(d.counters().total(), calls + 1, "failed call not counted");
    err
}

/// Reserves `pages` pages, creates one handle of `pages_per_handle` pages per slot, maps them back to
/// back and sets access on the whole. Returns the reservation and the handles.
fn mapped(d: &mut SimDriver, handles: u64, pages_per_handle: u64) -> (VaRange, Vec<PhysHandle>) {
    let size = pages_per_handle * G;
    let r = d.reserve(handles * size).unwrap();
    let hs: Vec<_> = (0..handles)
        .map(|i| {
            let h = d.create(size).unwrap();
            d.map(r.start + i * size, size, h).unwrap();
            h
        })
        .collect();
    d.set_access(r.start, r.size).unwrap();
    (r, hs)
}

fn teardown(d: &mut SimDriver, r: VaRange, hs: &[PhysHandle]) {
    d.unmap(r.start, r.size).unwrap();
    for &h in hs {
        d.release(h).unwrap();
    }
    d.free_reservation(r).unwrap();
}

#[test]
fn happy_path_ends_with_an_empty_leak_report() {
    let mut d = device();
    let r = d.reserve(4 * G).unwrap();
    let a = d.create(G).unwrap();
    let b = d.create(2 * G).unwrap();
    d.map(r.start, G, a).unwrap();
    d.map(r.start + G, 2 * G, b).unwrap();
    assert!(!d.is_accessible(r.start));
    d.set_access(r.start, 3 * G).unwrap(); // two whole mappings in one call
    assert!(d.is_accessible(r.start) && d.is_accessible(r.start + 3 * G - 1));
    assert!(!d.is_accessible(r.start + 3 * G));
    let data: Vec<u8> = (0..2 * G as usize).map(|i| (i % 253) as u8).collect();
    let at = r.start + G / 2; // spans both mappings
    d.write(at, &data).unwrap();
    assert_eq!(d.read(at, data.len()).unwrap(), data);
    assert_eq!(d.read(r.start, 16).unwrap(), vec![0; 16]);
    assert_eq!(
        (d.used_bytes(), d.handle_count(), d.mapping_count()),
        (3 * G, 2, 2)
    );
    d.unmap(r.start, 3 * G).unwrap();
    d.release(a).unwrap();
    d.release(b).unwrap();
    d.free_reservation(r).unwrap();
    let report = d.leak_report();
    assert!(report.is_empty(), "{report}");
    assert_eq!(report.to_string(), "no leaks");
    assert_eq!(d.used_bytes(), 0);
    assert_eq!(
        (d.handle_count(), d.mapping_count(), d.reservation_count()),
        (0, 0, 0)
    );
}

#[test]
fn reservations_are_realistic_aligned_and_apart() {
    let mut d = SimDriver::new(SimConfig::default());
    let g = d.granularity();
    let rs: Vec<VaRange> = [g, 3 * g, 10 * g, g]
        .iter()
        .map(|&s| d.reserve(s).unwrap())
        .collect();
    for w in rs.windows(2) {
        assert!(w[1].start >= w[0].end() + g, "{w:x?}");
    }
    for r in &rs {
        assert!(r.start >= 0x7f00_0000_0000 && r.end() <= 1 << 48);
        assert_eq!(r.start % g, 0);
    }
    for r in rs {
        d.free_reservation(r).unwrap();
    }
}

#[test]
fn reserve_rejects_bad_sizes_without_effect() {
    let mut d = device();
    assert_eq!(
        fails(&mut d, |d| d.reserve(0)),
        DriverError::ZeroSize { op: Op::Reserve }
    );
    assert_eq!(
        fails(&mut d, |d| d.reserve(G + 1)),
        DriverError::NotAligned {
            op: Op::Reserve,
            what: "size",
            value: G + 1,
            granularity: G
        }
    );
    let huge = u64::MAX / G * G;
    assert_eq!(
        fails(&mut d, |d| d.reserve(huge)),
        DriverError::VaExhausted {
            op: Op::Reserve,
            requested: huge
        }
    );
}

#[test]
fn va_space_is_exhausted_below_2_pow_48_and_freed_ranges_are_reused() {
    let mut d = SimDriver::new(SimConfig::default());
    let big = 1 << 46; // 64 TiB: two fit between 0x7f00_0000_0000 and 2^48
    let a = d.reserve(big).unwrap();
    let b = d.reserve(big).unwrap();
    assert!(b.end() <= 1 << 48);
    assert_eq!(
        fails(&mut d, |d| d.reserve(big)),
        DriverError::VaExhausted {
            op: Op::Reserve,
            requested: big
        }
    );
    d.free_reservation(a).unwrap();
    let c = d.reserve(big).unwrap();
    assert_eq!(c, a);
    d.free_reservation(b).unwrap();
    d.free_reservation(c).unwrap();
}

#[test]
fn free_reservation_needs_an_exact_empty_reservation() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 2, 1);
    let unknown = |start| DriverError::UnknownReservation {
        op: Op::FreeReservation,
        start,
    };
    assert_eq!(
        fails(&mut d, |d| d.free_reservation(VaRange::new(r.start + G, G))),
        unknown(r.start + G)
    );
    assert_eq!(
        fails(&mut d, |d| d.free_reservation(VaRange::new(r.start, G))),
        unknown(r.start)
    );
    assert_eq!(
        fails(&mut d, |d| d.free_reservation(r)),
        DriverError::ReservationInUse {
            start: r.start,
            mapped: 2
        }
    );
    teardown(&mut d, r, &hs);
    assert_eq!(fails(&mut d, |d| d.free_reservation(r)), unknown(r.start));
}

#[test]
fn create_checks_size_and_capacity() {
    let mut d = device();
    assert_eq!(
        fails(&mut d, |d| d.create(0)),
        DriverError::ZeroSize { op: Op::Create }
    );
    assert!(matches!(
        fails(&mut d, |d| d.create(G / 2)),
        DriverError::NotAligned {
            op: Op::Create,
            what: "size",
            ..
        }
    ));
    let h = d.create(10 * G).unwrap();
    let err = fails(&mut d, |d| d.create(7 * G));
    assert_eq!(
        err,
        DriverError::OutOfMemory {
            op: Op::Create,
            requested: 7 * G,
            free: 6 * G
        }
    );
    assert!(err.is_out_of_memory());
    let h2 = d.create(6 * G).unwrap();
    d.release(h).unwrap();
    d.release(h2).unwrap();
    assert_eq!(d.used_bytes(), 0);
}

#[test]
fn map_enforces_every_rule_without_effect() {
    let mut d = device();
    let r = d.reserve(4 * G).unwrap();
    let other = d.reserve(4 * G).unwrap();
    let h = d.create(2 * G).unwrap();
    let small = d.create(G).unwrap();
    let s = r.start;
    assert_eq!(
        fails(&mut d, |d| d.map(s, 0, h)),
        DriverError::ZeroSize { op: Op::Map }
    );
    assert!(matches!(
        fails(&mut d, |d| d.map(s, G + 512, h)),
        DriverError::NotAligned {
            op: Op::Map,
            what: "size",
            ..
        }
    ));
    assert!(matches!(
        fails(&mut d, |d| d.map(s + 512, 2 * G, h)),
        DriverError::NotAligned {
            op: Op::Map,
            what: "address",
            ..
        }
    ));
    let ghost = PhysHandle(9_999);
    assert_eq!(
        fails(&mut d, |d| d.map(s, 2 * G, ghost)),
        DriverError::UnknownHandle {
            op: Op::Map,
            handle: ghost
        }
    );
    assert_eq!(
        fails(&mut d, |d| d.map(s, G, h)),
        DriverError::SizeMismatch {
            handle: h,
            handle_size: 2 * G,
            size: G
        }
    );
    // Straddling the end of a reservation, in the gap after it, and before every reservation.
    for va in [s + 3 * G, r.end(), s - 4 * G] {
        assert_eq!(
            fails(&mut d, |d| d.map(va, 2 * G, h)),
            DriverError::OutsideReservation {
                op: Op::Map,
                start: va,
                size: 2 * G
            }
        );
    }
    let top = u64::MAX / G * G;
    assert!(matches!(
        fails(&mut d, |d| d.map(top, 2 * G, h)),
        DriverError::OutsideReservation { .. }
    ));
    d.map(s + G, 2 * G, h).unwrap();
    for va in [s + G, s + 2 * G] {
        let err = fails(&mut d, |d| d.map(va, G, small));
        assert_eq!(
            err,
            DriverError::AlreadyMapped {
                start: va,
                size: G,
                existing: s + G
            }
        );
    }
    let h3 = d.create(2 * G).unwrap();
    let err = fails(&mut d, |d| d.map(s, 2 * G, h3));
    assert_eq!(
        err,
        DriverError::AlreadyMapped {
            start: s,
            size: 2 * G,
            existing: s + G
        }
    );
    d.release(h3).unwrap();
    d.map(s, G, small).unwrap(); // right before the mapping: fine
    d.release(small).unwrap();
    let err = fails(&mut d, |d| d.map(other.start, G, small));
    assert_eq!(
        err,
        DriverError::UnknownHandle {
            op: Op::Map,
            handle: small
        }
    );
    d.unmap(s, 3 * G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
    d.free_reservation(other).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn unmap_and_set_access_need_whole_mappings_without_holes() {
    for op in [Op::Unmap, Op::SetAccess] {
        let mut d = device();
        let r = d.reserve(8 * G).unwrap();
        let s = r.start;
        let a = d.create(2 * G).unwrap();
        let b = d.create(2 * G).unwrap();
        d.map(s, 2 * G, a).unwrap();
        d.map(s + 2 * G, 2 * G, b).unwrap();
        let c = d.create(G).unwrap();
        d.map(s + 5 * G, G, c).unwrap(); // hole at s + 4G
        let call = |d: &mut SimDriver, va, size| match op {
            Op::Unmap => d.unmap(va, size),
            _ => d.set_access(va, size),
        };
        let partial = |va, size, mapping| DriverError::PartialMapping {
            op,
            start: va,
            size,
            mapping,
            mapping_size: 2 * G,
        };
        assert_eq!(fails(&mut d, |d| call(d, s, G)), partial(s, G, s));
        assert_eq!(fails(&mut d, |d| call(d, s + G, G)), partial(s + G, G, s));
        assert_eq!(
            fails(&mut d, |d| call(d, s + G, 3 * G)),
            partial(s + G, 3 * G, s)
        );
        assert_eq!(
            fails(&mut d, |d| call(d, s, 3 * G)),
            partial(s, 3 * G, s + 2 * G)
        );
        assert_eq!(
            fails(&mut d, |d| call(d, s, 6 * G)),
            DriverError::NotMapped {
                op,
                addr: s + 4 * G
            }
        );
        assert_eq!(
            fails(&mut d, |d| call(d, s + 6 * G, G)),
            DriverError::NotMapped {
                op,
                addr: s + 6 * G
            }
        );
        assert_eq!(
            fails(&mut d, |d| call(d, s, 0)),
            DriverError::ZeroSize { op }
        );
        assert!(matches!(
            fails(&mut d, |d| call(d, s, G - 1)),
            DriverError::NotAligned { what: "size", .. }
        ));
        assert!(matches!(
            fails(&mut d, |d| call(d, s + 1, G)),
            DriverError::NotAligned {
                what: "address",
                ..
            }
        ));
        // Several whole mappings at once are fine.
        call(&mut d, s, 4 * G).unwrap();
        call(&mut d, s + 5 * G, G).unwrap();
        if op == Op::SetAccess {
            d.unmap(s, 4 * G).unwrap();
            d.unmap(s + 5 * G, G).unwrap();
        }
        for h in [a, b, c] {
            d.release(h).unwrap();
        }
        d.free_reservation(r).unwrap();
        assert!(d.leak_report().is_empty());
    }
}

#[test]
fn reads_and_writes_need_mapped_accessible_memory() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 1, 2);
    let r2 = d.reserve(G).unwrap();
    let h2 = d.create(G).unwrap();
    d.map(r2.start, G, h2).unwrap();
    assert_eq!(
        d.write(r2.start, &[1]),
        Err(DriverError::AccessDenied { addr: r2.start })
    );
    assert_eq!(
        d.read(r2.start + 5, 1),
        Err(DriverError::AccessDenied { addr: r2.start + 5 })
    );
    let past = r.end();
    assert_eq!(
        d.read(past, 1),
        Err(DriverError::NotMapped {
            op: Op::Map,
            addr: past
        })
    );
    // A write running off the end of the mapping writes nothing at all.
    assert_eq!(
        d.write(past - 4, &[7; 8]),
        Err(DriverError::NotMapped {
            op: Op::Map,
            addr: past
        })
    );
    assert_eq!(d.read(past - 4, 4).unwrap(), vec![0; 4]);
    d.write(past - 4, &[7; 4]).unwrap();
    assert_eq!(d.read(past - 4, 4).unwrap(), vec![7; 4]);
    assert_eq!(d.read(past - 4, 0).unwrap(), Vec::<u8>::new());
    teardown(&mut d, r, &hs);
    assert_eq!(
        d.read(past - 4, 4),
        Err(DriverError::NotMapped {
            op: Op::Map,
            addr: past - 4
        })
    );
    d.unmap(r2.start, G).unwrap();
    d.release(h2).unwrap();
    d.free_reservation(r2).unwrap();
}

#[test]
fn without_a_backing_store_bytes_are_an_explicit_error() {
    let mut d = SimDriver::new(SimConfig::default().with_granularity(G));
    let (r, hs) = mapped(&mut d, 1, 1);
    assert_eq!(d.write(r.start, &[1, 2]), Err(DriverError::NoBackingStore));
    assert_eq!(d.read(r.start, 2), Err(DriverError::NoBackingStore));
    // Access rules are still checked first.
    assert!(matches!(
        d.read(r.end() + G, 1),
        Err(DriverError::NotMapped { .. })
    ));
    teardown(&mut d, r, &hs);
}

#[test]
fn memset_and_copy_to_host_are_counted_driver_calls_over_the_store() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 2, 1);
    let before = d.counters();
    d.memset_d8(r.start + 10, 2 * G - 20, 0xC3).unwrap();
    let mut out = vec![0; 2 * G as usize];
    d.copy_to_host(r.start, &mut out).unwrap();
    assert!(out[..10].iter().all(|&b| b == 0));
    assert!(out[10..out.len() - 10].iter().all(|&b| b == 0xC3));
    assert!(out[out.len() - 10..].iter().all(|&b| b == 0));
    // A later write wins over the fill, and the fill over what was there before.
    d.write(r.start + G, &[1, 2, 3]).unwrap();
    d.memset_d8(r.start + G + 1, 1, 9).unwrap();
    assert_eq!(
        d.read(r.start + G - 1, 5).unwrap(),
        vec![0xC3, 1, 9, 3, 0xC3]
    );
    let after = d.counters();
    assert_eq!(after.get(Op::Memset), before.get(Op::Memset) + 2);
    assert_eq!(after.get(Op::CopyToHost), before.get(Op::CopyToHost) + 1);
    let model = LatencyModel::a100();
    let expected = model.cost_ns(Op::Memset, 2 * G - 20)
        + model.cost_ns(Op::CopyToHost, 2 * G)
        + model.cost_ns(Op::Memset, 1);
    assert_eq!(after.time_ns - before.time_ns, expected);
    // The same access rules as reads and writes; a failed memset writes nothing.
    assert!(matches!(
        d.memset_d8(r.start, 3 * G, 1),
        Err(DriverError::NotMapped { .. })
    ));
    assert_eq!(d.read(r.start + 10, 1).unwrap(), vec![0xC3]);
    teardown(&mut d, r, &hs);

    let mut bare = SimDriver::new(SimConfig::default().with_granularity(G));
    let (r, hs) = mapped(&mut bare, 1, 1);
    assert_eq!(
        bare.memset_d8(r.start, G, 1),
        Err(DriverError::NoBackingStore)
    );
    assert_eq!(
        bare.copy_to_host(r.start, &mut [0; 4]),
        Err(DriverError::NoBackingStore)
    );
    teardown(&mut bare, r, &hs);
}

#[test]
fn bytes_move_with_a_remapped_handle() {
    let mut d = device();
    let r = d.reserve(8 * G).unwrap();
    let h = d.create(2 * G).unwrap();
    d.map(r.start, 2 * G, h).unwrap();
    d.set_access(r.start, 2 * G).unwrap();
    let pattern: Vec<u8> = (0..2 * G as usize).map(|i| (i * 7 % 256) as u8).collect();
    d.write(r.start, &pattern).unwrap();
    d.unmap(r.start, 2 * G).unwrap();
    let elsewhere = r.start + 5 * G;
    d.map(elsewhere, 2 * G, h).unwrap();
    assert!(
        !d.is_accessible(elsewhere),
        "a new mapping needs set_access again"
    );
    d.set_access(elsewhere, 2 * G).unwrap();
    assert_eq!(d.read(elsewhere, pattern.len()).unwrap(), pattern);
    assert!(matches!(
        d.read(r.start, 1),
        Err(DriverError::NotMapped { .. })
    ));
    d.unmap(elsewhere, 2 * G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
}

#[test]
fn a_released_handle_frees_its_memory_only_when_unmapped() {
    let mut d = device();
    let r = d.reserve(4 * G).unwrap();
    let h = d.create(2 * G).unwrap();
    d.map(r.start, 2 * G, h).unwrap();
    d.map(r.start + 2 * G, 2 * G, h).unwrap(); // the same handle twice: allowed
    d.set_access(r.start, 4 * G).unwrap();
    d.write(r.start + 10, b"shared").unwrap();
    assert_eq!(d.read(r.start + 2 * G + 10, 6).unwrap(), b"shared");
    d.release(h).unwrap();
    assert_eq!((d.handle_count(), d.used_bytes()), (0, 2 * G));
    assert!(d.leak_report().handles.is_empty());
    assert_eq!(d.read(r.start + 10, 6).unwrap(), b"shared");
    assert_eq!(
        fails(&mut d, |d| d.release(h)),
        DriverError::UnknownHandle {
            op: Op::Release,
            handle: h
        }
    );
    d.unmap(r.start, 2 * G).unwrap();
    assert_eq!(d.used_bytes(), 2 * G, "still mapped once");
    assert_eq!(d.mem_info().unwrap().free, 14 * G);
    d.unmap(r.start + 2 * G, 2 * G).unwrap();
    assert_eq!(d.used_bytes(), 0);
    assert_eq!(
        d.mem_info().unwrap(),
        MemInfo {
            free: 16 * G,
            total: 16 * G
        }
    );
    d.free_reservation(r).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn release_of_an_unknown_handle_fails() {
    let mut d = device();
    let ghost = PhysHandle(42);
    assert_eq!(
        fails(&mut d, |d| d.release(ghost)),
        DriverError::UnknownHandle {
            op: Op::Release,
            handle: ghost
        }
    );
    let h = d.create(G).unwrap();
    d.release(h).unwrap();
    assert_eq!(
        fails(&mut d, |d| d.release(h)),
        DriverError::UnknownHandle {
            op: Op::Release,
            handle: h
        }
    );
}

#[test]
fn fail_nth_fails_exactly_that_call() {
    let mut d = device();
    let first = d.create(G).unwrap(); // call 1 of create
    d.fail_nth(Op::Create, 2, FaultKind::Error); // call 3
    d.fail_nth(Op::Create, 3, FaultKind::OutOfMemory); // call 4
    let second = d.create(G).unwrap();
    assert_eq!(
        fails(&mut d, |d| d.create(G)),
        DriverError::Injected {
            op: Op::Create,
            call: 3
        }
    );
    assert_eq!(
        fails(&mut d, |d| d.create(G)),
        DriverError::OutOfMemory {
            op: Op::Create,
            requested: G,
            free: 14 * G
        }
    );
    let third = d.create(G).unwrap();
    assert_eq!(d.counters().get(Op::Create), 5);
    // Faults on other operations, and a fault hit by a call whose arguments are wrong.
    d.fail_nth(Op::Release, 1, FaultKind::Error);
    assert_eq!(
        fails(&mut d, |d| d.release(third)),
        DriverError::Injected {
            op: Op::Release,
            call: 1
        }
    );
    d.fail_nth(Op::Reserve, 1, FaultKind::Error);
    assert_eq!(
        fails(&mut d, |d| d.reserve(0)),
        DriverError::Injected {
            op: Op::Reserve,
            call: 1
        }
    );
    // clear_faults removes what is planned.
    d.fail_nth(Op::Create, 1, FaultKind::Error);
    d.clear_faults();
    let fourth = d.create(G).unwrap();
    for h in [first, second, third, fourth] {
        d.release(h).unwrap();
    }
    assert!(d.leak_report().is_empty());
}

/// The calls that fail when `ops` fail with probability 0.5 under `seed`.
fn random_pattern(seed: u64) -> Vec<bool> {
    let mut d = device();
    d.fail_randomly(&[Op::Create, Op::Release], 0.5, seed);
    let mut pattern = Vec::new();
    for _ in 0..100 {
        let created = d.create(G);
        pattern.push(created.is_err());
        if let Err(e) = &created {
            assert!(
                matches!(e, DriverError::Injected { op: Op::Create, .. }),
                "{e}"
            );
        }
        if let Ok(h) = created {
            loop {
                let released = d.release(h);
                pattern.push(released.is_err());
                if released.is_ok() {
                    break;
                }
            }
        }
        assert_eq!(d.used_bytes(), 0, "an injected failure had an effect");
    }
    pattern
}

#[test]
fn fail_randomly_is_deterministic_per_seed() {
    let a = random_pattern(7);
    assert_eq!(a, random_pattern(7));
    assert_ne!(a, random_pattern(8));
    let failures = a.iter().filter(|&&f| f).count();
    assert!(
        failures > 0 && failures < a.len(),
        "{failures} of {}",
        a.len()
    );
    let mut d = device();
    d.fail_randomly(&[Op::Create], 0.0, 1);
    assert!((0..50).all(|_| d.create(G).map(|h| d.release(h)).is_ok()));
    d.fail_randomly(&[Op::Create], 1.0, 1);
    assert!((0..50).all(|_| d.create(G).is_err()));
}

#[test]
fn events_complete_when_the_test_or_a_synchronize_says_so() {
    let mut d = device();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let (r, hs) = mapped(&mut d, 2, 1);
    let first = VaRange::new(r.start, G);
    let second = VaRange::new(r.start + G, G);
    // Events recorded behind pending work stay pending until that work completes.
    d.launch(s1, &[first]).unwrap();
    let a = d.record_event(s1).unwrap();
    d.launch(s1, &[second]).unwrap();
    let b = d.record_event(s1).unwrap();
    d.launch(s2, &[first]).unwrap();
    let c = d.record_event(s2).unwrap();
    assert_eq!((d.pending_events(s1), d.pending_events(s2)), (2, 1));
    assert_eq!((d.pending_work(s1), d.pending_work(s2)), (2, 1));
    assert_eq!(d.pending_event_ids(s1), vec![a, b]);
    assert!(!d.event_complete(a).unwrap());
    d.complete_event(a).unwrap();
    assert!(d.event_complete(a).unwrap());
    assert_eq!(
        d.pending_work(s1),
        1,
        "completing a completes the work before it only"
    );
    assert!(!d.event_complete(b).unwrap());
    d.complete_stream(s1);
    assert!(d.event_complete(b).unwrap());
    assert!(!d.event_complete(c).unwrap(), "another stream is untouched");
    d.launch(s1, &[second]).unwrap();
    let later = d.record_event(s1).unwrap();
    assert!(
        !d.event_complete(later).unwrap(),
        "recorded behind work launched after the stream completed"
    );
    d.synchronize(s2).unwrap();
    assert!(d.event_complete(c).unwrap());
    assert_eq!((d.pending_events(s1), d.pending_events(s2)), (1, 0));
    d.destroy_event(later).unwrap();
    assert_eq!(d.pending_events(s1), 0);
    assert_eq!(d.pending_work(s1), 1, "destroying an event leaves the work");
    let gone = DriverError::UnknownEvent { event: later };
    assert_eq!(d.event_complete(later), Err(gone.clone()));
    assert_eq!(d.destroy_event(later), Err(gone.clone()));
    assert_eq!(d.complete_event(later), Err(gone));
    let never = EventId(12_345);
    assert_eq!(
        d.event_complete(never),
        Err(DriverError::UnknownEvent { event: never })
    );
    d.synchronize(s1).unwrap();
    d.synchronize(StreamId::DEFAULT).unwrap();
    teardown(&mut d, r, &hs);
}

#[test]
fn an_event_on_an_idle_stream_is_complete_at_once() {
    let mut d = device();
    let e = d.record_event(StreamId(7)).unwrap();
    assert!(d.event_complete(e).unwrap());
    assert_eq!(d.pending_events(StreamId(7)), 0);
    d.complete_event(e).unwrap();
    d.destroy_event(e).unwrap();
}

#[test]
fn advance_completes_work_in_stream_order() {
    let mut d = device();
    let s = StreamId(3);
    let (r, hs) = mapped(&mut d, 3, 1);
    let pages: Vec<VaRange> = (0..3).map(|i| VaRange::new(r.start + i * G, G)).collect();
    let mut events = Vec::new();
    for &page in &pages {
        d.launch(s, &[page]).unwrap();
        events.push(d.record_event(s).unwrap());
    }
    assert_eq!(d.streams_using(r), vec![s]);
    assert_eq!(d.advance(s, 2), 2);
    let done: Vec<bool> = events
        .iter()
        .map(|&e| d.event_complete(e).unwrap())
        .collect();
    assert_eq!(done, [true, true, false]);
    assert_eq!(d.streams_using(VaRange::new(r.start, 2 * G)), vec![]);
    assert_eq!(d.streams_using(pages[2]), vec![s]);
    assert_eq!(d.advance(s, 5), 1, "only one work item was left");
    assert_eq!(d.advance(s, 1), 0);
    assert!(d.event_complete(events[2]).unwrap());
    for e in events {
        d.destroy_event(e).unwrap();
    }
    teardown(&mut d, r, &hs);
}

#[test]
fn work_launches_only_on_accessible_memory() {
    let mut d = device();
    let r = d.reserve(2 * G).unwrap();
    let h = d.create(G).unwrap();
    let s = StreamId(1);
    assert!(matches!(
        d.launch(s, &[VaRange::new(r.start, G)]),
        Err(DriverError::NotMapped { .. })
    ));
    d.map(r.start, G, h).unwrap();
    assert_eq!(
        d.launch(s, &[VaRange::new(r.start, G)]),
        Err(DriverError::AccessDenied { addr: r.start })
    );
    d.set_access(r.start, G).unwrap();
    assert!(
        d.launch(s, &[VaRange::new(r.start, G + 1)]).is_err(),
        "one byte past the mapping"
    );
    assert_eq!(d.pending_work(s), 0, "a refused launch queues nothing");
    d.launch(s, &[VaRange::new(r.start + 10, 100)]).unwrap();
    d.synchronize(s).unwrap();
    d.unmap(r.start, G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn unmapping_memory_that_pending_work_touches_fails_and_changes_nothing() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 4, 1);
    let (s1, s2) = (StreamId(1), StreamId(2));
    d.write(r.start + 3 * G, b"kept").unwrap();
    // s1 reads the last byte of page 1 and the first of page 2; s2 touches page 3.
    d.launch(s1, &[VaRange::new(r.start + 2 * G - 1, 2)])
        .unwrap();
    d.launch(s2, &[VaRange::new(r.start + 3 * G, 4)]).unwrap();
    let err = fails(&mut d, |d| d.unmap(r.start, r.size));
    assert_eq!(
        err,
        DriverError::UnmapWhileInUse {
            va: r.start + 2 * G - 1,
            stream: s1
        }
    );
    assert!(err.to_string().contains("pending work"), "{err}");
    assert_eq!(
        fails(&mut d, |d| d.unmap(r.start + 3 * G, G)),
        DriverError::UnmapWhileInUse {
            va: r.start + 3 * G,
            stream: s2
        }
    );
    // Page 0 is untouched by any work: it may go.
    d.unmap(r.start, G).unwrap();
    d.map(r.start, G, hs[0]).unwrap();
    d.set_access(r.start, G).unwrap();
    d.synchronize(s1).unwrap();
    d.unmap(r.start + G, 2 * G).unwrap();
    d.map(r.start + G, G, hs[1]).unwrap();
    d.map(r.start + 2 * G, G, hs[2]).unwrap();
    d.set_access(r.start + G, 2 * G).unwrap();
    assert_eq!(d.read(r.start + 3 * G, 4).unwrap(), b"kept");
    d.advance(s2, 1);
    teardown(&mut d, r, &hs);
}

#[test]
fn counters_and_estimated_time_follow_the_latency_model() {
    let mut d = SimDriver::new(SimConfig::default());
    let mib2 = 2 * MIB;
    let h = d.create(mib2).unwrap();
    assert_eq!(d.counters().time_ns, 193_000);
    let h4 = d.create(2 * mib2).unwrap();
    let r = d.reserve(4 * mib2).unwrap();
    let before = d.counters().time_ns;
    d.map(r.start, 2 * mib2, h4).unwrap();
    assert_eq!(
        d.counters().time_ns - before,
        2 * 1_500,
        "a 4 MiB map costs two units"
    );
    // A failed call is counted and costs time too.
    let before = d.counters();
    assert!(d.map(r.start, 2 * mib2, h4).is_err());
    assert_eq!(d.counters().get(Op::Map), before.get(Op::Map) + 1);
    assert_eq!(d.counters().time_ns - before.time_ns, 3_000);
    d.set_access(r.start, 2 * mib2).unwrap();
    d.unmap(r.start, 2 * mib2).unwrap();
    d.release(h4).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
    let c = d.counters();
    let expected = 193_000 * 3 + 5_000 + 3_000 * 2 + 36_000 * 2 + 26_000 * 2 + 26_000 * 3 + 5_000;
    assert_eq!(c.time_ns, expected);
    assert_eq!(c.total(), 10);
    assert_eq!(
        (c.get(Op::Create), c.get(Op::Release), c.get(Op::Malloc)),
        (2, 2, 0)
    );
    let model = LatencyModel::a100();
    assert_eq!(model.cost_ns(Op::Malloc, mib2), 230_500);
    assert_eq!(model.cost_ns(Op::Free, mib2), 52_000);
    let mut free = SimDriver::new(SimConfig::default().with_latency(LatencyModel::zero()));
    free.mem_info().unwrap();
    assert_eq!((free.counters().time_ns, free.counters().total()), (0, 1));
}

#[test]
fn mem_info_reports_free_and_total() {
    let mut d = device();
    assert_eq!(
        d.mem_info().unwrap(),
        MemInfo {
            free: 16 * G,
            total: 16 * G
        }
    );
    let h = d.create(4 * G).unwrap();
    let p = d.malloc(1000).unwrap(); // holds 1024 bytes
    assert_eq!(
        d.mem_info().unwrap(),
        MemInfo {
            free: 12 * G - 1024,
            total: 16 * G
        }
    );
    d.free(p).unwrap();
    d.release(h).unwrap();
    assert_eq!(d.mem_info().unwrap().free, 16 * G);
    assert_eq!(d.counters().get(Op::MemInfo), 3);
}

#[test]
fn malloc_and_free_follow_cuda_rules() {
    let mut d = SimDriver::new(
        SimConfig::default()
            .with_capacity(64 * MIB)
            .with_backing_store(true),
    );
    assert_eq!(
        fails(&mut d, |d| d.malloc(0)),
        DriverError::ZeroSize { op: Op::Malloc }
    );
    let small = d.malloc(100).unwrap();
    let small2 = d.malloc(100).unwrap();
    let large = d.malloc(3 * MIB).unwrap();
    assert!((0x7e00_0000_0000..0x7f00_0000_0000).contains(&small));
    assert_eq!(small % 512, 0);
    assert!(small2 >= small + 512, "no overlap");
    assert_eq!(large % (2 * MIB), 0);
    assert_eq!(d.used_bytes(), 1024 + 3 * MIB);
    assert_eq!(d.leak_report().allocations.len(), 3);
    let err = fails(&mut d, |d| d.malloc(62 * MIB));
    assert_eq!(
        err,
        DriverError::OutOfMemory {
            op: Op::Malloc,
            requested: 62 * MIB,
            free: 61 * MIB - 1024
        }
    );
    // Malloc'd memory is accessible at once, byte for byte, and no further.
    assert!(d.is_accessible(large) && d.is_accessible(large + 3 * MIB - 1));
    assert!(!d.is_accessible(large + 3 * MIB));
    d.write(large + MIB, b"hello").unwrap();
    assert_eq!(d.read(large + MIB, 5).unwrap(), b"hello");
    assert!(matches!(
        d.read(small + 99, 2),
        Err(DriverError::NotMapped { .. })
    ));
    let unknown = DriverError::UnknownPointer {
        op: Op::Free,
        addr: small + 512 * 1000,
    };
    assert_eq!(fails(&mut d, |d| d.free(small + 512 * 1000)), unknown);
    d.free(small).unwrap();
    assert_eq!(
        fails(&mut d, |d| d.free(small)),
        DriverError::UnknownPointer {
            op: Op::Free,
            addr: small
        }
    );
    assert!(!d.is_accessible(small));
    d.free(small2).unwrap();
    d.free(large).unwrap();
    assert_eq!(d.used_bytes(), 0);
    assert!(d.leak_report().is_empty());
}

#[test]
fn leak_report_lists_what_is_held_and_drop_does_not_panic() {
    let mut d = device();
    let r = d.reserve(2 * G).unwrap();
    let h = d.create(G).unwrap();
    d.map(r.start, G, h).unwrap();
    let p = d.malloc(G).unwrap();
    let report = d.leak_report();
    assert_eq!(report.handles, vec![(h, G)]);
    assert_eq!(report.mappings, vec![VaRange::new(r.start, G)]);
    assert_eq!(report.reservations, vec![r]);
    assert_eq!(report.allocations, vec![VaRange::new(p, G)]);
    let text = report.to_string();
    assert!(
        text.contains("1 handles not released (64.00 KiB): handle#1"),
        "{text}"
    );
    assert!(
        text.contains("mappings not unmapped") && text.contains("allocations not freed"),
        "{text}"
    );
    drop(d); // logs a warning, never panics
}

#[test]
fn granularity_zero_does_not_panic() {
    let mut d = SimDriver::new(SimConfig::default().with_granularity(0));
    assert_eq!(d.granularity(), 1);
    let r = d.reserve(10).unwrap();
    d.free_reservation(r).unwrap();
}

#[test]
fn planned_malloc_addresses_are_handed_out_by_size_when_clear() {
    let mut sim = SimDriver::new(SimConfig::default().with_capacity(1 << 30));
    let base = 0x7fe6_0000_0000;
    sim.plan_malloc_addresses([
        (2 << 20, base),
        (20 << 20, base + (64 << 20)),
        (2 << 20, base),
    ]);
    // A size with no plan entry is placed as usual.
    let other = sim.malloc(4 << 20).unwrap();
    assert!(!(base..base + (128 << 20)).contains(&other));
    // Sizes take the first planned entry of their size, out of order.
    assert_eq!(sim.malloc(20 << 20).unwrap(), base + (64 << 20));
    assert_eq!(sim.malloc(2 << 20).unwrap(), base);
    // The second entry for `base` overlaps a live allocation: skipped, so placed as usual.
    let third = sim.malloc(2 << 20).unwrap();
    assert_ne!(third, base);
    assert_eq!(sim.planned_malloc_addresses_left(), 1);
    sim.free(base).unwrap();
    assert_eq!(sim.malloc(2 << 20).unwrap(), base);
    assert_eq!(sim.planned_malloc_addresses_left(), 0);
}
