//! Physical pages: obtaining handles (pool, compaction of idle pages, create), and giving them back.
//!
//! A handle is one page, or, in the large pool under `compaction:pressure`, a *chunk* of `chunk_pages`
//! pages mapped at an aligned group of pages of one segment (PyTorch maps 20 MiB handles there). A handle is
//! in exactly one place: mapped (a chunk at all pages of its group, its lent pages also mapped a second time
//! elsewhere, see `lending.rs`), or pooled, unmapped (`pooled` for single pages, `pooled_chunks` for
//! chunks). Unmapping an idle page first makes sure no queued work can
//! still touch it: its stream is synchronized (at most once per stream per compaction), or, under pressure
//! before any blocking, an event query shows the stream has finished its queued work.

use super::Expandable;
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
/// event query found busy.
#[derive(Debug, Default)]
pub(crate) struct Compacting {
    done: Vec<StreamId>,
    busy: Vec<StreamId>,
}

impl<D: Driver> Expandable<D> {
    /// Whether reserving `extra` more bytes would take reserved memory past the pressure budget. Always
    /// true under `compaction:eager`, which reclaims before it creates.
    pub(super) fn under_pressure(&self, extra: u64) -> bool {
        self.config.compaction == Compaction::Eager
            || self.counters.reserved.current.saturating_add(extra) > self.budget
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
        let from_pool = count.min(self.pooled.len());
        out.extend((self.pooled.drain(self.pooled.len() - from_pool..)).map(PhysPage::from));
        // Compaction waits for streams and unmaps: never during a capture.
        if from_pool < count
            && !self.capturing()
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
            let allowed = self.pages_under_limit().min(wanted);
            let mut created = Ok(());
            if allowed > 0 {
                created = (self.driver).create_each(self.page_size, allowed, &mut fresh_handles);
            }
            if created.is_ok() && allowed < wanted {
                created = Err(self.limit_reached(wanted - allowed));
            }
            out.extend(fresh_handles.iter().copied().map(PhysPage::from));
            let fresh = fresh_handles.len() as u64;
            self.counters.created += fresh;
            self.counters.reserved.add(fresh * self.page_size);
            match created.map_err(Error::from) {
                Ok(()) => {}
                Err(err) if err.is_out_of_memory() && !retried && !self.capturing() => {
                    retried = true;
                    self.counters.retries += 1;
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
                while missing(out) > 0 && self.under_pressure(missing(out) as u64 * self.page_size)
                {
                    if self.steal_idle(missing(out), out, wait, &mut compacting)? == 0 {
                        break;
                    }
                }
                if missing(out) > 0 && self.under_pressure(missing(out) as u64 * self.page_size) {
                    self.lend_stranded(missing(out), out, wait, &mut compacting)?;
                }
            }
            Ok(0)
        })();
        let stolen = (out.len() - base) as u64;
        self.counters.compacted += stolen;
        if stolen > 0 {
            tracing::debug!(
                pages = stolen,
                "cuvmm: compaction: idle pages unmapped for reuse"
            );
        }
        result.map(|_| ())
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
                || !self.stream_done(self.segment(slot).stream, wait, compacting)?
            {
                continue;
            }
            // Idle runs from the highest down, each found when it is needed.
            let mut end = self.segment(slot).pages.len();
            while gained < count {
                let Some(run) = self.segment(slot).pages.last_idle_run_before(end) else {
                    break;
                };
                end = run.start;
                let run = self.whole_chunks(slot, run);
                if run.is_empty() {
                    continue;
                }
                let take = self.chunk_floor(slot, run.end - run.len().min(count - gained));
                gained += self.unmap_run(slot, take.max(run.start)..run.end, out)?;
            }
        }
        Ok(gained)
    }

    /// The segments with idle pages, in the order compaction takes them: by slot under `compaction:eager`,
    /// by when a block of theirs was last freed (oldest first) under pressure.
    pub(super) fn segments_with_idle_pages(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.segments.len())
            .filter(|&slot| {
                self.segments[slot]
                    .as_ref()
                    .is_some_and(|seg| seg.pages.idle_count() > 0)
                    // A live graph pool's pages stay where the graph baked them in.
                    && !self.pinned(slot)
            })
            .collect();
        if self.config.compaction == Compaction::Pressure {
            order.sort_by_key(|&slot| self.segment(slot).last_free);
        }
        order
    }

    /// Whether segment `slot` has an idle page that can be unmapped: one not in a chunk that a live block
    /// still touches.
    fn has_reclaimable(&self, slot: usize) -> bool {
        let pages = &self.segment(slot).pages;
        let mut end = pages.len();
        while let Some(run) = pages.last_idle_run_before(end) {
            if !self.whole_chunks(slot, run.clone()).is_empty() {
                return true;
            }
            end = run.start;
        }
        false
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
            let map = &this.segment(slot).pages;
            let start = map.first_unmapped(from..pages.end)?;
            Some(start..map.first_mapped(start..pages.end).unwrap_or(pages.end))
        };
        let Some(mut run) = unmapped_run(self, pages.start) else {
            return Ok(widened);
        };
        let k = self.chunk_pages;
        let bytes = k as u64 * self.page_size;
        let headroom = (self.budget as f64 * self.config.large_handle_headroom) as u64;
        let before = self.page_counts(slot);
        let (pool, stream) = (self.segment(slot).pool, self.segment(slot).stream);
        let mut result = Ok(());
        'runs: loop {
            let mut group = run.start - run.start % k;
            while group < run.end {
                let chunk = group..group + k;
                group += k;
                let seg = self.segment(slot);
                if chunk.end > seg.pages.len() || seg.pages.unmapped_count(chunk.clone()) != k {
                    continue;
                }
                let handle = match self.pooled_chunks.pop() {
                    Some(handle) => handle,
                    None if self.under_pressure(bytes.saturating_add(headroom)) => break 'runs,
                    None => match self.driver.create(bytes) {
                        Ok(handle) => {
                            self.chunks.insert(handle);
                            self.counters.created += k as u64;
                            self.counters.reserved.add(bytes);
                            handle
                        }
                        Err(err) if err.is_out_of_memory() => {
                            // Retried with single pages, which the cache release can make room for.
                            self.counters.retries += 1;
                            break 'runs;
                        }
                        Err(err) => {
                            result = Err(err.into());
                            break 'runs;
                        }
                    },
                };
                let va = self.segment(slot).page_addr(chunk.start);
                if let Err(err) = self.driver.map(va, bytes, handle) {
                    self.undo_failed_map(va, bytes);
                    self.pooled_chunks.push(handle);
                    result = Err(err.into());
                    break 'runs;
                }
                self.segment_mut(slot)
                    .pages
                    .map_chunk(chunk.clone(), handle);
                self.counters.mapped.add(pool, bytes);
                self.record(TraceAction::SegmentMap, va, bytes, stream);
                widened = widened.start.min(chunk.start)..widened.end.max(chunk.end);
            }
            match unmapped_run(self, run.end) {
                Some(next) => run = next,
                None => break,
            }
        }
        self.refresh_page_counts(slot, before);
        result.map(|()| widened)
    }

    /// Whether `stream`'s queued work is known complete for this compaction: synchronized (`Wait::Block`)
    /// or shown idle by an event query (`Wait::Query`), each stream at most once.
    pub(super) fn stream_done(
        &mut self,
        stream: StreamId,
        wait: Wait,
        compacting: &mut Compacting,
    ) -> Result<bool, Error> {
        if compacting.done.contains(&stream) {
            return Ok(true);
        }
        let done = match wait {
            Wait::Block => {
                self.synchronize(stream)?;
                true
            }
            Wait::Query if compacting.busy.contains(&stream) => false,
            Wait::Query => self.stream_idle(stream)?,
        };
        if done {
            compacting.done.push(stream);
        } else {
            compacting.busy.push(stream);
        }
        Ok(done)
    }

    /// The pages of the chunk whose home mapping `page` lies in, if there is one (a lent page mapped here is
    /// a mapping of its own, one page).
    ///
    /// Told by the page map, without looking the handle up in `chunks`: a chunk is mapped at every page of
    /// its aligned group and a single-page handle at one page only, so the handle at `page` is a chunk at
    /// home exactly when another page of the group holds the same handle and `page` is not a lent page (two
    /// lent pages of one chunk may lie in one group).
    pub(super) fn chunk_at(&self, slot: usize, page: usize) -> Option<Range<usize>> {
        let k = self.chunk_pages;
        let pages = &self.segment(slot).pages;
        let handle = pages.handle(page)?;
        let start = page - page % k;
        let other = if page == start { start + 1 } else { start };
        if k < 2 || other >= pages.len() || pages.handle(other) != Some(handle) {
            return None;
        }
        if self.is_alias(slot, page) {
            return None;
        }
        debug_assert!(self.chunks.contains(&handle));
        Some(start..start + k)
    }

    /// `run` of idle pages without the ends of chunks that lie partly outside it (and so are in use).
    fn whole_chunks(&self, slot: usize, run: Range<usize>) -> Range<usize> {
        if self.chunks.is_empty() || run.is_empty() {
            return run;
        }
        let start = match self.chunk_at(slot, run.start) {
            Some(chunk) if chunk.start < run.start => chunk.end,
            _ => run.start,
        };
        let end = match self.chunk_at(slot, run.end - 1) {
            Some(chunk) if chunk.end > run.end => chunk.start,
            _ => run.end,
        };
        start..end.max(start)
    }

    /// `pages`, widened at each end to the whole chunk that end lies in, if any.
    pub(super) fn widen_to_chunks(&self, slot: usize, pages: Range<usize>) -> Range<usize> {
        if pages.is_empty() || self.chunks.is_empty() {
            return pages;
        }
        let start = self
            .chunk_at(slot, pages.start)
            .map_or(pages.start, |c| c.start);
        let end = self
            .chunk_at(slot, pages.end - 1)
            .map_or(pages.end, |c| c.end);
        start..end
    }

    /// `page`, moved down to the start of its chunk if it lies in one.
    fn chunk_floor(&self, slot: usize, page: usize) -> usize {
        match self.chunks.is_empty() {
            true => page,
            false => self.chunk_at(slot, page).map_or(page, |chunk| chunk.start),
        }
    }

    /// Unmaps a run of idle pages (whose queued work is known complete) of one segment in one driver call,
    /// appends their single-page handles and lent pieces to `out` and releases the chunks unmapped at home
    /// (a chunk that cannot be released is pooled). Returns the pages gained.
    pub(super) fn unmap_run(
        &mut self,
        slot: usize,
        run: Range<usize>,
        out: &mut Vec<PhysPage>,
    ) -> Result<usize, Error> {
        let stream = self.segment(slot).stream;
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
        let mut handles = std::mem::take(&mut self.unmapped_scratch);
        handles.clear();
        // A sleeping tag's pages are unmapped under its live blocks (`sleep.rs`).
        let asleep = self.asleep(slot);
        let seg = self.segment_mut(slot);
        match asleep {
            false => seg.pages.unmap_run(run.clone(), &mut handles),
            true => seg.pages.unmap_run_in_use(run.clone(), &mut handles),
        }
        let pool = seg.pool;
        let mut chunks: Vec<PhysHandle> = Vec::new();
        let lent = self.note_unmapped(slot, run, &handles, out, &mut chunks) as u64;
        self.unmapped_scratch = handles;
        // A lent page's memory is counted at home.
        self.counters
            .mapped
            .sub(pool, (pages - lent) * self.page_size);
        self.refresh_page_counts(slot, before);
        self.release_chunks(chunks)?;
        Ok(pages as usize)
    }

    /// Releases chunks unmapped at home; one that cannot be released goes to `pooled_chunks`, as do the
    /// chunks after it.
    fn release_chunks(&mut self, chunks: Vec<PhysHandle>) -> Result<(), Error> {
        let mut result = Ok(());
        for handle in chunks {
            if result.is_ok() {
                result = self.release_handle(handle);
                if result.is_ok() {
                    continue;
                }
            }
            self.pooled_chunks.push(handle);
        }
        result
    }

    /// Waits for `stream`'s queued work (before one of its pages is unmapped, or pending frees are drained).
    pub(super) fn synchronize(&mut self, stream: StreamId) -> Result<(), Error> {
        self.driver.synchronize(stream)?;
        self.counters.synchronizations += 1;
        Ok(())
    }

    /// Gives one unmapped handle (a page or a chunk) back to the driver.
    pub(super) fn release_handle(&mut self, handle: PhysHandle) -> Result<(), Error> {
        self.release_settled(handle)?;
        let pages = match self.chunks.remove(&handle) {
            true => self.chunk_pages as u64,
            false => 1,
        };
        self.counters.released += pages;
        self.counters.reserved.sub(pages * self.page_size);
        Ok(())
    }

    /// Gives at least `bytes` (rounded up to whole pages) of idle physical memory back to the driver, or all
    /// of it if there is less: pooled handles first, then idle pages from the highest addresses down.
    /// Returns the bytes given back.
    pub(super) fn release_idle(&mut self, bytes: u64) -> Result<u64, Error> {
        let _span = tracing::debug_span!("cuvmm::release_idle", bytes).entered();
        let mut released = self.release_pooled(bytes)?;
        // Each stream is synchronized at most once, however many rounds it takes.
        let mut compacting = Compacting::default();
        while released < bytes && self.idle_pages > 0 {
            let pages = (bytes - released)
                .div_ceil(self.page_size)
                .min(self.idle_pages as u64) as usize;
            let mut handles = Vec::with_capacity(pages);
            let reserved = self.counters.reserved.current;
            let stolen = self.steal_idle(pages, &mut handles, Wait::Block, &mut compacting);
            released += reserved - self.counters.reserved.current;
            // Lent pages unmapped here go home, where their chunk can be unmapped whole once all its
            // pages are idle.
            self.put_back(handles);
            if stolen? == 0 {
                break;
            }
            released += self.release_pooled(bytes.saturating_sub(released))?;
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
            && let Some(handle) = self.pooled_chunks.pop()
        {
            if let Err(err) = self.release_handle(handle) {
                self.pooled_chunks.push(handle);
                return Err(err);
            }
            released += self.chunk_pages as u64 * self.page_size;
        }
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
            let (va, key, pool) = (seg.va, (seg.stream, seg.pool, seg.graph, seg.tag), seg.pool);
            self.free_reservation_settled(va)?;
            self.segments[slot] = None;
            self.by_addr.retain(|&(start, _)| start != va.start);
            if let Some(slots) = self.by_key.get_mut(&key) {
                slots.retain(|&s| s != slot);
                if slots.is_empty() {
                    self.by_key.remove(&key);
                }
            }
            self.counters.segment.sub(pool, 1);
            if let Some(graph) = key.2
                && !self.live_segments().any(|seg| seg.graph == Some(graph))
            {
                self.graphs.forget_released(graph);
            }
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
                        Ok(()) => {
                            // A chunk is listed once per page of it: keep it once; a lent page is a
                            // second mapping of a chunk kept at home.
                            let aliases = &self.aliases;
                            let mut handles: Vec<PhysHandle> = run
                                .filter(|&page| !aliases.contains_key(&seg.page_addr(page)))
                                .filter_map(|page| seg.pages.handle(page))
                                .collect();
                            handles.dedup();
                            self.pooled.extend(handles);
                        }
                        Err(err) => note(Err(err.into())),
                    }
                }
            }
            note(self.free_reservation_settled(seg.va).map_err(Error::from));
        }
        self.by_addr.clear();
        self.by_key.clear();
        self.aliases.clear();
        self.lenders.clear();
        self.lent_pages = [0; 2];
        let pooled_chunks = std::mem::take(&mut self.pooled_chunks);
        self.pooled.extend(pooled_chunks);
        while let Some(handle) = self.pooled.pop() {
            note(self.release_handle(handle));
        }
        first_err.map_or(Ok(()), Err)
    }
}
