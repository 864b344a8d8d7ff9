//! Growth: backing a block with pages, in the growth order for a request (see the module docs of
//! `mod.rs`): pooled handles, chunks, compaction and lending under pressure (`reclaim.rs`), new handles,
//! and one release of the cache and retry on out-of-memory.

use super::Expandable;
use super::accounting::SlotCounts;
use super::reclaim::{Compacting, Wait};
use super::settle::undo_failed_map;
use crate::driver::{Driver, DriverError, PhysPage};
use crate::strategy::config::Compaction;
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;
use std::ops::Range;

impl<D: Driver> Expandable<D> {
    /// Maps the missing pages of the live block `addr .. addr + size` and sets access on its pages.
    /// On failure every handle obtained is kept in the pool and the page map says what is mapped.
    pub(super) fn back_with_pages(
        &mut self,
        slot: usize,
        addr: u64,
        size: u64,
    ) -> Result<(), Error> {
        let pages = self.segments.at(slot).pages_of(addr, size);
        // Access is set on whole chunks, so the pages of a chunk beyond the block need no call later.
        let mut access = pages.clone();
        // Most requests find every page mapped: one search says so, and nothing is counted or collected.
        let all_mapped = || {
            self.segments
                .at(slot)
                .pages
                .first_unmapped(pages.clone())
                .is_none()
        };
        let mut need = None;
        let chunked = self.physical.chunk_pages() > 1 && self.segments.at(slot).pool == Pool::Large;
        if chunked {
            if all_mapped() {
                need = Some(0);
            } else {
                access = self.map_chunks(slot, pages.clone())?;
            }
        }
        let lending = self.lending.enabled();
        let mut mapped = self.map_missing(slot, pages.clone(), need);
        if mapped.is_err() && lending && !self.lending.enabled() {
            // The driver cannot map part of a handle: the lent pages went home; mapped without them.
            mapped = self.map_missing(slot, pages, None);
        }
        mapped?;
        if self.segments.at(slot).pages.inaccessible_count() == 0 {
            // Every mapped page of the segment has access: the usual case, with nothing left to do.
            return Ok(());
        }
        if chunked {
            // A chunk whose access failed earlier gets it now, whole: access is set on whole mappings. (The
            // pages `map_missing` mapped are single pages or lent pieces, which widen nothing: the same
            // range as before it.)
            access = self
                .physical
                .widen_to_chunks(&self.lending, self.segments.at(slot), access);
        }
        let mut pos = access.start;
        while let Some(run) = self
            .segments
            .at(slot)
            .pages
            .first_inaccessible_run(pos..access.end)
        {
            let va = self.segments.at(slot).page_addr(run.start);
            self.driver
                .set_access(va, run.len() as u64 * self.page_size)?;
            pos = run.end;
            self.segments.at_mut(slot).pages.set_accessible(run);
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
        let need =
            need.unwrap_or_else(|| self.segments.at(slot).pages.unmapped_count(pages.clone()));
        if need > 0 {
            // The handles, new ones first, in a buffer kept from one request to the next.
            let mut queue = self.physical.take_queue();
            let reused = self.obtain_handles(need, &mut queue)? as u64;
            let (pool, stream) = (self.segments.at(slot).pool, self.segments.at(slot).stream);
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
            while let Some(start) = self.segments.at(slot).pages.first_unmapped(pos..pages.end) {
                let end = (self.segments.at(slot).pages)
                    .first_mapped(start..pages.end)
                    .unwrap_or(pages.end);
                let run = &queue[taken..taken + (end - start)];
                let va = self.segments.at(slot).page_addr(start);
                let (done, failure) = match self.driver.map_each(va, self.page_size, run) {
                    Ok(()) => (run.len(), None),
                    Err((done, err)) => (done, Some(err)),
                };
                (self.segments.at_mut(slot).pages)
                    .map_run(start, run[..done].iter().map(|p| p.handle));
                let lent = (self.lending).note_mapped(
                    self.physical.chunks(),
                    self.segments.at(slot),
                    start,
                    &run[..done],
                );
                taken += done;
                if done > 0 {
                    let bytes = done as u64 * self.page_size;
                    // A lent page's memory is counted at home.
                    (self.books.counters.mapped).add(pool, bytes - lent as u64 * self.page_size);
                    self.books
                        .record(TraceAction::SegmentMap, va, bytes, stream);
                }
                if let Some(err) = failure {
                    // A driver without partial mappings refuses a lent page: with `Unsupported` (the
                    // trait's default), or, at offset 0, as a mapping smaller than its handle.
                    if matches!(
                        err,
                        DriverError::Unsupported { .. } | DriverError::SizeMismatch { .. }
                    ) && self.physical.is_chunk(queue[taken].handle)
                    {
                        self.lending.disable();
                    }
                    // The failed map may have mapped its page anyway (`settle.rs`): undone. The page that
                    // failed and those not used yet are put back.
                    undo_failed_map(
                        &mut self.driver,
                        va + done as u64 * self.page_size,
                        self.page_size,
                    );
                    let unused = queue.split_off(taken);
                    self.physical.restore_queue(queue);
                    self.put_back(unused);
                    return Err(err.into());
                }
                pos = end;
            }
            debug_assert_eq!(taken, queue.len(), "one handle per missing page");
            self.physical.restore_queue(queue);
            self.books.counters.handles_reused += reused;
        }
        Ok(())
    }

    /// Appends `count` pages for missing pages to `out`: pooled handles first; then, under
    /// `compaction:eager` or past the budget, idle pages unmapped from wherever they are, or lent (see
    /// [`Self::reclaim`]); then new handles from the driver; in `out` the new ones come first. Returns how
    /// many already existed (pooled, unmapped or lent). On driver out-of-memory the cache is released and
    /// creation retried once. On failure every page obtained so far is put back and `out` is as it was.
    pub(super) fn obtain_handles(
        &mut self,
        count: usize,
        out: &mut Vec<PhysPage>,
    ) -> Result<usize, Error> {
        let base = out.len();
        out.reserve(count);
        let from_pool = self.physical.take_pooled(count, out);
        // Compaction waits for streams and unmaps: never during a capture.
        if from_pool < count
            && !self.graphs.capturing()
            && let Err(err) = self.reclaim(count - from_pool, out)
        {
            let obtained: Vec<PhysPage> = out.drain(base..).collect();
            self.put_back(obtained);
            return Err(err);
        }
        let reused = out.len() - base;
        let mut retried = false;
        let mut fresh_handles = Vec::new();
        while out.len() - base < count {
            fresh_handles.clear();
            let wanted = count - (out.len() - base);
            // Past the memory limit the device is as full as if it were that small.
            let allowed = self
                .physical
                .pages_under_limit(self.books.counters.reserved.current)
                .min(wanted);
            let mut created = Ok(());
            if allowed > 0 {
                created = (self.driver).create_each(self.page_size, allowed, &mut fresh_handles);
            }
            if created.is_ok() && allowed < wanted {
                created = Err(self
                    .physical
                    .limit_reached(self.books.counters.reserved.current, wanted - allowed));
            }
            out.extend(fresh_handles.iter().copied().map(PhysPage::from));
            let fresh = fresh_handles.len() as u64;
            self.books.counters.created += fresh;
            self.books.counters.reserved.add(fresh * self.page_size);
            match created.map_err(Error::from) {
                Ok(()) => {}
                Err(err) if err.is_out_of_memory() && !retried && !self.graphs.capturing() => {
                    retried = true;
                    self.books.counters.retries += 1;
                    tracing::info!(
                        pages = count,
                        created = out.len() - base - reused,
                        "cuvmm: out of memory creating a page; releasing the cache and retrying once"
                    );
                    if let Err(err) = self.release_cache() {
                        let obtained: Vec<PhysPage> = out.drain(base..).collect();
                        self.put_back(obtained);
                        return Err(err);
                    }
                }
                Err(err) => {
                    let obtained: Vec<PhysPage> = out.drain(base..).collect();
                    self.put_back(obtained);
                    return Err(err);
                }
            }
        }
        out[base..].rotate_left(reused);
        Ok(reused)
    }

    /// The compaction for `count` missing pages: under `compaction:eager`, idle pages unmapped from every
    /// segment in order, each stream synchronized once. Under `compaction:pressure`, only while creating
    /// the pages would pass the budget: idle pages of segments whose stream an event query shows idle,
    /// those freed longest ago first; then, if that was not enough, after synchronizing each remaining
    /// stream once; at each of the two steps, once no idle page can be unmapped, idle pages of chunks that a
    /// live block still touches are lent (`lending.rs`). Single-page handles and lent pages are appended to
    /// `out`; chunks are released, which makes room to create single pages.
    fn reclaim(&mut self, count: usize, out: &mut Vec<PhysPage>) -> Result<(), Error> {
        let base = out.len();
        let missing = |out: &Vec<PhysPage>| count - (out.len() - base);
        let mut compacting = Compacting::default();
        let result = (|| {
            if self.config.compaction == Compaction::Eager {
                return self.steal_idle(count, out, Wait::Block, &mut compacting);
            }
            for wait in [Wait::Query, Wait::Block] {
                while missing(out) > 0
                    && self.physical.under_pressure(
                        self.books.counters.reserved.current,
                        missing(out) as u64 * self.page_size,
                    )
                {
                    if self.steal_idle(missing(out), out, wait, &mut compacting)? == 0 {
                        break;
                    }
                }
                if missing(out) > 0
                    && self.physical.under_pressure(
                        self.books.counters.reserved.current,
                        missing(out) as u64 * self.page_size,
                    )
                {
                    self.lend_stranded(missing(out), out, wait, &mut compacting)?;
                }
            }
            Ok(0)
        })();
        let stolen = (out.len() - base) as u64;
        self.books.counters.compacted += stolen;
        if stolen > 0 {
            tracing::debug!(
                pages = stolen,
                "cuvmm: compaction: idle pages unmapped for reuse"
            );
        }
        result.map(|_| ())
    }

    /// Maps a chunk at every aligned group of `chunk_pages` pages that overlaps `pages` and has no page
    /// mapped, while that keeps reserved memory `large_handle_headroom` of the budget under it (a pooled
    /// chunk first, else a new one: a job that comes near the budget is the one whose min capacity
    /// matters, and single pages strand nothing when it gets there); the other missing pages are left to single pages. Returns `pages` widened to the groups mapped.
    /// A chunk that cannot be created (out of memory) is not an error: single pages are tried instead.
    pub(super) fn map_chunks(
        &mut self,
        slot: usize,
        pages: Range<usize>,
    ) -> Result<Range<usize>, Error> {
        let mut widened = pages.clone();
        // Each maximal run of unmapped pages, found when it is needed (no list is built: a chunk mapped in
        // one run touches no page at or after the run's end unless the run ends at `pages.end`). (The caller
        // skips all this when every page is mapped, the usual case.)
        let unmapped_run = |this: &Self, from: usize| {
            let map = &this.segments.at(slot).pages;
            let start = map.first_unmapped(from..pages.end)?;
            Some(start..map.first_mapped(start..pages.end).unwrap_or(pages.end))
        };
        let Some(mut run) = unmapped_run(self, pages.start) else {
            return Ok(widened);
        };
        let k = self.physical.chunk_pages();
        let bytes = k as u64 * self.page_size;
        let headroom = (self.physical.budget() as f64 * self.config.large_handle_headroom) as u64;
        let before = SlotCounts::of(self.segments.at(slot));
        let (pool, stream) = (self.segments.at(slot).pool, self.segments.at(slot).stream);
        let mut result = Ok(());
        'runs: loop {
            let mut group = run.start - run.start % k;
            while group < run.end {
                let chunk = group..group + k;
                group += k;
                let seg = self.segments.at(slot);
                if chunk.end > seg.pages.len() || seg.pages.unmapped_count(chunk.clone()) != k {
                    continue;
                }
                let handle = match self.physical.pop_pooled_chunk() {
                    Some(handle) => handle,
                    None if self.physical.under_pressure(
                        self.books.counters.reserved.current,
                        bytes.saturating_add(headroom),
                    ) =>
                    {
                        break 'runs;
                    }
                    None => match self.driver.create(bytes) {
                        Ok(handle) => {
                            self.physical.add_chunk(handle);
                            self.books.counters.created += k as u64;
                            self.books.counters.reserved.add(bytes);
                            handle
                        }
                        Err(err) if err.is_out_of_memory() => {
                            // Retried with single pages, which the cache release can make room for.
                            self.books.counters.retries += 1;
                            break 'runs;
                        }
                        Err(err) => {
                            result = Err(err.into());
                            break 'runs;
                        }
                    },
                };
                let va = self.segments.at(slot).page_addr(chunk.start);
                if let Err(err) = self.driver.map(va, bytes, handle) {
                    undo_failed_map(&mut self.driver, va, bytes);
                    self.physical.pool_chunk(handle);
                    result = Err(err.into());
                    break 'runs;
                }
                self.segments
                    .at_mut(slot)
                    .pages
                    .map_chunk(chunk.clone(), handle);
                self.books.counters.mapped.add(pool, bytes);
                self.books
                    .record(TraceAction::SegmentMap, va, bytes, stream);
                widened = widened.start.min(chunk.start)..widened.end.max(chunk.end);
            }
            match unmapped_run(self, run.end) {
                Some(next) => run = next,
                None => break,
            }
        }
        self.books.refresh(self.segments.at(slot), before);
        result.map(|()| widened)
    }

    /// Lets device `peer` reach every range mapped now and every one mapped later.
    pub(super) fn grant_peer(&mut self, peer: usize) -> Result<(), Error> {
        self.driver.add_peer(peer)?;
        let mut runs = Vec::new();
        for seg in self.segments.live() {
            for run in seg.pages.accessible_runs(0..seg.pages.len()) {
                runs.push((seg.page_addr(run.start), run.len() as u64 * self.page_size));
            }
        }
        for (va, size) in runs {
            self.driver.set_access(va, size)?;
        }
        tracing::info!(peer, "cuvmm: peer device given access");
        Ok(())
    }
}
