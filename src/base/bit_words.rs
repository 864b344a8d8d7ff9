//! Updating bit vectors a word at a time: the words a range of bits touches, counting the bits of a word,
//! and a [`Bits`](crate::base::bits::Bits)' words borrowed for several updates. The page map updates its mapped,
//! accessible and idle bits over a block's or a chunk's pages with these, in one pass per vector: going
//! through `Bits::fill`, `take_ones` or one bit at a time cost several times the instructions
//! (`docs/performance.md`).

#![deny(unsafe_code)]

use std::ops::Range;

const BITS: usize = u64::BITS as usize;

/// A [`Bits`]' raw words, borrowed for several updates of whole words that keep the summary up to date.
/// bitvec decodes a vector's words from its pointer on every `as_raw_slice` (about a dozen instructions):
/// an operation that updates several vectors over a block's pages borrows each once.
pub(crate) struct WordsMut<'a> {
    words: &'a mut [u64],
    summary: &'a mut [u64],
}

impl<'a> WordsMut<'a> {
    /// Bits' raw `words` and the `summary` of their non-empty words.
    pub(crate) fn new(words: &'a mut [u64], summary: &'a mut [u64]) -> Self {
        Self { words, summary }
    }

    /// Word `w`.
    #[inline]
    pub(crate) fn word(&self, w: usize) -> u64 {
        self.words[w]
    }

    /// Sets the bits of word `w` that are set in `bits`.
    #[inline]
    pub(crate) fn set(&mut self, w: usize, bits: u64) {
        let old = self.words[w];
        if old == 0 && bits != 0 {
            self.summary[w / BITS] |= 1 << (w % BITS);
        }
        self.words[w] = old | bits;
    }

    /// Clears the bits of word `w` that are set in `bits`.
    #[inline]
    pub(crate) fn clear(&mut self, w: usize, bits: u64) {
        let old = self.words[w];
        let new = old & !bits;
        if new == 0 && old != 0 {
            self.summary[w / BITS] &= !(1 << (w % BITS));
        }
        self.words[w] = new;
    }
}

/// Calls `f(w, mask, n)` for each word `w` that bits `range` touch, with the mask of the range's bits in it
/// and their number `n`.
#[inline(always)]
pub(crate) fn for_each_word(range: Range<usize>, mut f: impl FnMut(usize, u64, usize)) {
    if range.is_empty() {
        return;
    }
    let last = (range.end - 1) / BITS;
    // Bits of the range in its last word, below its end.
    let end_bits = (range.end - 1) % BITS + 1;
    let mut w = range.start / BITS;
    let mut mask = u64::MAX << (range.start % BITS);
    let mut n = BITS - range.start % BITS;
    loop {
        // One call of `f` in the loop, so that it is inlined once.
        let at_last = w == last;
        if at_last {
            mask &= u64::MAX >> (BITS - end_bits);
            n -= BITS - end_bits;
        }
        f(w, mask, n);
        if at_last {
            return;
        }
        w += 1;
        mask = u64::MAX;
        n = BITS;
    }
}

/// How many bits `bits` has, a part of `mask` which has `n`: without a population count when `bits` is none
/// or all of `mask` or one run of bits (nearly always, for a block's pages). The build targets x86-64
/// without `popcnt`, where `count_ones` costs about 15 instructions.
#[inline(always)]
pub(crate) fn count_in(bits: u64, mask: u64, n: usize) -> usize {
    if bits == mask {
        return n;
    }
    if bits == 0 {
        return 0;
    }
    let run = bits >> bits.trailing_zeros();
    if run & run.wrapping_add(1) == 0 {
        return (u64::BITS - run.leading_zeros()) as usize;
    }
    bits.count_ones() as usize
}

/// The index of the lowest bit set in `bits` (not zero), in word `w`.
#[inline]
pub(crate) fn first_bit(w: usize, bits: u64) -> usize {
    w * BITS + bits.trailing_zeros() as usize
}
