//! Taking idle pages: unmapping them (whole chunks only) once their last use is known complete, lending the
//! idle pages of chunks that a live block still touches, and putting pages that end up mapped nowhere back
//! (single pages into the pool, lent pieces home).
//!
//! Unmapping an idle page first makes sure no queued work can still touch it: its stream is synchronized
//! (at most once per stream per compaction), or, under pressure before any blocking, an event query shows
//! the stream has finished its queued work ([`Compacting`]).

use super::{Parts, Supply};
use crate::driver::{Driver, PhysHandle, PhysPage};
use crate::expandable::accounting::SlotCounts;
use crate::expandable::compacting::{Compacting, Wait};
use crate::expandable::settle::unmap_settled;
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use std::ops::Range;

impl Supply {
    /// Unmaps up to `count` pages' worth of idle pages, highest addresses of each segment first, appends
    /// the single-page handles to `out` and releases the chunks; returns the pages gained. Segments are
    /// taken in the compaction policy's order; `wait` says how a segment's stream is known to be done with
    /// them.
    pub(super) fn steal_idle<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        count: usize,
        out: &mut Vec<PhysPage>,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<usize, Error> {
        let order = segments_with_idle_pages(p);
        let mut gained = 0;
        for slot in order {
            if gained >= count {
                break;
            }
            // Idle pages that lie only in chunks a live block still touches cannot be unmapped: no wait
            // for them.
            if !self.has_reclaimable(p, slot)
                || !compacting.stream_done(
                    (&mut *p.driver, &mut *p.books, &mut *p.waits),
                    p.segments.at(slot).stream,
                    wait,
                )?
            {
                continue;
            }
            // Idle runs from the highest down, each found when it is needed.
            let mut end = p.segments.at(slot).pages.len();
            while gained < count {
                let Some(run) = p.segments.at(slot).pages.last_idle_run_before(end) else {
                    break;
                };
                end = run.start;
                let run = self
                    .physical
                    .whole_chunks(&self.lending, p.segments.at(slot), run);
                if run.is_empty() {
                    continue;
                }
                let take = self.physical.chunk_floor(
                    &self.lending,
                    p.segments.at(slot),
                    run.end - run.len().min(count - gained),
                );
                gained += self.unmap_idle_run(p, slot, take.max(run.start)..run.end, out)?;
            }
        }
        Ok(gained)
    }

    /// Whether segment `slot` has an idle page that can be unmapped: one not in a chunk that a live block
    /// still touches.
    fn has_reclaimable<D>(&self, p: &Parts<'_, D>, slot: usize) -> bool {
        let pages = &p.segments.at(slot).pages;
        let mut end = pages.len();
        while let Some(run) = pages.last_idle_run_before(end) {
            if !self
                .physical
                .whole_chunks(&self.lending, p.segments.at(slot), run.clone())
                .is_empty()
            {
                return true;
            }
            end = run.start;
        }
        false
    }

    /// Unmaps a run of idle pages (whose queued work is known complete) of one segment in one driver call,
    /// appends their single-page handles and lent pieces to `out` and releases the chunks unmapped at home
    /// (a chunk that cannot be released is pooled). Returns the pages gained. (A sleeping tag's pages are
    /// unmapped under its live blocks, `sleep.rs`.)
    pub(crate) fn unmap_idle_run<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        run: Range<usize>,
        out: &mut Vec<PhysPage>,
    ) -> Result<usize, Error> {
        let (stream, graph) = (p.segments.at(slot).stream, p.segments.at(slot).graph);
        let va = p.segments.at(slot).page_addr(run.start);
        unmap_settled(&mut *p.driver, va, run.len() as u64 * self.page_size)?;
        let before = SlotCounts::of(p.segments.at(slot));
        let pages = run.len() as u64;
        tracing::debug!(va, pages, stream = stream.0, "cuvmm: unmapped idle pages");
        p.books.record(
            TraceAction::SegmentUnmap,
            va,
            pages * self.page_size,
            stream,
            graph,
        );
        let mut handles = self.physical.take_scratch();
        let asleep = p.tags.sleeps(p.segments.at(slot).tag);
        let seg = p.segments.at_mut(slot);
        match asleep {
            false => seg.pages.unmap_run(run.clone(), &mut handles),
            true => seg.pages.unmap_run_in_use(run.clone(), &mut handles),
        }
        let mut chunks: Vec<PhysHandle> = Vec::new();
        let lent = (self.lending).note_unmapped(
            self.physical.chunks(),
            p.segments.at(slot),
            (run, &handles),
            out,
            &mut chunks,
        ) as u64;
        self.physical.restore_scratch(handles);
        // A lent page's memory is counted at home.
        let unmapped = (pages - lent) * self.page_size;
        (p.books.counters).count_mapped(p.segments.at(slot), unmapped, false);
        p.books.refresh(p.segments.at(slot), before);
        self.physical
            .release_chunks(&mut *p.driver, &mut *p.books, chunks)?;
        Ok(pages as usize)
    }

    /// Lends up to `count` idle pages of chunks that a live block still touches, appending them to `out` as
    /// pieces of their chunks; returns the pages lent. Segments are taken as by
    /// [`steal_idle`](Self::steal_idle), and only those whose stream `wait` shows done with its queued work.
    pub(super) fn lend_stranded<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        count: usize,
        out: &mut Vec<PhysPage>,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<usize, Error> {
        if !self.physical.has_chunks() || !self.lending.enabled() {
            return Ok(0);
        }
        let order = segments_with_idle_pages(p);
        let mut lent = 0;
        for slot in order {
            if lent >= count {
                break;
            }
            let pages = self.lendable(p, slot, count - lent);
            if pages.is_empty()
                || !compacting.stream_done(
                    (&mut *p.driver, &mut *p.books, &mut *p.waits),
                    p.segments.at(slot).stream,
                    wait,
                )?
            {
                continue;
            }
            for page in pages {
                self.lend_page(p, slot, page, out);
                lent += 1;
            }
        }
        if lent > 0 {
            tracing::debug!(pages = lent, "cuvmm: lent idle pages of chunks in use");
        }
        Ok(lent)
    }

    /// Up to `count` idle pages of segment `slot` that lie in chunks, highest first. (Idle pages in chunks
    /// that no live block touches are taken whole by `steal_idle` before any is lent.)
    fn lendable<D>(&self, p: &Parts<'_, D>, slot: usize, count: usize) -> Vec<usize> {
        let pages = &p.segments.at(slot).pages;
        let mut found = Vec::new();
        let mut end = pages.len();
        while found.len() < count
            && let Some(run) = pages.last_idle_run_before(end)
        {
            end = run.start;
            found.extend(
                run.rev()
                    .filter(|&page| {
                        self.physical
                            .chunk_at(&self.lending, p.segments.at(slot), page)
                            .is_some()
                    })
                    .take(count - found.len()),
            );
        }
        found
    }

    /// Lends idle `page` of segment `slot`, which holds a chunk at home: its addresses become a lent block
    /// and its piece of the chunk goes to `out`.
    fn lend_page<D>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        page: usize,
        out: &mut Vec<PhysPage>,
    ) {
        let group = (self
            .physical
            .chunk_at(&self.lending, p.segments.at(slot), page))
        .expect("a page to lend holds a chunk at home")
        .start;
        let handle = (p.segments.at(slot).pages.handle(page)).expect("a chunk's page is mapped");
        let before = SlotCounts::of(p.segments.at(slot));
        let addr = p.segments.at(slot).page_addr(page);
        let page_size = self.page_size;
        p.segments.at_mut(slot).lend(addr, page_size);
        let pool = p.segments.at(slot).pool;
        p.books.count_lent(pool, true);
        p.books.refresh(p.segments.at(slot), before);
        out.push((self.lending).lend_piece(handle, (slot, group, page), page_size));
    }

    /// Takes a lent page, mapped nowhere else now, back home: its lent block is freed and the page is idle
    /// there again.
    fn return_home<D>(&mut self, p: &mut Parts<'_, D>, piece: PhysPage) {
        let (slot, page) = self.lending.return_piece(piece, self.page_size);
        let before = SlotCounts::of(p.segments.at(slot));
        let addr = p.segments.at(slot).page_addr(page);
        p.segments.at_mut(slot).unlend(addr);
        let pool = p.segments.at(slot).pool;
        p.books.count_lent(pool, false);
        p.books.refresh(p.segments.at(slot), before);
    }

    /// Puts pages not mapped anywhere back: single-page handles into the pool, lent pieces of chunks home.
    pub(super) fn put_back<D>(
        &mut self,
        p: &mut Parts<'_, D>,
        pages: impl IntoIterator<Item = PhysPage>,
    ) {
        for page in pages {
            if self.physical.is_chunk(page.handle) {
                self.return_home(p, page);
            } else {
                self.physical.pool_page(page.handle);
            }
        }
    }
}

/// The segments with idle pages that compaction may take, in the compaction policy's order. A live graph
/// pool's pages stay where the graph baked them in, and a sleeping tag's are its own (`Parts::pinned`).
fn segments_with_idle_pages<D>(p: &Parts<'_, D>) -> Vec<usize> {
    let mut order: Vec<usize> = (0..p.segments.slot_count())
        .filter(|&slot| {
            p.segments
                .try_at(slot)
                .is_some_and(|seg| seg.pages.idle_count() > 0)
                && !p.pinned(slot)
        })
        .collect();
    p.policies.compaction.order(&mut order, p.segments);
    order
}
