//! Backing a block with pages: chunks at the unmapped aligned groups the handle-size policy lets it
//! create, then the block's other missing pages (`obtain.rs`), one `map` per page or chunk, then access on
//! every run of the block's pages that lacks it.

use super::{Parts, Shortage, Supply};
use crate::driver::{Driver, DriverError};
use crate::expandable::accounting::SlotCounts;
use crate::expandable::settle::undo_failed_map;
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;
use std::ops::Range;

impl Supply {
    /// Maps the missing pages of the live block `addr .. addr + size` of segment `slot` and sets access on
    /// its pages; `shortage` says whether the cache may be released on out-of-memory. On failure every
    /// handle obtained is kept in the pool and the page map says what is mapped.
    pub(crate) fn back_block<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        (slot, addr, size): (usize, u64, u64),
        shortage: &mut Shortage,
    ) -> Result<(), Error> {
        let pages = p.segments.at(slot).pages_of(addr, size);
        // Access is set on whole chunks, so the pages of a chunk beyond the block need no call later.
        let mut access = pages.clone();
        let mut need = None;
        let chunked = self.physical.chunk_pages() > 1 && p.segments.at(slot).pool == Pool::Large;
        if chunked {
            // Most requests find every page mapped: one search says so, and nothing is counted or collected.
            if (p.segments.at(slot).pages)
                .first_unmapped(pages.clone())
                .is_none()
            {
                need = Some(0);
            } else {
                access = self.map_chunks(p, slot, pages.clone(), shortage)?;
            }
        }
        let lending = self.lending.enabled();
        let mut mapped = self.map_missing(p, slot, pages.clone(), need, shortage);
        if mapped.is_err() && lending && !self.lending.enabled() {
            // The driver cannot map part of a handle: the lent pages went home; mapped without them.
            mapped = self.map_missing(p, slot, pages, None, shortage);
        }
        mapped?;
        if p.segments.at(slot).pages.inaccessible_count() == 0 {
            // Every mapped page of the segment has access: the usual case, with nothing left to do.
            return Ok(());
        }
        if chunked {
            // A chunk whose access failed earlier gets it now, whole: access is set on whole mappings. (The
            // pages `map_missing` mapped are single pages or lent pieces, which widen nothing: the same
            // range as before it.)
            access = self
                .physical
                .widen_to_chunks(&self.lending, p.segments.at(slot), access);
        }
        let mut pos = access.start;
        while let Some(run) = p
            .segments
            .at(slot)
            .pages
            .first_inaccessible_run(pos..access.end)
        {
            let va = p.segments.at(slot).page_addr(run.start);
            p.driver.set_access(va, run.len() as u64 * self.page_size)?;
            pos = run.end;
            p.segments.at_mut(slot).pages.set_accessible(run);
        }
        Ok(())
    }

    /// Maps the missing pages of `pages` of segment `slot`: pooled, unmapped, lent or new ones. On failure
    /// every page obtained and not mapped is put back, and the page map says what is mapped; a lent page the
    /// driver cannot map (it cannot map part of a handle) turns lending off.
    /// `need`: the missing pages, if known.
    fn map_missing<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        pages: Range<usize>,
        need: Option<usize>,
        shortage: &mut Shortage,
    ) -> Result<(), Error> {
        let need = need.unwrap_or_else(|| p.segments.at(slot).pages.unmapped_count(pages.clone()));
        if need > 0 {
            self.map_runs(p, slot, pages, need, shortage)?;
        }
        Ok(())
    }

    /// [`map_missing`](Self::map_missing) of `need` pages, known missing. Pages no live block touches come
    /// back idle (a tag's wake maps its graph pools' pages so), which the books learn of.
    fn map_runs<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        pages: Range<usize>,
        need: usize,
        shortage: &mut Shortage,
    ) -> Result<(), Error> {
        // The handles, new ones first, in a buffer kept from one request to the next.
        let mut queue = self.physical.take_queue();
        let reused = self.obtain(p, need, &mut queue, shortage)? as u64;
        // After `obtain`, which may take idle pages of this segment (and books them).
        let before = SlotCounts::of(p.segments.at(slot));
        let seg = p.segments.at(slot);
        let (stream, graph) = (seg.stream, seg.graph);
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
        while let Some(start) = p.segments.at(slot).pages.first_unmapped(pos..pages.end) {
            let end = (p.segments.at(slot).pages)
                .first_mapped(start..pages.end)
                .unwrap_or(pages.end);
            let run = &queue[taken..taken + (end - start)];
            let va = p.segments.at(slot).page_addr(start);
            let (done, failure) = match p.driver.map_each(va, self.page_size, run) {
                Ok(()) => (run.len(), None),
                Err((done, err)) => (done, Some(err)),
            };
            (p.segments.at_mut(slot).pages)
                .map_run(start, run[..done].iter().map(|page| page.handle));
            let lent = (self.lending).note_mapped(
                self.physical.chunks(),
                p.segments.at(slot),
                start,
                &run[..done],
            );
            taken += done;
            if done > 0 {
                let bytes = done as u64 * self.page_size;
                // A lent page's memory is counted at home.
                let mapped = bytes - lent as u64 * self.page_size;
                (p.books.counters).count_mapped(p.segments.at(slot), mapped, true);
                p.books
                    .record(TraceAction::SegmentMap, va, bytes, stream, graph);
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
                    &mut *p.driver,
                    va + done as u64 * self.page_size,
                    self.page_size,
                );
                p.books.refresh_if_idle_moved(p.segments.at(slot), before);
                let unused = queue.split_off(taken);
                self.physical.restore_queue(queue);
                self.put_back(p, unused);
                return Err(err.into());
            }
            pos = end;
        }
        debug_assert_eq!(taken, queue.len(), "one handle per missing page");
        p.books.refresh_if_idle_moved(p.segments.at(slot), before);
        self.physical.restore_queue(queue);
        p.books.counters.handles_reused += reused;
        Ok(())
    }

    /// Maps a chunk at every aligned group of `chunk_pages` pages that overlaps `pages` and has no page
    /// mapped, while the handle-size policy lets it (a pooled chunk first, else a new one); the other
    /// missing pages are left to single pages. Returns `pages` widened to the groups mapped. A chunk that
    /// cannot be created (out of memory) is not an error: single pages are tried instead, which `shortage`
    /// notes.
    fn map_chunks<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        pages: Range<usize>,
        shortage: &mut Shortage,
    ) -> Result<Range<usize>, Error> {
        let mut widened = pages.clone();
        // Each maximal run of unmapped pages, found when it is needed (no list is built: a chunk mapped in
        // one run touches no page at or after the run's end unless the run ends at `pages.end`). (The caller
        // skips all this when every page is mapped, the usual case.)
        let unmapped_run = |segments: &crate::expandable::segments::Segments, from: usize| {
            let map = &segments.at(slot).pages;
            let start = map.first_unmapped(from..pages.end)?;
            Some(start..map.first_mapped(start..pages.end).unwrap_or(pages.end))
        };
        let Some(mut run) = unmapped_run(p.segments, pages.start) else {
            return Ok(widened);
        };
        let k = self.physical.chunk_pages();
        let bytes = k as u64 * self.page_size;
        let before = SlotCounts::of(p.segments.at(slot));
        let seg = p.segments.at(slot);
        let (stream, graph) = (seg.stream, seg.graph);
        let mut result = Ok(());
        'runs: loop {
            let mut group = run.start - run.start % k;
            while group < run.end {
                let chunk = group..group + k;
                group += k;
                let seg = p.segments.at(slot);
                if chunk.end > seg.pages.len() || seg.pages.unmapped_count(chunk.clone()) != k {
                    continue;
                }
                let handle = match self.physical.pop_pooled_chunk() {
                    Some(handle) => handle,
                    None if !(p.policies.handle_size).new_chunk(
                        (self.physical).growth(p.books.counters.reserved.current, bytes),
                    ) =>
                    {
                        break 'runs;
                    }
                    None => match self.free_under_margin(p.driver, shortage).and_then(|free| {
                        match free {
                            // Past the device margin, as a driver out of memory: single pages are tried.
                            Some(free) if free.saturating_sub(self.physical.margin()) < bytes => {
                                Err(self.physical.margin_reached(free, k))
                            }
                            _ => p.driver.create(bytes),
                        }
                    }) {
                        Ok(handle) => {
                            self.physical.add_chunk(handle);
                            p.books.counters.created += k as u64;
                            p.books.counters.reserved.add(bytes);
                            handle
                        }
                        Err(err) if err.is_out_of_memory() => {
                            // Retried with single pages, which the cache release can make room for.
                            shortage.fell_back = true;
                            break 'runs;
                        }
                        Err(err) => {
                            result = Err(err.into());
                            break 'runs;
                        }
                    },
                };
                let va = p.segments.at(slot).page_addr(chunk.start);
                if let Err(err) = p.driver.map(va, bytes, handle) {
                    undo_failed_map(&mut *p.driver, va, bytes);
                    self.physical.pool_chunk(handle);
                    result = Err(err.into());
                    break 'runs;
                }
                p.segments
                    .at_mut(slot)
                    .pages
                    .map_chunk(chunk.clone(), handle);
                p.books
                    .counters
                    .count_mapped(p.segments.at(slot), bytes, true);
                p.books
                    .record(TraceAction::SegmentMap, va, bytes, stream, graph);
                widened = widened.start.min(chunk.start)..widened.end.max(chunk.end);
            }
            match unmapped_run(p.segments, run.end) {
                Some(next) => run = next,
                None => break,
            }
        }
        p.books.refresh(p.segments.at(slot), before);
        result.map(|()| widened)
    }
}
