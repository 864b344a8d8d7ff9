//! The simulated device's page table: for each granule of virtual address space, the mapping that covers it.
//!
//! A mapping maps one whole handle at a granule-aligned address, so it covers `handle size / granularity`
//! consecutive granules. Each covered granule records the handle, its offset in granules from the mapping's
//! start, and whether access was set. Looking up an address is then one division and one array read, and a
//! call costs time in proportion to the granules it covers, as on a GPU, instead of the ordered-map searches
//! a map from start addresses needs for every overlap check. Granules are stored in chunks created when
//! something is first mapped there, so the table's memory follows what was mapped, not the reservations.

use crate::fast_hash::FastMap;
use std::fmt;

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
    chunks: FastMap<u64, Box<[Granule]>>,
}

impl Granules {
    /// The granule at `index` (unmapped if nothing was ever mapped near it).
    pub(super) fn get(&self, index: u64) -> Granule {
        self.chunks
            .get(&(index / CHUNK))
            .map_or_else(Granule::default, |chunk| chunk[(index % CHUNK) as usize])
    }

    /// Sets the granule at `index`.
    pub(super) fn set(&mut self, index: u64, granule: Granule) {
        let chunk = self
            .chunks
            .entry(index / CHUNK)
            .or_insert_with(|| vec![Granule::default(); CHUNK as usize].into_boxed_slice());
        chunk[(index % CHUNK) as usize] = granule;
    }

    /// The first granules of the mappings that start at granule indices `start .. end`, in increasing order,
    /// with what they record.
    pub(super) fn mapping_starts(&self, start: u64, end: u64) -> Vec<(u64, Granule)> {
        let mut keys: Vec<u64> = self
            .chunks
            .keys()
            .copied()
            .filter(|&k| k >= start / CHUNK && k <= end.saturating_sub(1) / CHUNK)
            .collect();
        keys.sort_unstable();
        let mut out = Vec::new();
        for key in keys {
            for (i, granule) in self.chunks[&key].iter().enumerate() {
                let index = key * CHUNK + i as u64;
                if (start..end).contains(&index) && granule.is_mapped() && granule.offset == 0 {
                    out.push((index, *granule));
                }
            }
        }
        out
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
        for (index, granule) in [
            (5000, at(3, 0)),
            (5001, at(3, 1)),
            (10, at(2, 0)),
            (3 * CHUNK - 1, at(4, 0)),
        ] {
            g.set(index, granule);
        }
        assert_eq!(g.get(5001), at(3, 1));
        assert_eq!(
            g.mapping_starts(0, u64::MAX),
            [(10, at(2, 0)), (3 * CHUNK - 1, at(4, 0)), (5000, at(3, 0))]
        );
        assert_eq!(g.mapping_starts(11, 5000), [(3 * CHUNK - 1, at(4, 0))]);
        g.set(10, Granule::default());
        assert_eq!(g.mapping_starts(0, 5000).len(), 1);
    }
}
