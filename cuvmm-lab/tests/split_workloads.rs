//! The classic and pytorch-expandable models replay every built-in workload with their invariants
//! checked along the way, and give everything back to the device afterwards.

use cuvmm::Strategy;
use cuvmm::config::Config;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::GIB;
use cuvmm_lab::pytorch_model::Split;
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::workload::{self, BUILTIN};

fn check(expandable: bool) {
    for name in BUILTIN {
        let trace = workload::generate(name, workload::DEFAULT_SEED).expect("built-in");
        let sim = SimDriver::new(SimConfig::default().with_capacity(80 * GIB));
        let config = Config {
            expandable_segments: expandable,
            ..Config::default()
        };
        let mut a = Split::new(sim, config).expect("allocator");
        let options = ReplayOptions {
            check_invariants_every: Some(997),
            ..ReplayOptions::default()
        };
        let result = replay(&mut a, &trace, &options).expect("replay");
        assert_eq!(result.ooms, 0, "{name}");
        assert!(result.peak_reserved_bytes >= result.peak_allocated_bytes);
        let s = a.stats();
        assert_eq!(s.allocated_bytes.peak, result.peak_allocated_bytes);
        a.empty_cache().expect("empty_cache");
        a.check_invariants().expect("invariants after empty_cache");
        let live = a.stats().allocated_bytes.current;
        assert!(a.stats().reserved_bytes.current >= live);
        drop(a);
    }
}

#[test]
fn classic_replays_every_workload() {
    check(false);
}

#[test]
fn pytorch_expandable_replays_every_workload() {
    check(true);
}
