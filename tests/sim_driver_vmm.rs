//! SimDriver's virtual-memory calls against CUDA's rules: reserve, create, map, set_access, unmap, release,
//! free_reservation and malloc/free. Each misuse is its own typed error and leaves the device as it was;
//! the leak report lists what is still held.

mod common;

use common::sim_device::{G, device, fails, mapped, teardown};
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, MemInfo, Op, PhysHandle, VaRange};
use cuvmm::size::MIB;

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
