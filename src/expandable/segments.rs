//! The segments: every reservation (a [`Segment`], tiled by its blocks and indexed for best fit), found by
//! slot, by address and by key. A part that owns its state: it makes no driver call; the orchestrator
//! reserves and frees the reservations.

use super::accounting::{Books, SlotCounts};
use super::segment::Segment;
use super::segment::TagId;
use crate::driver::StreamId;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;
use rustc_hash::FxHashMap;

/// The segments of one kind: a stream, a pool (small or large), the private pool they serve, if any, and
/// the tag their allocations were made under, if any.
pub(super) type SegmentKey = (StreamId, Pool, Option<GraphPool>, Option<TagId>);

/// Every segment, by slot, address and key.
#[derive(Debug, Default)]
pub(super) struct Segments {
    slots: Vec<Option<Segment>>,
    /// `(reservation start, slot)` of every segment, sorted by start: a handful of segments, so a search of a
    /// vector is cheaper than a tree's on every free.
    by_addr: Vec<(u64, usize)>,
    by_key: FxHashMap<SegmentKey, Vec<usize>>,
    /// Counts frees, to order segments by when a block of theirs was last freed.
    free_clock: u64,
}

impl Segments {
    /// The segments that exist.
    pub(super) fn live(&self) -> impl Iterator<Item = &Segment> {
        self.slots.iter().flatten()
    }

    /// The segments that exist, with their slots.
    pub(super) fn slotted(&self) -> impl Iterator<Item = (usize, &Segment)> {
        (self.slots.iter().enumerate()).filter_map(|(slot, seg)| Some((slot, seg.as_ref()?)))
    }

    /// How many slots there are (some may be empty).
    pub(super) fn slot_count(&self) -> usize {
        self.slots.len()
    }

    /// The segment at `slot`, if the slot is in use.
    pub(super) fn try_at(&self, slot: usize) -> Option<&Segment> {
        self.slots.get(slot).and_then(Option::as_ref)
    }

    /// The segment at `slot`, which is in use.
    pub(super) fn at(&self, slot: usize) -> &Segment {
        self.slots[slot].as_ref().expect("segment slot in use")
    }

    /// The segment at `slot`, which is in use, mutably.
    pub(super) fn at_mut(&mut self, slot: usize) -> &mut Segment {
        self.slots[slot].as_mut().expect("segment slot in use")
    }

    /// The segment whose reservation contains `addr`.
    pub(super) fn slot_of(&self, addr: u64) -> Option<usize> {
        let at = self.by_addr.partition_point(|&(start, _)| start <= addr);
        let (_, slot) = self.by_addr[at.checked_sub(1)?];
        self.at(slot).va.contains(addr).then_some(slot)
    }

    /// The slots of the segments of `key`, in the order they were added.
    pub(super) fn of_key(&self, key: &SegmentKey) -> impl Iterator<Item = usize> + '_ {
        self.by_key.get(key).into_iter().flatten().copied()
    }

    /// Adds `segment` of `key` in the first free slot; returns the slot.
    pub(super) fn add_segment(&mut self, key: SegmentKey, segment: Segment) -> usize {
        let slot = match self.slots.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                self.slots.push(None);
                self.slots.len() - 1
            }
        };
        let start = segment.va.start;
        self.slots[slot] = Some(segment);
        let at = self.by_addr.partition_point(|&(s, _)| s < start);
        self.by_addr.insert(at, (start, slot));
        self.by_key.entry(key).or_default().push(slot);
        slot
    }

    /// Takes the segment at `slot` out.
    pub(super) fn take_out(&mut self, slot: usize) -> Segment {
        let seg = self.slots[slot].take().expect("segment slot in use");
        let key = (seg.stream, seg.pool, seg.graph, seg.tag);
        self.by_addr.retain(|&(start, _)| start != seg.va.start);
        if let Some(slots) = self.by_key.get_mut(&key) {
            slots.retain(|&s| s != slot);
            if slots.is_empty() {
                self.by_key.remove(&key);
            }
        }
        seg
    }

    /// Takes every segment out (teardown).
    pub(super) fn take_all(&mut self) -> Vec<Segment> {
        self.by_addr.clear();
        self.by_key.clear();
        std::mem::take(&mut self.slots)
            .into_iter()
            .flatten()
            .collect()
    }

    /// The next tick of the free clock.
    pub(super) fn tick_free_clock(&mut self) -> u64 {
        self.free_clock += 1;
        self.free_clock
    }

    /// The largest request that can be served now without a driver call.
    pub(super) fn largest_free_mapped_block(&self) -> u64 {
        self.live()
            .map(Segment::largest_free_mapped)
            .max()
            .unwrap_or(0)
    }

    /// The slots of the segments of tag `id`.
    pub(super) fn of_tag(&self, id: TagId) -> Vec<usize> {
        (self.slotted())
            .filter(|(_, s)| s.tag == Some(id))
            .map(|(slot, _)| slot)
            .collect()
    }

    /// Whether a segment of graph pool `pool` exists.
    pub(super) fn any_of_graph(&self, pool: GraphPool) -> bool {
        self.live().any(|seg| seg.graph == Some(pool))
    }

    /// Frees the pending block at `addr` of segment `slot`: parked, its events all completed, or freed while
    /// its tag slept, now awake. Returns its size.
    pub(super) fn release_parked(&mut self, books: &mut Books, slot: usize, addr: u64) -> u64 {
        let before = SlotCounts::of(self.at(slot));
        let (size, requested) = self.at_mut(slot).release_pending(addr);
        let seg = self.at(slot);
        let (pool, stream, graph) = (seg.pool, seg.stream, seg.graph);
        books.counters.count_inactive(pool, size, requested);
        books.record(TraceAction::FreeCompleted, addr, requested, stream, graph);
        books.refresh(self.at(slot), before);
        size
    }
}
