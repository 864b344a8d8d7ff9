//! The conformance suite (`tests/conformance/mod.rs`) on the simulated device: SimDriver must obey every
//! CUDA rule the suite checks, reject every probe, and run the allocator's properties.

mod conformance;

use conformance::Subject;
use conformance::capture::{self, Capture};
use cuvmm::driver::sim::{LeakReport, SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, DriverError, StreamId};
use cuvmm::size::KIB;

impl Subject for SimDriver {
    fn held(&self) -> LeakReport {
        self.leak_report()
    }
}

impl Capture for SimDriver {
    fn begin_capture(&mut self, stream: StreamId, mode: CaptureMode) -> Result<u64, DriverError> {
        SimDriver::begin_capture(self, stream, mode)
    }
    fn end_capture(&mut self, stream: StreamId) -> Result<(), DriverError> {
        SimDriver::end_capture(self, stream)
    }
}

/// A 64 KiB-granularity device of 512 pages (32 MiB) with a backing store, so bytes can be checked.
fn sim() -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_granularity(64 * KIB)
            .with_capacity(512 * 64 * KIB)
            .with_backing_store(true),
    )
}

#[test]
fn sim_driver_obeys_every_rule() {
    conformance::run_rules(sim);
}

#[test]
fn sim_driver_obeys_every_rule_with_2_mib_pages() {
    conformance::run_rules(|| {
        SimDriver::new(
            SimConfig::default()
                .with_capacity(2 * cuvmm::size::GIB)
                .with_backing_store(true),
        )
    });
}

/// The simulator that can map part of a handle, as lending needs (no GPU driver is known to).
#[test]
fn sim_driver_obeys_every_rule_with_partial_mappings() {
    conformance::run_rules(|| SimDriver::new(sim().config().clone().with_partial_mappings(true)));
}

/// The simulator of a device whose handles cannot be exported (or a container that refuses them).
#[test]
fn sim_driver_obeys_every_rule_without_exportable_handles() {
    conformance::run_rules(|| {
        SimDriver::new(sim().config().clone().with_exportable_handles(false))
    });
}

#[test]
fn sim_driver_rejects_every_probe() {
    for probe in conformance::probes(sim) {
        assert!(
            probe.outcome.is_err(),
            "the simulator accepted: {}",
            probe.name
        );
    }
}

#[test]
fn sim_driver_obeys_every_capture_rule() {
    capture::run_capture_rules(sim);
}

/// The simulator refuses every call that gives memory back during a global capture, and the refusal
/// invalidates the capture (stricter than CUDA may be: `cuda_capture_facts_are_recorded` says what a GPU
/// does).
#[test]
fn sim_driver_refuses_giving_memory_back_during_a_global_capture() {
    let stream = capture::CAPTURED;
    for fact in capture::capture_facts(sim) {
        assert!(
            matches!(fact.outcome, Err(DriverError::CaptureUnsupported { stream: s, .. }) if s == stream),
            "{} during a global capture: {:?}",
            fact.call,
            fact.outcome
        );
        assert_eq!(
            fact.end,
            Err(DriverError::CaptureInvalidated { stream }),
            "{}",
            fact.call
        );
    }
}

#[test]
fn allocator_properties_hold_on_the_sim_driver() {
    conformance::allocator_properties(sim, 64);
}
