//! Splitting stranded chunks (`compaction:split`, `compaction/split.rs`): a chunk that live blocks still
//! touch cannot be unmapped in part (CUDA maps and unmaps a handle only whole), so its idle pages are
//! stranded. Under pressure, once nothing else is left to reclaim, such a chunk is re-created as single
//! pages at the same addresses: the device is synchronized (no queued work anywhere can touch the live
//! pages), the live pages' bytes are copied to host memory, the chunk is unmapped and released, one page is
//! created and mapped for each live page, access is set and the bytes are copied back. The chunk's idle
//! pages are gone: reserved memory falls by them, which makes room to create the request's pages.
//!
//! A driver that keeps no bytes (the simulator without a backing store, as replays run it) has nothing to
//! copy: [`DriverError::NoBackingStore`] on the copy out means no bytes are kept.

use super::{Parts, Supply};
use crate::driver::{Driver, DriverError, HostMemory, PhysHandle};
use crate::expandable::accounting::SlotCounts;
use crate::expandable::compacting::Compacting;
use crate::expandable::segments::Segments;
use crate::expandable::settle::{undo_failed_map, unmap_settled};
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;
use std::ops::Range;

/// How often a split calls a failing driver call again once the chunk is unmapped: until the live pages are
/// mapped with access again, a program's memory is unbacked, so each call is repeated at once, as settling
/// repeats a failed call (`settle.rs`). A driver that fails one call this many times in a row (on a GPU, a
/// lost context) leaves the live pages unmapped and the error returned.
const REPEATS: usize = 8;

/// `call` made until it succeeds, at most [`REPEATS`] times; the last error if it never does.
fn repeated<T>(mut call: impl FnMut() -> Result<T, DriverError>) -> Result<T, DriverError> {
    let mut attempt = 1;
    loop {
        match call() {
            Ok(value) => return Ok(value),
            Err(err) if attempt == REPEATS => return Err(err),
            Err(_) => attempt += 1,
        }
    }
}

/// A chunk that live blocks touch, with idle pages: its segment, its group's first page, its idle pages.
#[derive(Clone, Copy, Debug)]
struct Stranded {
    idle: usize,
    slot: usize,
    start: usize,
}

impl Supply {
    /// Every stranded chunk re-created as single pages now, whatever the compaction policy: the program's
    /// own call at a point where it knows no other thread launches work (`release_stranded`). The frees
    /// that wait are settled first (the device synchronized once, which the split needs anyway), so the
    /// blocks they free strand nothing. Returns the bytes given back.
    pub(crate) fn release_stranded<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
    ) -> Result<u64, Error> {
        let mut compacting = Compacting::by_device();
        p.settle_frees(&mut compacting)?;
        let pages = self.split_stranded(p, usize::MAX, &mut compacting)?;
        Ok(pages as u64 * self.page_size)
    }

    /// Re-creates as single pages the chunks that live blocks still touch, those with the most idle pages
    /// first, until at least `count` idle pages are given back; returns the pages given back. Synchronizes
    /// the device (once per compaction, through `compacting`) before the first. Nothing is done where
    /// lending is on (the driver maps parts of handles: the idle pages are lent instead) or no chunk is
    /// stranded.
    pub(super) fn split_stranded<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        count: usize,
        compacting: &mut Compacting,
    ) -> Result<usize, Error> {
        if count == 0 || !self.physical.has_chunks() || self.lending.enabled() {
            return Ok(0);
        }
        let mut stranded = self.stranded(p);
        if stranded.is_empty() {
            return Ok(0);
        }
        // The live pages' bytes move: no queued work on any stream may still touch them.
        compacting.device_done(&mut *p.driver, &mut *p.books)?;
        stranded.sort_by_key(|s| (std::cmp::Reverse(s.idle), s.slot, s.start));
        let mut gained = 0;
        for s in stranded {
            if gained >= count {
                break;
            }
            gained += self.split_chunk(p, s.slot, s.start)?;
        }
        if gained > 0 {
            tracing::debug!(pages = gained, "cuvmm: split chunks that live blocks touch");
        }
        Ok(gained)
    }

    /// Idle pages that lie in chunks a live block still touches, in every segment: what no compaction but a
    /// split can give back (the out-of-memory diagnosis).
    pub(in crate::expandable) fn stranded_pages(&self, segments: &Segments) -> usize {
        if !self.physical.has_chunks() {
            return 0;
        }
        let mut stranded = 0;
        for slot in 0..segments.slot_count() {
            let Some(seg) = segments.try_at(slot) else {
                continue;
            };
            let mut end = seg.pages.len();
            while let Some(run) = seg.pages.last_idle_run_before(end) {
                end = run.start;
                let whole = self.physical.whole_chunks(&self.lending, seg, run.clone());
                stranded += run.len() - whole.len();
            }
        }
        stranded
    }

    /// The chunks at home in large-pool segments that compaction may take (`Parts::pinned`) and that never
    /// shared memory with another process (`Segment::shared`: the other process maps the same handles), with
    /// both idle pages and pages a live block touches, and access set on every page.
    fn stranded<D>(&self, p: &Parts<'_, D>) -> Vec<Stranded> {
        let k = self.physical.chunk_pages();
        let mut found = Vec::new();
        for slot in 0..p.segments.slot_count() {
            let Some(seg) = p.segments.try_at(slot) else {
                continue;
            };
            if seg.pool != Pool::Large
                || seg.pages.idle_count() == 0
                || p.pinned(slot)
                || seg.shared
            {
                continue;
            }
            let mut end = seg.pages.len();
            let mut last_group = usize::MAX;
            while let Some(run) = seg.pages.last_idle_run_before(end) {
                end = run.start;
                for page in run.rev() {
                    let Some(chunk) = self.physical.chunk_at(&self.lending, seg, page) else {
                        continue;
                    };
                    if chunk.start == last_group {
                        continue;
                    }
                    last_group = chunk.start;
                    let idle = chunk.clone().filter(|&q| seg.pages.is_idle(q)).count();
                    // A chunk without access is one just mapped for the block being backed: left alone.
                    if idle < k && seg.pages.all_accessible(chunk.clone()) {
                        found.push(Stranded {
                            idle,
                            slot,
                            start: chunk.start,
                        });
                    }
                }
            }
        }
        found
    }

    /// Re-creates the chunk at the group of segment `slot` from page `start` as single pages at its live
    /// pages (the device synchronized); returns its idle pages, given back. On a failure before the chunk
    /// is released nothing changes; after it, the live pages are mapped again (a chunk again where single
    /// pages cannot be had) and the error returned.
    fn split_chunk<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        start: usize,
    ) -> Result<usize, Error> {
        let k = self.physical.chunk_pages();
        let page_size = self.page_size;
        let group = start..start + k;
        let seg = p.segments.at(slot);
        let (stream, graph) = (seg.stream, seg.graph);
        let Some(handle) = p.segments.at(slot).pages.handle(start) else {
            return Ok(0);
        };
        let live = live_runs(p, slot, group.clone());
        let live_pages: usize = live.iter().map(Range::len).sum();
        let idle = k - live_pages;
        // The live pages' bytes, kept in host memory while the pages move.
        let mut kept: Vec<Option<HostMemory>> = Vec::with_capacity(live.len());
        for run in &live {
            let va = p.segments.at(slot).page_addr(run.start);
            let len = run.len() as u64 * page_size;
            let bytes =
                usize::try_from(len).map_err(|_| DriverError::HostOutOfMemory { bytes: len })?;
            let mut host = p.driver.alloc_host(bytes)?;
            match p.driver.copy_to_host(va, host.as_mut_slice()) {
                Ok(()) => kept.push(Some(host)),
                Err(DriverError::NoBackingStore) => kept.push(None),
                // A driver that cannot copy bytes cannot move them: the chunk stays (nothing changed yet).
                Err(DriverError::Unsupported { .. }) => return Ok(0),
                Err(err) => return Err(err.into()),
            }
        }
        let va = p.segments.at(slot).page_addr(start);
        let bytes = k as u64 * page_size;
        unmap_settled(&mut *p.driver, va, bytes)?;
        let before = SlotCounts::of(p.segments.at(slot));
        let mut handles: Vec<PhysHandle> = self.physical.take_scratch();
        p.segments
            .at_mut(slot)
            .pages
            .unmap_run_in_use(group.clone(), &mut handles);
        self.physical.restore_scratch(handles);
        p.books
            .counters
            .count_mapped(p.segments.at(slot), bytes, false);
        p.books
            .record(TraceAction::SegmentUnmap, va, bytes, stream, graph);
        let result = match self
            .physical
            .release_handle(&mut *p.driver, &mut *p.books, handle)
        {
            Ok(()) => self.map_singles(p, slot, &live),
            Err(err) => {
                // Still held: mapped back whole, bytes and all.
                self.physical.pool_chunk(handle);
                Err(err)
            }
        };
        if let Err(err) = &result {
            // The live pages must be mapped again: a chunk (pooled, else new) at the whole group, and
            // their bytes put back in it.
            tracing::warn!(%err, "cuvmm: splitting a chunk failed; mapped whole again");
            if let Err(err) = self.remap_chunk(p, slot, group) {
                p.books.refresh(p.segments.at(slot), before);
                return Err(err);
            }
        }
        p.books.refresh(p.segments.at(slot), before);
        for (run, host) in live.iter().zip(&kept) {
            if let Some(host) = host {
                let va = p.segments.at(slot).page_addr(run.start);
                repeated(|| p.driver.copy_from_host(va, host.as_slice()))?;
            }
        }
        result?;
        Ok(idle)
    }

    /// Creates and maps one page at each page of `live` of segment `slot`, and sets access on them. On
    /// failure the pages mapped here are unmapped and every page created here is released or pooled.
    fn map_singles<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        live: &[Range<usize>],
    ) -> Result<(), Error> {
        let page_size = self.page_size;
        let seg = p.segments.at(slot);
        let (stream, graph) = (seg.stream, seg.graph);
        let count: usize = live.iter().map(Range::len).sum();
        let mut fresh = Vec::with_capacity(count);
        let created = repeated(|| {
            let before = fresh.len();
            let created = p.driver.create_each(page_size, count - before, &mut fresh);
            let made = (fresh.len() - before) as u64;
            p.books.counters.created += made;
            p.books.counters.reserved.add(made * page_size);
            created
        });
        if let Err(err) = created {
            self.physical.pool_pages(fresh);
            return Err(err.into());
        }
        let mut taken = 0;
        let mut mapped: Vec<Range<usize>> = Vec::new();
        let mut failure = None;
        for run in live {
            let va = p.segments.at(slot).page_addr(run.start);
            let pages: Vec<crate::driver::PhysPage> = fresh[taken..taken + run.len()]
                .iter()
                .copied()
                .map(Into::into)
                .collect();
            let mut done = 0;
            let result = repeated(|| {
                match p
                    .driver
                    .map_each(va + done as u64 * page_size, page_size, &pages[done..])
                {
                    Ok(()) => {
                        done = pages.len();
                        Ok(())
                    }
                    Err((more, err)) => {
                        done += more;
                        undo_failed_map(&mut *p.driver, va + done as u64 * page_size, page_size);
                        Err(err)
                    }
                }
            });
            (p.segments.at_mut(slot).pages)
                .map_run(run.start, fresh[taken..taken + done].iter().copied());
            (p.books.counters).count_mapped(p.segments.at(slot), done as u64 * page_size, true);
            if done > 0 {
                p.books.record(
                    TraceAction::SegmentMap,
                    va,
                    done as u64 * page_size,
                    stream,
                    graph,
                );
                mapped.push(run.start..run.start + done);
            }
            taken += done;
            if let Err(err) = result {
                failure = Some(Error::from(err));
                break;
            }
            match repeated(|| p.driver.set_access(va, run.len() as u64 * page_size)) {
                Ok(()) => p.segments.at_mut(slot).pages.set_accessible(run.clone()),
                Err(err) => {
                    failure = Some(err.into());
                    break;
                }
            }
        }
        let Some(err) = failure else {
            return Ok(());
        };
        // Undone: the single pages mapped here are unmapped and pooled, with those not mapped.
        let mut back = fresh.split_off(taken);
        for run in mapped.into_iter().rev() {
            let va = p.segments.at(slot).page_addr(run.start);
            unmap_settled(&mut *p.driver, va, run.len() as u64 * page_size)?;
            let mut handles = Vec::new();
            (p.segments.at_mut(slot).pages).unmap_run_in_use(run.clone(), &mut handles);
            let bytes = run.len() as u64 * page_size;
            (p.books.counters).count_mapped(p.segments.at(slot), bytes, false);
            back.extend(handles);
        }
        self.physical.pool_pages(back);
        Err(err)
    }

    /// Maps a chunk (pooled, else new) at the whole `group` of segment `slot`, none of whose pages is
    /// mapped, with access: what a failed split leaves its live pages on.
    fn remap_chunk<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        slot: usize,
        group: Range<usize>,
    ) -> Result<(), Error> {
        let bytes = group.len() as u64 * self.page_size;
        let seg = p.segments.at(slot);
        let (stream, graph) = (seg.stream, seg.graph);
        let handle = match self.physical.pop_pooled_chunk() {
            Some(handle) => handle,
            None => {
                // Room for it: the single pages created for the split are given back first.
                self.physical
                    .release_pooled(&mut *p.driver, &mut *p.books, bytes)?;
                let handle = repeated(|| p.driver.create(bytes))?;
                self.physical.add_chunk(handle);
                p.books.counters.created += group.len() as u64;
                p.books.counters.reserved.add(bytes);
                handle
            }
        };
        let va = p.segments.at(slot).page_addr(group.start);
        let mapped = repeated(|| {
            let mapped = p.driver.map(va, bytes, handle);
            if mapped.is_err() {
                undo_failed_map(&mut *p.driver, va, bytes);
            }
            mapped
        });
        if let Err(err) = mapped {
            self.physical.pool_chunk(handle);
            return Err(err.into());
        }
        p.segments
            .at_mut(slot)
            .pages
            .map_chunk(group.clone(), handle);
        p.books
            .counters
            .count_mapped(p.segments.at(slot), bytes, true);
        p.books
            .record(TraceAction::SegmentMap, va, bytes, stream, graph);
        repeated(|| p.driver.set_access(va, bytes))?;
        p.segments.at_mut(slot).pages.set_accessible(group);
        Ok(())
    }
}

/// The runs of pages of `group` of segment `slot` that live blocks touch (mapped, not idle).
fn live_runs<D>(p: &Parts<'_, D>, slot: usize, group: Range<usize>) -> Vec<Range<usize>> {
    let pages = &p.segments.at(slot).pages;
    let mut runs: Vec<Range<usize>> = Vec::new();
    for page in group {
        if pages.is_idle(page) {
            continue;
        }
        match runs.last_mut() {
            Some(run) if run.end == page => run.end += 1,
            _ => runs.push(page..page + 1),
        }
    }
    runs
}
