//! Lending the idle pages of a chunk that a live block still touches.
//!
//! A chunk (a multi-page handle, see `physical.rs`) is mapped at a group of pages in one `map` call, and a
//! mapping can only be unmapped whole. So while one live block touches a page of the group, the chunk's
//! other pages cannot be unmapped: their memory is stranded. Under memory pressure, rather than failing or
//! creating past the budget, such an idle page is *lent*: its memory is mapped a second time where a request
//! needs a page (`Driver::map_from`, `cuMemMap` from the page's offset in the chunk), and its own addresses
//! become a [`Lent`](super::blocks::BlockState::Lent) block, never allocated, until the page comes back.
//!
//! A lent page comes back ("home") when its second mapping is unmapped and not mapped again at once (a
//! release of the cache, a failed request): its lent block is freed and the page is idle again at home, so
//! the chunk can be unmapped and released once all of its pages are idle. A chunk with pages lent is never
//! unmapped (its lent pages are not idle) nor released.
//!
//! Lending makes no driver call of its own: the page is already mapped and its stream is known done with it
//! (as for any page taken by a compaction). Mapping it elsewhere costs one `map` per page, as a single page
//! does. Physical memory is counted once, at home: the second mapping adds nothing to `mapped_bytes` or
//! `reserved_bytes`.

use super::Expandable;
use super::lender::Lender;
use super::physical::{Compacting, Wait};
use crate::driver::{Driver, PhysHandle, PhysPage};
use crate::strategy::error::Error;
use std::ops::Range;

impl<D: Driver> Expandable<D> {
    /// Lends up to `count` idle pages of chunks that a live block still touches, appending them to `out` as
    /// pieces of their chunks; returns the pages lent. Segments are taken as by
    /// [`steal_idle`](Self::steal_idle) (oldest last free first), and only those whose stream `wait` shows
    /// done with its queued work.
    pub(super) fn lend_stranded(
        &mut self,
        count: usize,
        out: &mut Vec<PhysPage>,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<usize, Error> {
        if self.chunks.is_empty() || !self.lending {
            return Ok(0);
        }
        let order = self.segments_with_idle_pages();
        let mut lent = 0;
        for slot in order {
            if lent >= count {
                break;
            }
            let pages = self.lendable(slot, count - lent);
            if pages.is_empty() || !self.stream_done(self.segment(slot).stream, wait, compacting)? {
                continue;
            }
            for page in pages {
                self.lend(slot, page, out);
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
    fn lendable(&self, slot: usize, count: usize) -> Vec<usize> {
        let pages = &self.segment(slot).pages;
        let mut found = Vec::new();
        let mut end = pages.len();
        while found.len() < count
            && let Some(run) = pages.last_idle_run_before(end)
        {
            end = run.start;
            found.extend(
                run.rev()
                    .filter(|&page| self.chunk_at(slot, page).is_some())
                    .take(count - found.len()),
            );
        }
        found
    }

    /// Whether `page` of segment `slot` holds a lent page (a second mapping of a chunk's page).
    pub(super) fn is_alias(&self, slot: usize, page: usize) -> bool {
        !self.aliases.is_empty()
            && self
                .aliases
                .contains_key(&self.segment(slot).page_addr(page))
    }

    /// Lends idle `page` of segment `slot`, which holds a chunk at home: its addresses become a lent block
    /// and its piece of the chunk goes to `out`.
    fn lend(&mut self, slot: usize, page: usize, out: &mut Vec<PhysPage>) {
        let group = (self.chunk_at(slot, page))
            .expect("a page to lend holds a chunk at home")
            .start;
        let handle = (self.segment(slot).pages.handle(page)).expect("a chunk's page is mapped");
        let before = self.page_counts(slot);
        let addr = self.segment(slot).page_addr(page);
        let page_size = self.page_size;
        self.segment_mut(slot).lend(addr, page_size);
        let pool = self.segment(slot).pool;
        self.lent_pages[pool.index()] += 1;
        self.refresh_page_counts(slot, before);
        self.lenders
            .entry(handle)
            .or_insert(Lender {
                slot,
                group,
                lent: 0,
            })
            .lent += 1;
        out.push(PhysPage {
            handle,
            offset: (page - group) as u64 * self.page_size,
        });
    }

    /// Takes a lent page, mapped nowhere else now, back home: its lent block is freed and the page is idle
    /// there again.
    fn return_home(&mut self, piece: PhysPage) {
        let lender = self
            .lenders
            .get_mut(&piece.handle)
            .expect("a lent piece has a lender");
        lender.lent -= 1;
        let (slot, group) = (lender.slot, lender.group);
        if lender.lent == 0 {
            self.lenders.remove(&piece.handle);
        }
        let page = group + (piece.offset / self.page_size) as usize;
        let before = self.page_counts(slot);
        let addr = self.segment(slot).page_addr(page);
        self.segment_mut(slot).unlend(addr);
        let pool = self.segment(slot).pool;
        self.lent_pages[pool.index()] -= 1;
        self.refresh_page_counts(slot, before);
    }

    /// Puts pages not mapped anywhere back: single-page handles into the pool, lent pieces of chunks home.
    pub(super) fn put_back(&mut self, pages: impl IntoIterator<Item = PhysPage>) {
        for page in pages {
            if self.chunks.contains(&page.handle) {
                self.return_home(page);
            } else {
                self.pooled.push(page.handle);
            }
        }
    }

    /// Records that `pages` (pieces, one per page) were mapped at the pages from `start` of segment `slot`:
    /// the lent ones as second mappings. Returns how many were lent.
    pub(super) fn note_mapped(&mut self, slot: usize, start: usize, pages: &[PhysPage]) -> usize {
        if self.lenders.is_empty() {
            return 0;
        }
        let mut lent = 0;
        for (i, page) in pages.iter().enumerate() {
            if self.chunks.contains(&page.handle) {
                let addr = self.segment(slot).page_addr(start + i);
                self.aliases.insert(addr, *page);
                lent += 1;
            }
        }
        lent
    }

    /// Records that the pages `run` of segment `slot` were unmapped, their handles `handles` (in page order,
    /// as the page map gave them): appends single pages and lent pieces to `out`, appends each chunk unmapped
    /// at home once to `chunks`. Returns how many were lent pieces.
    pub(super) fn note_unmapped(
        &mut self,
        slot: usize,
        run: Range<usize>,
        handles: &[PhysHandle],
        out: &mut Vec<PhysPage>,
        chunks: &mut Vec<PhysHandle>,
    ) -> usize {
        if self.chunks.is_empty() {
            out.extend(handles.iter().copied().map(PhysPage::from));
            return 0;
        }
        let mut lent = 0;
        for (page, &handle) in run.zip(handles) {
            if !self.chunks.contains(&handle) {
                out.push(PhysPage::from(handle));
            } else if let Some(piece) = (!self.aliases.is_empty())
                .then(|| self.aliases.remove(&self.segment(slot).page_addr(page)))
                .flatten()
            {
                out.push(piece);
                lent += 1;
            } else if chunks.last() != Some(&handle) {
                chunks.push(handle);
            }
        }
        lent
    }
}
