//! The conformance suite (`tests/conformance/mod.rs`) on the simulated device: SimDriver must obey every
//! CUDA rule the suite checks, reject every probe, and run the allocator's properties.

mod conformance;

use conformance::Subject;
use cuvmm::driver::sim::{LeakReport, SimConfig, SimDriver};
use cuvmm::size::KIB;

impl Subject for SimDriver {
    fn held(&self) -> LeakReport {
        self.leak_report()
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
fn allocator_properties_hold_on_the_sim_driver() {
    conformance::allocator_properties(sim, 64);
}
