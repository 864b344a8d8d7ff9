//! The simulated device's page table: for each granule of virtual address space, the mapping that covers it.
//!
//! A mapping maps one whole handle at a granule-aligned address, so it covers `handle size / granularity`
//! consecutive granules. Each covered granule records the handle, its offset in granules from the mapping's
//! start, and whether access was set. Looking up an address is then one division and one array read, and a
//! call costs time in proportion to the granules it covers, as on a GPU, instead of the ordered-map searches
//! a map from start addresses needs for every overlap check. Granules are stored in chunks created when
//! something is first mapped there, so the table's memory follows what was mapped, not the reservations.

use crate::fast_hash::FastMap;
use std::cell::Cell;
use std::fmt;
use std::ops::Range;

/// Granules per chunk.
const CHUNK: u64 = 1024;

/// What the table records for one granule.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Granule {
    /// The handle mapped here; 0 (never a handle's number) when nothing is.
    pub(super) handle: u64,
    /// Granules from the start of the mapping.
    pub(super) offset: u64,
    /// Whether `set_access` was called on the mapping.
    pub(super) accessible: bool,
}

impl Granule {
    /// Whether a mapping covers this granule.
    pub(super) fn is_mapped(&self) -> bool {
        self.handle != 0
    }
}

/// Every granule of the address space, by granule index (address / granularity).
#[derive(Clone, Default)]
pub(super) struct Granules {
    chunks: Vec<Box<[Granule]>>,
    /// Chunk number (granule index / [`CHUNK`]) to its position in `chunks`.
    index: FastMap<u64, usize>,
    /// The chunk found last, `(chunk number, position)`: calls come in runs on neighbouring granules.
    last: Cell<Option<(u64, usize)>>,
}

impl Granules {
    /// The granule at `index` (unmapped if nothing was ever mapped near it).
    pub(super) fn get(&self, index: u64) -> Granule {
        self.position(index / CHUNK)
            .map_or_else(Granule::default, |at| {
                self.chunks[at][(index % CHUNK) as usize]
            })
    }

    /// The granule at `index`, to change it.
    pub(super) fn get_mut(&mut self, index: u64) -> &mut Granule {
        let at = self.position_or_insert(index / CHUNK);
        &mut self.chunks[at][(index % CHUNK) as usize]
    }

    /// The highest granule in `range` that a mapping covers, with its index.
    pub(super) fn last_mapped(&self, range: Range<u64>) -> Option<(u64, Granule)> {
        let mut found = None;
        // Chunks come in increasing order: a later find is a higher granule.
        for_chunks(range, |number, slots| {
            let Some(at) = self.position(number) else {
                return;
            };
            let chunk = &self.chunks[at];
            if let Some(i) = slots.clone().rev().find(|&i| chunk[i].is_mapped()) {
                found = Some((number * CHUNK + i as u64, chunk[i]));
            }
        });
        found
    }

    /// Sets each granule of `range` to `granule(offset from the range's start)`.
    pub(super) fn fill(&mut self, range: Range<u64>, granule: impl Fn(u64) -> Granule) {
        let start = range.start;
        for_chunks(range, |number, slots| {
            let at = self.position_or_insert(number);
            for i in slots {
                self.chunks[at][i] = granule(number * CHUNK + i as u64 - start);
            }
        });
    }

    /// Applies `f` to each granule of `range`.
    pub(super) fn update(&mut self, range: Range<u64>, mut f: impl FnMut(&mut Granule)) {
        for_chunks(range, |number, slots| {
            let at = self.position_or_insert(number);
            self.chunks[at][slots].iter_mut().for_each(&mut f);
        });
    }

    /// Calls `f(index, granule)` for each granule of `range` in order, stopping at the first error.
    pub(super) fn try_for_each<E>(
        &self,
        range: Range<u64>,
        mut f: impl FnMut(u64, Granule) -> Result<(), E>,
    ) -> Result<(), E> {
        let mut result = Ok(());
        for_chunks(range, |number, slots| {
            if result.is_err() {
                return;
            }
            let base = number * CHUNK;
            match self.position(number) {
                Some(at) => {
                    let chunk = &self.chunks[at];
                    result = slots.clone().try_for_each(|i| f(base + i as u64, chunk[i]));
                }
                None => {
                    result = slots
                        .clone()
                        .try_for_each(|i| f(base + i as u64, Granule::default()));
                }
            }
        });
        result
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
    fn position(&self, number: u64) -> Option<usize> {
        if let Some((last, at)) = self.last.get()
            && last == number
        {
            return Some(at);
        }
        let at = *self.index.get(&number)?;
        self.last.set(Some((number, at)));
        Some(at)
    }

    /// Where chunk `number` is in `chunks`, created unmapped if it does not exist.
    fn position_or_insert(&mut self, number: u64) -> usize {
        if let Some(at) = self.position(number) {
            return at;
        }
        let at = self.chunks.len();
        self.chunks
            .push(vec![Granule::default(); CHUNK as usize].into_boxed_slice());
        self.index.insert(number, at);
        self.last.set(Some((number, at)));
        at
    }
}

/// Calls `f(chunk number, slots in the chunk)` for each chunk that granules `range` touch, in order.
fn for_chunks(range: Range<u64>, mut f: impl FnMut(u64, Range<usize>)) {
    let mut at = range.start;
    while at < range.end {
        let number = at / CHUNK;
        let end = ((number + 1) * CHUNK).min(range.end);
        f(
            number,
            (at % CHUNK) as usize..(end - number * CHUNK) as usize,
        );
        at = end;
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
}
