//! A small deterministic pseudo-random generator (SplitMix64) for the workload generators.
//!
//! Workloads must be reproducible from a seed on every platform and every version of the crate, so they do not
//! use the `rand` crate, whose streams may change between releases. SplitMix64 is tiny, fast, and passes
//! BigCrush; its quality is far beyond what drawing tensor shapes needs.

use std::ops::Range;

/// SplitMix64: a 64-bit state advanced by a Weyl sequence and scrambled on output.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    state: u64,
}

impl Rng {
    /// A generator seeded with `seed`. Equal seeds give equal sequences.
    pub fn new(seed: u64) -> Self {
        Self { state: seed }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.state = self.state.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.state;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A number in `0 .. n` (Lemire's multiply-shift; the bias, below `n / 2^64`, is irrelevant here).
    ///
    /// # Panics
    /// If `n` is 0.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "Rng::below(0)");
        ((u128::from(self.next_u64()) * u128::from(n)) >> 64) as u64
    }

    /// A number in `range`.
    ///
    /// # Panics
    /// If the range is empty.
    pub fn range(&mut self, range: Range<u64>) -> u64 {
        assert!(range.start < range.end, "Rng::range on an empty range");
        range.start + self.below(range.end - range.start)
    }

    /// A float in `[0, 1)` with 53 random bits.
    pub fn f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// `true` with probability `p`.
    pub fn chance(&mut self, p: f64) -> bool {
        self.f64() < p
    }

    /// One of `choices`, each picked with probability proportional to its weight.
    ///
    /// # Panics
    /// If the weights sum to 0.
    pub fn choose_weighted<'a, T>(&mut self, choices: &'a [(T, u64)]) -> &'a T {
        let total: u64 = choices.iter().map(|(_, w)| w).sum();
        let mut pick = self.below(total);
        for (choice, weight) in choices {
            if pick < *weight {
                return choice;
            }
            pick -= weight;
        }
        unreachable!("pick < total weight")
    }

    /// A size in `lo ..= hi` whose logarithm is uniform: as many draws between 1 KiB and 2 KiB as between
    /// 1 GiB and 2 GiB, which is how tensor sizes spread.
    ///
    /// # Panics
    /// If `lo` is 0 or greater than `hi`.
    pub fn log_uniform(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(0 < lo && lo <= hi, "Rng::log_uniform({lo}, {hi})");
        let (ln_lo, ln_hi) = ((lo as f64).ln(), (hi as f64).ln());
        let value = (ln_lo + self.f64() * (ln_hi - ln_lo)).exp() as u64;
        value.clamp(lo, hi)
    }

    /// An exponentially distributed value with the given mean (inter-arrival times).
    pub fn exponential(&mut self, mean: f64) -> f64 {
        -mean * (1.0 - self.f64()).ln()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equal_seeds_give_equal_sequences_and_different_seeds_differ() {
        let draw = |seed| {
            let mut rng = Rng::new(seed);
            (0..8).map(|_| rng.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn draws_stay_in_their_ranges() {
        let mut rng = Rng::new(1);
        for _ in 0..10_000 {
            assert!(rng.below(3) < 3);
            assert!((10..20).contains(&rng.range(10..20)));
            let x = rng.f64();
            assert!((0.0..1.0).contains(&x));
            assert!((512..=4096).contains(&rng.log_uniform(512, 4096)));
            assert!(rng.exponential(2.0) >= 0.0);
        }
        assert_eq!(rng.log_uniform(64, 64), 64);
    }

    #[test]
    fn below_covers_every_value() {
        let mut rng = Rng::new(2);
        let mut seen = [false; 5];
        for _ in 0..1_000 {
            seen[rng.below(5) as usize] = true;
        }
        assert!(seen.iter().all(|&s| s));
    }

    #[test]
    fn weighted_choice_follows_weights() {
        let mut rng = Rng::new(3);
        let choices = [('a', 0), ('b', 1), ('c', 3)];
        let mut counts = [0u32; 3];
        for _ in 0..4_000 {
            match rng.choose_weighted(&choices) {
                'a' => counts[0] += 1,
                'b' => counts[1] += 1,
                _ => counts[2] += 1,
            }
        }
        assert_eq!(counts[0], 0, "a zero weight is never chosen");
        assert!(counts[2] > 2 * counts[1], "3:1 weights, got {counts:?}");
    }

    #[test]
    fn log_uniform_spreads_over_orders_of_magnitude() {
        let mut rng = Rng::new(4);
        let draws: Vec<u64> = (0..1_000).map(|_| rng.log_uniform(1, 1 << 30)).collect();
        let small = draws.iter().filter(|&&d| d < 1 << 15).count();
        assert!(
            (350..650).contains(&small),
            "half below the geometric middle, got {small}"
        );
    }
}
