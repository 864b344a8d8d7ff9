//! Placement: which block serves a request. The best-fitting free block among the request's segments,
//! compared by the pages each would need mapped (`Segment::mapped_fit`); past the budget, as the compaction
//! policy says, every free block; a cached block of another stream's segment when `cross_stream_reuse`
//! finds one that saves pages; else a new segment (`reservations.rs`).

use super::Expandable;
use super::segment::{Kind, TagId};
use crate::driver::{Driver, StreamId};
use crate::strategy::error::Error;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::pool::Pool;

/// How many of the best-fitting free blocks are compared by the pages they would need mapped.
const FIT_CANDIDATES: usize = 8;

impl<D: Driver> Expandable<D> {
    /// The block for `size` bytes on `stream`: the best-fitting free block among the segments of
    /// `(stream, pool)` of the request's kind ([`Kind`]: whole pages as the compaction policy's `whole_pages`
    /// says; a whole-page request that would need pages there takes mapped whole pages of the other segments
    /// if they have some),
    /// unless it needs pages mapped and `cross_stream_reuse` finds a cached block of another stream's
    /// segment; a new segment when none fits. Returns the segment's slot, the block's address, and whether
    /// the block is borrowed from another stream's segment.
    pub(super) fn find_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
        (graph, tag): (Option<GraphPool>, Option<TagId>),
    ) -> Result<(usize, u64, bool), Error> {
        let kind = self.kind_of(size, pool);
        let key = (stream, pool, graph, tag);
        let mut best: Option<((usize, u64), usize, u64)> = None;
        for slot in self.segments.of_key(&key) {
            if self.segments.at(slot).kind != kind {
                continue;
            }
            if let Some((missing, block_size, addr)) =
                self.segments
                    .at(slot)
                    .mapped_fit(size, FIT_CANDIDATES, false)
                && best.is_none_or(|(key, ..)| (missing, block_size) < key)
            {
                best = Some(((missing, block_size), slot, addr));
            }
        }
        if kind == Kind::WholePages && best.is_none_or(|((missing, _), ..)| missing > 0) {
            // Pages mapped in the other segments serve it where they are, on whole pages of a free block
            // (so it still shares no page), rather than be unmapped and mapped again.
            let mut in_place: Option<(u64, usize, u64)> = None;
            for slot in self.segments.of_key(&key) {
                if self.segments.at(slot).kind != Kind::WholePages
                    && let Some((0, block_size, addr)) =
                        self.segments
                            .at(slot)
                            .mapped_fit(size, FIT_CANDIDATES, true)
                    && in_place.is_none_or(|(smallest, ..)| block_size < smallest)
                {
                    in_place = Some((block_size, slot, addr));
                }
            }
            if let Some((block_size, slot, addr)) = in_place {
                best = Some(((0, block_size), slot, addr));
            }
        }
        let mut own_missing = best.map_or(usize::MAX, |((missing, _), ..)| missing);
        let reserved = self.books.counters.reserved.current;
        if own_missing > 0
            && own_missing != usize::MAX
            && (self.policies.compaction).compares_every_fit(
                (self.supply).growth(reserved, own_missing as u64 * self.page_size),
            )
        {
            // Growing would pass the budget: every free block is worth comparing by the pages it needs.
            for slot in self.segments.of_key(&key) {
                if let Some((missing, block_size, addr)) =
                    self.segments.at(slot).mapped_fit(size, usize::MAX, false)
                    && best.is_none_or(|(key, ..)| (missing, block_size) < key)
                {
                    best = Some(((missing, block_size), slot, addr));
                }
            }
            own_missing = best.map_or(usize::MAX, |((missing, _), ..)| missing);
        }
        // Borrowing costs event calls, and saves only pages: under `compaction:pressure` it waits until
        // growing would pass the budget.
        let need = (own_missing as u64).min(size.div_ceil(self.page_size) + 1);
        // A graph's pool and a tag take no other stream's memory, and a capture allows no event query.
        if self.config.cross_stream_reuse
            && graph.is_none()
            && tag.is_none()
            && !self.graphs.capturing()
            && own_missing > 0
            && (self.policies.compaction)
                .reclaims((self.supply).growth(reserved, need.saturating_mul(self.page_size)))
            && let Some((slot, addr)) = self.borrow_block(size, stream, pool, kind)?
        {
            return Ok((slot, addr, true));
        }
        if let Some((_, slot, addr)) = best {
            return Ok((slot, addr, false));
        }
        let slot = self.reserve_segment(key, kind, size)?;
        let (_, addr) = self
            .segments
            .at(slot)
            .best_fit(size)
            .expect("a new segment fits the request it was sized for");
        Ok((slot, addr, false))
    }

    /// The kind of segments a request of `size` bytes (rounded) in `pool` is placed among: whole pages where
    /// the compaction policy keeps them apart, else any.
    fn kind_of(&self, size: u64, pool: Pool) -> Kind {
        match (self.policies.compaction).whole_pages(size, pool, self.page_size) {
            true => Kind::WholePages,
            false => Kind::Mixed,
        }
    }

    /// A cached free block (every page mapped with access, so serving it needs no driver call) of another
    /// stream's segment of `pool` that fits `size` bytes, whose stream has finished all its queued work: an
    /// event recorded on it now has completed, so nothing still queued there can touch the block (the RMM
    /// rule). The smallest such block among each segment's best fits; streams still busy are skipped. The
    /// unmapped frontier of a reservation is never borrowed: growing into another stream's segment would
    /// interleave the streams' blocks there (see `docs/allocator.md`, "Streams").
    fn borrow_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
        kind: Kind,
    ) -> Result<Option<(usize, u64)>, Error> {
        // The smallest candidate first, found without collecting them: its stream is usually idle.
        let Some((_, slot, addr)) = self.borrow_candidates(size, stream, pool, kind).min() else {
            return Ok(None);
        };
        let busy = self.segments.at(slot).stream;
        if self.waits.stream_idle(&mut self.driver, busy)? {
            return Ok(Some((slot, addr)));
        }
        // Its stream is busy: the other streams' candidates by size, each stream checked once.
        let mut candidates: Vec<(u64, usize, u64)> = self
            .borrow_candidates(size, stream, pool, kind)
            .filter(|&(_, slot, _)| self.segments.at(slot).stream != busy)
            .collect();
        candidates.sort_unstable();
        let mut checked: Vec<(StreamId, bool)> = Vec::new();
        for (.., slot, addr) in candidates {
            let owner = self.segments.at(slot).stream;
            let idle = match checked.iter().find(|(s, _)| *s == owner) {
                Some(&(_, idle)) => idle,
                None => {
                    let idle = self.waits.stream_idle(&mut self.driver, owner)?;
                    checked.push((owner, idle));
                    idle
                }
            };
            if idle {
                return Ok(Some((slot, addr)));
            }
        }
        Ok(None)
    }

    /// For each segment of `pool` of a stream other than `stream`, of the request's kind, that has a cached
    /// fit for `size` bytes, `(block size, slot, address)`
    /// ([`Segment::cached_fit`](super::segment::Segment::cached_fit)).
    fn borrow_candidates(
        &self,
        size: u64,
        stream: StreamId,
        pool: Pool,
        kind: Kind,
    ) -> impl Iterator<Item = (u64, usize, u64)> + '_ {
        self.segments.slotted().filter_map(move |(slot, seg)| {
            let seg = Some(seg).filter(|s| {
                s.pool == pool
                    && s.stream != stream
                    && s.kind == kind
                    && s.graph.is_none()
                    && s.tag.is_none()
            })?;
            let (block_size, addr) = seg.cached_fit(size, FIT_CANDIDATES)?;
            Some((block_size, slot, addr))
        })
    }
}
