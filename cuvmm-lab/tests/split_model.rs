//! Model-based property test of the split allocator, classic and pytorch-expandable.
//!
//! Weighted random sequences of alloc / free / empty_cache / trim over three streams, under several
//! PyTorch configurations, are applied to the allocator and to a `BTreeMap` model of live allocations.
//! Properties checked after every step:
//! - live allocations never overlap, are 512 B aligned, and keep their size: `allocated_bytes`,
//!   `requested_bytes` and `allocation` equal the model's sums;
//! - every invariant of `check_invariants()` holds (blocks tile segments, free neighbours merged, pools and
//!   statistics agree with the blocks, expandable pages mapped exactly under mapped blocks);
//! - a failure is out-of-memory, and only when the device cannot hold the live blocks' segments plus the
//!   request's;
//! - at the end, after freeing everything and `empty_cache()`: nothing reserved and the simulated driver
//!   reports no leak.

use cuvmm::config::Config;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::MIB;
use cuvmm::{Strategy as _, StreamId};
use cuvmm_lab::pytorch_model::Split;
use proptest::prelude::*;
use std::collections::BTreeMap;

#[derive(Debug, Clone)]
enum Action {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    EmptyCache,
    Trim { mib: u64 },
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0u32..=26, 1u64..=1 << 20, 0u64..3).prop_map(|(shift, frac, stream)| {
            // Log-uniform sizes from 1 byte to 64 MiB.
            let size = ((((64 * MIB) >> shift).max(1) * frac) >> 20).max(1);
            Action::Alloc { size, stream }
        }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        1 => Just(Action::EmptyCache),
        1 => (0u64..64).prop_map(|mib| Action::Trim { mib }),
    ]
}

const CONFIGS: [&str; 5] = [
    "",
    "max_split_size_mb:40",
    "roundup_power2_divisions:[2:1,8:4,>:8],max_split_size_mb:24,max_non_split_rounding_mb:30",
    "garbage_collection_threshold:0.6",
    "expandable_segments:True",
];

fn run(conf: &str, actions: Vec<Action>) {
    let capacity = 512 * MIB;
    let sim = SimDriver::new(SimConfig::default().with_capacity(capacity));
    let mut a = Split::new(sim, Config::from_alloc_conf(conf).unwrap()).unwrap();
    if conf.contains("garbage") {
        a.set_memory_fraction(0.9).unwrap();
    }
    let mut model: BTreeMap<u64, (u64, u64)> = BTreeMap::new();
    for action in actions {
        match action {
            Action::Alloc { size, stream } => match a.alloc(size, StreamId(stream)) {
                Ok(addr) => {
                    assert_eq!(addr % 512, 0);
                    let end = addr + size;
                    if let Some((&prev, &(psize, _))) = model.range(..addr).next_back() {
                        assert!(prev + psize <= addr, "overlaps the block at {prev:#x}");
                    }
                    if let Some((&next, _)) = model.range(addr..).next() {
                        assert!(end <= next, "overlaps the block at {next:#x}");
                    }
                    model.insert(addr, (size, stream));
                }
                Err(e) => {
                    assert!(e.is_out_of_memory(), "{e}");
                    // Each live block needs at most its own 20 MiB-rounded segment (or 2 MiB page run
                    // plus a partial page at each end); failing with far less live is a bug.
                    let live: u64 = model.values().map(|&(s, _)| s).sum();
                    assert!(
                        live + size > capacity / 4,
                        "out of memory with only {live} bytes live and {size} asked"
                    );
                }
            },
            Action::Free { pick } => {
                if !model.is_empty() {
                    let addr = *model.keys().nth(pick % model.len()).unwrap();
                    model.remove(&addr);
                    a.free(addr).unwrap();
                }
            }
            Action::EmptyCache => a.empty_cache().unwrap(),
            Action::Trim { mib } => {
                a.trim(mib * MIB).unwrap();
            }
        }
        a.check_invariants().unwrap();
        let s = a.stats();
        assert_eq!(s.allocation.current, model.len() as u64);
        assert_eq!(
            s.requested_bytes.current,
            model.values().map(|&(sz, _)| sz).sum::<u64>()
        );
        assert!(s.allocated_bytes.current >= s.requested_bytes.current);
        assert!(s.reserved_bytes.current >= s.allocated_bytes.current);
    }
    for addr in std::mem::take(&mut model).into_keys() {
        a.free(addr).unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(a.driver().leak_report().is_empty());
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 48, ..ProptestConfig::default() })]

    #[test]
    fn split_keeps_its_invariants(
        conf in 0..CONFIGS.len(),
        actions in prop::collection::vec(action(), 1..200),
    ) {
        run(CONFIGS[conf], actions);
    }
}
