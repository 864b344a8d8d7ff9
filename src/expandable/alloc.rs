//! The allocation path: round, pick a block, carve it, and back its pages with physical memory.

use super::segment::Segment;
use super::streams::StreamUses;
use super::tag::TagId;
use super::{Expandable, ROUND, SegmentKey};
use crate::base::size::round_up;
use crate::driver::{Driver, DriverError, MemInfo, StreamId};
use crate::strategy::config::Compaction;
use crate::strategy::error::{Error, OutOfMemory, ReclaimStep};
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::{TraceAction, TraceEntry};
use crate::strategy::pool::Pool;
use std::ops::Range;

/// How many of the best-fitting free blocks are compared by the pages they would need mapped.
const FIT_CANDIDATES: usize = 8;

impl<D: Driver> Expandable<D> {
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
        let marks = self.reclaim_marks();
        let (slot, addr, borrowed) = self.find_block(rounded, stream, pool, (graph, tag))?;
        let before = self.page_counts(slot);
        self.segment_mut(slot).carve(addr, rounded, size);
        // Counted only once its pages are there: a request that fails must not move a statistic or its
        // peak (PyTorch counts a block when it hands it out). Meanwhile it is `carving`, so the
        // non-releasable bytes of its pages stay right.
        self.carving = Some((pool, rounded));
        self.refresh_page_counts(slot, before);
        let backed = self.back_with_pages(slot, addr, rounded);
        self.carving = None;
        match backed {
            Ok(()) => {
                self.count_block(pool, rounded, size, true);
                if borrowed {
                    // Work on `stream` will use a block of another stream's segment: its free must wait.
                    self.stream_uses.insert(addr, StreamUses::new(stream));
                }
                self.record(TraceAction::Alloc, addr, size, stream);
                Ok(addr)
            }
            Err(err) => {
                let before = self.page_counts(slot);
                self.segment_mut(slot).free_live_at_addr(addr, rounded);
                self.refresh_page_counts(slot, before);
                if !err.is_out_of_memory() {
                    return Err(err);
                }
                // Under memory pressure nothing idle is worth keeping: give it all back before reporting
                // (not during a capture, which forbids the waits and unmaps that takes).
                if !self.capturing()
                    && let Err(release_err) = self.release_cache()
                {
                    tracing::warn!(%release_err, "cuvmm: releasing the cache after out-of-memory failed");
                }
                self.counters.ooms += 1;
                let oom = self.out_of_memory(size, rounded, stream, marks);
                if let Some(history) = &mut self.history {
                    history.push(TraceEntry {
                        action: TraceAction::Oom,
                        addr: 0,
                        size: rounded,
                        stream,
                        device_free: Some(oom.device_free),
                    });
                }
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
        for &slot in self.by_key.get(&key).into_iter().flatten() {
            if self.segment(slot).whole_pages != whole_pages {
                continue;
            }
            if let Some((missing, block_size, addr)) =
                self.segment(slot).mapped_fit(size, FIT_CANDIDATES, false)
                && best.is_none_or(|(key, ..)| (missing, block_size) < key)
            {
                best = Some(((missing, block_size), slot, addr));
            }
        }
        if whole_pages && best.is_none_or(|((missing, _), ..)| missing > 0) {
            // Pages mapped in the other segments serve it where they are, on whole pages of a free block
            // (so it still shares no page), rather than be unmapped and mapped again.
            let mut in_place: Option<(u64, usize, u64)> = None;
            for &slot in self.by_key.get(&key).into_iter().flatten() {
                if !self.segment(slot).whole_pages
                    && let Some((0, block_size, addr)) =
                        self.segment(slot).mapped_fit(size, FIT_CANDIDATES, true)
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
            && self.under_pressure(own_missing as u64 * self.page_size)
        {
            // Growing would pass the budget: every free block is worth comparing by the pages it needs.
            for &slot in self.by_key.get(&key).into_iter().flatten() {
                if let Some((missing, block_size, addr)) =
                    self.segment(slot).mapped_fit(size, usize::MAX, false)
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
            && !self.capturing()
            && own_missing > 0
            && self.under_pressure(need.saturating_mul(self.page_size))
            && let Some((slot, addr)) = self.borrow_block(size, stream, pool)?
        {
            return Ok((slot, addr, true));
        }
        if let Some((_, slot, addr)) = best {
            return Ok((slot, addr, false));
        }
        let slot = self.reserve_segment(key, whole_pages, size)?;
        let (_, addr) = self
            .segment(slot)
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
        let busy = self.segment(slot).stream;
        if self.stream_idle(busy)? {
            return Ok(Some((slot, addr)));
        }
        // Its stream is busy: the other streams' candidates by size, each stream checked once.
        let mut candidates: Vec<(u64, usize, u64)> = self
            .borrow_candidates(size, stream, pool)
            .filter(|&(_, slot, _)| self.segment(slot).stream != busy)
            .collect();
        candidates.sort_unstable();
        let mut checked: Vec<(StreamId, bool)> = Vec::new();
        for (.., slot, addr) in candidates {
            let owner = self.segment(slot).stream;
            let idle = match checked.iter().find(|(s, _)| *s == owner) {
                Some(&(_, idle)) => idle,
                None => {
                    let idle = self.stream_idle(owner)?;
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
        self.segments
            .iter()
            .enumerate()
            .filter_map(move |(slot, seg)| {
                let seg = seg.as_ref().filter(|s| {
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

    /// Whether `stream` has no queued work left: an event recorded on it now has already completed. An
    /// event that cannot be destroyed is destroyed again at the next poll.
    pub(super) fn stream_idle(&mut self, stream: StreamId) -> Result<bool, Error> {
        let event = self.driver.record_event(stream)?;
        let complete = self.driver.event_complete(event);
        let destroyed = self.destroy_event(event);
        let complete = complete?;
        destroyed?;
        Ok(complete)
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
        let slot = match self.segments.iter().position(Option::is_none) {
            Some(slot) => slot,
            None => {
                self.segments.push(None);
                self.segments.len() - 1
            }
        };
        let mut segment = Segment::new(va, stream, pool, whole_pages, self.page_size);
        segment.graph = graph;
        segment.tag = tag;
        self.segments[slot] = Some(segment);
        let at = self.by_addr.partition_point(|&(start, _)| start < va.start);
        self.by_addr.insert(at, (va.start, slot));
        self.by_key.entry(key).or_default().push(slot);
        self.counters.segment.add(pool, 1);
        Ok(slot)
    }

    /// Maps the missing pages of the live block `addr .. addr + size` and sets access on its pages.
    /// On failure every handle obtained is kept in the pool and the page map says what is mapped.
    pub(super) fn back_with_pages(
        &mut self,
        slot: usize,
        addr: u64,
        size: u64,
    ) -> Result<(), Error> {
        let pages = self.segment(slot).pages_of(addr, size);
        // Access is set on whole chunks, so the pages of a chunk beyond the block need no call later.
        let mut access = pages.clone();
        // Most requests find every page mapped: one search says so, and nothing is counted or collected.
        let all_mapped = || {
            self.segment(slot)
                .pages
                .first_unmapped(pages.clone())
                .is_none()
        };
        let mut need = None;
        let chunked = self.chunk_pages > 1 && self.segment(slot).pool == Pool::Large;
        if chunked {
            if all_mapped() {
                need = Some(0);
            } else {
                access = self.map_chunks(slot, pages.clone())?;
            }
        }
        let lending = self.lending;
        let mut mapped = self.map_missing(slot, pages.clone(), need);
        if mapped.is_err() && lending && !self.lending {
            // The driver cannot map part of a handle: the lent pages went home; mapped without them.
            mapped = self.map_missing(slot, pages, None);
        }
        mapped?;
        if self.segment(slot).pages.inaccessible_count() == 0 {
            // Every mapped page of the segment has access: the usual case, with nothing left to do.
            return Ok(());
        }
        if chunked {
            // A chunk whose access failed earlier gets it now, whole: access is set on whole mappings. (The
            // pages `map_missing` mapped are single pages or lent pieces, which widen nothing: the same
            // range as before it.)
            access = self.widen_to_chunks(slot, access);
        }
        let mut pos = access.start;
        while let Some(run) = self
            .segment(slot)
            .pages
            .first_inaccessible_run(pos..access.end)
        {
            let va = self.segment(slot).page_addr(run.start);
            self.driver
                .set_access(va, run.len() as u64 * self.page_size)?;
            pos = run.end;
            self.segment_mut(slot).pages.set_accessible(run);
        }
        Ok(())
    }

    /// Maps the missing pages of `pages` of segment `slot`: pooled, unmapped, lent or new ones. On failure
    /// every page obtained and not mapped is put back, and the page map says what is mapped; a lent page the
    /// driver cannot map (it cannot map part of a handle) turns lending off.
    /// `need`: the missing pages, if known.
    fn map_missing(
        &mut self,
        slot: usize,
        pages: Range<usize>,
        need: Option<usize>,
    ) -> Result<(), Error> {
        let need = need.unwrap_or_else(|| self.segment(slot).pages.unmapped_count(pages.clone()));
        if need > 0 {
            // The handles, new ones first, in a buffer kept from one request to the next.
            let mut queue = std::mem::take(&mut self.handle_queue);
            queue.clear();
            let reused = self.obtain_handles(need, &mut queue)? as u64;
            let (pool, stream) = (self.segment(slot).pool, self.segment(slot).stream);
            tracing::debug!(
                pages = need,
                reused,
                created = need as u64 - reused,
                "cuvmm: mapping pages"
            );
            // Each run of missing pages: one `map` call per page, then the page map and the statistics
            // once for the run, and one `segment_map` event.
            let mut taken = 0;
            let mut pos = pages.start;
            while let Some(start) = self.segment(slot).pages.first_unmapped(pos..pages.end) {
                let end = (self.segment(slot).pages)
                    .first_mapped(start..pages.end)
                    .unwrap_or(pages.end);
                let run = &queue[taken..taken + (end - start)];
                let va = self.segment(slot).page_addr(start);
                let (done, failure) = match self.driver.map_each(va, self.page_size, run) {
                    Ok(()) => (run.len(), None),
                    Err((done, err)) => (done, Some(err)),
                };
                (self.segment_mut(slot).pages).map_run(start, run[..done].iter().map(|p| p.handle));
                let lent = self.note_mapped(slot, start, &run[..done]);
                taken += done;
                if done > 0 {
                    let bytes = done as u64 * self.page_size;
                    // A lent page's memory is counted at home.
                    (self.counters.mapped).add(pool, bytes - lent as u64 * self.page_size);
                    self.record(TraceAction::SegmentMap, va, bytes, stream);
                }
                if let Some(err) = failure {
                    // A driver without partial mappings refuses a lent page: with `Unsupported` (the
                    // trait's default), or, at offset 0, as a mapping smaller than its handle.
                    if matches!(
                        err,
                        DriverError::Unsupported { .. } | DriverError::SizeMismatch { .. }
                    ) && self.chunks.contains(&queue[taken].handle)
                    {
                        self.lending = false;
                    }
                    // The failed map may have mapped its page anyway (`settle.rs`): undone. The page that
                    // failed and those not used yet are put back.
                    self.undo_failed_map(va + done as u64 * self.page_size, self.page_size);
                    let unused = queue.split_off(taken);
                    self.handle_queue = queue;
                    self.put_back(unused);
                    return Err(err.into());
                }
                pos = end;
            }
            debug_assert_eq!(taken, queue.len(), "one handle per missing page");
            self.handle_queue = queue;
            self.counters.handles_reused += reused;
        }
        Ok(())
    }

    /// The counters that say which reclaim steps ran, read when a request starts.
    fn reclaim_marks(&self) -> ReclaimMarks {
        ReclaimMarks {
            compacted: self.counters.compacted,
            released: self.counters.released,
            retries: self.counters.retries,
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
        let c = &self.counters;
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
            allowed: self.limit,
            allocated: c.allocated.current(),
            reserved: c.reserved.current,
            idle: self.idle_bytes(),
            idle_handles: self.pooled_pages() as u64 * self.page_size,
            largest_free_block: self.largest_free_block(),
            retried,
            graph_pool_bytes: self.graph_pool_bytes().0,
            capturing: self.capturing(),
            asleep: self.asleep_tags(),
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
