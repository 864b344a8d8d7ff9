//! Physical pages: obtaining handles (pool, compaction of idle pages, create), and giving them back.
//!
//! Every handle is one page. A handle is in exactly one of two places: mapped at one page of one segment, or
//! in the pool (`Expandable::pooled`), unmapped and ready to map. Unmapping an idle page first synchronizes
//! the stream that owns its segment, so no queued work can still touch it.

use super::Expandable;
use crate::driver::{Driver, PhysHandle, StreamId};
use crate::error::Error;
use crate::history::TraceAction;
use std::ops::Range;

impl<D: Driver> Expandable<D> {
    /// Appends `count` handles for missing pages to `out`: pooled ones first, then idle pages unmapped from
    /// wherever they are, then new ones from the driver; in `out` the new ones come first. Returns how many
    /// already existed (pooled or unmapped). On driver out-of-memory the cache is released and creation
    /// retried once. On failure every handle obtained so far goes back to the pool and `out` is as it was.
    pub(super) fn obtain_handles(
        &mut self,
        count: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<usize, Error> {
        let base = out.len();
        out.reserve(count);
        let from_pool = count.min(self.pooled.len());
        out.extend(self.pooled.drain(self.pooled.len() - from_pool..));
        if from_pool < count {
            let stolen = self.steal_idle(count - from_pool, out);
            let stolen_pages = (out.len() - base - from_pool) as u64;
            self.counters.compacted += stolen_pages;
            if stolen_pages > 0 {
                tracing::debug!(
                    pages = stolen_pages,
                    pooled = from_pool,
                    "cuvmm: compaction: idle pages unmapped for reuse"
                );
            }
            if let Err(err) = stolen {
                self.pooled.extend(out.drain(base..));
                return Err(err);
            }
        }
        let reused = out.len() - base;
        let mut retried = false;
        while out.len() - base < count {
            let before = out.len();
            let created = self
                .driver
                .create_each(self.page_size, count - (before - base), out);
            let fresh = (out.len() - before) as u64;
            self.counters.created += fresh;
            self.counters.reserved.add(fresh * self.page_size);
            match created.map_err(Error::from) {
                Ok(()) => {}
                Err(err) if err.is_out_of_memory() && !retried => {
                    retried = true;
                    self.counters.retries += 1;
                    tracing::info!(
                        pages = count,
                        created = out.len() - base - reused,
                        "cuvmm: out of memory creating a page; releasing the cache and retrying once"
                    );
                    if let Err(err) = self.release_cache() {
                        self.pooled.extend(out.drain(base..));
                        return Err(err);
                    }
                }
                Err(err) => {
                    self.pooled.extend(out.drain(base..));
                    return Err(err);
                }
            }
        }
        out[base..].rotate_left(reused);
        Ok(reused)
    }

    /// Unmaps up to `count` idle pages, highest addresses of each segment first, and appends their handles
    /// to `out`. This is the compaction of idle physical pages.
    fn steal_idle(&mut self, count: usize, out: &mut Vec<PhysHandle>) -> Result<(), Error> {
        let target = out.len() + count;
        for slot in 0..self.segments.len() {
            if out.len() == target {
                break;
            }
            let Some(seg) = &self.segments[slot] else {
                continue;
            };
            // Idle runs from the highest down, each found when it is needed.
            let mut end = seg.pages.len();
            while out.len() < target {
                let Some(run) = self.segment(slot).pages.last_idle_run_before(end) else {
                    break;
                };
                let take = run.len().min(target - out.len());
                self.unmap_run(slot, run.end - take..run.end, out)?;
                end = run.start;
            }
        }
        Ok(())
    }

    /// Unmaps a run of idle pages of one segment in one driver call and appends their handles to `out`.
    fn unmap_run(
        &mut self,
        slot: usize,
        run: Range<usize>,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), Error> {
        let stream = self.segment(slot).stream;
        self.synchronize(stream)?;
        let va = self.segment(slot).page_addr(run.start);
        self.unmap_settled(va, run.len() as u64 * self.page_size)?;
        let before = self.page_counts(slot);
        let pages = run.len() as u64;
        tracing::debug!(va, pages, stream = stream.0, "cuvmm: unmapped idle pages");
        self.record(
            TraceAction::SegmentUnmap,
            va,
            pages * self.page_size,
            stream,
        );
        let seg = self.segment_mut(slot);
        seg.pages.unmap_run(run, out);
        let pool = seg.pool;
        self.counters.mapped.sub(pool, pages * self.page_size);
        self.refresh_page_counts(slot, before);
        Ok(())
    }

    /// Waits for `stream`'s queued work (before one of its pages is unmapped, or pending frees are drained).
    pub(super) fn synchronize(&mut self, stream: StreamId) -> Result<(), Error> {
        self.driver.synchronize(stream)?;
        self.counters.synchronizations += 1;
        Ok(())
    }

    fn release_handle(&mut self, handle: PhysHandle) -> Result<(), Error> {
        self.release_settled(handle)?;
        self.counters.released += 1;
        self.counters.reserved.sub(self.page_size);
        Ok(())
    }

    /// Gives at least `bytes` (rounded up to whole pages) of idle physical memory back to the driver, or all
    /// of it if there is less: pooled handles first, then idle pages from the highest addresses down.
    /// Returns the bytes given back.
    pub(super) fn release_idle(&mut self, bytes: u64) -> Result<u64, Error> {
        let _span = tracing::debug_span!("cuvmm::release_idle", bytes).entered();
        let mut released = self.release_pooled(bytes)?;
        while released < bytes && self.idle_pages > 0 {
            let pages = (bytes - released)
                .div_ceil(self.page_size)
                .min(self.idle_pages as u64) as usize;
            let mut handles = Vec::with_capacity(pages);
            let stolen = self.steal_idle(pages, &mut handles);
            let got_any = !handles.is_empty();
            self.pooled.extend(handles);
            stolen?;
            if !got_any {
                break;
            }
            released += self.release_pooled(bytes - released)?;
        }
        if released > 0 {
            tracing::debug!(released, "cuvmm: released idle memory to the driver");
        }
        Ok(released)
    }

    /// Releases pooled handles until at least `bytes` are given back or the pool is empty; returns the bytes
    /// given back. A handle whose release fails stays in the pool.
    fn release_pooled(&mut self, bytes: u64) -> Result<u64, Error> {
        let mut released = 0;
        while released < bytes
            && let Some(handle) = self.pooled.pop()
        {
            if let Err(err) = self.release_handle(handle) {
                self.pooled.push(handle);
                return Err(err);
            }
            released += self.page_size;
        }
        Ok(released)
    }

    /// Frees the reservations of segments that hold no live block and no mapped page.
    pub(super) fn free_empty_segments(&mut self) -> Result<(), Error> {
        for slot in 0..self.segments.len() {
            let Some(seg) = &self.segments[slot] else {
                continue;
            };
            if seg.occupied_count() > 0 || seg.pages.mapped_count() > 0 {
                continue;
            }
            let (va, key, pool) = (seg.va, (seg.stream, seg.pool), seg.pool);
            self.free_reservation_settled(va)?;
            self.segments[slot] = None;
            self.by_addr.remove(&va.start);
            if let Some(slots) = self.by_key.get_mut(&key) {
                slots.retain(|&s| s != slot);
                if slots.is_empty() {
                    self.by_key.remove(&key);
                }
            }
            self.counters.segment.sub(pool, 1);
        }
        Ok(())
    }

    /// Unmaps and releases everything, live blocks included, and frees every reservation. Used on drop.
    /// Goes on after a failure so as much as possible is given back, and returns the first failure.
    pub(super) fn teardown(&mut self) -> Result<(), Error> {
        let mut first_err: Option<Error> = None;
        let mut note = |result: Result<(), Error>| {
            if let Err(err) = result {
                first_err.get_or_insert(err);
            }
        };
        note(self.quiesce_streams());
        for seg in std::mem::take(&mut self.segments).into_iter().flatten() {
            if seg.pages.mapped_count() > 0 {
                note(self.driver.synchronize(seg.stream).map_err(Error::from));
                for run in seg.pages.mapped_runs(0..seg.pages.len()) {
                    let va = seg.page_addr(run.start);
                    match self.unmap_settled(va, run.len() as u64 * self.page_size) {
                        Ok(()) => self
                            .pooled
                            .extend(run.filter_map(|page| seg.pages.handle(page))),
                        Err(err) => note(Err(err.into())),
                    }
                }
            }
            note(self.free_reservation_settled(seg.va).map_err(Error::from));
        }
        self.by_addr.clear();
        self.by_key.clear();
        while let Some(handle) = self.pooled.pop() {
            note(self.release_handle(handle));
        }
        first_err.map_or(Ok(()), Err)
    }
}
