//! The conformance suite (`tests/conformance/mod.rs`) on a real GPU through `CudaDriver`.
//!
//! Without libcuda or without a device, each test prints why it is skipped and passes: CI has no GPU, and
//! this file's job there is to prove that the `cuda` build compiles and that absence is handled without a
//! panic. Set `CUVMM_CUDA_DEVICE=N` to test device N instead of device 0. The tests share one GPU, so run
//! them with `--test-threads=1` on a GPU machine (docs/gpu.md) to keep the free-memory checks exact.
#![cfg(feature = "cuda")]

mod conformance;

use conformance::Subject;
use cuvmm::driver::cuda::CudaDriver;
use cuvmm::driver::sim::LeakReport;
use cuvmm::driver::{Driver, DriverError};

impl Subject for CudaDriver {
    fn held(&self) -> LeakReport {
        self.leak_report()
    }
}

/// The device under test.
fn ordinal() -> usize {
    std::env::var("CUVMM_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The device, or `None` (with a message) when this machine has no CUDA driver or no such device.
fn gpu() -> Option<CudaDriver> {
    match CudaDriver::new(ordinal()) {
        Ok(d) => Some(d),
        Err(DriverError::NoDriver { reason }) => {
            eprintln!("skipping the CUDA conformance suite: no CUDA driver found: {reason}");
            None
        }
        Err(e) => panic!("opening CUDA device {}: {e}", ordinal()),
    }
}

fn open() -> CudaDriver {
    CudaDriver::new(ordinal()).expect("the device opened a moment ago")
}

#[test]
fn opening_never_panics_and_absence_is_no_driver() {
    match CudaDriver::new(ordinal()) {
        Ok(d) => assert!(d.granularity() > 0 && d.granularity().is_power_of_two()),
        Err(DriverError::NoDriver { reason }) => assert!(!reason.is_empty()),
        Err(e) => panic!("unexpected error opening the device: {e}"),
    }
    // A device number no machine has is always "no driver/device", never a panic.
    match CudaDriver::new(1_000_000) {
        Err(DriverError::NoDriver { reason }) => assert!(!reason.is_empty()),
        other => panic!("device 1000000: {other:?}"),
    }
}

#[test]
fn cuda_driver_obeys_every_rule() {
    if gpu().is_none() {
        return;
    }
    conformance::run_rules(open);
}

#[test]
fn cuda_driver_probes_are_recorded() {
    if gpu().is_none() {
        return;
    }
    for probe in conformance::probes(open) {
        match probe.outcome {
            Ok(()) => eprintln!(
                "probe: CUDA accepts {} (the simulator is stricter)",
                probe.name
            ),
            Err(e) => eprintln!("probe: CUDA rejects {}: {e}", probe.name),
        }
    }
}

#[test]
fn allocator_properties_hold_on_the_cuda_driver() {
    if gpu().is_none() {
        return;
    }
    conformance::allocator_properties(open, 16);
}
