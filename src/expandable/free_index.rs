//! The free blocks of a segment ordered by `(size, address)`, for best fit: size classes, each a sorted
//! sequence kept in chunks of at most [`CHUNK`] entries.
//!
//! A segment holds a few dozen to a few hundred free blocks, and each allocation and free inserts and removes
//! one to three of them. A `BTreeSet` spent a sixth of a replay on those (its nodes hold 11 keys, so even
//! small sets are several nodes deep); one sorted sequence still spent a tenth, on a binary search and moving
//! up to a chunk of entries per change. Entries are split first by size class, four per power of two as in
//! TLSF, with a bitmap of the classes that hold entries: a change touches one class, which holds a handful of
//! entries, and a best-fit search starts in the request's class and walks the bitmap to the next ones. Within
//! a class, a chunk that overflows splits in two, so a pathological segment with very many free blocks of
//! one size still costs a search over chunks, not a move of the whole sequence.

#![deny(unsafe_code)]

/// Most entries in one chunk before it splits.
const CHUNK: usize = 128;

/// One size class's entries: a sorted sequence in chunks of at most [`CHUNK`].
#[derive(Debug, Clone, Default)]
struct Chunked {
    /// Sorted chunks, each holding entries greater than every entry of the chunks before it; non-empty,
    /// except a single chunk left when the last entry was removed.
    chunks: Vec<Vec<(u64, u64)>>,
    len: usize,
}

impl Chunked {
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
        // An insertion step from the end: a class holds a handful of entries, so walking them costs less
        // than a binary search and a call to move the tail.
        chunk.push(key);
        let entries = chunk.as_mut_slice();
        let mut at = entries.len() - 1;
        while at > 0 && entries[at - 1] > key {
            entries[at] = entries[at - 1];
            at -= 1;
        }
        entries[at] = key;
        if at > 0 && entries[at - 1] == key {
            chunk.remove(at);
            return false;
        }
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
        // A class holds a handful of entries, usually one: a scan finds it with fewer branches missed.
        let found = match chunk.len() {
            0..=8 => chunk.iter().position(|k| k == key),
            _ => chunk.binary_search(key).ok(),
        };
        let Some(at) = found else {
            return false;
        };
        chunk.remove(at);
        // The last chunk stays, empty, so that a class emptied and refilled (the common case) does not
        // free and allocate it again.
        if chunk.is_empty() && self.chunks.len() > 1 {
            self.chunks.remove(c);
        }
        self.len -= 1;
        true
    }

    /// Replaces `old` by `new` when the class holds one chunk and `old` is in it: one search for each and
    /// one move of the entries between them, where a removal and an insertion moved the tail of the chunk
    /// twice. Returns false, changing nothing, otherwise (or if `new` is present already).
    fn replace_in_place(&mut self, old: &(u64, u64), new: (u64, u64)) -> bool {
        let [chunk] = self.chunks.as_mut_slice() else {
            return false;
        };
        let Ok(i) = chunk.binary_search(old) else {
            return false;
        };
        let Err(j) = chunk.binary_search(&new) else {
            return false;
        };
        if j > i {
            // `new` goes after the entries that follow `old` and are below it.
            chunk[i..j].rotate_left(1);
            chunk[j - 1] = new;
        } else {
            chunk[j..=i].rotate_right(1);
            chunk[j] = new;
        }
        true
    }

    /// Where the first entry at or after `from` is: `(chunk, index in it)`, possibly one past the end of a
    /// chunk or of the chunks.
    fn position_of(&self, from: &(u64, u64)) -> (usize, usize) {
        let c = self.chunk_for(from);
        let at = self
            .chunks
            .get(c)
            .map_or(0, |chunk| chunk.partition_point(|k| k < from));
        (c, at)
    }

    /// The first chunk whose last entry is at least `key` (`chunks.len()` if none is), or 0 when there is at
    /// most one chunk.
    fn chunk_for(&self, key: &(u64, u64)) -> usize {
        if self.chunks.len() <= 1 {
            // Where the one chunk (or none) answers as a search over them would.
            return 0;
        }
        self.chunks
            .partition_point(|chunk| chunk.last().is_some_and(|last| last < key))
    }
}

/// Size classes: four per power of two ([`class_of`]), so each holds entries within 25% of each other.
const CLASSES: usize = 256;

/// The size class of `size`: sizes below 4 are their own class; above, the power of two and the two bits
/// after the leading one. Non-decreasing in `size`, so classes in order hold entries in order.
fn class_of(size: u64) -> usize {
    if size < 4 {
        return size as usize;
    }
    let log = 63 - size.leading_zeros();
    (log * 4) as usize + ((size >> (log - 2)) & 3) as usize
}

/// `(size, address)` of every free block, in increasing order, for best fit.
#[derive(Debug, Clone)]
pub(crate) struct FreeIndex {
    classes: Vec<Chunked>,
    /// Bit `c` is set when class `c` has an entry.
    nonempty: [u64; CLASSES / 64],
    len: usize,
}

impl Default for FreeIndex {
    fn default() -> Self {
        Self {
            classes: vec![Chunked::default(); CLASSES],
            nonempty: [0; CLASSES / 64],
            len: 0,
        }
    }
}

impl FreeIndex {
    /// Number of entries.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether `key` is present.
    pub(crate) fn contains(&self, key: &(u64, u64)) -> bool {
        self.classes[class_of(key.0)].contains(key)
    }

    /// Adds `key`; returns false if it was present.
    pub(crate) fn insert(&mut self, key: (u64, u64)) -> bool {
        self.insert_in(class_of(key.0), key)
    }

    /// Removes `key`; returns false if it was absent.
    pub(crate) fn remove(&mut self, key: &(u64, u64)) -> bool {
        self.remove_in(class_of(key.0), key)
    }

    /// Replaces `old` by `new`: as `remove(old)` and then `insert(new)`, with the same result. Returns
    /// whether `old` was present. Carving a block and merging a freed one each turn one free block into
    /// another; in the same size class, one move of the entries between them does.
    pub(crate) fn replace(&mut self, old: &(u64, u64), new: (u64, u64)) -> bool {
        let (c, d) = (class_of(old.0), class_of(new.0));
        if c == d && self.classes[c].replace_in_place(old, new) {
            return true;
        }
        let removed = self.remove_in(c, old);
        self.insert_in(d, new);
        removed
    }

    /// [`insert`](Self::insert) of `key`, of class `c`.
    #[inline]
    fn insert_in(&mut self, c: usize, key: (u64, u64)) -> bool {
        let added = self.classes[c].insert(key);
        if added {
            self.len += 1;
            self.nonempty[c / 64] |= 1 << (c % 64);
        }
        added
    }

    /// [`remove`](Self::remove) of `key`, of class `c`.
    #[inline]
    fn remove_in(&mut self, c: usize, key: &(u64, u64)) -> bool {
        let removed = self.classes[c].remove(key);
        if removed && self.classes[c].len() == 0 {
            self.nonempty[c / 64] &= !(1 << (c % 64));
        }
        self.len -= usize::from(removed);
        removed
    }

    /// The entries at or after `from`, in increasing order.
    pub(crate) fn range_from(&self, from: (u64, u64)) -> RangeFrom<'_> {
        let class = class_of(from.0);
        let (chunk, at) = self.classes[class].position_of(&from);
        RangeFrom {
            index: self,
            class,
            chunk,
            at,
        }
    }

    /// All entries, in increasing order.
    pub(crate) fn iter(&self) -> RangeFrom<'_> {
        self.range_from((0, 0))
    }

    /// The first class from `from` on that holds an entry.
    fn next_nonempty_class(&self, from: usize) -> Option<usize> {
        let mut next = from;
        while next < CLASSES {
            let word = self.nonempty[next / 64] & (u64::MAX << (next % 64));
            if word != 0 {
                return Some(next / 64 * 64 + word.trailing_zeros() as usize);
            }
            next = (next / 64 + 1) * 64;
        }
        None
    }
}

/// The entries of a [`FreeIndex`] from some key on, in increasing order: a position (class, chunk, index)
/// stepped forward, the bitmap giving the next class that holds entries. Best fit takes the first few, so
/// this is on every allocation's path.
pub(crate) struct RangeFrom<'a> {
    index: &'a FreeIndex,
    class: usize,
    chunk: usize,
    at: usize,
}

impl<'a> Iterator for RangeFrom<'a> {
    type Item = &'a (u64, u64);

    fn next(&mut self) -> Option<&'a (u64, u64)> {
        loop {
            let chunks = &self.index.classes[self.class].chunks;
            if let Some(chunk) = chunks.get(self.chunk) {
                if let Some(entry) = chunk.get(self.at) {
                    self.at += 1;
                    return Some(entry);
                }
                self.chunk += 1;
                self.at = 0;
                continue;
            }
            self.class = self.index.next_nonempty_class(self.class + 1)?;
            self.chunk = 0;
            self.at = 0;
        }
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
            if step % 7 == 3 {
                // The replaced key: the key itself, one near it, or one far from it.
                let new = match step % 3 {
                    0 => key,
                    1 => (key.0 + next(3), key.1 + 512),
                    _ => (next(300), next(50) * 512),
                };
                let had = model.remove(&key);
                model.insert(new);
                assert_eq!(index.replace(&key, new), had, "replace {key:?} by {new:?}");
            } else if step % 3 == 2 {
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
        let chunks: usize = index.classes.iter().map(|c| c.chunks.len()).sum();
        assert!(chunks > 10, "chunks split: {chunks}");
        for key in model.clone() {
            assert!(index.remove(&key));
        }
        assert_eq!(index.len(), 0);
        assert!(index.classes.iter().all(|c| c.chunks.len() <= 1));
        assert!(
            index
                .classes
                .iter()
                .flat_map(|c| &c.chunks)
                .all(Vec::is_empty)
        );
        assert_eq!(index.nonempty, [0; CLASSES / 64]);
        assert_eq!(index.range_from((0, 0)).count(), 0);
    }
}
