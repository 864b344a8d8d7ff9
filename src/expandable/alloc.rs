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
        let (slot, addr) = self.find_block(rounded, stream, pool)?;
        let before = self.page_counts(slot);
        self.segment_mut(slot).carve(addr, rounded, size);
        self.counters.allocated.add(rounded);
        self.counters.active.add(rounded);
        self.counters.requested.add(size);
        self.counters.allocation.add(1);
        self.refresh_page_counts(slot, before);
        let retries_before = self.counters.retries;
        match self.back_with_pages(slot, addr, rounded) {
            Ok(()) => Ok(addr),
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

    /// The best-fitting free block for `size` bytes among the segments of `(stream, pool)`, reserving a new
    /// segment when none fits. Returns the segment's slot and the block's address.
    fn find_block(
        &mut self,
        size: u64,
        stream: StreamId,
        pool: Pool,
    ) -> Result<(usize, u64), Error> {
        let mut best: Option<((usize, u64), usize, u64)> = None;
        for &slot in self.by_key.get(&(stream, pool)).into_iter().flatten() {
            if let Some((missing, block_size, addr)) =
                self.segment(slot).mapped_fit(size, FIT_CANDIDATES)
                && best.is_none_or(|(key, ..)| (missing, block_size) < key)
            {
                best = Some(((missing, block_size), slot, addr));
            }
        }
        if let Some((_, slot, addr)) = best {
            return Ok((slot, addr));
        }
        let slot = self.reserve_segment(stream, pool, size)?;
        let (_, addr) = self
            .segment(slot)
            .best_fit(size)
            .expect("a new segment fits the request it was sized for");
        Ok((slot, addr))
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
        let missing = self.segment(slot).pages.unmapped_runs(pages.clone());
        let need: usize = missing.iter().map(|run| run.len()).sum();
        if need > 0 {
            let handles = self.obtain_handles(need)?;
            let reused = handles.reused.len() as u64;
            let mut queue = handles
                .fresh
                .into_iter()
                .chain(handles.reused)
                .collect::<Vec<_>>();
            queue.reverse();
            for page in missing.into_iter().flatten() {
                let handle = queue.pop().expect("one handle per missing page");
                let va = self.segment(slot).page_addr(page);
                if let Err(err) = self.driver.map(va, self.page_size, handle) {
                    self.pooled.push(handle);
                    self.pooled.extend(queue);
                    return Err(err.into());
                }
                self.segment_mut(slot).pages.map(page, handle);
            }
            self.counters.handles_reused += reused;
        }
        for run in self.segment(slot).pages.inaccessible_runs(pages) {
            let va = self.segment(slot).page_addr(run.start);
            self.driver
                .set_access(va, run.len() as u64 * self.page_size)?;
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
