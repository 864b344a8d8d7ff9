//! Physical memory: the handle pool, the chunks, and the budget and limit that growth stays under.
//!
//! A handle is one page, or, in the large pool when the handle-size policy makes them (`handle_size/`), a
//! *chunk* of `chunk_pages` pages mapped at an aligned group of pages of one segment (PyTorch maps 20 MiB
//! handles there). A handle is in exactly one place: mapped (a chunk at all pages of its group, its lent
//! pages also mapped a second time elsewhere, see `lending.rs`), or pooled, unmapped (`pooled` for single
//! pages, `pooled_chunks` for chunks). The supply's own state: the rest of the supply maps and unmaps, and
//! asks it for pooled handles, for the chunk a page lies in, and where growth stands against the budget.
//!
//! The memory limit (`per_process_memory_fraction`, [`Config::memory_limit`](crate::Config::memory_limit))
//! is PyTorch's `set_per_process_memory_fraction` for cuvmm: growth past it is refused as a full device's
//! would be, so a request is served from idle memory or fails with out-of-memory. The device margin
//! ([`Config::device_margin`](crate::Config::device_margin)) does the same where a request's growth would
//! leave less than it free on the device.

use super::exports::Exports;
use super::lending::Lending;
use crate::driver::{Driver, DriverError, Op, PhysHandle, PhysPage};
use crate::expandable::accounting::Books;
use crate::expandable::segment::Segment;
use crate::expandable::settle::release_settled;
use crate::strategy::error::Error;
use rustc_hash::FxHashSet;
use std::ops::Range;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// The handles held and the rules growth follows.
#[derive(Debug)]
pub(crate) struct Physical {
    pooled: Vec<PhysHandle>,
    /// Unmapped chunks (multi-page handles) ready to map at a group of pages.
    pooled_chunks: Vec<PhysHandle>,
    /// Every chunk held (mapped or pooled).
    chunks: FxHashSet<PhysHandle>,
    /// Pages per large-pool handle, as the handle-size policy says (1: no chunks).
    chunk_pages: usize,
    page_size: u64,
    /// Reserved bytes under which `compaction:pressure` grows without reclaiming, never above the limit
    /// ([`Config::budget_bytes`](crate::Config::budget_bytes)).
    budget: u64,
    /// The most bytes that may be reserved ([`Config::memory_limit`](crate::Config::memory_limit)); `None`:
    /// the device's memory.
    limit: Option<u64>,
    /// The bytes reserved when the limit was set below them (`set_per_process_memory_fraction` lowered under
    /// what is held): they stay, as under PyTorch's allocator, and nothing grows until the limit is met.
    held_over_limit: u64,
    /// Bytes of the device a request's growth leaves free
    /// ([`Config::device_margin`](crate::Config::device_margin)).
    margin: u64,
    /// The handles of the request being backed with pages; kept between requests so its buffer is reused.
    /// Empty outside `back_with_pages`: a handle is never only here.
    handle_queue: Vec<PhysPage>,
    /// The handles of a run being unmapped, as the page map gives them; kept so its buffer is reused.
    unmapped_scratch: Vec<PhysHandle>,
    /// The descriptors of the handles exported, until their release (`exports.rs`).
    exports: Exports,
}

/// Reserved memory against the budget, for a growth of `extra` bytes: what the policies decide by
/// (`compaction/`, `handle_size/`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Growth {
    /// Bytes reserved now.
    pub reserved: u64,
    /// The budget ([`Config::budget_bytes`](crate::Config::budget_bytes), never above the memory limit).
    pub budget: u64,
    /// Bytes the growth would add.
    pub extra: u64,
}

impl Growth {
    /// Whether the growth takes reserved memory past the budget.
    pub(crate) fn over_budget(self) -> bool {
        self.reserved.saturating_add(self.extra) > self.budget
    }
}

/// How a [`Physical`] is set up.
pub(crate) struct Setup {
    pub chunk_pages: usize,
    pub page_size: u64,
    pub budget: u64,
    pub limit: Option<u64>,
    pub margin: u64,
    /// Chunks the set of chunks has room for up front.
    pub chunk_room: usize,
}

impl Physical {
    /// No handle held yet.
    pub(crate) fn set_up(s: Setup) -> Self {
        Self {
            pooled: Vec::new(),
            pooled_chunks: Vec::new(),
            chunks: FxHashSet::with_capacity_and_hasher(s.chunk_room, Default::default()),
            chunk_pages: s.chunk_pages,
            page_size: s.page_size,
            budget: s.budget,
            limit: s.limit,
            held_over_limit: 0,
            margin: s.margin,
            handle_queue: Vec::new(),
            unmapped_scratch: Vec::new(),
            exports: Exports::default(),
        }
    }

    /// Pages per chunk (1: no chunks).
    pub(crate) fn chunk_pages(&self) -> usize {
        self.chunk_pages
    }

    /// The memory limit, if any.
    pub(crate) fn limit(&self) -> Option<u64> {
        self.limit
    }

    /// The most bytes that may be reserved now: the limit, or what was held when it was set below that.
    pub(crate) fn reserved_allowed(&self) -> Option<u64> {
        self.limit.map(|limit| limit.max(self.held_over_limit))
    }

    /// Sets the memory limit and the budget under it ([`Config::budget_bytes`](crate::Config::budget_bytes)
    /// of the new limit, never above it), with `reserved` bytes reserved now (kept, if above the limit).
    pub(crate) fn set_limit(&mut self, limit: u64, budget: u64, reserved: u64) {
        self.limit = Some(limit);
        self.budget = budget;
        self.held_over_limit = if reserved > limit { reserved } else { 0 };
    }

    /// The bytes of the device a request's growth leaves free.
    pub(crate) fn margin(&self) -> u64 {
        self.margin
    }

    /// Sets the bytes of the device a request's growth leaves free.
    pub(crate) fn set_margin(&mut self, bytes: u64) {
        self.margin = bytes;
    }

    /// Where reserving `extra` more bytes, with `reserved` reserved now, stands against the budget.
    pub(crate) fn growth(&self, reserved: u64, extra: u64) -> Growth {
        Growth {
            reserved,
            budget: self.budget,
            extra,
        }
    }

    /// How many more pages the memory limit lets the allocator reserve, with `reserved` reserved now (all
    /// it wants without a limit).
    pub(crate) fn pages_under_limit(&self, reserved: u64) -> usize {
        match self.limit {
            None => usize::MAX,
            Some(limit) => {
                let room = limit.saturating_sub(reserved) / self.page_size;
                usize::try_from(room).unwrap_or(usize::MAX)
            }
        }
    }

    /// The out-of-memory error of creating `pages` pages past the memory limit: what the driver would say of
    /// a device that small.
    pub(crate) fn limit_reached(&self, reserved: u64, pages: usize) -> DriverError {
        let limit = self.limit.unwrap_or(0);
        DriverError::OutOfMemory {
            op: Op::Create,
            requested: pages as u64 * self.page_size,
            free: limit.saturating_sub(reserved),
        }
    }

    /// The out-of-memory error of creating `pages` pages past the device margin, with `free` bytes free
    /// on the device: what the driver would say of a device smaller by the margin.
    pub(crate) fn margin_reached(&self, free: u64, pages: usize) -> DriverError {
        DriverError::OutOfMemory {
            op: Op::Create,
            requested: pages as u64 * self.page_size,
            free: free.saturating_sub(self.margin),
        }
    }

    /// Pages held by pooled handles, single pages and chunks.
    pub(crate) fn pooled_pages(&self) -> usize {
        self.pooled.len() + self.pooled_chunks.len() * self.chunk_pages
    }

    /// Moves up to `count` pooled single pages to `out`; returns how many.
    pub(crate) fn take_pooled(&mut self, count: usize, out: &mut Vec<PhysPage>) -> usize {
        let from_pool = count.min(self.pooled.len());
        out.extend((self.pooled.drain(self.pooled.len() - from_pool..)).map(PhysPage::from));
        from_pool
    }

    /// Pools an unmapped single-page handle.
    pub(crate) fn pool_page(&mut self, handle: PhysHandle) {
        self.pooled.push(handle);
    }

    /// Pools unmapped handles (teardown: chunks too, for release).
    pub(crate) fn pool_pages(&mut self, handles: impl IntoIterator<Item = PhysHandle>) {
        self.pooled.extend(handles);
    }

    /// A pooled chunk, if any.
    pub(crate) fn pop_pooled_chunk(&mut self) -> Option<PhysHandle> {
        self.pooled_chunks.pop()
    }

    /// Pools an unmapped chunk.
    pub(crate) fn pool_chunk(&mut self, handle: PhysHandle) {
        self.pooled_chunks.push(handle);
    }

    /// Holds a new chunk.
    pub(crate) fn add_chunk(&mut self, handle: PhysHandle) {
        self.chunks.insert(handle);
    }

    /// Whether `handle` is a chunk.
    #[inline]
    pub(crate) fn is_chunk(&self, handle: PhysHandle) -> bool {
        self.chunks.contains(&handle)
    }

    /// Whether any chunk is held.
    #[inline]
    pub(crate) fn has_chunks(&self) -> bool {
        !self.chunks.is_empty()
    }

    /// The chunks held (for the invariants).
    pub(crate) fn chunks(&self) -> &FxHashSet<PhysHandle> {
        &self.chunks
    }

    /// The descriptor that exports the held `handle`: the same one for every share of it until its release.
    pub(crate) fn export<D: Driver>(
        &mut self,
        driver: &mut D,
        handle: PhysHandle,
    ) -> Result<Arc<OwnedFd>, DriverError> {
        self.exports.descriptor(driver, handle)
    }

    /// The handles exported and not released since (for the invariants).
    pub(crate) fn exported(&self) -> impl Iterator<Item = PhysHandle> + '_ {
        self.exports.handles()
    }

    /// The pooled single pages and chunks (for the invariants).
    pub(crate) fn pooled(&self) -> (&[PhysHandle], &[PhysHandle]) {
        (&self.pooled, &self.pooled_chunks)
    }

    /// The buffer for the handles of a request, empty; give it back with [`restore_queue`](Self::restore_queue).
    pub(crate) fn take_queue(&mut self) -> Vec<PhysPage> {
        let mut queue = std::mem::take(&mut self.handle_queue);
        queue.clear();
        queue
    }

    /// Gives the request's buffer back.
    pub(crate) fn restore_queue(&mut self, queue: Vec<PhysPage>) {
        self.handle_queue = queue;
    }

    /// The buffer for the handles of a run being unmapped, empty; give it back with
    /// [`restore_scratch`](Self::restore_scratch).
    pub(crate) fn take_scratch(&mut self) -> Vec<PhysHandle> {
        let mut handles = std::mem::take(&mut self.unmapped_scratch);
        handles.clear();
        handles
    }

    /// Gives the unmapping buffer back.
    pub(crate) fn restore_scratch(&mut self, handles: Vec<PhysHandle>) {
        self.unmapped_scratch = handles;
    }

    /// The pages of the chunk whose home mapping `page` of `seg` lies in, if there is one (a lent page mapped
    /// here is a mapping of its own, one page).
    ///
    /// Told by the page map, without looking the handle up in `chunks`: a chunk is mapped at every page of
    /// its aligned group and a single-page handle at one page only, so the handle at `page` is a chunk at
    /// home exactly when another page of the group holds the same handle and `page` is not a lent page (two
    /// lent pages of one chunk may lie in one group).
    pub(crate) fn chunk_at(
        &self,
        lending: &Lending,
        seg: &Segment,
        page: usize,
    ) -> Option<Range<usize>> {
        let k = self.chunk_pages;
        let pages = &seg.pages;
        let handle = pages.handle(page)?;
        let start = page - page % k;
        let other = if page == start { start + 1 } else { start };
        if k < 2 || other >= pages.len() || pages.handle(other) != Some(handle) {
            return None;
        }
        if lending.is_alias(seg.page_addr(page)) {
            return None;
        }
        debug_assert!(self.chunks.contains(&handle));
        Some(start..start + k)
    }

    /// `run` of idle pages of `seg` without the ends of chunks that lie partly outside it (and so are in use).
    pub(crate) fn whole_chunks(
        &self,
        lending: &Lending,
        seg: &Segment,
        run: Range<usize>,
    ) -> Range<usize> {
        if self.chunks.is_empty() || run.is_empty() {
            return run;
        }
        let start = match self.chunk_at(lending, seg, run.start) {
            Some(chunk) if chunk.start < run.start => chunk.end,
            _ => run.start,
        };
        let end = match self.chunk_at(lending, seg, run.end - 1) {
            Some(chunk) if chunk.end > run.end => chunk.start,
            _ => run.end,
        };
        start..end.max(start)
    }

    /// `pages` of `seg`, widened at each end to the whole chunk that end lies in, if any.
    pub(crate) fn widen_to_chunks(
        &self,
        lending: &Lending,
        seg: &Segment,
        pages: Range<usize>,
    ) -> Range<usize> {
        if pages.is_empty() || self.chunks.is_empty() {
            return pages;
        }
        let start = self
            .chunk_at(lending, seg, pages.start)
            .map_or(pages.start, |c| c.start);
        let end = self
            .chunk_at(lending, seg, pages.end - 1)
            .map_or(pages.end, |c| c.end);
        start..end
    }

    /// `page` of `seg`, moved down to the start of its chunk if it lies in one.
    pub(crate) fn chunk_floor(&self, lending: &Lending, seg: &Segment, page: usize) -> usize {
        match self.chunks.is_empty() {
            true => page,
            false => self
                .chunk_at(lending, seg, page)
                .map_or(page, |chunk| chunk.start),
        }
    }

    /// Gives one unmapped handle (a page or a chunk) back to the driver.
    pub(crate) fn release_handle<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
        handle: PhysHandle,
    ) -> Result<(), Error> {
        release_settled(driver, handle)?;
        self.exports.forget(handle);
        let pages = match self.chunks.remove(&handle) {
            true => self.chunk_pages as u64,
            false => 1,
        };
        books.counters.released += pages;
        books.counters.reserved.sub(pages * self.page_size);
        Ok(())
    }

    /// Releases chunks unmapped at home; one that cannot be released is pooled, as are the chunks after it.
    pub(crate) fn release_chunks<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
        chunks: Vec<PhysHandle>,
    ) -> Result<(), Error> {
        let mut result = Ok(());
        for handle in chunks {
            if result.is_ok() {
                result = self.release_handle(driver, books, handle);
                if result.is_ok() {
                    continue;
                }
            }
            self.pooled_chunks.push(handle);
        }
        result
    }

    /// Releases pooled handles until at least `bytes` are given back or the pool is empty; returns the bytes
    /// given back. A handle whose release fails stays in the pool.
    pub(crate) fn release_pooled<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
        bytes: u64,
    ) -> Result<u64, Error> {
        let mut released = 0;
        while released < bytes
            && let Some(handle) = self.pooled_chunks.pop()
        {
            if let Err(err) = self.release_handle(driver, books, handle) {
                self.pooled_chunks.push(handle);
                return Err(err);
            }
            released += self.chunk_pages as u64 * self.page_size;
        }
        while released < bytes
            && let Some(handle) = self.pooled.pop()
        {
            if let Err(err) = self.release_handle(driver, books, handle) {
                self.pooled.push(handle);
                return Err(err);
            }
            released += self.page_size;
        }
        Ok(released)
    }

    /// Releases every pooled handle, chunks included (teardown); goes on after a failure and hands each
    /// failure to `note`.
    pub(crate) fn release_all<D: Driver>(
        &mut self,
        driver: &mut D,
        books: &mut Books,
        mut note: impl FnMut(Result<(), Error>),
    ) {
        let pooled_chunks = std::mem::take(&mut self.pooled_chunks);
        self.pooled.extend(pooled_chunks);
        while let Some(handle) = self.pooled.pop() {
            note(self.release_handle(driver, books, handle));
        }
    }
}
