//! Reclaiming memory: compaction (unmapping idle pages whose last use is complete, lending idle pages of
//! chunks in use), giving idle memory and the cache back to the driver, freeing empty segments, and the
//! teardown on drop.
//!
//! Unmapping an idle page first makes sure no queued work can still touch it: its stream is synchronized
//! (at most once per stream per compaction), or, under pressure before any blocking, an event query shows
//! the stream has finished its queued work.

use super::Expandable;
use super::accounting::SlotCounts;
use super::segment::FreeOutcome;
use super::settle::{free_reservation_settled, unmap_settled};
use super::streams::{StreamUses, synchronize, synchronize_device};
use crate::driver::{Driver, PhysHandle, PhysPage, StreamId};
use crate::strategy::config::Compaction;
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use std::ops::Range;

/// How a compaction learns that an idle page's last use is complete.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Wait {
    /// Only segments whose stream an event query shows idle; never blocks.
    Query,
    /// Synchronize each segment's stream (once per compaction).
    Block,
}

/// What one compaction has learnt about streams: those whose queued work is known complete, and those an
/// event query found busy; or, for one that waits for the device rather than for streams
/// ([`by_device`](Self::by_device)), whether it did.
#[derive(Debug, Default)]
pub(crate) struct Compacting {
    done: Vec<StreamId>,
    busy: Vec<StreamId>,
    /// A blocking wait synchronizes the device, once, instead of the stream.
    by_device: bool,
    device_done: bool,
}

impl Compacting {
    /// A compaction whose blocking waits synchronize the device once, naming no stream.
    pub(super) fn by_device() -> Self {
        Self {
            by_device: true,
            ..Self::default()
        }
    }
}

impl<D: Driver> Expandable<D> {
    /// Physical bytes held by no live block: idle mapped pages plus pooled handles.
    pub(super) fn idle_bytes(&self) -> u64 {
        (self.books.idle_pages() + self.physical.pooled_pages()) as u64 * self.page_size
    }

    /// Polls the pending events and frees the parked blocks whose events all completed ([`StreamWaits::poll`](super::streams::StreamWaits::poll)).
    /// Returns the bytes freed.
    #[inline]
    pub(super) fn poll_events(&mut self) -> Result<u64, Error> {
        let (segments, books) = (&mut self.segments, &mut self.books);
        self.waits.poll(&mut self.driver, |slot, addr| {
            segments.release_parked(books, slot, addr)
        })
    }

    /// Everything cached goes back to the driver (`empty_cache`, and before an out-of-memory): the device is
    /// synchronized once, then every parked block is freed and every pooled handle and idle page released.
    ///
    /// One synchronization of the device, not one per stream: the streams whose freed memory is cached may
    /// have been destroyed since (threads that made their own streams and ended), and a call naming a
    /// destroyed stream is undefined behaviour on a GPU. It waits for other streams' work too, as
    /// PyTorch's `cudaFree` does; this path is the last resort, never the common one.
    pub(super) fn release_cache(&mut self) -> Result<u64, Error> {
        if self.graphs.any_deferred() {
            self.insert_deferred_events()?;
        }
        let mut compacting = Compacting::by_device();
        if self.waits.any_parked() {
            self.device_done(&mut compacting)?;
        }
        let segments = &mut self.segments;
        self.waits.drain(&mut self.driver, |slot, addr| {
            segments.release_parked(&mut self.books, slot, addr)
        })?;
        self.release_idle_in(u64::MAX, &mut compacting)
    }

    /// Frees the blocks whose free was deferred during a capture: records events on their other streams
    /// and parks them. Only once no capture is underway.
    pub(super) fn insert_deferred_events(&mut self) -> Result<(), Error> {
        while let Some(addr) = self.graphs.last_deferred() {
            let slot = self
                .segments
                .slot_of(addr)
                .ok_or(Error::UnknownAddress { addr })?;
            let streams = (self.waits.take_uses(addr)).expect("a deferred free keeps its streams");
            // On failure the block stays live with its streams, and stays deferred.
            self.park_block(slot, addr, streams)?;
            self.graphs.deferred_done();
        }
        Ok(())
    }

    /// Frees the live block at `addr` in its segment `slot`, which other streams use: records an event on
    /// each of them and parks the block until they complete. If an event cannot be recorded, the block stays
    /// live, the events already recorded are destroyed, and the error is returned.
    pub(super) fn park_block(
        &mut self,
        slot: usize,
        addr: u64,
        streams: StreamUses,
    ) -> Result<(), Error> {
        let left = self.waits.record_events(&mut self.driver, addr, streams)?;
        let FreeOutcome::Freed {
            size, requested, ..
        } = self.segments.at_mut(slot).park(addr)
        else {
            unreachable!("park_block is called for a live block start");
        };
        let pool = self.segments.at(slot).pool;
        self.books.count_block(pool, size, requested, false);
        let own = self.segments.at(slot).stream;
        self.books
            .record(TraceAction::FreeRequested, addr, requested, own);
        self.waits.park(addr, slot, left);
        Ok(())
    }

    /// Whether segment `slot` belongs to a live pool (its pages stay mapped where they are and its blocks
    /// stay the pool's) or to a sleeping tag (`sleep.rs`: nothing of it is taken or placed).
    pub(super) fn pinned(&self, slot: usize) -> bool {
        (self.segments.at(slot).graph).is_some_and(|pool| self.graphs.pool_is_live(pool))
            || self.tags.sleeps(self.segments.at(slot).tag)
    }

    /// Unmaps up to `count` pages' worth of idle pages, highest addresses of each segment first, appends
    /// the single-page handles to `out` and releases the chunks; returns the pages gained. Segments are
    /// taken in slot order under `compaction:eager`, by when a block of theirs was last freed (oldest first)
    /// under pressure; `wait` says how a segment's stream is known to be done with them.
    pub(super) fn steal_idle(
        &mut self,
        count: usize,
        out: &mut Vec<PhysPage>,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<usize, Error> {
        let order = self.segments_with_idle_pages();
        let mut gained = 0;
        for slot in order {
            if gained >= count {
                break;
            }
            // Idle pages that lie only in chunks a live block still touches cannot be unmapped: no wait
            // for them.
            if !self.has_reclaimable(slot)
                || !self.stream_done(self.segments.at(slot).stream, wait, compacting)?
            {
                continue;
            }
            // Idle runs from the highest down, each found when it is needed.
            let mut end = self.segments.at(slot).pages.len();
            while gained < count {
                let Some(run) = self.segments.at(slot).pages.last_idle_run_before(end) else {
                    break;
                };
                end = run.start;
                let run = self
                    .physical
                    .whole_chunks(&self.lending, self.segments.at(slot), run);
                if run.is_empty() {
                    continue;
                }
                let take = self.physical.chunk_floor(
                    &self.lending,
                    self.segments.at(slot),
                    run.end - run.len().min(count - gained),
                );
                gained += self.unmap_idle_run(slot, take.max(run.start)..run.end, out)?;
            }
        }
        Ok(gained)
    }

    /// The segments with idle pages, in the order compaction takes them: by slot under `compaction:eager`,
    /// by when a block of theirs was last freed (oldest first) under pressure.
    pub(super) fn segments_with_idle_pages(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.segments.slot_count())
            .filter(|&slot| {
                self.segments
                    .try_at(slot)
                    .is_some_and(|seg| seg.pages.idle_count() > 0)
                    // A live graph pool's pages stay where the graph baked them in.
                    && !self.pinned(slot)
            })
            .collect();
        if self.config.compaction == Compaction::Pressure {
            order.sort_by_key(|&slot| self.segments.at(slot).last_free);
        }
        order
    }

    /// Whether segment `slot` has an idle page that can be unmapped: one not in a chunk that a live block
    /// still touches.
    fn has_reclaimable(&self, slot: usize) -> bool {
        let pages = &self.segments.at(slot).pages;
        let mut end = pages.len();
        while let Some(run) = pages.last_idle_run_before(end) {
            if !self
                .physical
                .whole_chunks(&self.lending, self.segments.at(slot), run.clone())
                .is_empty()
            {
                return true;
            }
            end = run.start;
        }
        false
    }

    /// Synchronizes the device, once per compaction: every stream's queued work is complete after it.
    fn device_done(&mut self, compacting: &mut Compacting) -> Result<(), Error> {
        if !compacting.device_done {
            synchronize_device(&mut self.driver, &mut self.books)?;
            compacting.device_done = true;
        }
        Ok(())
    }

    /// Whether `stream`'s queued work is known complete for this compaction: synchronized (`Wait::Block`;
    /// the device, once, in a compaction [`by_device`](Compacting::by_device)) or shown idle by an event
    /// query (`Wait::Query`), each stream at most once.
    pub(super) fn stream_done(
        &mut self,
        stream: StreamId,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<bool, Error> {
        if compacting.device_done || compacting.done.contains(&stream) {
            return Ok(true);
        }
        if compacting.by_device && wait == Wait::Block {
            self.device_done(compacting)?;
            return Ok(true);
        }
        let done = match wait {
            Wait::Block => {
                synchronize(&mut self.driver, &mut self.books, stream)?;
                true
            }
            Wait::Query if compacting.busy.contains(&stream) => false,
            Wait::Query => self.waits.stream_idle(&mut self.driver, stream)?,
        };
        if done {
            compacting.done.push(stream);
        } else {
            compacting.busy.push(stream);
        }
        Ok(done)
    }

    /// Unmaps a run of idle pages (whose queued work is known complete) of one segment in one driver call,
    /// appends their single-page handles and lent pieces to `out` and releases the chunks unmapped at home
    /// (a chunk that cannot be released is pooled). Returns the pages gained.
    pub(super) fn unmap_idle_run(
        &mut self,
        slot: usize,
        run: Range<usize>,
        out: &mut Vec<PhysPage>,
    ) -> Result<usize, Error> {
        let stream = self.segments.at(slot).stream;
        let va = self.segments.at(slot).page_addr(run.start);
        unmap_settled(&mut self.driver, va, run.len() as u64 * self.page_size)?;
        let before = SlotCounts::of(self.segments.at(slot));
        let pages = run.len() as u64;
        tracing::debug!(va, pages, stream = stream.0, "cuvmm: unmapped idle pages");
        self.books.record(
            TraceAction::SegmentUnmap,
            va,
            pages * self.page_size,
            stream,
        );
        let mut handles = self.physical.take_scratch();
        // A sleeping tag's pages are unmapped under its live blocks (`sleep.rs`).
        let asleep = self.tags.sleeps(self.segments.at(slot).tag);
        let seg = self.segments.at_mut(slot);
        match asleep {
            false => seg.pages.unmap_run(run.clone(), &mut handles),
            true => seg.pages.unmap_run_in_use(run.clone(), &mut handles),
        }
        let pool = seg.pool;
        let mut chunks: Vec<PhysHandle> = Vec::new();
        let lent = (self.lending).note_unmapped(
            self.physical.chunks(),
            self.segments.at(slot),
            (run, &handles),
            out,
            &mut chunks,
        ) as u64;
        self.physical.restore_scratch(handles);
        // A lent page's memory is counted at home.
        self.books
            .counters
            .mapped
            .sub(pool, (pages - lent) * self.page_size);
        self.books.refresh(self.segments.at(slot), before);
        self.physical
            .release_chunks(&mut self.driver, &mut self.books, chunks)?;
        Ok(pages as usize)
    }

    /// Gives at least `bytes` (rounded up to whole pages) of idle physical memory back to the driver, or all
    /// of it if there is less: pooled handles first, then idle pages from the highest addresses down.
    /// Returns the bytes given back.
    pub(super) fn release_idle(&mut self, bytes: u64) -> Result<u64, Error> {
        // Each stream is synchronized at most once, however many rounds it takes.
        self.release_idle_in(bytes, &mut Compacting::default())
    }

    /// [`release_idle`](Self::release_idle) within one compaction, which may know streams done already.
    fn release_idle_in(&mut self, bytes: u64, compacting: &mut Compacting) -> Result<u64, Error> {
        let _span = tracing::debug_span!("cuvmm::release_idle", bytes).entered();
        let mut released =
            self.physical
                .release_pooled(&mut self.driver, &mut self.books, bytes)?;
        while released < bytes && self.books.idle_pages() > 0 {
            let pages = (bytes - released)
                .div_ceil(self.page_size)
                .min(self.books.idle_pages() as u64) as usize;
            let mut handles = Vec::with_capacity(pages);
            let reserved = self.books.counters.reserved.current;
            let stolen = self.steal_idle(pages, &mut handles, Wait::Block, compacting);
            released += reserved - self.books.counters.reserved.current;
            // Lent pages unmapped here go home, where their chunk can be unmapped whole once all its
            // pages are idle.
            self.put_back(handles);
            if stolen? == 0 {
                break;
            }
            released += self.physical.release_pooled(
                &mut self.driver,
                &mut self.books,
                bytes.saturating_sub(released),
            )?;
        }
        if released > 0 {
            tracing::debug!(released, "cuvmm: released idle memory to the driver");
        }
        Ok(released)
    }

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
        if !self.physical.has_chunks() || !self.lending.enabled() {
            return Ok(0);
        }
        let order = self.segments_with_idle_pages();
        let mut lent = 0;
        for slot in order {
            if lent >= count {
                break;
            }
            let pages = self.lendable(slot, count - lent);
            if pages.is_empty()
                || !self.stream_done(self.segments.at(slot).stream, wait, compacting)?
            {
                continue;
            }
            for page in pages {
                self.lend_page(slot, page, out);
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
        let pages = &self.segments.at(slot).pages;
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
                            .chunk_at(&self.lending, self.segments.at(slot), page)
                            .is_some()
                    })
                    .take(count - found.len()),
            );
        }
        found
    }

    /// Lends idle `page` of segment `slot`, which holds a chunk at home: its addresses become a lent block
    /// and its piece of the chunk goes to `out`.
    fn lend_page(&mut self, slot: usize, page: usize, out: &mut Vec<PhysPage>) {
        let group = (self
            .physical
            .chunk_at(&self.lending, self.segments.at(slot), page))
        .expect("a page to lend holds a chunk at home")
        .start;
        let handle = (self.segments.at(slot).pages.handle(page)).expect("a chunk's page is mapped");
        let before = SlotCounts::of(self.segments.at(slot));
        let addr = self.segments.at(slot).page_addr(page);
        let page_size = self.page_size;
        self.segments.at_mut(slot).lend(addr, page_size);
        let pool = self.segments.at(slot).pool;
        self.books.count_lent(pool, true);
        self.books.refresh(self.segments.at(slot), before);
        out.push((self.lending).lend_piece(handle, (slot, group, page), page_size));
    }

    /// Takes a lent page, mapped nowhere else now, back home: its lent block is freed and the page is idle
    /// there again.
    fn return_home(&mut self, piece: PhysPage) {
        let (slot, page) = self.lending.return_piece(piece, self.page_size);
        let before = SlotCounts::of(self.segments.at(slot));
        let addr = self.segments.at(slot).page_addr(page);
        self.segments.at_mut(slot).unlend(addr);
        let pool = self.segments.at(slot).pool;
        self.books.count_lent(pool, false);
        self.books.refresh(self.segments.at(slot), before);
    }

    /// Puts pages not mapped anywhere back: single-page handles into the pool, lent pieces of chunks home.
    pub(super) fn put_back(&mut self, pages: impl IntoIterator<Item = PhysPage>) {
        for page in pages {
            if self.physical.is_chunk(page.handle) {
                self.return_home(page);
            } else {
                self.physical.pool_page(page.handle);
            }
        }
    }

    /// Frees the reservations of segments that hold no live block and no mapped page.
    pub(super) fn free_empty_segments(&mut self) -> Result<(), Error> {
        for slot in 0..self.segments.slot_count() {
            let Some(seg) = self.segments.try_at(slot) else {
                continue;
            };
            if seg.occupied_count() > 0 || seg.pages.mapped_count() > 0 {
                continue;
            }
            let (va, graph, pool) = (seg.va, seg.graph, seg.pool);
            free_reservation_settled(&mut self.driver, va)?;
            self.segments.take_out(slot);
            self.books.counters.segment.sub(pool, 1);
            if let Some(graph) = graph
                && !self.segments.any_of_graph(graph)
            {
                self.graphs.forget_released(graph);
            }
        }
        Ok(())
    }

    /// Unmaps and releases everything, live blocks included, and frees every reservation. Used on drop.
    /// Goes on after a failure so as much as possible is given back, and returns the first failure.
    ///
    /// It waits for the device once, not for each stream it knows of: a program may have destroyed those
    /// streams before dropping the allocator (Rust drops a stream made after the allocator first), and a call
    /// naming a destroyed stream is undefined behaviour on a GPU.
    pub(super) fn teardown(&mut self) -> Result<(), Error> {
        let mut first_err: Option<Error> = None;
        let mut note = |result: Result<(), Error>| {
            if let Err(err) = result {
                first_err.get_or_insert(err);
            }
        };
        let segments = self.segments.take_all();
        if self.waits.any() || segments.iter().any(|seg| seg.pages.mapped_count() > 0) {
            note(synchronize_device(&mut self.driver, &mut self.books));
        }
        note(self.waits.forget_all(&mut self.driver));
        for seg in segments {
            if seg.pages.mapped_count() > 0 {
                for run in seg.pages.mapped_runs(0..seg.pages.len()) {
                    let va = seg.page_addr(run.start);
                    match unmap_settled(&mut self.driver, va, run.len() as u64 * self.page_size) {
                        Ok(()) => {
                            // A chunk is listed once per page of it: keep it once; a lent page is a
                            // second mapping of a chunk kept at home.
                            let lending = &self.lending;
                            let mut handles: Vec<PhysHandle> = run
                                .filter(|&page| !lending.is_alias(seg.page_addr(page)))
                                .filter_map(|page| seg.pages.handle(page))
                                .collect();
                            handles.dedup();
                            self.physical.pool_pages(handles);
                        }
                        Err(err) => note(Err(err.into())),
                    }
                }
            }
            note(free_reservation_settled(&mut self.driver, seg.va).map_err(Error::from));
        }
        self.lending.forget_all();
        self.books.forget_lent();
        let (physical, driver, books) = (&mut self.physical, &mut self.driver, &mut self.books);
        physical.release_all(driver, books, note);
        first_err.map_or(Ok(()), Err)
    }
}
