//! Fault-injection sweep: every driver call a random operation sequence makes is made to fail in turn.
//!
//! For each allocator (cuvmm's `Expandable`, the classic split model and PyTorch's expandable segments) and
//! each seed, a random sequence of operations (allocations of random sizes, multi-page growths included;
//! frees; `trim`; `empty_cache`; for cuvmm also `record_stream`, allocations under two tags, and `sleep`
//! (keeping the bytes or not) and `wake` of those tags) first runs without faults, counting the
//! driver calls of each kind it makes. Then, for each kind of call (reserve, create, map, set_access,
//! unmap, release, and the other calls each allocator makes) and each call index `n` the sequence reached,
//! the sequence runs again on a fresh allocator whose `n`th call of that kind fails (`SimDriver::fail_nth`;
//! `create` and `malloc` also fail once as out-of-memory, the failure the allocators retry). The sweep
//! runs a second time with failures *after the effect* (`AfterEffect`: the call does its work, then
//! returns an error, as a real driver's call can) for cuvmm. (The models of PyTorch's allocator do not
//! survive that sweep, as PyTorch's allocator would not: after a `cudaFree` or `cuMemAddressFree` that
//! worked but reported an error they keep the segment and fail when freeing it again.) Checked:
//! - the fault fires, and the operation it fires in either succeeds (recovered: a documented retry, or
//!   memory kept idle when giving it back failed) or fails with a typed driver or out-of-memory error;
//!   an out-of-memory `create` or `malloc` inside a successful allocation was retried
//!   (`num_alloc_retries` went up); every other operation succeeds;
//! - after every operation: `check_invariants()`, the statistics against the live allocations,
//!   `reserved_bytes` equal to what the device holds, and every live allocation's bytes, except those of a
//!   sleeping tag (asleep, or half way after a failed sleep or wake): after its wake, its bytes are back if
//!   its sleep kept them; an allocation under, or a free of, a sleeping tag is refused (`TagAsleep`);
//! - at the end, with faults cleared: the allocator serves new requests (a multi-page one included) and
//!   their bytes read back; after freeing everything and `empty_cache`, nothing is reserved, no event is
//!   left, and the device's leak report is empty (no handle, mapping, reservation or `malloc`).
//!
//! `CUVMM_FAULT_SWEEP_SEEDS=N` runs N seeds per allocator instead of the default (for the figures in
//! `docs/reliability.md`); each test prints what it injected to stderr.

#[path = "fault_sweep/trial.rs"]
mod trial;

use trial::run;

use cuvmm::config::Config;
use cuvmm::driver::Op;
use cuvmm::driver::after_effect::AfterEffect;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Driver as _, Error, Strategy, StreamId};
use cuvmm_lab::pytorch_model::Split;
use std::collections::BTreeMap;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
/// Seeds per allocator in a plain `cargo test`.
const DEFAULT_SEEDS: u64 = 12;
/// Operations per sequence.
const OPS: usize = 36;
/// Bytes of one marker written into live allocations.
const MARKER: u64 = 16;
/// The calls a fault is injected into, for every allocator (a kind an allocator never calls is skipped).
const FAULT_OPS: [Op; 17] = [
    Op::Reserve,
    Op::Create,
    Op::Map,
    Op::SetAccess,
    Op::Unmap,
    Op::Release,
    Op::FreeReservation,
    Op::Synchronize,
    Op::Malloc,
    Op::Free,
    Op::RecordEvent,
    Op::QueryEvent,
    Op::DestroyEvent,
    Op::MemInfo,
    Op::CopyToHost,
    Op::CopyFromHost,
    Op::HostAlloc,
];

/// Which allocator a sweep drives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Cuvmm,
    Classic,
    PytorchExpandable,
}

impl Kind {
    /// Device granularity; allocation sizes scale with it.
    fn granularity(self) -> u64 {
        match self {
            Kind::Cuvmm => 64 * KIB,
            Kind::Classic | Kind::PytorchExpandable => 2 * MIB,
        }
    }

    /// A device large enough that no sequence runs out of memory.
    fn capacity(self) -> u64 {
        match self {
            Kind::Cuvmm => 512 * self.granularity(),
            Kind::Classic | Kind::PytorchExpandable => 1024 * MIB,
        }
    }

    /// Spacing of the markers in live allocations: one per page.
    fn stride(self) -> u64 {
        match self {
            Kind::Cuvmm => self.granularity(),
            Kind::Classic | Kind::PytorchExpandable => 2 * MIB,
        }
    }
}

/// The driver under every allocator: the simulator, wrapped to fail chosen calls after their effect.
type Device = AfterEffect<SimDriver>;

/// The allocator under test, reachable as a `Strategy` and through its simulated device.
enum Subject {
    Cuvmm(Box<Expandable<Device>>),
    Split(Box<Split<Device>>),
}

impl Subject {
    /// A fresh allocator of `kind`; `seed` picks cuvmm's idle limit (0, so frees give memory back, or
    /// unlimited).
    fn new(kind: Kind, seed: u64) -> Self {
        let sim = AfterEffect::new(SimDriver::new(
            SimConfig::default()
                .with_capacity(kind.capacity())
                .with_granularity(kind.granularity())
                .with_backing_store(true),
        ));
        match kind {
            Kind::Cuvmm => {
                let idle = if seed % 2 == 0 { 0 } else { u64::MAX };
                let config = Config {
                    small_size: 4 * KIB,
                    ..Config::default()
                }
                .with_max_idle_bytes(idle);
                Subject::Cuvmm(Box::new(
                    Expandable::new(sim, config).expect("valid configuration"),
                ))
            }
            Kind::Classic | Kind::PytorchExpandable => {
                let config = Config {
                    expandable_segments: kind == Kind::PytorchExpandable,
                    ..Config::default()
                };
                Subject::Split(Box::new(
                    Split::new(sim, config).expect("valid configuration"),
                ))
            }
        }
    }

    fn strategy(&mut self) -> &mut dyn Strategy {
        match self {
            Subject::Cuvmm(a) => a.as_mut(),
            Subject::Split(a) => a.as_mut(),
        }
    }

    fn device_mut(&mut self) -> &mut Device {
        match self {
            Subject::Cuvmm(a) => a.driver_mut(),
            Subject::Split(a) => a.driver_mut(),
        }
    }

    fn sim(&self) -> &SimDriver {
        match self {
            Subject::Cuvmm(a) => a.driver().inner(),
            Subject::Split(a) => a.driver().inner(),
        }
    }

    fn sim_mut(&mut self) -> &mut SimDriver {
        self.device_mut().inner_mut()
    }

    /// Plans `fault`.
    fn plan(&mut self, fault: Fault) {
        match fault.kind {
            Failure::Before(kind) => self.sim_mut().fail_nth(fault.op, fault.n, kind),
            Failure::AfterEffect => self.device_mut().fail_nth_after_effect(fault.op, fault.n),
        }
    }

    /// Removes every planned fault.
    fn clear_faults(&mut self) {
        self.device_mut().clear();
        self.sim_mut().clear_faults();
    }
}

/// One operation of a sequence. Picks choose among the live allocations (modulo their number).
#[derive(Clone, Copy, Debug)]
enum Step {
    Alloc { size: u64, stream: u64 },
    AllocTagged { size: u64, stream: u64, tag: usize },
    Sleep { tag: usize, keep: bool },
    Wake { tag: usize },
    Free { pick: usize },
    RecordStream { pick: usize, stream: u64 },
    Trim { bytes: u64 },
    EmptyCache,
}

/// SplitMix64, so a sequence is a pure function of its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// A random sequence for `kind`: sizes from a few bytes to several pages (multi-page growths), at most
/// eight allocations live, so the device never runs short.
fn sequence(kind: Kind, seed: u64) -> Vec<Step> {
    let mut rng = Rng(seed.wrapping_mul(0x2545_F491_4F6C_DD1D) ^ kind as u64);
    let page = kind.granularity();
    let (mut live, mut steps) = (0usize, Vec::with_capacity(OPS));
    // cuvmm also draws tagged allocations, sleeps and wakes.
    let kinds = if kind == Kind::Cuvmm { 26 } else { 20 };
    while steps.len() < OPS {
        let step = match rng.below(kinds) {
            0..=8 if live < 8 => {
                let size = match rng.below(4) {
                    0 => 1 + rng.below(4 * KIB),
                    1 => 1 + rng.below(page),
                    2 => page * (1 + rng.below(6)) + rng.below(page),
                    _ => match kind {
                        Kind::Cuvmm => page * (1 + rng.below(12)),
                        _ => MIB * (1 + rng.below(60)) + rng.below(MIB),
                    },
                };
                live += 1;
                Step::Alloc {
                    size,
                    stream: rng.below(3),
                }
            }
            0..=13 if live > 0 => {
                live -= 1;
                Step::Free {
                    pick: rng.next() as usize,
                }
            }
            14..=15 if live > 0 && kind == Kind::Cuvmm => Step::RecordStream {
                pick: rng.next() as usize,
                stream: rng.below(3),
            },
            16..=17 => Step::Trim {
                bytes: page * rng.below(8),
            },
            18 => Step::EmptyCache,
            20..=21 if live < 8 => {
                live += 1;
                Step::AllocTagged {
                    size: 1 + rng.below(6 * page),
                    stream: rng.below(3),
                    tag: rng.below(2) as usize,
                }
            }
            22..=23 => Step::Sleep {
                tag: rng.below(2) as usize,
                keep: rng.below(3) > 0,
            },
            24..=25 => Step::Wake {
                tag: rng.below(2) as usize,
            },
            _ => continue,
        };
        steps.push(step);
    }
    steps
}

/// How a planned call fails.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Failure {
    /// Before it has any effect (`SimDriver::fail_nth`), as an error or as out-of-memory.
    Before(FaultKind),
    /// After it took effect (`AfterEffect::fail_nth_after_effect`).
    AfterEffect,
}

/// A fault planned for one run: the `n`th call of `op` fails as `kind` says.
#[derive(Clone, Copy, Debug)]
struct Fault {
    op: Op,
    n: u64,
    kind: Failure,
}

/// What one run saw.
#[derive(Debug, Default)]
struct Outcome {
    /// Driver calls per kind made by the sequence (before the final cleanup).
    calls: BTreeMap<Op, u64>,
    /// The operation the fault fired in, and whether it returned an error.
    fired_in: Option<(usize, bool)>,
    /// Map calls made by each operation: (first map call, last map call), 1-based.
    maps: Vec<(u64, u64)>,
}

/// What a sweep injected, for the test's report.
#[derive(Debug, Default)]
struct Tally {
    sequences: u64,
    runs: u64,
    per_op: BTreeMap<Op, u64>,
    surfaced: u64,
    recovered: u64,
    halfway_maps: u64,
}

/// Sweeps `seeds` sequences of `kind`: one run per fault, each failing before its effect or, with
/// `after_effect`, after it. Panics naming the first failing run.
fn sweep(kind: Kind, seeds: u64, after_effect: bool) -> Tally {
    let mut tally = Tally::default();
    for seed in 0..seeds {
        let steps = sequence(kind, seed);
        let baseline = run(kind, seed, &steps, None)
            .unwrap_or_else(|e| panic!("{kind:?} seed {seed} without faults: {e}\n{steps:#?}"));
        tally.sequences += 1;
        for (&op, &count) in &baseline.calls {
            let kinds: &[Failure] = match op {
                _ if after_effect => &[Failure::AfterEffect],
                Op::Create | Op::Malloc => &[
                    Failure::Before(FaultKind::Error),
                    Failure::Before(FaultKind::OutOfMemory),
                ],
                _ => &[Failure::Before(FaultKind::Error)],
            };
            for n in 1..=count {
                for &fault_kind in kinds {
                    let fault = Fault {
                        op,
                        n,
                        kind: fault_kind,
                    };
                    let outcome = run(kind, seed, &steps, Some(fault)).unwrap_or_else(|e| {
                        panic!("{kind:?} seed {seed} with {fault:?}: {e}\n{steps:#?}")
                    });
                    let (step, failed) = outcome.fired_in.expect("checked by run");
                    tally.runs += 1;
                    *tally.per_op.entry(op).or_default() += 1;
                    if failed {
                        tally.surfaced += 1;
                    } else {
                        tally.recovered += 1;
                    }
                    let (first, last) = baseline.maps[step];
                    if op == Op::Map && n > first && n <= last {
                        tally.halfway_maps += 1;
                    }
                }
            }
        }
    }
    let per_op: Vec<String> = tally
        .per_op
        .iter()
        .map(|(op, n)| format!("{op} {n}"))
        .collect();
    let halfway = match kind {
        Kind::Classic => String::new(),
        _ => format!(
            "; {} maps failed after the first page of a multi-page growth",
            tally.halfway_maps
        ),
    };
    let when = if after_effect { " after effect" } else { "" };
    eprintln!(
        "fault sweep{when} {kind:?}: {} sequences of {OPS} operations, {} faults injected ({}); {} surfaced \
         as typed errors, {} recovered{halfway}",
        tally.sequences,
        tally.runs,
        per_op.join(", "),
        tally.surfaced,
        tally.recovered,
    );
    tally
}

/// Seeds per allocator: `CUVMM_FAULT_SWEEP_SEEDS`, else [`DEFAULT_SEEDS`].
fn seeds() -> u64 {
    std::env::var("CUVMM_FAULT_SWEEP_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(DEFAULT_SEEDS)
}

/// The virtual-memory calls every expandable allocator makes, each of which the sweeps must fail.
const VMM_OPS: [Op; 6] = [
    Op::Reserve,
    Op::Create,
    Op::Map,
    Op::SetAccess,
    Op::Unmap,
    Op::Release,
];

/// The sweep reached what it is for: the six VMM calls (or malloc and free), and maps that fail half
/// way through a multi-page growth.
fn assert_covers(tally: &Tally, ops: &[Op]) {
    for op in ops {
        assert!(
            tally.per_op.get(op).copied().unwrap_or(0) > 0,
            "no {op} fault was injected"
        );
    }
    assert!(tally.surfaced > 0 && tally.recovered > 0, "{tally:?}");
}

#[test]
fn every_driver_call_of_cuvmm_fails_in_turn() {
    let tally = sweep(Kind::Cuvmm, seeds(), false);
    // A sleep's and a wake's copy jobs: pinning host memory, the copies, the wait.
    let sleep = [
        Op::HostAlloc,
        Op::CopyToHost,
        Op::CopyFromHost,
        Op::Synchronize,
    ];
    assert_covers(
        &tally,
        &[&VMM_OPS[..], &[Op::RecordEvent], &sleep[..]].concat(),
    );
    assert!(tally.halfway_maps > 0, "no map failed half way: {tally:?}");
}

#[test]
fn every_driver_call_of_the_classic_model_fails_in_turn() {
    let tally = sweep(Kind::Classic, seeds(), false);
    assert_covers(&tally, &[Op::Malloc, Op::Free]);
}

#[test]
fn every_driver_call_of_pytorch_expandable_fails_in_turn() {
    let tally = sweep(Kind::PytorchExpandable, seeds(), false);
    assert_covers(&tally, &VMM_OPS);
    assert!(tally.halfway_maps > 0, "no map failed half way: {tally:?}");
}

#[test]
fn every_driver_call_of_cuvmm_fails_after_its_effect_in_turn() {
    let tally = sweep(Kind::Cuvmm, seeds(), true);
    let events = [Op::RecordEvent, Op::QueryEvent, Op::DestroyEvent];
    let sleep = [Op::HostAlloc, Op::CopyToHost, Op::CopyFromHost];
    assert_covers(
        &tally,
        &[
            &VMM_OPS[..],
            &[Op::FreeReservation],
            &events[..],
            &sleep[..],
        ]
        .concat(),
    );
    assert!(tally.halfway_maps > 0, "no map failed half way: {tally:?}");
}
