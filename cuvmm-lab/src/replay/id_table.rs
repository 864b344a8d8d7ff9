//! What a replay knows about each trace id: live at an address, failed with out-of-memory, or neither.
//!
//! Ids from the built-in workloads and from recorded traces are handed out in order from 0, so most of them
//! index a vector directly; an id too large for that (an RMM pointer used as an id, say) goes to a hash map.
//! Either way a lookup costs no SipHash, which was a large share of a replay.

use rustc_hash::FxHashMap;

/// One id's state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum Slot {
    /// Never allocated, or freed.
    #[default]
    Unknown,
    /// Allocated at `addr`, `size` bytes requested.
    Live {
        /// The address the allocator returned.
        addr: u64,
        /// Bytes requested.
        size: u64,
    },
    /// Its allocation failed with out-of-memory; its free and record_streams are skipped.
    Failed,
}

/// The state of every id of one replay.
#[derive(Debug)]
pub(super) struct IdTable {
    dense: Vec<Slot>,
    limit: u64,
    sparse: FxHashMap<u64, Slot>,
}

impl IdTable {
    /// A table for a trace of `events` events whose allocations use `ids`: ids below `4 * events + 1024`
    /// are stored densely, and the dense part is laid out up front as far as the largest such id, so
    /// setting an id during the replay never grows (copies and zero-fills) it.
    pub(super) fn new(events: usize, ids: impl IntoIterator<Item = u64>) -> Self {
        let limit = (events as u64).saturating_mul(4).saturating_add(1024);
        let dense_len = ids
            .into_iter()
            .filter(|&id| id < limit)
            .max()
            .map_or(0, |id| id as usize + 1);
        Self {
            dense: vec![Slot::Unknown; dense_len],
            limit,
            sparse: FxHashMap::default(),
        }
    }

    /// The state of `id`.
    #[inline]
    pub(super) fn get(&self, id: u64) -> Slot {
        if id < self.limit {
            self.dense.get(id as usize).copied().unwrap_or_default()
        } else {
            self.sparse.get(&id).copied().unwrap_or_default()
        }
    }

    /// Sets the state of `id`.
    #[inline]
    pub(super) fn set(&mut self, id: u64, slot: Slot) {
        // The usual case, an id of the dense part laid out up front, inlined; the rest out of line.
        if id < self.limit
            && let Some(entry) = self.dense.get_mut(id as usize)
        {
            *entry = slot;
        } else {
            self.set_outside(id, slot);
        }
    }

    /// [`set`](Self::set) for an id outside the dense part laid out so far.
    #[inline(never)]
    fn set_outside(&mut self, id: u64, slot: Slot) {
        if id < self.limit {
            let index = id as usize;
            if index >= self.dense.len() {
                if slot == Slot::Unknown {
                    return;
                }
                self.dense
                    .resize((index + 1).next_power_of_two(), Slot::Unknown);
            }
            self.dense[index] = slot;
        } else if slot == Slot::Unknown {
            self.sparse.remove(&id);
        } else {
            self.sparse.insert(id, slot);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dense_and_sparse_ids_keep_their_state() {
        let mut table = IdTable::new(10, []);
        let live = Slot::Live { addr: 7, size: 3 };
        for id in [0, 5, 1063, 1064, u64::MAX] {
            assert_eq!(table.get(id), Slot::Unknown);
            table.set(id, live);
            assert_eq!(table.get(id), live, "{id}");
            table.set(id, Slot::Failed);
            assert_eq!(table.get(id), Slot::Failed);
            table.set(id, Slot::Unknown);
            assert_eq!(table.get(id), Slot::Unknown);
        }
        assert!(table.sparse.is_empty());
        assert!(table.dense.len() < 4096);
    }

    #[test]
    fn the_dense_part_is_laid_out_to_the_largest_dense_id() {
        // 5000 is past the dense limit (4 * 10 + 1024) and goes to the hash map when set.
        let mut table = IdTable::new(10, [3, 9, 5000]);
        assert_eq!(table.dense.len(), 10);
        table.set(9, Slot::Failed);
        table.set(5000, Slot::Failed);
        assert_eq!(
            table.dense.len(),
            10,
            "setting a laid-out id does not grow the table"
        );
        assert_eq!(table.sparse.len(), 1);
    }
}
