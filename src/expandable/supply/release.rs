//! Giving physical memory back to the driver: idle memory beyond a limit or asked for (`trim`), the whole
//! cache (`empty_cache`, and the release before a request's one retry), what a sleeping tag unmapped, and
//! everything on drop.

use super::{Parts, Supply};
use crate::driver::{Driver, PhysHandle, PhysPage};
use crate::expandable::accounting::Books;
use crate::expandable::compacting::{Compacting, Wait};
use crate::expandable::segment::Segment;
use crate::expandable::settle::unmap_settled;
use crate::strategy::error::Error;

impl Supply {
    /// Everything cached goes back to the driver (`empty_cache`, and a request's release before its retry):
    /// the frees that wait are settled (the device synchronized once if any is parked, `parked.rs`), then
    /// every pooled handle and idle page is released.
    ///
    /// One synchronization of the device, not one per stream: the streams whose freed memory is cached may
    /// have been destroyed since (threads that made their own streams and ended), and a call naming a
    /// destroyed stream is undefined behaviour on a GPU. It waits for other streams' work too, as
    /// PyTorch's `cudaFree` does; this path is the last resort, never the common one.
    pub(crate) fn release_cache<D: Driver>(&mut self, p: &mut Parts<'_, D>) -> Result<u64, Error> {
        let mut compacting = Compacting::by_device();
        p.settle_frees(&mut compacting)?;
        self.release_idle_in(p, u64::MAX, &mut compacting)
    }

    /// Gives back the idle pages of the segments `slots` (one pool's cache, `pools.rs`): each run of idle
    /// pages, whole chunks only, is unmapped once its segment's stream is done (the device synchronized
    /// once, if any is not), then released with the handles it freed. Returns the bytes given back.
    pub(crate) fn release_idle_of<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slots: &[usize],
    ) -> Result<u64, Error> {
        let reserved = p.books.counters.reserved.current;
        let mut compacting = Compacting::by_device();
        let mut handles = Vec::new();
        for &slot in slots {
            let stream = p.segments.at(slot).stream;
            let mut end = p.segments.at(slot).pages.len();
            while let Some(run) = p.segments.at(slot).pages.last_idle_run_before(end) {
                end = run.start;
                let run = (self.physical).whole_chunks(&self.lending, p.segments.at(slot), run);
                let waits = (&mut *p.driver, &mut *p.books, &mut *p.waits);
                if run.is_empty() || !compacting.stream_done(waits, stream, Wait::Block)? {
                    continue;
                }
                self.unmap_idle_run(p, slot, run, &mut handles)?;
            }
        }
        let pages = handles.len() as u64;
        self.put_back(p, handles);
        (self.physical).release_pooled(&mut *p.driver, &mut *p.books, pages * self.page_size)?;
        Ok(reserved.saturating_sub(p.books.counters.reserved.current))
    }

    /// Gives every pooled handle and idle page back, waiting for the device once: what a request that ran
    /// out of memory after the cache was released for it gathered, and the pages its block had mapped.
    pub(crate) fn release_all_idle<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
    ) -> Result<u64, Error> {
        self.release_idle_in(p, u64::MAX, &mut Compacting::by_device())
    }

    /// Gives at least `bytes` (rounded up to whole pages) of idle physical memory back to the driver, or all
    /// of it if there is less: pooled handles first, then idle pages from the highest addresses down.
    /// Returns the bytes given back.
    pub(crate) fn release_idle<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        bytes: u64,
    ) -> Result<u64, Error> {
        // Each stream is synchronized at most once, however many rounds it takes.
        self.release_idle_in(p, bytes, &mut Compacting::default())
    }

    /// [`release_idle`](Self::release_idle) within one compaction, which may know streams done already.
    fn release_idle_in<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        bytes: u64,
        compacting: &mut Compacting,
    ) -> Result<u64, Error> {
        let _span = tracing::debug_span!("cuvmm::release_idle", bytes).entered();
        let mut released = (self.physical).release_pooled(&mut *p.driver, &mut *p.books, bytes)?;
        while released < bytes && p.books.idle_pages() > 0 {
            let pages = (bytes - released)
                .div_ceil(self.page_size)
                .min(p.books.idle_pages() as u64) as usize;
            let mut handles = Vec::with_capacity(pages);
            let reserved = p.books.counters.reserved.current;
            let stolen = self.steal_idle(p, pages, &mut handles, Wait::Block, compacting);
            released += reserved - p.books.counters.reserved.current;
            // Lent pages unmapped here go home, where their chunk can be unmapped whole once all its
            // pages are idle.
            self.put_back(p, handles);
            if stolen? == 0 {
                break;
            }
            released += self.physical.release_pooled(
                &mut *p.driver,
                &mut *p.books,
                bytes.saturating_sub(released),
            )?;
        }
        if released > 0 {
            tracing::debug!(released, "cuvmm: released idle memory to the driver");
        }
        Ok(released)
    }

    /// Gives pages a sleeping tag unmapped back: single-page handles are released (pooled if that fails),
    /// lent pieces go home.
    pub(crate) fn release_unmapped<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        pages: Vec<PhysPage>,
    ) {
        let mut singles = Vec::new();
        for page in pages {
            if self.physical.is_chunk(page.handle) {
                self.put_back(p, [page]);
            } else {
                singles.push(page.handle);
            }
        }
        for handle in singles {
            if let Err(err) = (self.physical).release_handle(&mut *p.driver, &mut *p.books, handle)
            {
                tracing::warn!(%err, "cuvmm: sleep: releasing a page failed; pooled for others");
                self.physical.pool_page(handle);
            }
        }
    }

    /// Unmaps every mapped run of `seg`, taken out of the segments on drop, live blocks' pages included, and
    /// pools the handles for [`release_all`](Self::release_all): a chunk once (it is listed once per page of
    /// it), a lent page not at all (it is a second mapping of a chunk kept at home). A run that cannot be
    /// unmapped keeps its handles; each failure goes to `note`.
    pub(crate) fn unmap_segment<D: Driver>(
        &mut self,
        driver: &mut D,
        seg: &Segment,
        note: &mut impl FnMut(Result<(), Error>),
    ) {
        if seg.pages.mapped_count() == 0 {
            return;
        }
        for run in seg.pages.mapped_runs(0..seg.pages.len()) {
            let va = seg.page_addr(run.start);
            if let Err(err) = unmap_settled(driver, va, run.len() as u64 * self.page_size) {
                note(Err(err.into()));
                continue;
            }
            let lending = &self.lending;
            let mut handles: Vec<PhysHandle> = run
                .filter(|&page| !lending.is_alias(seg.page_addr(page)))
                .filter_map(|page| seg.pages.handle(page))
                .collect();
            handles.dedup();
            self.physical.pool_pages(handles);
        }
    }

    /// Forgets every lent page and releases every handle held (drop, once every segment is unmapped); goes
    /// on after a failure and hands each failure to `note`.
    pub(crate) fn release_all<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
        note: impl FnMut(Result<(), Error>),
    ) {
        self.lending.forget_all();
        books.forget_lent();
        self.physical.release_all(driver, books, note);
    }
}
