//! The allocation path: round, pick a block, carve it, and back its pages with physical memory.

use super::segment::{Pool, Segment};
use super::{Expandable, ROUND};
use crate::driver::{Driver, MemInfo, PhysHandle, StreamId};
use crate::error::{Error, OutOfMemory};
use crate::size::round_up;

/// How many of the best-fitting free blocks are compared by the pages they would need mapped.
const FIT_CANDIDATES: usize = 8;

/// Where the handles for a request's missing pages came from.
pub(super) struct Handles {
    /// Handles that already existed (pooled, or unmapped from idle pages).
    pub reused: Vec<PhysHandle>,
    /// Handles created for this request.
    pub fresh: Vec<PhysHandle>,
}

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream`.
    pub(super) fn allocate(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
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
        let (slot, addr, borrowed) = self.find_block(rounded, stream, pool)?;
        let before = self.page_counts(slot);
        self.segment_mut(slot).carve(addr, rounded, size);
        self.counters.allocated.add(rounded);
        self.counters.active.add(rounded);
        self.counters.requested.add(size);
        self.counters.allocation.add(1);
        self.refresh_page_counts(slot, before);
        let retries_before = self.counters.retries;
        match self.back_with_pages(slot, addr, rounded) {
            Ok(()) => {
                if borrowed {
                    // Work on `stream` will use a block of another stream's segment: its free must wait.
                    self.stream_uses.insert(addr, vec![stream]);
                }
                Ok(addr)
            }
            Err(err) => {
                self.free_block(addr)?;
                if !err.is_out_of_memory() {
                    return Err(err);
                }
                // Under memory pressure nothing idle is worth keeping: give it all back before reporting.
                if let Err(release_err) = self.release_cache() {
                    tracing::warn!(%release_err, "cuvmm: releasing the cache after out-of-memory failed");
                }
                self.counters.ooms += 1;
                let retried = self.counters.retries > retries_before;
                Err(self.out_of_memory(size, stream, retried))
            }
        }
    }

    /// The block for `size` bytes on `stream`: the best-fitting free block among the segments of
    /// `(stream, pool)`, unless it needs pages mapped and `cross_stream_reuse` finds a cached block of another
    /// stream's segment; a new segment when none fits. Returns the segment's slot, the block's address, and
    /// whether the block is borrowed from another stream's segment.
    fn find_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
    ) -> Result<(usize, u64, bool), Error> {
        let mut best: Option<((usize, u64), usize, u64)> = None;
        for &slot in self.by_key.get(&(stream, pool)).into_iter().flatten() {
            if let Some((missing, block_size, addr)) =
                self.segment(slot).mapped_fit(size, FIT_CANDIDATES)
                && best.is_none_or(|(key, ..)| (missing, block_size) < key)
            {
                best = Some(((missing, block_size), slot, addr));
            }
        }
        let own_missing = best.map_or(usize::MAX, |((missing, _), ..)| missing);
        if self.config.cross_stream_reuse
            && own_missing > 0
            && let Some((slot, addr)) = self.borrow_block(size, stream, pool)?
        {
            return Ok((slot, addr, true));
        }
        if let Some((_, slot, addr)) = best {
            return Ok((slot, addr, false));
        }
        let slot = self.reserve_segment(stream, pool, size)?;
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
        let mut candidates: Vec<(u64, usize, u64)> = self
            .segments
            .iter()
            .enumerate()
            .filter_map(|(slot, seg)| {
                let seg = seg
                    .as_ref()
                    .filter(|s| s.pool == pool && s.stream != stream)?;
                let (block_size, addr) = seg.cached_fit(size, FIT_CANDIDATES)?;
                Some((block_size, slot, addr))
            })
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

    /// Whether `stream` has no queued work left: an event recorded on it now has already completed.
    fn stream_idle(&mut self, stream: StreamId) -> Result<bool, Error> {
        let event = self.driver.record_event(stream)?;
        let complete = self.driver.event_complete(event);
        let destroyed = self.driver.destroy_event(event);
        let complete = complete?;
        destroyed?;
        Ok(complete)
    }

    /// Reserves a segment for `(stream, pool)` large enough for `min_size` bytes.
    fn reserve_segment(
        &mut self,
        stream: StreamId,
        pool: Pool,
        min_size: u64,
    ) -> Result<usize, Error> {
        let wanted = self
            .device_total
            .saturating_mul(self.config.va_factor)
            .max(min_size);
        let size = round_up(wanted, self.page_size).ok_or(Error::TooLarge {
            requested: min_size,
            capacity: self.device_total,
        })?;
        let va = self.driver.reserve(size)?;
        tracing::debug!(
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
        self.segments[slot] = Some(Segment::new(va, stream, pool, self.page_size));
        self.by_addr.insert(va.start, slot);
        self.by_key.entry((stream, pool)).or_default().push(slot);
        self.counters.segment.add(1);
        Ok(slot)
    }

    /// Maps the missing pages of the live block `addr .. addr + size` and sets access on its pages.
    /// On failure every handle obtained is kept in the pool and the page map says what is mapped.
    fn back_with_pages(&mut self, slot: usize, addr: u64, size: u64) -> Result<(), Error> {
        let pages = self.segment(slot).pages_of(addr, size);
        let need = self.segment(slot).pages.unmapped_count(pages.clone());
        if need > 0 {
            let handles = self.obtain_handles(need)?;
            let reused = handles.reused.len() as u64;
            let mut queue = handles.fresh.into_iter().chain(handles.reused);
            let mut pos = pages.start;
            while let Some(page) = self.segment(slot).pages.first_unmapped(pos..pages.end) {
                let handle = queue.next().expect("one handle per missing page");
                let va = self.segment(slot).page_addr(page);
                if let Err(err) = self.driver.map(va, self.page_size, handle) {
                    self.pooled.push(handle);
                    self.pooled.extend(queue);
                    return Err(err.into());
                }
                self.segment_mut(slot).pages.map(page, handle);
                pos = page + 1;
            }
            self.counters.handles_reused += reused;
        }
        let mut pos = pages.start;
        while let Some(run) = self
            .segment(slot)
            .pages
            .first_inaccessible_run(pos..pages.end)
        {
            let va = self.segment(slot).page_addr(run.start);
            self.driver
                .set_access(va, run.len() as u64 * self.page_size)?;
            pos = run.end;
            self.segment_mut(slot).pages.set_accessible(run);
        }
        Ok(())
    }

    /// The out-of-memory error for a request, with the allocator's state for diagnosis.
    fn out_of_memory(&mut self, requested: u64, stream: StreamId, retried: bool) -> Error {
        let info = self.driver.mem_info().unwrap_or(MemInfo {
            free: 0,
            total: self.device_total,
        });
        Error::OutOfMemory(Box::new(OutOfMemory {
            requested,
            stream,
            device_total: info.total,
            device_free: info.free,
            allocated: self.counters.allocated.current,
            reserved: self.counters.reserved.current,
            idle: self.idle_bytes(),
            largest_free_block: self.largest_free_block(),
            retried,
        }))
    }
}
