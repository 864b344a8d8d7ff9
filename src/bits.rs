//! A bit vector that finds set bits fast in sparse stretches: bitvec's `BitVec` holds the bits, and a second
//! `BitVec` keeps one bit per word of the first, set when that word has any bit set.
//!
//! A segment's page map spans its whole reservation (tens of thousands of pages for an 80 GiB device), but
//! its idle pages, and the mapped pages inside a free block, are few: searching for them a word at a time
//! still read a thousand words. With the summary a search skips 64 empty words per summary bit. Searching
//! for clear bits is not summarized: the runs of set bits it ends are short.
//!
//! Counting, filling, copying and searching within a word range are bitvec's own (`count_ones`, `fill`,
//! `copy_from_bitslice`, `first_one`, `last_zero`, ...), which work a whole `u64` at a time on the aligned
//! middle of a range. This type adds only the summary and keeps it in step: after each write it re-reads
//! the words the write touched (`as_raw_slice`).

#![deny(unsafe_code)]

use bitvec::prelude::{BitSlice, BitVec, Lsb0};
use std::ops::Range;

const BITS: usize = u64::BITS as usize;

type Words = BitVec<u64, Lsb0>;

/// A fixed-length bit vector with a summary of its non-empty words.
#[derive(Debug, Clone)]
pub(crate) struct Bits {
    bits: Words,
    /// Bit `w` is set when word `w` of `bits` is not zero.
    nonempty: Words,
}

impl Bits {
    /// `len` clear bits.
    pub(crate) fn new(len: usize) -> Self {
        Self {
            bits: BitVec::repeat(false, len),
            nonempty: BitVec::repeat(false, len.div_ceil(BITS)),
        }
    }

    /// Bit `i`.
    pub(crate) fn get(&self, i: usize) -> bool {
        assert!(i < self.bits.len(), "bit {i} out of {}", self.bits.len());
        self.bits[i]
    }

    /// Sets bit `i` to `value`.
    pub(crate) fn set(&mut self, i: usize, value: bool) {
        assert!(i < self.bits.len(), "bit {i} out of {}", self.bits.len());
        self.bits.set(i, value);
        self.summarize(i..i + 1);
    }

    /// Sets every bit of `range` to `value`.
    pub(crate) fn fill(&mut self, range: Range<usize>, value: bool) {
        self.slice_mut(&range).fill(value);
        self.summarize(range);
    }

    /// Copies bits `range` of `other` (of the same length) into the same bits of `self`. Returns how many of
    /// them are set.
    pub(crate) fn copy_from(&mut self, other: &Bits, range: Range<usize>) -> usize {
        let source = other.slice(&range);
        self.slice_mut(&range).copy_from_bitslice(source);
        self.summarize(range);
        source.count_ones()
    }

    /// Clears every bit of `range`. Returns how many were set.
    pub(crate) fn take_ones(&mut self, range: Range<usize>) -> usize {
        let slice = self.slice_mut(&range);
        let ones = slice.count_ones();
        if ones > 0 {
            slice.fill(false);
            self.summarize(range);
        }
        ones
    }

    /// Set bits in `range`.
    pub(crate) fn count_ones(&self, range: Range<usize>) -> usize {
        self.slice(&range).count_ones()
    }

    /// Whether every bit of `range` is set (true for an empty range).
    pub(crate) fn all(&self, range: Range<usize>) -> bool {
        self.slice(&range).all()
    }

    /// The first bit in `range` equal to `value`.
    pub(crate) fn find(&self, range: Range<usize>, value: bool) -> Option<usize> {
        if !value {
            return self
                .slice(&range)
                .first_zero()
                .map(|i| range.start + i);
        }
        self.check(&range);
        let mut at = range.start;
        while at < range.end {
            // Within the word that holds `at`, then from the next non-empty word on (the summary).
            let word_end = ((at / BITS + 1) * BITS).min(range.end);
            if let Some(i) = self.bits[at..word_end].first_one() {
                return Some(at + i);
            }
            at = self.next_nonempty(word_end.div_ceil(BITS))? * BITS;
        }
        None
    }

    /// The maximal runs of bits equal to `value` in `range`, in order, found as they are iterated (no
    /// allocation: placement looks at only the first few runs of a block).
    pub(crate) fn runs(&self, range: Range<usize>, value: bool) -> Runs<'_> {
        self.check(&range);
        Runs {
            bits: self,
            pos: range.start,
            end: range.end,
            value,
        }
    }

    /// The last set bit at or before `at`.
    pub(crate) fn find_last_set(&self, at: usize) -> Option<usize> {
        assert!(at < self.bits.len(), "bit {at} out of {}", self.bits.len());
        let mut end = at + 1;
        loop {
            let word_start = (end - 1) / BITS * BITS;
            if let Some(i) = self.bits[word_start..end].last_one() {
                return Some(word_start + i);
            }
            // The last non-empty word before this one, from the summary.
            let word = self.nonempty[..word_start / BITS].last_one()?;
            end = ((word + 1) * BITS).min(self.bits.len());
        }
    }

    /// The last clear bit at or before `at`.
    pub(crate) fn find_last_clear(&self, at: usize) -> Option<usize> {
        assert!(at < self.bits.len(), "bit {at} out of {}", self.bits.len());
        self.bits[..=at].last_zero()
    }

    /// The last maximal run of set bits that ends at or before `end` (cut at `end`).
    pub(crate) fn last_run_before(&self, end: usize) -> Option<Range<usize>> {
        let last = self.find_last_set(end.checked_sub(1)?)?;
        let start = self.find_last_clear(last).map_or(0, |clear| clear + 1);
        Some(start..last + 1)
    }

    /// The index of the first non-empty word at or after word `from`.
    fn next_nonempty(&self, from: usize) -> Option<usize> {
        let rest = self.nonempty.get(from..)?;
        rest.first_one().map(|w| from + w)
    }

    /// Brings the summary bits of the words that bits `range` touch up to date.
    fn summarize(&mut self, range: Range<usize>) {
        if range.is_empty() {
            return;
        }
        let words = range.start / BITS..(range.end - 1) / BITS + 1;
        let raw = self.bits.as_raw_slice();
        for w in words {
            self.nonempty.set(w, raw[w] != 0);
        }
    }

    fn slice(&self, range: &Range<usize>) -> &BitSlice<u64, Lsb0> {
        self.check(range);
        &self.bits[range.clone()]
    }

    fn slice_mut(&mut self, range: &Range<usize>) -> &mut BitSlice<u64, Lsb0> {
        self.check(range);
        &mut self.bits[range.clone()]
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.bits.len(),
            "bits {range:?} out of {}",
            self.bits.len()
        );
    }
}

/// The runs of equal bits of a range, from [`Bits::runs`].
pub(crate) struct Runs<'a> {
    bits: &'a Bits,
    pos: usize,
    end: usize,
    value: bool,
}

impl Iterator for Runs<'_> {
    type Item = Range<usize>;

    fn next(&mut self) -> Option<Range<usize>> {
        let start = self.bits.find(self.pos..self.end, self.value)?;
        let end = self
            .bits
            .find(start..self.end, !self.value)
            .unwrap_or(self.end);
        self.pos = end;
        Some(start..end)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The same operations on `Bits` and on a `Vec<bool>` agree, across word and summary boundaries.
    #[test]
    fn bits_match_a_vector_of_bools() {
        let len = 64 * 64 * 2 + 37;
        let mut bits = Bits::new(len);
        let mut model = vec![false; len];
        let mut seed = 12345u64;
        let mut next = |n: usize| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize % n
        };
        for step in 0..3000 {
            let a = next(len);
            let b = (a + next(300)).min(len);
            match step % 4 {
                0 => {
                    bits.set(a, true);
                    model[a] = true;
                }
                1 => {
                    bits.fill(a..b, step % 8 == 1);
                    model[a..b].iter_mut().for_each(|x| *x = step % 8 == 1);
                }
                2 => {
                    bits.set(a, false);
                    model[a] = false;
                }
                _ => {}
            }
            let c = (b + next(9000)).min(len);
            let last = (0..=a).rev().find(|&i| model[i]);
            assert_eq!(bits.find_last_set(a), last, "last set at or before {a}");
            let last_clear = (0..=a).rev().find(|&i| !model[i]);
            assert_eq!(
                bits.find_last_clear(a),
                last_clear,
                "last clear at or before {a}"
            );
            let run = last.map(|end| {
                let start = (0..end).rev().find(|&i| !model[i]).map_or(0, |c| c + 1);
                start..end + 1
            });
            assert_eq!(
                bits.last_run_before(a + 1),
                run,
                "last run before {}",
                a + 1
            );
            for value in [true, false] {
                let expected = (a..c).find(|&i| model[i] == value);
                assert_eq!(bits.find(a..c, value), expected, "find {value} in {a}..{c}");
            }
            assert_eq!(
                bits.count_ones(a..c),
                model[a..c].iter().filter(|&&x| x).count()
            );
            assert_eq!(bits.get(a), model[a]);
            let runs: Vec<_> = bits.runs(a..c, true).collect();
            let mut expected = Vec::new();
            let mut i = a;
            while i < c {
                if model[i] {
                    let start = i;
                    while i < c && model[i] {
                        i += 1;
                    }
                    expected.push(start..i);
                } else {
                    i += 1;
                }
            }
            assert_eq!(runs, expected);
        }
        let mut copy = Bits::new(len);
        let copied = copy.copy_from(&bits, 100..5000);
        assert_eq!(copied, model[100..5000].iter().filter(|&&x| x).count());
        let mut taken = bits.clone();
        assert_eq!(taken.take_ones(100..5000), copied);
        assert_eq!(taken.count_ones(0..len), bits.count_ones(0..len) - copied);
        assert!(taken.find(100..5000, true).is_none());
        for (i, &bit) in model.iter().enumerate() {
            assert_eq!(copy.get(i), (100..5000).contains(&i) && bit, "{i}");
        }
        assert!(Bits::new(0).find(0..0, true).is_none());
        assert_eq!(Bits::new(5).find_last_set(4), None);
        assert!(bits.all(7..7));
    }
}
