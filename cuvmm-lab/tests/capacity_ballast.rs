//! The ballast that makes a capacity real on a CUDA device (`cuvmm capacity --backend cuda`), checked on
//! the simulated device, whose `malloc` and `create` share one capacity. Properties checked:
//! - a ballast leaves exactly the capacity free (in whole 2 MiB pages), and releasing it gives everything
//!   back; a capacity above what is free is refused without allocating;
//! - an allocator on a device with a ballast fits or runs out of memory as on a simulated device of that
//!   size: at the capacity the simulated-size search found, and one page less;
//! - the capacity search with a ballast ([`SimBallast`], the method of `--backend cuda`) finds the same
//!   capacity as the simulated-size search for cuvmm and classic.
//!
//! Not for pytorch-expandable, and rightly so: PyTorch reserves each expandable segment's address range
//! at 1.125 times the device's *total* memory. On a device of C bytes that is 1.125 C, and a segment whose
//! range is used up (its freed middle cannot be reused for a larger block) makes PyTorch open another; with
//! a ballast the total is the whole device's and the range never runs out. So with a ballast it may fit in
//! less (on `moe`, three pages less), as PyTorch would on a large GPU with only C free. The property
//! checked for it: the ballast's capacity is never above the simulated size's, and it fits there.
//! - a trace whose lower bound is above what the device has free is a usage error, before any replay.

use cuvmm::driver::Driver;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::{GIB, MIB};
use cuvmm_lab::experiments::capacity::ballast::{Ballast, BallastError, with_ballast};
use cuvmm_lab::experiments::capacity::device::{CapacityDevice, SimBallast, SimSized};
use cuvmm_lab::experiments::capacity::{self, CapacityError, CapacityOptions};
use cuvmm_lab::replay::allocators::{self, ALLOCATORS};
use cuvmm_lab::replay::observe::NoObserver;
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::trace::Trace;
use cuvmm_lab::workload;

const PAGE: u64 = 2 * MIB;

fn sim(capacity: u64) -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(capacity)
            .with_granularity(PAGE),
    )
}

fn moe() -> Trace {
    workload::generate("moe", workload::DEFAULT_SEED).expect("moe")
}

/// OOMs of `allocator` replaying `trace` on a `device`-byte simulated device with a ballast leaving
/// `capacity` free, the allocator on the ballast's own driver.
fn ooms_with_ballast(trace: &Trace, allocator: &str, capacity: u64, device: u64) -> u64 {
    let config = capacity::config(&CapacityOptions::default()).unwrap();
    let mut driver = sim(device);
    with_ballast(&mut driver, capacity, |d, ballast| {
        assert_eq!(ballast.free_seen(), capacity);
        let mut strategy = allocators::build_on(allocator, &mut *d, config).unwrap();
        let result = replay(strategy.as_mut(), trace, &ReplayOptions::default());
        Ok::<_, BallastError>(result.unwrap().ooms)
    })
    .unwrap()
}

#[test]
fn a_ballast_leaves_the_capacity_free_and_gives_it_all_back() {
    let mut driver = sim(8 * GIB);
    let ballast = Ballast::place(&mut driver, 3 * GIB).unwrap();
    assert_eq!(ballast.bytes(), 5 * GIB);
    assert_eq!(ballast.free_seen(), 3 * GIB);
    let info = driver.mem_info().unwrap();
    assert_eq!((info.free, info.total), (3 * GIB, 8 * GIB));
    ballast.release(&mut driver).unwrap();
    assert_eq!(driver.mem_info().unwrap().free, 8 * GIB);
    assert_eq!(driver.used_bytes(), 0);

    // Not a whole number of 2 MiB pages: the ballast is rounded down, the allocator sees a little more.
    let ballast = Ballast::place(&mut driver, 3 * GIB + MIB).unwrap();
    assert_eq!(ballast.bytes(), 5 * GIB - 2 * MIB);
    assert_eq!(ballast.free_seen(), 3 * GIB + 2 * MIB);
    ballast.release(&mut driver).unwrap();

    // The whole device: no ballast at all.
    let ballast = Ballast::place(&mut driver, 8 * GIB).unwrap();
    assert_eq!(ballast.bytes(), 0);
    ballast.release(&mut driver).unwrap();

    // More than is free: refused, nothing allocated.
    let err = Ballast::place(&mut driver, 9 * GIB).unwrap_err();
    assert!(
        matches!(err, BallastError::AboveFree { free, .. } if free == 8 * GIB),
        "{err}"
    );
    assert!(
        err.to_string().contains("above what the device has free"),
        "{err}"
    );
    assert_eq!(driver.used_bytes(), 0);
    let usage = CapacityError::from(err);
    assert!(usage.is_usage_error());
}

#[test]
fn the_ballast_is_released_when_the_replay_fails() {
    let mut driver = sim(4 * GIB);
    let result: Result<(), CapacityError> = with_ballast(&mut driver, GIB, |d, _| {
        assert_eq!(d.mem_info().unwrap().free, GIB);
        Err(CapacityError::TraceAboveFree {
            trace: "t".into(),
            lower_bound: 2 * GIB,
            free: GIB,
        })
    });
    assert!(result.is_err());
    assert_eq!(driver.used_bytes(), 0);
}

#[test]
fn with_a_ballast_each_allocator_fits_and_ooms_as_on_a_device_of_that_size() {
    let trace = moe();
    let options = CapacityOptions::default();
    for allocator in ALLOCATORS {
        let found = capacity::search(&trace, allocator, &options, &mut NoObserver).unwrap();
        let min = found.min_capacity_bytes.expect("fits");
        let device = 4 * min;
        assert_eq!(
            ooms_with_ballast(&trace, allocator, min, device),
            0,
            "{allocator} at {min}"
        );
        // (pytorch-expandable's segments are larger with a ballast: see the module docs.)
        if min > found.lower_bound_bytes && *allocator != "pytorch-expandable" {
            assert!(
                ooms_with_ballast(&trace, allocator, min - PAGE, device) > 0,
                "{allocator}: one page less fits with a ballast"
            );
        }
    }
}

#[test]
fn the_search_with_a_ballast_finds_the_simulated_size_capacity() {
    let trace = moe();
    let options = CapacityOptions::default();
    let config = capacity::config(&options).unwrap();
    for allocator in ALLOCATORS {
        let mut sized = SimSized {
            page_size: PAGE,
            config: config.clone(),
        };
        let by_size =
            capacity::search_on(&trace, allocator, &options, &mut sized, &mut NoObserver).unwrap();
        // A device larger than any capacity the sized search may try (16 times the lower bound).
        let mut ballasted = SimBallast {
            device_capacity: by_size.lower_bound_bytes * 16,
            page_size: PAGE,
            config: config.clone(),
        };
        let by_ballast =
            capacity::search_on(&trace, allocator, &options, &mut ballasted, &mut NoObserver)
                .unwrap();
        if *allocator == "pytorch-expandable" {
            // Its segments' address ranges follow the device's total: see the module docs.
            assert!(by_ballast.min_capacity_bytes <= by_size.min_capacity_bytes);
        } else {
            assert_eq!(
                by_ballast.min_capacity_bytes, by_size.min_capacity_bytes,
                "{allocator}"
            );
            assert_eq!(
                by_ballast.peak_reserved_bytes, by_size.peak_reserved_bytes,
                "{allocator}"
            );
        }
        assert_eq!(by_ballast.device_free_bytes, by_ballast.min_capacity_bytes);
        assert_eq!(by_size.device_free_bytes, None);
    }
}

#[test]
fn a_trace_above_what_the_device_has_free_is_refused_before_any_replay() {
    let trace = moe();
    let options = CapacityOptions::default();
    let lower = capacity::lower_bound(&trace, PAGE);
    let mut small = SimBallast {
        device_capacity: lower - PAGE,
        page_size: PAGE,
        config: capacity::config(&options).unwrap(),
    };
    assert_eq!(small.ceiling().unwrap(), Some(lower - PAGE));
    let err =
        capacity::search_on(&trace, "cuvmm", &options, &mut small, &mut NoObserver).unwrap_err();
    assert!(
        matches!(err, CapacityError::TraceAboveFree { lower_bound, .. } if lower_bound == lower),
        "{err}"
    );
    assert!(err.is_usage_error());
    assert!(err.to_string().contains("the device has free"), "{err}");

    // The search stops at what the device has free: nothing up to it fits, no capacity is claimed.
    let mut tight = SimBallast {
        device_capacity: lower,
        ..small
    };
    let result = capacity::search_on(&trace, "classic", &options, &mut tight, &mut NoObserver);
    let result = result.unwrap();
    if result.min_capacity_bytes.is_none() {
        assert_eq!(result.searched_up_to_bytes, lower);
    }
}

#[test]
fn cuda_async_is_refused_on_the_simulator() {
    let trace = moe();
    let options = CapacityOptions::default();
    let err = capacity::search(&trace, "cuda-async", &options, &mut NoObserver).unwrap_err();
    assert!(err.is_usage_error());
    assert!(err.to_string().contains("runs only on a GPU"), "{err}");
}
