//! The simulated device's page table: for each granule of virtual address space, the mapping that covers it.
//!
//! A mapping maps a handle, or a granule-aligned part of it, at a granule-aligned address, so it covers
//! `mapping size / granularity` consecutive granules. Each covered granule records the handle, its offset in
//! granules from the mapping's start, where the mapping starts in the handle, and whether access was set. Looking up an address is then one division and one array read, and a
//! call costs time in proportion to the granules it covers, as on a GPU, instead of the ordered-map searches
//! a map from start addresses needs for every overlap check. Granules are stored in chunks created when
//! something is first mapped there, so the table's memory follows what was mapped, not the reservations.
//!
//! A range of granules is read as [`pieces`](Granules::pieces) and changed with
//! [`update_slices`](Granules::update_slices), one chunk's slice at a time, so a call over many granules
//! looks each chunk up once rather than once per granule. The chunk found last is remembered: calls come in runs on
//! neighbouring granules, so most lookups are one comparison.

use rustc_hash::FxHashMap;
use std::cell::Cell;
use std::fmt;
use std::ops::Range;

/// Granules per chunk.
const CHUNK: u64 = 1024;

/// A chunk number no granule has (the highest is `u64::MAX / CHUNK`): `last` before any lookup.
const NO_CHUNK: u64 = u64::MAX;

/// What the table records for one granule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Granule {
    /// The handle mapped here; 0 (never a handle's number) when nothing is.
    pub(super) handle: u64,
    /// Granules from the start of the mapping.
    pub(super) offset: u64,
    /// Where the mapping starts in its handle, in granules (0 for a whole handle).
    pub(super) base: u64,
    /// Whether `set_access` was called on the mapping.
    pub(super) accessible: bool,
}

impl Granule {
    /// Whether a mapping covers this granule.
    pub(super) fn is_mapped(&self) -> bool {
        self.handle != 0
    }
}

/// One chunk's granules.
type Chunk = [Granule; CHUNK as usize];

/// Every granule of the address space, by granule index (address / granularity).
#[derive(Clone)]
pub(super) struct Granules {
    chunks: Vec<Box<Chunk>>,
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
    /// The granule at `index` (unmapped if nothing was ever mapped near it).
    #[inline]
    pub(super) fn get(&self, index: u64) -> Granule {
        self.position(index / CHUNK)
            .map_or_else(Granule::default, |at| {
                self.chunks[at][(index % CHUNK) as usize]
            })
    }

    /// The granule at `index`, to change it.
    // Always inlined, as are `position_or_insert` and `position`: a single-granule map, the usual one, is
    // a few dozen instructions, and a call here was a fifth of them (callgrind, llm-serving).
    #[inline(always)]
    pub(super) fn get_mut(&mut self, index: u64) -> &mut Granule {
        let at = self.position_or_insert(index / CHUNK);
        &mut self.chunks[at][(index % CHUNK) as usize]
    }

    /// The granules of `range` in order, in pieces that each lie in one chunk: `(indices, granules)`, the
    /// granules `None` where nothing was ever mapped (all of them unmapped).
    pub(super) fn pieces(
        &self,
        range: Range<u64>,
    ) -> impl Iterator<Item = (Range<u64>, Option<&[Granule]>)> + '_ {
        ChunkSlots(range).map(|(number, slots)| {
            let base = number * CHUNK;
            let indices = base + slots.start as u64..base + slots.end as u64;
            let granules = self.position(number).map(|at| &self.chunks[at][slots]);
            (indices, granules)
        })
    }

    /// Applies `f` to each granule of `range`, in order (creating chunks that do not exist yet).
    pub(super) fn update(&mut self, range: Range<u64>, mut f: impl FnMut(&mut Granule)) {
        self.update_slices(range, |granules| granules.iter_mut().for_each(&mut f));
    }

    /// Calls `f` on the granules of `range`, in order, one chunk's slice at a time (creating chunks that do
    /// not exist yet).
    pub(super) fn update_slices(&mut self, range: Range<u64>, mut f: impl FnMut(&mut [Granule])) {
        for (number, slots) in ChunkSlots(range) {
            let at = self.position_or_insert(number);
            f(&mut self.chunks[at][slots]);
        }
    }

    /// The highest granule in `range` that a mapping covers, with its index.
    pub(super) fn last_mapped(&self, range: Range<u64>) -> Option<(u64, Granule)> {
        let mut found = None;
        // Pieces come in increasing order: a later find is a higher granule.
        for (indices, granules) in self.pieces(range) {
            if let Some(granules) = granules
                && let Some(i) = granules.iter().rposition(Granule::is_mapped)
            {
                found = Some((indices.start + i as u64, granules[i]));
            }
        }
        found
    }

    /// Sets each granule of `range` to `granule(offset from the range's start)`.
    pub(super) fn fill(&mut self, range: Range<u64>, granule: impl Fn(u64) -> Granule) {
        let mut offset = 0;
        self.update(range, |slot| {
            *slot = granule(offset);
            offset += 1;
        });
    }

    /// The first granules of the mappings that start at granule indices `start .. end`, in increasing order,
    /// with what they record.
    pub(super) fn mapping_starts(&self, start: u64, end: u64) -> Vec<(u64, Granule)> {
        let mut numbers: Vec<(u64, usize)> = self
            .index
            .iter()
            .map(|(&number, &at)| (number, at))
            .filter(|&(k, _)| k >= start / CHUNK && k <= end.saturating_sub(1) / CHUNK)
            .collect();
        numbers.sort_unstable();
        let mut out = Vec::new();
        for (number, at) in numbers {
            for (i, granule) in self.chunks[at].iter().enumerate() {
                let index = number * CHUNK + i as u64;
                if (start..end).contains(&index) && granule.is_mapped() && granule.offset == 0 {
                    out.push((index, *granule));
                }
            }
        }
        out
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
            None => self.insert(number),
        }
    }

    /// Creates chunk `number`, unmapped. Returns its position.
    #[inline(never)]
    fn insert(&mut self, number: u64) -> usize {
        let at = self.chunks.len();
        // Built on the heap: `Box::new` of the array would build 24 KiB on the stack and copy it.
        let chunk: Box<[Granule]> = vec![Granule::default(); CHUNK as usize].into_boxed_slice();
        self.chunks
            .push(chunk.try_into().expect("a chunk has CHUNK granules"));
        self.index.insert(number, at);
        self.last.set((number, at));
        at
    }
}

/// The chunks that granules `range` touch, in order: `(chunk number, slots in the chunk)`.
struct ChunkSlots(Range<u64>);

impl Iterator for ChunkSlots {
    type Item = (u64, Range<usize>);

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
    fn granules_read_back_and_mapping_starts_come_in_order() {
        let mut g = Granules::default();
        assert!(!g.get(5).is_mapped());
        let at = |handle, offset| Granule {
            handle,
            offset,
            base: 0,
            accessible: false,
        };
        g.fill(5000..5002, |offset| at(3, offset));
        g.fill(10..11, |_| at(2, 0));
        g.fill(3 * CHUNK - 1..3 * CHUNK, |_| at(4, 0));
        assert_eq!(g.get(5001), at(3, 1));
        assert_eq!(g.last_mapped(0..5000), Some((3 * CHUNK - 1, at(4, 0))));
        assert_eq!(g.last_mapped(11..3 * CHUNK - 1), None);
        assert_eq!(
            g.mapping_starts(0, u64::MAX),
            [(10, at(2, 0)), (3 * CHUNK - 1, at(4, 0)), (5000, at(3, 0))]
        );
        assert_eq!(g.mapping_starts(11, 5000), [(3 * CHUNK - 1, at(4, 0))]);
        g.update(5000..5002, |granule| granule.accessible = true);
        assert!(g.get(5000).accessible && g.get(5001).accessible && !g.get(5002).accessible);
        g.fill(10..11, |_| Granule::default());
        assert_eq!(g.mapping_starts(0, 5000).len(), 1);
    }

    #[test]
    fn pieces_split_a_range_at_chunk_boundaries_and_mark_missing_chunks() {
        let mut g = Granules::default();
        let mapped = Granule {
            handle: 7,
            offset: 0,
            base: 0,
            accessible: true,
        };
        g.fill(CHUNK + 3..CHUNK + 4, |_| mapped);
        let pieces: Vec<_> = g
            .pieces(CHUNK - 2..2 * CHUNK + 1)
            .map(|(indices, granules)| (indices, granules.map(<[Granule]>::to_vec)))
            .collect();
        assert_eq!(pieces.len(), 3);
        assert_eq!(pieces[0], (CHUNK - 2..CHUNK, None));
        assert_eq!(pieces[1].0, CHUNK..2 * CHUNK);
        assert_eq!(pieces[1].1.as_ref().unwrap()[3], mapped);
        assert_eq!(pieces[2], (2 * CHUNK..2 * CHUNK + 1, None));
        assert_eq!(g.pieces(5..5).count(), 0);
        // The last chunk of the index space ends at u64::MAX, where `(number + 1) * CHUNK` would overflow.
        let top: Vec<_> = ChunkSlots(u64::MAX - 3..u64::MAX).collect();
        assert_eq!(
            top,
            [(u64::MAX / CHUNK, CHUNK as usize - 4..CHUNK as usize - 1)]
        );
    }
}
