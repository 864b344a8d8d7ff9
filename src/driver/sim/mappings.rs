//! The simulated device's live mappings, each recorded once: where it starts, how many granules it covers,
//! and what it maps.
//!
//! Records live in a slab numbered from 1 (a freed number is reused by the next mapping); the page table
//! ([`Granules`](super::granules::Granules)) holds each covered granule's mapping number. A call on a mapping
//! of many granules then reads its extent from the record instead of scanning granules for it, and
//! `set_access` changes one record, not every granule.

use super::granules::MappingId;

/// One mapping: a handle, or a granule-aligned part of it, at a granule-aligned address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Record {
    /// Its first granule (address / granularity).
    pub(super) first: u64,
    /// Granules it covers (at least 1).
    pub(super) granules: u64,
    /// The handle's number; 0 (never a handle's number) in a free slot.
    pub(super) handle: u64,
    /// Where the mapping starts in its handle, in granules (0 for a whole handle).
    pub(super) base: u64,
    /// Whether `set_access` was called on the mapping.
    pub(super) accessible: bool,
    /// The peers (one bit per device ordinal) that a `set_access` on the mapping granted access to.
    pub(super) peers: u32,
}

impl Record {
    /// The granule after its last one.
    #[inline]
    pub(super) fn end(&self) -> u64 {
        self.first + self.granules
    }
}

/// Every live mapping, by number.
#[derive(Debug, Clone, Default)]
pub(super) struct Mappings {
    /// Mapping number `n` at index `n - 1`; a free slot has handle 0.
    slots: Vec<Record>,
    /// Numbers of free slots, the last freed on top.
    free: Vec<MappingId>,
}

impl Mappings {
    /// No mappings, with room for `count` before the slab grows.
    pub(super) fn with_capacity(count: usize) -> Self {
        Self {
            slots: Vec::with_capacity(count),
            free: Vec::new(),
        }
    }

    /// Records `record` (whose handle is not 0) and returns its number (never 0).
    #[inline]
    pub(super) fn insert(&mut self, record: Record) -> MappingId {
        if let Some(id) = self.free.pop() {
            self.slots[id as usize - 1] = record;
            return id;
        }
        self.slots.push(record);
        MappingId::try_from(self.slots.len()).expect("fewer than 2^32 live mappings")
    }

    /// Forgets mapping `id` (live) and returns what it was.
    #[inline]
    pub(super) fn remove(&mut self, id: MappingId) -> Record {
        let slot = &mut self.slots[id as usize - 1];
        let record = *slot;
        slot.handle = 0;
        self.free.push(id);
        record
    }

    /// Live mapping `id` (a number the page table holds).
    #[inline]
    pub(super) fn get(&self, id: MappingId) -> &Record {
        &self.slots[id as usize - 1]
    }

    /// Live mapping `id`, to change it.
    #[inline]
    pub(super) fn get_mut(&mut self, id: MappingId) -> &mut Record {
        &mut self.slots[id as usize - 1]
    }

    /// Live mappings.
    pub(super) fn len(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Live mappings, in no particular order.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Record> + '_ {
        self.slots.iter().filter(|record| record.handle != 0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_start_at_one_and_freed_ones_are_reused() {
        let mut m = Mappings::default();
        let record = |first, handle| Record {
            first,
            granules: 2,
            handle,
            base: 0,
            accessible: false,
            peers: 0,
        };
        let a = m.insert(record(10, 5));
        let b = m.insert(record(20, 6));
        assert_eq!((a, b), (1, 2));
        assert_eq!(m.get(b).end(), 22);
        m.get_mut(a).accessible = true;
        assert_eq!(
            m.remove(a),
            Record {
                accessible: true,
                ..record(10, 5)
            }
        );
        assert_eq!(m.len(), 1);
        assert_eq!(m.iter().map(|r| r.first).collect::<Vec<_>>(), [20]);
        assert_eq!(m.insert(record(30, 7)), a);
        assert_eq!(m.len(), 2);
    }
}
