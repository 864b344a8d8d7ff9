//! The simulated device's page table: which granules of virtual address space are mapped, where each
//! mapping starts, and its number in [`Mappings`](super::mappings::Mappings).
//!
//! A mapping maps a handle, or a granule-aligned part of it, at a granule-aligned address, so it covers
//! `mapping size / granularity` consecutive granules; what it maps is recorded once, in `Mappings`. The table
//! keeps one bit per granule for "mapped", one for "a mapping starts here", and the mapping's number at its
//! first granule only. Checking that a 20 MiB range of 2 MiB granules is free and marking it mapped is then a
//! mask test and an OR on one word, instead of reading and writing ten entries; a mapping is found from any
//! of its granules by the nearest start at or below it, a word of start bits at a time. Granules are stored
//! in chunks of 256 created when something is first mapped there, so the table's memory follows what was
//! mapped, not the reservations.
//!
//! A range of granules is handled one chunk's slots at a time, and within a chunk one 64-bit word at a time,
//! so a call over many granules looks each chunk up once. The chunk found last is remembered: calls come in
//! runs on neighbouring granules, so most lookups are one comparison.

use rustc_hash::FxHashMap;
use std::cell::Cell;
use std::fmt;
use std::ops::Range;

/// Granules per chunk (512 MiB of 2 MiB granules). A new chunk's array of numbers is zeroed: at 1024 granules
/// that cost a replay more than the extra chunk lookups of 256 do (callgrind, `cs336_2.7b_ctx128_fullstep_fp32`:
/// 60 thousand instructions more).
const CHUNK: u64 = 256;

/// 64-bit words per bit vector of a chunk.
const WORDS: usize = CHUNK as usize / 64;

/// A chunk number no granule has (the highest is `u64::MAX / CHUNK`): `last` before any lookup.
const NO_CHUNK: u64 = u64::MAX;

/// The number of a mapping in [`Mappings`](super::mappings::Mappings); 0 is never a mapping's number.
pub(super) type MappingId = u32;

/// One chunk's granules.
#[derive(Clone)]
struct Chunk {
    /// Bit `i`: granule `i` is mapped.
    mapped: [u64; WORDS],
    /// Bit `i`: a mapping starts at granule `i`.
    starts: [u64; WORDS],
    /// At a mapping's first granule, its number; 0 at every other granule.
    ids: Box<[MappingId; CHUNK as usize]>,
}

impl Chunk {
    /// Nothing mapped.
    fn new() -> Self {
        // Zeroed memory from the allocator, not built on the stack and copied.
        let ids: Box<[MappingId]> = vec![0; CHUNK as usize].into_boxed_slice();
        Self {
            mapped: [0; WORDS],
            starts: [0; WORDS],
            ids: ids.try_into().expect("a chunk has CHUNK granules"),
        }
    }
}

/// Every granule of the address space, by granule index (address / granularity).
#[derive(Clone)]
pub(super) struct Granules {
    chunks: Vec<Chunk>,
    /// Chunk number (granule index / [`CHUNK`]) to its position in `chunks`.
    index: FxHashMap<u64, usize>,
    /// The chunk found last, `(chunk number, position)`, or [`NO_CHUNK`].
    last: Cell<(u64, usize)>,
}

impl Default for Granules {
    fn default() -> Self {
        Self {
            chunks: Vec::new(),
            index: FxHashMap::default(),
            last: Cell::new((NO_CHUNK, 0)),
        }
    }
}

impl Granules {
    /// The number of the mapping that starts at granule `index`, or 0 if none does.
    #[inline]
    pub(super) fn starting_at(&self, index: u64) -> MappingId {
        self.position(index / CHUNK)
            .map_or(0, |at| self.chunks[at].ids[(index % CHUNK) as usize])
    }

    /// The mapping that covers granule `index`: its first granule and its number.
    pub(super) fn mapping_at(&self, index: u64) -> Option<(u64, MappingId)> {
        let (mut number, slot) = (index / CHUNK, (index % CHUNK) as usize);
        let mut chunk = &self.chunks[self.position(number)?];
        if chunk.mapped[slot / 64] & (1 << (slot % 64)) == 0 {
            return None;
        }
        // The nearest start at or below `index`: mappings cover consecutive granules and never overlap.
        let mut word = slot / 64;
        let mut bits = chunk.starts[word] & (u64::MAX >> (63 - slot % 64));
        loop {
            if bits != 0 {
                let slot = word * 64 + 63 - bits.leading_zeros() as usize;
                return Some((number * CHUNK + slot as u64, chunk.ids[slot]));
            }
            if word == 0 {
                // The mapping began in an earlier chunk, which it covers too, so it exists.
                number = number.checked_sub(1)?;
                chunk = &self.chunks[self.position(number)?];
                word = WORDS;
            }
            word -= 1;
            bits = chunk.starts[word];
        }
    }

    /// The highest granule of `range` that a mapping covers.
    #[inline]
    pub(super) fn last_mapped(&self, range: Range<u64>) -> Option<u64> {
        if range.is_empty() {
            return None;
        }
        let number = range.start / CHUNK;
        if number == (range.end - 1) / CHUNK {
            // The usual call: a few granules, in one chunk.
            let chunk = &self.chunks[self.position(number)?];
            return highest_in(&chunk.mapped, slots(&range)).map(|slot| number * CHUNK + slot);
        }
        let mut found = None;
        // Chunks come in increasing order: a later find is a higher granule.
        for (number, slots) in ChunkSlots(range) {
            if let Some(at) = self.position(number)
                && let Some(slot) = highest_in(&self.chunks[at].mapped, slots)
            {
                found = Some(number * CHUNK + slot);
            }
        }
        found
    }

    /// Records the mapping `id()` makes over `range` (not empty) if no granule of it is mapped; otherwise
    /// returns the highest mapped granule and does not call `id` (a chunk may have been created, empty).
    #[inline(always)]
    pub(super) fn claim(
        &mut self,
        range: Range<u64>,
        id: impl FnOnce() -> MappingId,
    ) -> Result<(), u64> {
        let number = range.start / CHUNK;
        if number != (range.end - 1) / CHUNK {
            return self.claim_across(range, id);
        }
        // The usual call: a few granules, in one chunk, so one lookup checks and records them.
        let at = self.position_or_insert(number);
        let chunk = &mut self.chunks[at];
        let slots = slots(&range);
        let (word, last) = (slots.start / 64, (slots.end - 1) / 64);
        if word == last {
            // In one word: a test and two ORs.
            let mask = (u64::MAX << (slots.start % 64)) & (u64::MAX >> (63 - (slots.end - 1) % 64));
            let bits = chunk.mapped[word] & mask;
            if bits != 0 {
                return Err(
                    number * CHUNK + (word * 64) as u64 + 63 - u64::from(bits.leading_zeros())
                );
            }
            chunk.mapped[word] |= mask;
        } else {
            if let Some(slot) = highest_in(&chunk.mapped, slots.clone()) {
                return Err(number * CHUNK + slot);
            }
            set_bits(&mut chunk.mapped, slots.clone(), true);
        }
        chunk.starts[word] |= 1 << (slots.start % 64);
        chunk.ids[slots.start] = id();
        Ok(())
    }

    /// [`claim`](Self::claim) of a range over several chunks.
    #[inline(never)]
    fn claim_across(
        &mut self,
        range: Range<u64>,
        id: impl FnOnce() -> MappingId,
    ) -> Result<(), u64> {
        if let Some(index) = self.last_mapped(range.clone()) {
            return Err(index);
        }
        self.insert(range, id());
        Ok(())
    }

    /// Records mapping `id` over `range` (not empty, and not mapped), creating chunks that do not exist yet.
    #[inline]
    pub(super) fn insert(&mut self, range: Range<u64>, id: MappingId) {
        let number = range.start / CHUNK;
        let at = self.position_or_insert(number);
        let chunk = &mut self.chunks[at];
        let slot = (range.start % CHUNK) as usize;
        chunk.starts[slot / 64] |= 1 << (slot % 64);
        chunk.ids[slot] = id;
        if number == (range.end - 1) / CHUNK {
            set_bits(&mut chunk.mapped, slots(&range), true);
            return;
        }
        for (number, slots) in ChunkSlots(range) {
            let at = self.position_or_insert(number);
            set_bits(&mut self.chunks[at].mapped, slots, true);
        }
    }

    /// Forgets the mapping that covers exactly `range` (not empty).
    #[inline]
    pub(super) fn remove(&mut self, range: Range<u64>) {
        let number = range.start / CHUNK;
        let Some(at) = self.position(number) else {
            return;
        };
        let chunk = &mut self.chunks[at];
        let slot = (range.start % CHUNK) as usize;
        chunk.starts[slot / 64] &= !(1 << (slot % 64));
        chunk.ids[slot] = 0;
        if number == (range.end - 1) / CHUNK {
            set_bits(&mut chunk.mapped, slots(&range), false);
            return;
        }
        for (number, slots) in ChunkSlots(range) {
            if let Some(at) = self.position(number) {
                set_bits(&mut self.chunks[at].mapped, slots, false);
            }
        }
    }

    /// The mappings that start at granule indices `start .. end`. Looks only at chunks that exist.
    pub(super) fn starts_in(&self, start: u64, end: u64) -> usize {
        if start >= end {
            return 0;
        }
        let (first, last) = (start / CHUNK, (end - 1) / CHUNK);
        self.index
            .iter()
            .filter(|&(&number, _)| (first..=last).contains(&number))
            .map(|(&number, &at)| {
                let base = number * CHUNK;
                let from = start.max(base) - base;
                let to = end.min(base.saturating_add(CHUNK)) - base;
                Masks::new(from as usize..to as usize)
                    .map(|(word, mask)| (self.chunks[at].starts[word] & mask).count_ones() as usize)
                    .sum::<usize>()
            })
            .sum()
    }

    /// Where chunk `number` is in `chunks`, if it exists.
    #[inline(always)]
    fn position(&self, number: u64) -> Option<usize> {
        let (last, at) = self.last.get();
        if last == number {
            return Some(at);
        }
        self.find(number)
    }

    /// [`position`](Self::position) for a chunk other than the last one found.
    #[inline(never)]
    fn find(&self, number: u64) -> Option<usize> {
        let at = *self.index.get(&number)?;
        self.last.set((number, at));
        Some(at)
    }

    /// Where chunk `number` is in `chunks`, created unmapped if it does not exist.
    #[inline(always)]
    fn position_or_insert(&mut self, number: u64) -> usize {
        match self.position(number) {
            Some(at) => at,
            None => self.insert_chunk(number),
        }
    }

    /// Creates chunk `number`, unmapped. Returns its position.
    #[inline(never)]
    fn insert_chunk(&mut self, number: u64) -> usize {
        let at = self.chunks.len();
        self.chunks.push(Chunk::new());
        self.index.insert(number, at);
        self.last.set((number, at));
        at
    }
}

/// The chunks that granules `range` touch, in order: `(chunk number, slots in the chunk)`, never empty.
struct ChunkSlots(Range<u64>);

impl Iterator for ChunkSlots {
    type Item = (u64, Range<usize>);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        let Range { start, end } = self.0;
        if start >= end {
            return None;
        }
        let number = start / CHUNK;
        // The chunk's last granule + 1, which only the very last chunk of `u64` cannot represent.
        let piece_end = (start | (CHUNK - 1)).saturating_add(1).min(end);
        self.0.start = piece_end;
        let base = number * CHUNK;
        Some((number, (start - base) as usize..(piece_end - base) as usize))
    }
}

/// The slots of `range` (not empty, in one chunk) in its chunk.
#[inline(always)]
fn slots(range: &Range<u64>) -> Range<usize> {
    let start = (range.start % CHUNK) as usize;
    start..start + (range.end - range.start) as usize
}

/// The highest slot of `slots` (not empty) whose bit is set in `words`.
#[inline(always)]
fn highest_in(words: &[u64; WORDS], slots: Range<usize>) -> Option<u64> {
    let first = slots.start / 64;
    let mut word = (slots.end - 1) / 64;
    let mut bits = words[word] & (u64::MAX >> (63 - (slots.end - 1) % 64));
    loop {
        if word == first {
            bits &= u64::MAX << (slots.start % 64);
        }
        if bits != 0 {
            return Some((word * 64) as u64 + 63 - u64::from(bits.leading_zeros()));
        }
        if word == first {
            return None;
        }
        word -= 1;
        bits = words[word];
    }
}

/// Sets (`on`) or clears the bits of `slots` (not empty) in `words`.
#[inline(always)]
fn set_bits(words: &mut [u64; WORDS], slots: Range<usize>, on: bool) {
    for (word, mask) in Masks::new(slots) {
        if on {
            words[word] |= mask;
        } else {
            words[word] &= !mask;
        }
    }
}

/// The words of a chunk's bit vector that slots `start .. end` (not empty) touch, in order, each with the
/// mask of the slots' bits in it.
struct Masks {
    word: usize,
    last: usize,
    /// Bits of `word` from the first slot on.
    low: u64,
    /// Bits of `last` up to the last slot.
    high: u64,
}

impl Masks {
    #[inline]
    fn new(slots: Range<usize>) -> Self {
        let last_slot = slots.end - 1;
        Self {
            word: slots.start / 64,
            last: last_slot / 64,
            low: u64::MAX << (slots.start % 64),
            high: u64::MAX >> (63 - last_slot % 64),
        }
    }
}

impl Iterator for Masks {
    type Item = (usize, u64);

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        if self.word > self.last {
            return None;
        }
        let word = self.word;
        let mut mask = self.low;
        if word == self.last {
            mask &= self.high;
        }
        self.word += 1;
        self.low = u64::MAX;
        Some((word, mask))
    }
}

impl fmt::Debug for Granules {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Granules")
            .field("chunks", &self.chunks.len())
            .finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_are_found_from_any_granule_and_removed() {
        let mut g = Granules::default();
        assert_eq!((g.starting_at(5), g.mapping_at(5)), (0, None));
        g.insert(5000..5002, 3);
        g.insert(10..11, 2);
        g.insert(3 * CHUNK - 1..3 * CHUNK, 4);
        assert_eq!((g.starting_at(5000), g.starting_at(5001)), (3, 0));
        assert_eq!(g.mapping_at(5001), Some((5000, 3)));
        assert_eq!(g.mapping_at(5002), None);
        assert_eq!(g.last_mapped(0..5000), Some(3 * CHUNK - 1));
        assert_eq!(g.last_mapped(0..5002), Some(5001));
        assert_eq!(g.last_mapped(11..3 * CHUNK - 1), None);
        assert_eq!(g.starts_in(0, u64::MAX), 3);
        assert_eq!(g.starts_in(11, 5001), 2);
        assert_eq!(g.starts_in(5001, 6000), 0);
        assert_eq!(g.claim(4990..5001, || panic!("not called")), Err(5000));
        assert_eq!(
            g.claim(2 * CHUNK - 1..5001, || panic!("not called")),
            Err(5000)
        );
        assert_eq!(g.claim(5001..5003, || panic!("not called")), Err(5001));
        assert_eq!(g.claim(5002..5004, || 11), Ok(()));
        assert_eq!(g.mapping_at(5003), Some((5002, 11)));
        g.remove(5002..5004);
        assert_eq!(g.mapping_at(5003), None);
        assert_eq!(g.claim(4990..5000, || 9), Ok(()));
        assert_eq!(g.mapping_at(4999), Some((4990, 9)));
        assert_eq!(g.claim(CHUNK - 1..CHUNK + 1, || 10), Ok(()));
        assert_eq!(g.mapping_at(CHUNK), Some((CHUNK - 1, 10)));
        g.remove(CHUNK - 1..CHUNK + 1);
        g.remove(4990..5000);
        g.remove(10..11);
        assert_eq!((g.starting_at(10), g.mapping_at(10)), (0, None));
        assert_eq!(g.starts_in(0, 5000), 1);
    }

    #[test]
    fn a_mapping_across_chunks_and_words_is_found_from_its_last_granule() {
        let mut g = Granules::default();
        g.insert(CHUNK - 70..2 * CHUNK + 1, 7);
        g.insert(2 * CHUNK + 1..2 * CHUNK + 2, 8);
        assert_eq!(g.chunks.len(), 3);
        assert_eq!(g.mapping_at(CHUNK - 71), None);
        for index in [CHUNK - 70, CHUNK - 1, CHUNK, CHUNK + CHUNK / 2, 2 * CHUNK] {
            assert_eq!(g.mapping_at(index), Some((CHUNK - 70, 7)), "{index}");
        }
        assert_eq!(g.mapping_at(2 * CHUNK + 1), Some((2 * CHUNK + 1, 8)));
        assert_eq!(g.last_mapped(0..4 * CHUNK), Some(2 * CHUNK + 1));
        assert_eq!(g.last_mapped(0..CHUNK), Some(CHUNK - 1));
        assert_eq!(g.last_mapped(5..5), None);
        assert_eq!(g.last_mapped(0..0), None);
        g.remove(CHUNK - 70..2 * CHUNK + 1);
        assert_eq!(g.last_mapped(0..2 * CHUNK + 1), None);
        assert_eq!(g.mapping_at(2 * CHUNK + 1), Some((2 * CHUNK + 1, 8)));
        // The last chunk of the index space ends at u64::MAX, where `(number + 1) * CHUNK` would overflow.
        let top: Vec<_> = ChunkSlots(u64::MAX - 3..u64::MAX).collect();
        assert_eq!(
            top,
            [(u64::MAX / CHUNK, CHUNK as usize - 4..CHUNK as usize - 1)]
        );
    }

    #[test]
    fn masks_cover_exactly_the_slots() {
        let masks: Vec<_> = Masks::new(3..5).collect();
        assert_eq!(masks, [(0, 0b11000)]);
        let masks: Vec<_> = Masks::new(60..130).collect();
        assert_eq!(masks, [(0, 0xF << 60), (1, u64::MAX), (2, 0b11)]);
        let masks: Vec<_> = Masks::new(0..64).collect();
        assert_eq!(masks, [(0, u64::MAX)]);
        let mut words = [0; WORDS];
        set_bits(&mut words, 60..130, true);
        assert_eq!(words[..3], [0xF << 60, u64::MAX, 0b11]);
        assert_eq!(highest_in(&words, 0..CHUNK as usize), Some(129));
        assert_eq!(highest_in(&words, 0..128), Some(127));
        assert_eq!(highest_in(&words, 0..61), Some(60));
        assert_eq!(highest_in(&words, 0..60), None);
        assert_eq!(highest_in(&words, 130..CHUNK as usize), None);
        set_bits(&mut words, 64..129, false);
        assert_eq!(highest_in(&words, 61..CHUNK as usize), Some(129));
        assert_eq!(highest_in(&words, 64..129), None);
    }
}
