//! A small simulated device and the checks the `sim_driver_*` tests share.

use cuvmm::driver::sim::{LeakReport, SimConfig, SimDriver};
use cuvmm::driver::{Driver, DriverError, PhysHandle, VaRange};
use cuvmm::size::KIB;

/// The device's granularity: 64 KiB.
pub const G: u64 = 64 * KIB;

/// A device with a 64 KiB granularity, 1 MiB of memory and a backing store.
pub fn device() -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_granularity(G)
            .with_capacity(16 * G)
            .with_backing_store(true),
    )
}

/// Everything observable about a device's memory, to prove a failed call changed nothing.
#[derive(Debug, PartialEq)]
pub struct State {
    report: LeakReport,
    used: u64,
    handles: usize,
    mappings: usize,
    reservations: usize,
    accessible: Vec<bool>,
}

impl State {
    pub fn of(d: &SimDriver) -> Self {
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
pub fn fails<T: std::fmt::Debug>(
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

/// Reserves room for `handles` handles of `pages_per_handle` pages each, creates them, maps them back to
/// back and sets access on the whole. Returns the reservation and the handles.
pub fn mapped(
    d: &mut SimDriver,
    handles: u64,
    pages_per_handle: u64,
) -> (VaRange, Vec<PhysHandle>) {
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

/// Unmaps, releases and frees what [`mapped`] made.
pub fn teardown(d: &mut SimDriver, r: VaRange, hs: &[PhysHandle]) {
    d.unmap(r.start, r.size).unwrap();
    for &h in hs {
        d.release(h).unwrap();
    }
    d.free_reservation(r).unwrap();
}
