//! SimDriver's calls as counted and failed: fault injection (`fail_nth`, `fail_randomly`), the counters
//! and the latency model's estimated time, and `mem_info`.

mod common;

use common::sim_device::{G, device, fails};
use cuvmm::driver::sim::{FaultKind, LatencyModel, SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, MemInfo, Op};
use cuvmm::size::MIB;

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
