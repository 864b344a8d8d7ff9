//! SimDriver's bytes: they belong to physical memory (they move with a remapped handle), are read and
//! written only through mapped, accessible memory, and need a backing store.

mod common;

use common::sim_device::{G, device, mapped, teardown};
use cuvmm::driver::sim::{LatencyModel, SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, Op};

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
