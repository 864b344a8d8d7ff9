//! The free blocks of a segment ordered by `(size, address)`, for best fit: a sorted sequence kept in chunks of
//! at most [`CHUNK`] entries.
//!
//! A segment holds a few dozen free blocks (at most 127 on every built-in workload and recorded trace), and
//! each allocation and free inserts and removes one to three of them. A `BTreeSet` spent a sixth of a replay
//! on those: its nodes hold 11 keys, so even small sets are several nodes deep. Here a lookup is a binary
//! search over the chunks' last entries and one inside a chunk, and an insert or a removal moves at most a
//! chunk's worth of entries; a chunk that overflows splits in two, so a pathological segment with very many
//! free blocks still costs a search over chunks, not a move of the whole sequence.

#![deny(unsafe_code)]

/// Most entries in one chunk before it splits.
const CHUNK: usize = 128;

/// `(size, address)` of every free block, in increasing order.
#[derive(Debug, Clone, Default)]
pub(crate) struct FreeIndex {
    /// Sorted, non-empty chunks, each holding entries greater than every entry of the chunks before it.
    chunks: Vec<Vec<(u64, u64)>>,
    len: usize,
}

impl FreeIndex {
    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `key` is present.
    pub(crate) fn contains(&self, key: &(u64, u64)) -> bool {
        let c = self.chunk_for(key);
        self.chunks
            .get(c)
            .is_some_and(|chunk| chunk.binary_search(key).is_ok())
    }

    /// Adds `key`; returns false if it was present.
    pub(crate) fn insert(&mut self, key: (u64, u64)) -> bool {
        if self.chunks.is_empty() {
            self.chunks.push(vec![key]);
            self.len = 1;
            return true;
        }
        let c = self.chunk_for(&key).min(self.chunks.len() - 1);
        let chunk = &mut self.chunks[c];
        let Err(at) = chunk.binary_search(&key) else {
            return false;
        };
        chunk.insert(at, key);
        self.len += 1;
        if chunk.len() > CHUNK {
            let upper = chunk.split_off(CHUNK / 2);
            self.chunks.insert(c + 1, upper);
        }
        true
    }

    /// Removes `key`; returns false if it was absent.
    pub(crate) fn remove(&mut self, key: &(u64, u64)) -> bool {
        let c = self.chunk_for(key);
        let Some(chunk) = self.chunks.get_mut(c) else {
            return false;
        };
        let Ok(at) = chunk.binary_search(key) else {
            return false;
        };
        chunk.remove(at);
        if chunk.is_empty() {
            self.chunks.remove(c);
        }
        self.len -= 1;
        true
    }

    /// The entries at or after `from`, in increasing order.
    pub(crate) fn range_from(&self, from: (u64, u64)) -> impl Iterator<Item = &(u64, u64)> + '_ {
        let c = self.chunk_for(&from);
        let at = self
            .chunks
            .get(c)
            .map_or(0, |chunk| chunk.partition_point(|k| *k < from));
        self.chunks
            .get(c..)
            .unwrap_or_default()
            .iter()
            .enumerate()
            .flat_map(move |(i, chunk)| chunk[if i == 0 { at } else { 0 }..].iter())
    }

    /// All entries, in increasing order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = &(u64, u64)> + '_ {
        self.chunks.iter().flatten()
    }

    /// The first chunk whose last entry is at least `key` (`chunks.len()` if none is).
    fn chunk_for(&self, key: &(u64, u64)) -> usize {
        self.chunks
            .partition_point(|chunk| chunk.last().is_some_and(|last| last < key))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// Random inserts and removals give the same answers as a `BTreeSet`, with enough entries to split
    /// chunks many times and remove whole chunks.
    #[test]
    fn matches_a_btreeset() {
        let mut index = FreeIndex::default();
        let mut model = BTreeSet::new();
        let mut seed = 7u64;
        let mut next = |n: u64| {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) % n
        };
        for step in 0..20_000 {
            let key = (next(300), next(50) * 512);
            if step % 3 == 2 {
                assert_eq!(index.remove(&key), model.remove(&key), "remove {key:?}");
            } else {
                assert_eq!(index.insert(key), model.insert(key), "insert {key:?}");
            }
            assert_eq!(index.len(), model.len());
            let from = (next(310), 0);
            let got: Vec<_> = index.range_from(from).take(8).copied().collect();
            let expected: Vec<_> = model.range(from..).take(8).copied().collect();
            assert_eq!(got, expected, "range from {from:?}");
            assert_eq!(index.contains(&key), model.contains(&key));
        }
        assert!(index.iter().copied().eq(model.iter().copied()));
        assert!(
            index.chunks.len() > 10,
            "chunks split: {}",
            index.chunks.len()
        );
        for key in model.clone() {
            assert!(index.remove(&key));
        }
        assert_eq!((index.len(), index.chunks.len()), (0, 0));
        assert_eq!(index.range_from((0, 0)).count(), 0);
    }
}
