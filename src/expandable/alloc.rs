//! The block path: an allocation rounds, picks a block (or reserves a segment), carves it and backs its
//! pages (`grow.rs`); a free frees the block at once or parks it behind events (`streams.rs`); a
//! `record_stream` notes another stream's use.

use super::accounting::SlotCounts;
use super::segment::TagId;
use super::segment::{FreeOutcome, Segment};
use super::segments::SegmentKey;
use super::{Expandable, ROUND};
use crate::base::size::round_up;
use crate::driver::{Driver, MemInfo, StreamId};
use crate::strategy::config::Compaction;
use crate::strategy::error::{Error, OutOfMemory, ReclaimStep};
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;

/// How many of the best-fitting free blocks are compared by the pages they would need mapped.
const FIT_CANDIDATES: usize = 8;

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream`, under `tag` if given.
    pub(super) fn alloc_in(
        &mut self,
        size: u64,
        stream: StreamId,
        tag: Option<TagId>,
    ) -> Result<u64, Error> {
        let graph = self.graphs.pool_for(&mut self.driver, stream)?;
        // Event queries are refused during a capture; pending frees wait until it ends.
        if !self.graphs.capturing() {
            self.poll_pending()?;
        }
        self.allocate(size, stream, graph, tag)
    }

    /// Allocates `size` bytes on `stream`.
    pub(super) fn allocate(
        &mut self,
        size: u64,
        stream: StreamId,
        graph: Option<GraphPool>,
        tag: Option<TagId>,
    ) -> Result<u64, Error> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let rounded = match round_up(size, ROUND) {
            Some(rounded) if rounded <= self.device_total => rounded,
            _ => {
                // Never fits, so nothing is released for it; but it is an out-of-memory, counted and
                // recorded as PyTorch does.
                self.books.counters.ooms += 1;
                let device_free = self.driver.mem_info().map_or(0, |info| info.free);
                self.books.record_oom(size, stream, device_free);
                return Err(Error::TooLarge {
                    requested: size,
                    capacity: self.device_total,
                });
            }
        };
        let pool = if rounded <= self.config.small_size {
            Pool::Small
        } else {
            Pool::Large
        };
        // A pool that splits no page (`MemPool(no_split=True)`): each allocation takes whole pages.
        let rounded = match self.graphs.no_split(graph) {
            true => round_up(rounded, self.page_size).unwrap_or(rounded),
            false => rounded,
        };
        let marks = self.reclaim_marks();
        let (slot, addr, borrowed) = self.find_block(rounded, stream, pool, (graph, tag))?;
        let before = SlotCounts::of(self.segments.at(slot));
        self.segments.at_mut(slot).carve(addr, rounded, size);
        // Counted only once its pages are there: a request that fails must not move a statistic or its
        // peak (PyTorch counts a block when it hands it out). Meanwhile it is `carving`, so the
        // non-releasable bytes of its pages stay right.
        self.books.set_carving(Some((pool, rounded)));
        self.books.refresh(self.segments.at(slot), before);
        let backed = self.back_with_pages(slot, addr, rounded);
        self.books.set_carving(None);
        match backed {
            Ok(()) => {
                self.books.count_block(pool, rounded, size, true);
                if borrowed {
                    // Work on `stream` will use a block of another stream's segment: its free must wait.
                    self.waits.add_use(addr, stream);
                }
                self.books.record(TraceAction::Alloc, addr, size, stream);
                Ok(addr)
            }
            Err(err) => {
                let before = SlotCounts::of(self.segments.at(slot));
                self.segments.at_mut(slot).free_live_at_addr(addr, rounded);
                self.books.refresh(self.segments.at(slot), before);
                if !err.is_out_of_memory() {
                    return Err(err);
                }
                // The free memory of pools that lend it when memory runs out (`pools.rs`).
                if graph.is_none()
                    && tag.is_none()
                    && let Some(addr) = self.serve_from_pools(size, rounded, stream, pool)?
                {
                    return Ok(addr);
                }
                // Under memory pressure nothing idle is worth keeping: give it all back before reporting
                // (not during a capture, which forbids the waits and unmaps that takes).
                if !self.graphs.capturing()
                    && let Err(release_err) = self.release_cache()
                {
                    tracing::warn!(%release_err, "cuvmm: releasing the cache after out-of-memory failed");
                }
                self.books.counters.ooms += 1;
                let oom = self.out_of_memory(size, rounded, stream, marks);
                self.books.record_oom(rounded, stream, oom.device_free);
                tracing::info!(
                    requested = size,
                    stream = stream.0,
                    allocated = oom.allocated,
                    reserved = oom.reserved,
                    "cuvmm: out of memory"
                );
                Err(Error::OutOfMemory(Box::new(oom)))
            }
        }
    }

    /// The block for `size` bytes on `stream`: the best-fitting free block among the segments of
    /// `(stream, pool)` of the request's class ([`Self::whole_pages`]; a whole-page request that would need
    /// pages there takes mapped whole pages of the other segments if they have some), unless it needs pages mapped and `cross_stream_reuse` finds a cached block of another
    /// stream's segment; a new segment when none fits. Returns the segment's slot, the block's address, and
    /// whether the block is borrowed from another stream's segment.
    fn find_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
        (graph, tag): (Option<GraphPool>, Option<TagId>),
    ) -> Result<(usize, u64, bool), Error> {
        let whole_pages = self.whole_pages(size, pool);
        let key = (stream, pool, graph, tag);
        let mut best: Option<((usize, u64), usize, u64)> = None;
        for slot in self.segments.of_key(&key) {
            if self.segments.at(slot).whole_pages != whole_pages {
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
        if whole_pages && best.is_none_or(|((missing, _), ..)| missing > 0) {
            // Pages mapped in the other segments serve it where they are, on whole pages of a free block
            // (so it still shares no page), rather than be unmapped and mapped again.
            let mut in_place: Option<(u64, usize, u64)> = None;
            for slot in self.segments.of_key(&key) {
                if !self.segments.at(slot).whole_pages
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
        if own_missing > 0
            && own_missing != usize::MAX
            && self.config.compaction == Compaction::Pressure
            && self.physical.under_pressure(
                self.books.counters.reserved.current,
                own_missing as u64 * self.page_size,
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
            && self.physical.under_pressure(
                self.books.counters.reserved.current,
                need.saturating_mul(self.page_size),
            )
            && let Some((slot, addr)) = self.borrow_block(size, stream, pool)?
        {
            return Ok((slot, addr, true));
        }
        if let Some((_, slot, addr)) = best {
            return Ok((slot, addr, false));
        }
        let slot = self.reserve_segment(key, whole_pages, size)?;
        let (_, addr) = self
            .segments
            .at(slot)
            .best_fit(size)
            .expect("a new segment fits the request it was sized for");
        Ok((slot, addr, false))
    }

    /// A cached free block (every page mapped with access, so serving it needs no driver call) of another
    /// stream's segment of `pool` that fits `size` bytes, whose stream has finished all its queued work: an
    /// event recorded on it now has completed, so nothing still queued there can touch the block (the RMM
    /// rule). The smallest such block among each segment's best fits; streams still busy are skipped. The
    /// unmapped frontier of a reservation is never borrowed: growing into another stream's segment would
    /// interleave the streams' blocks there (see `docs/DESIGN.md`).
    fn borrow_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
    ) -> Result<Option<(usize, u64)>, Error> {
        // The smallest candidate first, found without collecting them: its stream is usually idle.
        let Some((_, slot, addr)) = self.borrow_candidates(size, stream, pool).min() else {
            return Ok(None);
        };
        let busy = self.segments.at(slot).stream;
        if self.waits.stream_idle(&mut self.driver, busy)? {
            return Ok(Some((slot, addr)));
        }
        // Its stream is busy: the other streams' candidates by size, each stream checked once.
        let mut candidates: Vec<(u64, usize, u64)> = self
            .borrow_candidates(size, stream, pool)
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

    /// For each segment of `pool` of a stream other than `stream` that has a cached fit for `size` bytes,
    /// `(block size, slot, address)` ([`Segment::cached_fit`]).
    fn borrow_candidates(
        &self,
        size: u64,
        stream: StreamId,
        pool: Pool,
    ) -> impl Iterator<Item = (u64, usize, u64)> + '_ {
        let whole_pages = self.whole_pages(size, pool);
        self.segments.slotted().filter_map(move |(slot, seg)| {
            let seg = Some(seg).filter(|s| {
                s.pool == pool
                    && s.stream != stream
                    && s.whole_pages == whole_pages
                    && s.graph.is_none()
                    && s.tag.is_none()
            })?;
            let (block_size, addr) = seg.cached_fit(size, FIT_CANDIDATES)?;
            Some((block_size, slot, addr))
        })
    }

    /// Whether a request of `size` bytes (rounded) in `pool` goes to the segments of whole-page requests
    /// rather than to the others: under `compaction:eager`, large-pool requests of a multiple of the page
    /// size. Placed among their own kind, or on whole pages of the others' free blocks, such blocks start
    /// and end on page boundaries, so none of them keeps a page that another block freed (`docs/DESIGN.md`,
    /// "Whole pages apart").
    fn whole_pages(&self, size: u64, pool: Pool) -> bool {
        self.config.compaction == Compaction::Eager
            && pool == Pool::Large
            && size % self.page_size == 0
    }

    /// Reserves a segment for `(stream, pool)` large enough for `min_size` bytes.
    fn reserve_segment(
        &mut self,
        key: SegmentKey,
        whole_pages: bool,
        min_size: u64,
    ) -> Result<usize, Error> {
        let (stream, pool, graph, tag) = key;
        let wanted = self
            .device_total
            .saturating_mul(self.config.va_factor)
            .max(min_size);
        let size = round_up(wanted, self.page_size).ok_or(Error::TooLarge {
            requested: min_size,
            capacity: self.device_total,
        })?;
        let va = self.driver.reserve(size)?;
        tracing::info!(
            start = va.start,
            size,
            ?pool,
            stream = stream.0,
            "cuvmm: reserved segment"
        );
        let mut segment = Segment::new(va, stream, pool, whole_pages, self.page_size);
        segment.graph = graph;
        segment.tag = tag;
        let slot = self.segments.add_segment(key, segment);
        self.books.counters.segment.add(pool, 1);
        Ok(slot)
    }

    /// Frees the live block at `addr`: at once if only its segment's stream used it, else parked until
    /// events on the other streams complete.
    pub(super) fn free_block(&mut self, addr: u64) -> Result<(), Error> {
        let slot = self
            .segments
            .slot_of(addr)
            .ok_or(Error::UnknownAddress { addr })?;
        if let Some(tag) = self.segments.at(slot).tag
            && !self.tags.is_awake(tag)
        {
            return Err(self.tags.asleep_error("free", tag));
        }
        let (size, requested, at) = match self.segments.at(slot).check_free(addr) {
            FreeOutcome::Freed {
                size,
                requested,
                at,
            } => (size, requested, at),
            FreeOutcome::AlreadyFree => return Err(Error::DoubleFree { addr }),
            FreeOutcome::NotABlockStart => return Err(Error::UnknownAddress { addr }),
        };
        // A block whose free was deferred is freed, though still live until its events are recorded.
        if self.graphs.is_deferred(addr) {
            return Err(Error::DoubleFree { addr });
        }
        if self.waits.any_uses() {
            if self.graphs.capturing() {
                // No event may be recorded or queried now: the block stays live, with its streams, until
                // no capture is underway (`graphs.rs`).
                if self.waits.used_elsewhere(addr) {
                    self.graphs.defer(addr);
                    return Ok(());
                }
            } else if let Some(streams) = self.waits.take_uses(addr) {
                return self.park_block(slot, addr, streams);
            }
        }
        let before = SlotCounts::of(self.segments.at(slot));
        let (pool, stream) = (self.segments.at(slot).pool, self.segments.at(slot).stream);
        let clock = self.segments.tick_free_clock();
        let seg = self.segments.at_mut(slot);
        seg.free_live(at, addr, size);
        seg.last_free = clock;
        self.books.count_block(pool, size, requested, false);
        self.books.counters.count_inactive(pool, size);
        self.books
            .record(TraceAction::FreeRequested, addr, requested, stream);
        self.books
            .record(TraceAction::FreeCompleted, addr, requested, stream);
        self.books.refresh(self.segments.at(slot), before);
        Ok(())
    }

    /// Gives idle memory beyond `max_idle_bytes` back to the driver. A failure keeps the memory idle (the next
    /// free or poll tries again) and is reported through `tracing`: it must not fail the free that caused it.
    pub(super) fn release_excess_idle(&mut self) {
        if self.graphs.capturing() {
            // Releasing unmaps, which a capture forbids: the next free after it ends does it.
            return;
        }
        let excess = self.idle_bytes().saturating_sub(self.config.max_idle_bytes);
        if excess > 0
            && let Err(err) = self.release_idle(excess)
        {
            tracing::warn!(%err, excess, "cuvmm: releasing idle memory beyond max_idle_bytes failed; kept idle");
        }
    }

    /// Frees the pending blocks whose events completed, then keeps idle memory within its limit.
    fn poll_pending(&mut self) -> Result<(), Error> {
        if self.graphs.any_deferred() {
            self.insert_deferred_events()?;
        }
        if self.poll_events()? > 0 {
            self.release_excess_idle();
        }
        Ok(())
    }

    /// Records that the live block at `addr` is used by work on `stream` too. A no-op for the stream of
    /// the block's segment, whose reuse is stream-ordered, and for a stream already recorded.
    pub(super) fn record_stream_use(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let slot = self
            .segments
            .slot_of(addr)
            .ok_or(Error::UnknownAddress { addr })?;
        // A block whose free was deferred during a capture is freed already.
        if self.graphs.is_deferred(addr) {
            return Err(Error::UnknownAddress { addr });
        }
        // A live block must start at `addr`: found by its start, with no search for the block around it.
        if !(self.segments.at(slot).block_at(addr)).is_some_and(|block| block.is_live()) {
            return Err(Error::UnknownAddress { addr });
        }
        if stream == self.segments.at(slot).stream {
            return Ok(());
        }
        self.waits.add_use(addr, stream);
        Ok(())
    }

    /// The counters that say which reclaim steps ran, read when a request starts.
    fn reclaim_marks(&self) -> ReclaimMarks {
        ReclaimMarks {
            compacted: self.books.counters.compacted,
            released: self.books.counters.released,
            retries: self.books.counters.retries,
        }
    }

    /// The out-of-memory error for a request of `requested` bytes (`rounded` after rounding), with the
    /// allocator's state for diagnosis and the reclaim steps run since `marks` were read.
    fn out_of_memory(
        &mut self,
        requested: u64,
        rounded: u64,
        stream: StreamId,
        marks: ReclaimMarks,
    ) -> OutOfMemory {
        let info = self.driver.mem_info().unwrap_or(MemInfo {
            free: 0,
            total: self.device_total,
        });
        let c = &self.books.counters;
        let mut reclaim = Vec::new();
        if c.compacted > marks.compacted {
            reclaim.push(ReclaimStep::Compaction {
                pages: c.compacted - marks.compacted,
            });
        }
        if c.released > marks.released {
            reclaim.push(ReclaimStep::ReleaseCache {
                bytes: (c.released - marks.released) * self.page_size,
            });
        }
        let retried = c.retries > marks.retries;
        if retried {
            reclaim.push(ReclaimStep::Retry);
        }
        OutOfMemory {
            allocator: "cuvmm",
            device: self.driver.ordinal(),
            requested,
            alloc_size: rounded,
            stream,
            device_total: info.total,
            device_free: info.free,
            allowed: self.physical.limit(),
            allocated: c.allocated.current(),
            reserved: c.reserved.current,
            idle: self.idle_bytes(),
            idle_handles: self.physical.pooled_pages() as u64 * self.page_size,
            largest_free_block: self.segments.largest_free_mapped_block(),
            retried,
            graph_pool_bytes: self.graphs.pool_bytes(&self.segments, self.page_size).0,
            capturing: self.graphs.capturing(),
            asleep: self.tags.asleep_list(&self.segments, self.page_size),
            reclaim,
        }
    }
}
/// Counters read when a request starts, to tell which reclaim steps it ran.
#[derive(Clone, Copy, Debug)]
pub(super) struct ReclaimMarks {
    compacted: u64,
    released: u64,
    retries: u64,
}
