//! A bit vector that finds set bits fast in sparse stretches: bitvec's `BitVec` holds the bits, and a second
//! `BitVec` keeps one bit per word of the first, set when that word has any bit set.
//!
//! A segment's page map spans its whole reservation (tens of thousands of pages for an 80 GiB device), but
//! its idle pages, and the mapped pages inside a free block, are few: searching for them a word at a time
//! still read a thousand words. With the summary a search skips 64 empty words per summary bit. Searching
//! for clear bits is not summarized: the runs of set bits it ends are short.
//!
//! bitvec owns the storage: both levels are `BitVec<u64, Lsb0>`. The operations the allocation path makes on
//! every request (get, set, count, fill, copy, search) work on bitvec's raw words (`as_raw_slice`,
//! `as_raw_mut_slice`) rather than through its bit-level API: measured on `llm-serving`, going through
//! bitvec's `first_one`, `count_ones`, `fill` and `copy_from_bitslice` cost the whole replay 39% more
//! instructions (`docs/performance.md`, "The page map on bitvec").

#![deny(unsafe_code)]

use crate::base::bit_words::WordsMut;
use bitvec::prelude::{BitVec, Lsb0};
use std::ops::Range;

const BITS: usize = u64::BITS as usize;

type Words = BitVec<u64, Lsb0>;

/// A fixed-length bit vector with a summary of its non-empty words.
#[derive(Debug, Clone)]
pub(crate) struct Bits {
    /// Number of bits (bitvec's own length is decoded from its pointer on every call).
    len: usize,
    bits: Words,
    /// Bit `w` is set when word `w` of `bits` is not zero.
    nonempty: Words,
}

impl Bits {
    /// `len` clear bits.
    pub(crate) fn new(len: usize) -> Self {
        Self {
            len,
            bits: BitVec::repeat(false, len),
            nonempty: BitVec::repeat(false, len.div_ceil(BITS)),
        }
    }

    /// Bit `i`.
    #[inline(always)]
    pub(crate) fn get(&self, i: usize) -> bool {
        assert!(i < self.len, "bit {i} out of {}", self.len);
        self.bits.as_raw_slice()[i / BITS] >> (i % BITS) & 1 == 1
    }

    /// Sets bit `i` to `value`.
    #[inline]
    pub(crate) fn set(&mut self, i: usize, value: bool) {
        self.replace(i, value);
    }

    /// Sets bit `i` to `value` and returns what it was. On the raw word: bitvec's `set` costs about 5x the
    /// instructions, on a path that runs for every page a block touches (`docs/performance.md`).
    #[inline(always)]
    pub(crate) fn replace(&mut self, i: usize, value: bool) -> bool {
        assert!(i < self.len, "bit {i} out of {}", self.len);
        let w = i / BITS;
        let mask = 1 << (i % BITS);
        let word = &mut self.bits.as_raw_mut_slice()[w];
        let was = *word & mask != 0;
        if was != value {
            *word ^= mask;
            // The summary changes only when the word turns empty or stops being empty.
            if *word == 0 || *word == mask {
                let word = *word;
                summarize(self.nonempty.as_raw_mut_slice(), w, word);
            }
        }
        was
    }

    /// Sets every bit of `range` to `value`.
    pub(crate) fn fill(&mut self, range: Range<usize>, value: bool) {
        self.update(
            range,
            |_, word, mask| {
                if value { word | mask } else { word & !mask }
            },
        );
    }

    /// Clears every bit of `range`. Returns how many were set. One pass: counting first and then clearing
    /// read every word twice.
    pub(crate) fn take_ones(&mut self, range: Range<usize>) -> usize {
        let mut ones = 0;
        self.update(range, |_, word, mask| {
            ones += (word & mask).count_ones() as usize;
            word & !mask
        });
        ones
    }

    /// The raw words of the bits, for reading several vectors a word at a time.
    #[inline]
    pub(crate) fn words(&self) -> &[u64] {
        self.bits.as_raw_slice()
    }

    /// The raw words and the summary, borrowed for updates of whole words.
    #[inline]
    pub(crate) fn words_mut(&mut self) -> WordsMut<'_> {
        WordsMut::new(
            self.bits.as_raw_mut_slice(),
            self.nonempty.as_raw_mut_slice(),
        )
    }

    /// Set bits in `range`. On the raw words: bitvec's `count_ones` costs about 4x as many instructions on
    /// the short ranges the page map counts (`docs/performance.md`).
    #[inline]
    pub(crate) fn count_ones(&self, range: Range<usize>) -> usize {
        // A range inside one word (most of a block's pages) is counted here, inlined; the rest below.
        if range.start < range.end
            && range.end <= self.len
            && range.start / BITS == (range.end - 1) / BITS
        {
            let low = u64::MAX << (range.start % BITS);
            let high = u64::MAX >> (BITS - 1 - (range.end - 1) % BITS);
            return (self.bits.as_raw_slice()[range.start / BITS] & low & high).count_ones()
                as usize;
        }
        self.count_ones_wide(range)
    }

    #[inline(never)]
    fn count_ones_wide(&self, range: Range<usize>) -> usize {
        self.check(&range);
        if range.is_empty() {
            return 0;
        }
        let words = self.bits.as_raw_slice();
        let (first, last) = (range.start / BITS, (range.end - 1) / BITS);
        let low = u64::MAX << (range.start % BITS);
        let high = u64::MAX >> (BITS - 1 - (range.end - 1) % BITS);
        if first == last {
            return (words[first] & low & high).count_ones() as usize;
        }
        let ends = (words[first] & low).count_ones() + (words[last] & high).count_ones();
        let middle: u32 = words[first + 1..last].iter().map(|w| w.count_ones()).sum();
        (ends + middle) as usize
    }

    /// Whether every bit of `range` is set (true for an empty range).
    pub(crate) fn all(&self, range: Range<usize>) -> bool {
        self.find(range, false).is_none()
    }

    /// The first bit in `range` equal to `value`. On the raw words, skipping empty words through the summary
    /// when looking for a set bit: bitvec's `first_one` / `first_zero` go through its bit iterators and
    /// cost several times as many instructions here (`docs/performance.md`).
    #[inline]
    pub(crate) fn find(&self, range: Range<usize>, value: bool) -> Option<usize> {
        // Answered by the range's first word (found there, or the range ends in it), inlined; else below.
        if range.start < range.end && range.end <= self.len {
            let w = range.start / BITS;
            let word = self.bits.as_raw_slice()[w];
            let word = if value { word } else { !word } & (u64::MAX << (range.start % BITS));
            if word != 0 {
                let found = w * BITS + word.trailing_zeros() as usize;
                return (found < range.end).then_some(found);
            }
            if (range.end - 1) / BITS == w {
                return None;
            }
        }
        self.find_wide(range, value)
    }

    #[inline(never)]
    fn find_wide(&self, range: Range<usize>, value: bool) -> Option<usize> {
        self.check(&range);
        let words = self.bits.as_raw_slice();
        let summary = self.nonempty.as_raw_slice();
        let mut at = range.start;
        while at < range.end {
            let w = at / BITS;
            let word = if value { words[w] } else { !words[w] };
            let from_bit = word & (u64::MAX << (at % BITS));
            if from_bit != 0 {
                let found = w * BITS + from_bit.trailing_zeros() as usize;
                return (found < range.end).then_some(found);
            }
            at = if value {
                next_nonempty(summary, w + 1, range.end.div_ceil(BITS))? * BITS
            } else {
                (w + 1) * BITS
            };
        }
        None
    }

    /// The maximal runs of bits equal to `value` in `range`, in order, found as they are iterated (no
    /// allocation: placement looks at only the first few runs of a block). A word at a time: a run that
    /// ends inside a word costs a few instructions, and the search for set bits skips empty words through
    /// the summary.
    pub(crate) fn runs(&self, range: Range<usize>, value: bool) -> Runs<'_> {
        self.check(&range);
        let words = self.bits.as_raw_slice();
        let flip = if value { 0 } else { u64::MAX };
        let w = range.start / BITS;
        let word = if range.is_empty() {
            0
        } else {
            (words[w] ^ flip) & (u64::MAX << (range.start % BITS))
        };
        Runs {
            words,
            summary: value.then(|| self.nonempty.as_raw_slice()),
            flip,
            w,
            word,
            end: range.end,
        }
    }

    /// The first maximal run of bits inside `range` that are set here and clear in `other` (of the same
    /// length), cut at `range`'s end. A word at a time, skipping runs of this vector's empty words through
    /// the summary: the page map's search for mapped pages without access, on every request, made four
    /// searches and a lookup before.
    pub(crate) fn first_run_without(
        &self,
        other: &Bits,
        range: Range<usize>,
    ) -> Option<Range<usize>> {
        self.check(&range);
        if range.is_empty() {
            return None;
        }
        let (words, others) = (self.bits.as_raw_slice(), other.bits.as_raw_slice());
        let summary = self.nonempty.as_raw_slice();
        let mut w = range.start / BITS;
        let mut word = words[w] & !others[w] & (u64::MAX << (range.start % BITS));
        while word == 0 {
            w += 1;
            if w * BITS >= range.end {
                return None;
            }
            if words[w] == 0 {
                w = next_nonempty(summary, w, range.end.div_ceil(BITS))?;
            }
            word = words[w] & !others[w];
        }
        let low = word.trailing_zeros() as usize;
        let start = w * BITS + low;
        if start >= range.end {
            return None;
        }
        let stop = low + (!(word >> low)).trailing_zeros() as usize;
        let end = if stop < BITS {
            w * BITS + stop
        } else {
            loop {
                w += 1;
                if w * BITS >= range.end {
                    break range.end;
                }
                let word = words[w] & !others[w];
                if word != u64::MAX {
                    break w * BITS + (!word).trailing_zeros() as usize;
                }
            }
        };
        Some(start..end.min(range.end))
    }

    /// The last set bit at or before `at` (raw words and the summary, as [`Bits::find`]).
    pub(crate) fn find_last_set(&self, at: usize) -> Option<usize> {
        assert!(at < self.len, "bit {at} out of {}", self.len);
        let words = self.bits.as_raw_slice();
        let mut w = at / BITS;
        let mut word = words[w] & (u64::MAX >> (BITS - 1 - at % BITS));
        loop {
            if word != 0 {
                return Some(w * BITS + (BITS - 1 - word.leading_zeros() as usize));
            }
            w = self.previous_nonempty(w)?;
            word = words[w];
        }
    }

    /// The last clear bit at or before `at`.
    pub(crate) fn find_last_clear(&self, at: usize) -> Option<usize> {
        assert!(at < self.len, "bit {at} out of {}", self.len);
        let words = self.bits.as_raw_slice();
        let mut w = at / BITS;
        let mut word = !words[w] & (u64::MAX >> (BITS - 1 - at % BITS));
        loop {
            if word != 0 {
                return Some(w * BITS + (BITS - 1 - word.leading_zeros() as usize));
            }
            w = w.checked_sub(1)?;
            word = !words[w];
        }
    }

    /// The last maximal run of set bits that ends at or before `end` (cut at `end`).
    pub(crate) fn last_run_before(&self, end: usize) -> Option<Range<usize>> {
        let last = self.find_last_set(end.checked_sub(1)?)?;
        let start = self.find_last_clear(last).map_or(0, |clear| clear + 1);
        Some(start..last + 1)
    }

    /// The index of the last non-empty word before word `before`.
    fn previous_nonempty(&self, before: usize) -> Option<usize> {
        let summary = self.nonempty.as_raw_slice();
        let before = before.checked_sub(1)?;
        let mut s = before / BITS;
        let mut bits = summary[s] & (u64::MAX >> (BITS - 1 - before % BITS));
        loop {
            if bits != 0 {
                return Some(s * BITS + (BITS - 1 - bits.leading_zeros() as usize));
            }
            s = s.checked_sub(1)?;
            bits = summary[s];
        }
    }

    /// Applies `f(word index, word, mask of the range's bits in it)` to each raw word that bits `range`
    /// touch, and brings their summary bits up to date. bitvec's `fill` and `copy_from_bitslice` over the
    /// same ranges cost about 4x the instructions (`docs/performance.md`).
    fn update(&mut self, range: Range<usize>, mut f: impl FnMut(usize, u64, u64) -> u64) {
        self.check(&range);
        if range.is_empty() {
            return;
        }
        let words = self.bits.as_raw_mut_slice();
        let summary = self.nonempty.as_raw_mut_slice();
        let (first, last) = (range.start / BITS, (range.end - 1) / BITS);
        let low = u64::MAX << (range.start % BITS);
        let high = u64::MAX >> (BITS - 1 - (range.end - 1) % BITS);
        if first == last {
            // Most ranges (a block's pages) lie in one word.
            words[first] = f(first, words[first], low & high);
            summarize(summary, first, words[first]);
            return;
        }
        words[first] = f(first, words[first], low);
        summarize(summary, first, words[first]);
        for (i, word) in words[first + 1..last].iter_mut().enumerate() {
            let w = first + 1 + i;
            *word = f(w, *word, u64::MAX);
            summarize(summary, w, *word);
        }
        words[last] = f(last, words[last], high);
        summarize(summary, last, words[last]);
    }

    fn check(&self, range: &Range<usize>) {
        assert!(
            range.start <= range.end && range.end <= self.len,
            "bits {range:?} out of {}",
            self.len
        );
    }
}

/// The index of the first non-empty word at or after word `from` and before word `end`, from the summary's
/// words. Bounded by `end`: a search inside a block's pages used to read the summary to the end of the
/// reservation (20 words and more) whenever the block had no page of the kind looked for.
#[inline]
fn next_nonempty(summary: &[u64], from: usize, end: usize) -> Option<usize> {
    if from >= end {
        return None;
    }
    let mut s = from / BITS;
    let last = (end - 1) / BITS;
    let mut bits = *summary.get(s)? & (u64::MAX << (from % BITS));
    loop {
        if bits != 0 {
            let w = s * BITS + bits.trailing_zeros() as usize;
            return (w < end).then_some(w);
        }
        if s >= last {
            return None;
        }
        s += 1;
        bits = *summary.get(s)?;
    }
}

/// Sets summary bit `w` when `word` (word `w` of the bits) is not zero, and clears it when it is.
#[inline]
fn summarize(summary: &mut [u64], w: usize, word: u64) {
    let mask = 1 << (w % BITS);
    if word != 0 {
        summary[w / BITS] |= mask;
    } else {
        summary[w / BITS] &= !mask;
    }
}

/// The runs of equal bits of a range, from [`Bits::runs`].
pub(crate) struct Runs<'a> {
    words: &'a [u64],
    /// The summary of non-empty words, when looking for set bits.
    summary: Option<&'a [u64]>,
    /// XORed into each word, so that the bits looked for are the set ones.
    flip: u64,
    /// The word being read, and its bits not yet returned (looked-for bits set).
    w: usize,
    word: u64,
    end: usize,
}

impl Iterator for Runs<'_> {
    type Item = Range<usize>;

    fn next(&mut self) -> Option<Range<usize>> {
        while self.word == 0 {
            let next = match self.summary {
                Some(summary) => next_nonempty(summary, self.w + 1, self.end.div_ceil(BITS))?,
                None => self.w + 1,
            };
            if next * BITS >= self.end {
                return None;
            }
            self.w = next;
            self.word = self.words[next] ^ self.flip;
        }
        let low = self.word.trailing_zeros() as usize;
        let start = self.w * BITS + low;
        if start >= self.end {
            self.word = 0;
            return None;
        }
        // Where the run stops inside this word (`BITS` if it reaches the word's top bit).
        let stop = low + (!(self.word >> low)).trailing_zeros() as usize;
        let end = if stop < BITS {
            self.word &= u64::MAX << stop;
            self.w * BITS + stop
        } else {
            self.word = 0;
            loop {
                self.w += 1;
                if self.w * BITS >= self.end {
                    break self.end;
                }
                let word = self.words[self.w] ^ self.flip;
                if word != u64::MAX {
                    let stop = (!word).trailing_zeros() as usize;
                    self.word = word & (u64::MAX << stop);
                    break self.w * BITS + stop;
                }
            }
        };
        Some(start..end.min(self.end))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::base::bit_words::{count_in, for_each_word};

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
            for value in [true, false] {
                let runs: Vec<_> = bits.runs(a..c, value).collect();
                let mut expected = Vec::new();
                let mut i = a;
                while i < c {
                    if model[i] == value {
                        let start = i;
                        while i < c && model[i] == value {
                            i += 1;
                        }
                        expected.push(start..i);
                    } else {
                        i += 1;
                    }
                }
                assert_eq!(runs, expected, "runs of {value} in {a}..{c}");
            }
        }
        let mut copy = Bits::new(len);
        let mut copied = 0;
        let mut words = copy.words_mut();
        for_each_word(100..5000, |w, mask, n| {
            let word = bits.words()[w] & mask;
            assert_eq!(count_in(word, mask, n), word.count_ones() as usize);
            copied += count_in(word, mask, n);
            words.set(w, word);
        });
        let mut other = Bits::new(len);
        other.fill(2000..2100, true);
        other.fill(4000..4003, true);
        let without: Vec<bool> = (0..len)
            .map(|i| model[i] && !((2000..2100).contains(&i) || (4000..4003).contains(&i)))
            .collect();
        for (a, c) in [
            (0, len),
            (1999, 2101),
            (2050, 6000),
            (3990, 4010),
            (0, 0),
            (len - 1, len),
        ] {
            let first = (a..c)
                .find(|&i| without[i])
                .map(|start| start..(start..c).find(|&i| !without[i]).unwrap_or(c));
            assert_eq!(bits.first_run_without(&other, a..c), first, "in {a}..{c}");
        }
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
