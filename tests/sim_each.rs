//! `Driver::create_each` and `Driver::map_each` on the simulated device, which does the calls in one pass
//! when all of them succeed: every outcome must be the one the calls made one by one give. Twin devices
//! run the same operations, one through the simulator's methods and one through `create_each_by_calls`
//! and `map_each_by_calls`, and must agree after each on the result, the handles, the counters (calls and
//! estimated time) and everything the device holds, through failures of every kind: out of memory, bad
//! sizes and addresses, mapped or released handles, ranges past the reservation, injected faults.

use cuvmm::driver::sim::{FaultKind, LeakReport, SimConfig, SimDriver};
use cuvmm::driver::{
    Driver, DriverCounters, DriverError, Op, PhysHandle, PhysPage, VaRange, create_each_by_calls,
    map_each_by_calls,
};
use cuvmm::size::KIB;
use proptest::prelude::*;

const G: u64 = 64 * KIB;
/// Granules of memory on the device.
const CAPACITY: u64 = 24;
/// Granules of the one reservation.
const RESERVED: u64 = 16;

#[derive(Clone, Debug)]
enum Step {
    /// One `create` of `granules` granules (0 is a bad size).
    Create { granules: u64 },
    /// `release` of the `pick`-th handle known.
    Release { pick: usize },
    /// One `map` of the `pick`-th handle at granule `at`.
    MapOne { at: u64, pick: usize },
    /// `create_each` of `count` handles of `granules` granules.
    CreateEach { granules: u64, count: usize },
    /// `map_each` at granule `at` (plus `skew` bytes) of `granules`-granule slots, of the handles picked,
    /// each from an offset of some granules (a pick past the known handles is a handle the device never
    /// made; an offset past a handle's end is refused).
    MapEach {
        at: u64,
        skew: u64,
        granules: u64,
        picks: Vec<(usize, u64)>,
    },
    /// The `n`-th next call of `create` or `map` fails.
    FailNth { map: bool, n: u64, oom: bool },
    /// No fault planned any more.
    ClearFaults,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        1 => (0..3u64).prop_map(|granules| Step::Create { granules }),
        1 => (0..12usize).prop_map(|pick| Step::Release { pick }),
        1 => (0..RESERVED + 2, 0..12usize).prop_map(|(at, pick)| Step::MapOne { at, pick }),
        3 => (0..3u64, 0..14usize).prop_map(|(granules, count)| Step::CreateEach { granules, count }),
        4 => (
            0..RESERVED + 2,
            prop_oneof![6 => Just(0u64), 1 => Just(4 * KIB)],
            1..3u64,
            prop::collection::vec((0..14usize, prop_oneof![4 => Just(0u64), 1 => 1..3u64]), 0..8),
        )
            .prop_map(|(at, skew, granules, picks)| Step::MapEach {
                at,
                skew,
                granules,
                picks,
            }),
        1 => (any::<bool>(), 1..5u64, any::<bool>()).prop_map(|(map, n, oom)| Step::FailNth {
            map,
            n,
            oom
        }),
        1 => Just(Step::ClearFaults),
    ]
}

/// One of the twins: its device, its reservation and the handles it was given, in order.
struct Twin {
    device: SimDriver,
    reserved: VaRange,
    handles: Vec<PhysHandle>,
}

/// Everything the two twins must agree on after a step.
#[derive(Debug, PartialEq)]
struct Seen {
    outcome: Result<(), (usize, DriverError)>,
    handles: Vec<PhysHandle>,
    counters: DriverCounters,
    held: LeakReport,
    used: u64,
    live_handles: usize,
    mappings: usize,
}

impl Twin {
    fn new() -> Self {
        let mut device = SimDriver::new(
            SimConfig::default()
                .with_granularity(G)
                .with_capacity(CAPACITY * G),
        );
        let reserved = device.reserve(RESERVED * G).expect("reserve");
        Self {
            device,
            reserved,
            handles: Vec::new(),
        }
    }

    /// The `pick`-th handle, or one the device never made.
    fn handle(&self, pick: usize) -> PhysHandle {
        self.handles.get(pick).copied().unwrap_or(PhysHandle(9_999))
    }

    /// Runs `step`; `batched` picks the simulator's one-pass methods over the calls one by one.
    fn run(&mut self, step: &Step, batched: bool) -> Seen {
        let single = |r: Result<(), DriverError>| r.map_err(|e| (0, e));
        let outcome = match step {
            Step::Create { granules } => match self.device.create(granules * G) {
                Ok(handle) => {
                    self.handles.push(handle);
                    Ok(())
                }
                Err(err) => Err((0, err)),
            },
            Step::Release { pick } => single(self.device.release(self.handle(*pick))),
            Step::MapOne { at, pick } => {
                let (va, handle) = (self.reserved.start + at * G, self.handle(*pick));
                let size = self.device_size(handle);
                single(self.device.map(va, size, handle))
            }
            Step::CreateEach { granules, count } => {
                let result = if batched {
                    self.device
                        .create_each(granules * G, *count, &mut self.handles)
                } else {
                    create_each_by_calls(&mut self.device, granules * G, *count, &mut self.handles)
                };
                single(result)
            }
            Step::MapEach {
                at,
                skew,
                granules,
                picks,
            } => {
                let va = self.reserved.start + at * G + skew;
                let pages: Vec<PhysPage> = picks
                    .iter()
                    .map(|&(p, offset)| PhysPage {
                        handle: self.handle(p),
                        offset: offset * G,
                    })
                    .collect();
                if batched {
                    self.device.map_each(va, granules * G, &pages)
                } else {
                    map_each_by_calls(&mut self.device, va, granules * G, &pages)
                }
            }
            Step::FailNth { map, n, oom } => {
                let op = if *map { Op::Map } else { Op::Create };
                let kind = if *oom {
                    FaultKind::OutOfMemory
                } else {
                    FaultKind::Error
                };
                self.device.fail_nth(op, *n, kind);
                Ok(())
            }
            Step::ClearFaults => {
                self.device.clear_faults();
                Ok(())
            }
        };
        Seen {
            outcome,
            handles: self.handles.clone(),
            counters: self.device.counters(),
            held: self.device.leak_report(),
            used: self.device.used_bytes(),
            live_handles: self.device.handle_count(),
            mappings: self.device.mapping_count(),
        }
    }

    /// The size of `handle` as the device holds it (a granule for one it does not know).
    fn device_size(&self, handle: PhysHandle) -> u64 {
        self.device
            .leak_report()
            .handles
            .iter()
            .find(|(h, _)| *h == handle)
            .map_or(G, |&(_, size)| size)
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(512))]

    #[test]
    fn one_pass_and_one_by_one_agree_on_everything(steps in prop::collection::vec(step(), 1..40)) {
        let (mut batched, mut by_calls) = (Twin::new(), Twin::new());
        for (i, step) in steps.iter().enumerate() {
            let a = batched.run(step, true);
            let b = by_calls.run(step, false);
            prop_assert_eq!(a, b, "step {}: {:?}", i, step);
        }
    }
}

/// The one-pass path is taken and counts every call: a run of maps then shows up as that many calls and
/// that much estimated time, with the pages mapped where asked.
#[test]
fn a_run_is_counted_call_by_call() {
    let mut twin = Twin::new();
    let mut handles = Vec::new();
    twin.device
        .create_each(G, 5, &mut handles)
        .expect("five granules fit");
    assert_eq!(handles.len(), 5);
    let va = twin.reserved.start + 3 * G;
    let pages: Vec<PhysPage> = handles.iter().copied().map(PhysPage::from).collect();
    twin.device.map_each(va, G, &pages).expect("maps");
    let counters = twin.device.counters();
    assert_eq!(counters.get(Op::Create), 5);
    assert_eq!(counters.get(Op::Map), 5);
    let latency = &twin.device.config().latency;
    let expected_ns = latency.cost_ns(Op::Reserve, RESERVED * G)
        + 5 * latency.cost_ns(Op::Create, G)
        + 5 * latency.cost_ns(Op::Map, G);
    assert_eq!(counters.time_ns, expected_ns);
    let mapped = twin.device.leak_report().mappings;
    assert_eq!(
        mapped,
        (3..8)
            .map(|i| VaRange::new(twin.reserved.start + i * G, G))
            .collect::<Vec<_>>()
    );
}

/// A failure part way reports how many calls succeeded, and those stay done.
#[test]
fn a_failure_part_way_keeps_what_was_done() {
    let mut twin = Twin::new();
    let mut handles = Vec::new();
    twin.device.create_each(G, 3, &mut handles).expect("fits");
    let va = twin.reserved.start;
    // The third handle goes where the first already is: granule 0 again.
    twin.device.map(va + 2 * G, G, handles[0]).expect("maps");
    let pages: Vec<PhysPage> = handles.iter().copied().map(PhysPage::from).collect();
    let err = twin
        .device
        .map_each(va, G, &pages)
        .expect_err("the third map overlaps");
    assert!(
        matches!(err, (2, DriverError::AlreadyMapped { .. })),
        "{err:?}"
    );
    assert_eq!(twin.device.mapping_count(), 3);
    // Creating more than fits stops at the first that does not, with what fitted kept.
    let mut more = Vec::new();
    let err = twin
        .device
        .create_each(G, CAPACITY as usize, &mut more)
        .expect_err("more than fits");
    assert!(err.is_out_of_memory(), "{err:?}");
    assert_eq!(more.len(), (CAPACITY - 3) as usize);
}
