//! Deterministic fault injection: fail the n-th call of an operation, or each call with a seeded probability.

use crate::driver::Op;
use rustc_hash::FxHashMap;

/// What an injected fault looks like to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// [`DriverError::Injected`](crate::driver::DriverError::Injected).
    Error,
    /// [`DriverError::OutOfMemory`](crate::driver::DriverError::OutOfMemory).
    OutOfMemory,
}

/// The faults planned on a simulated device.
#[derive(Debug, Clone, Default)]
pub(super) struct Faults {
    /// Planned faults by (operation, absolute 1-based call number of that operation).
    planned: FxHashMap<(Op, u64), FaultKind>,
    /// Random faults, if any are planned.
    random: Option<RandomFaults>,
}

/// Each call of one of `ops` fails with probability `probability`.
#[derive(Debug, Clone)]
struct RandomFaults {
    ops: [bool; Op::ALL.len()],
    probability: f64,
    rng: SplitMix64,
}

impl Faults {
    /// Plans a fault of `kind` on call number `call` (absolute, 1-based) of `op`. Replaces a fault planned
    /// for the same call.
    pub(super) fn plan(&mut self, op: Op, call: u64, kind: FaultKind) {
        self.planned.insert((op, call), kind);
    }

    /// Makes each later call of any of `ops` fail with `probability` (clamped to 0..=1; NaN counts as 0),
    /// drawn from a SplitMix64 generator seeded with `seed`. Replaces earlier random faults.
    pub(super) fn randomly(&mut self, ops: &[Op], probability: f64, seed: u64) {
        let mut mask = [false; Op::ALL.len()];
        for &op in ops {
            mask[op as usize] = true;
        }
        let probability = if probability.is_nan() {
            0.0
        } else {
            probability.clamp(0.0, 1.0)
        };
        self.random = Some(RandomFaults {
            ops: mask,
            probability,
            rng: SplitMix64::new(seed),
        });
    }

    /// Removes every planned fault.
    pub(super) fn clear(&mut self) {
        self.planned.clear();
        self.random = None;
    }

    /// Whether no fault is planned, random or numbered: no call can fail by injection.
    #[inline]
    pub(super) fn none_planned(&self) -> bool {
        self.random.is_none() && self.planned.is_empty()
    }

    /// Whether call number `call` of `op` must fail, and how. The random generator draws once for every
    /// call of a selected operation, whether or not a planned fault also hits it, so the random pattern
    /// depends only on the seed and the sequence of calls.
    #[inline]
    pub(super) fn check(&mut self, op: Op, call: u64) -> Option<FaultKind> {
        // No faults planned, the usual case: nothing to draw or look up.
        if self.none_planned() {
            return None;
        }
        self.check_planned(op, call)
    }

    /// [`check`](Self::check) when some fault is planned.
    #[inline(never)]
    fn check_planned(&mut self, op: Op, call: u64) -> Option<FaultKind> {
        let random = match &mut self.random {
            Some(r) if r.ops[op as usize] => r.rng.next_f64() < r.probability,
            _ => false,
        };
        let planned = if self.planned.is_empty() {
            None
        } else {
            self.planned.remove(&(op, call))
        };
        planned.or(random.then_some(FaultKind::Error))
    }
}

/// SplitMix64 (Steele, Lea, Flood 2014): a tiny, fast, seedable generator, good enough for fault patterns.
#[derive(Debug, Clone)]
pub(super) struct SplitMix64 {
    state: u64,
}

impl SplitMix64 {
    /// A generator seeded with `seed`.
    pub(super) fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub(super) fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in `0.0 .. 1.0` (53 random bits).
    pub(super) fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn splitmix64_matches_the_reference_sequence() {
        // Reference values of SplitMix64 seeded with 1234567.
        let mut rng = SplitMix64::new(1_234_567);
        let got: Vec<u64> = (0..3).map(|_| rng.next_u64()).collect();
        assert_eq!(
            got,
            [
                6457827717110365317,
                3203168211198807973,
                9817491932198370423
            ]
        );
    }

    #[test]
    fn planned_fault_fires_once_on_its_call() {
        let mut f = Faults::default();
        f.plan(Op::Map, 2, FaultKind::OutOfMemory);
        assert_eq!(f.check(Op::Map, 1), None);
        assert_eq!(f.check(Op::Create, 2), None);
        assert_eq!(f.check(Op::Map, 2), Some(FaultKind::OutOfMemory));
        assert_eq!(f.check(Op::Map, 2), None);
    }

    #[test]
    fn probability_bounds_are_respected() {
        let mut f = Faults::default();
        f.randomly(&[Op::Map], 1.0, 7);
        assert!((0..100).all(|i| f.check(Op::Map, i).is_some()));
        assert!((0..100).all(|i| f.check(Op::Unmap, i).is_none()));
        f.randomly(&[Op::Map], f64::NAN, 7);
        assert!((0..100).all(|i| f.check(Op::Map, i).is_none()));
    }
}
