//! PyTorch's expandable segments (`expandable_segments:True`): one virtual reservation of 1.125x device
//! memory per (stream, pool) and growth, mapped page by page: 2 MiB pages in the small pool, 20 MiB in
//! the large one. Each page gets its own physical handle when it is mapped and gives it back when it is
//! unmapped; handles are never reused. Pages are unmapped only on the release paths (`empty_cache`, and
//! before the retry on out-of-memory), after synchronizing the segment's stream.
//!
//! The segment's unmapped tail is a block too (`mapped: false`), kept in the pool's `unmapped` set, so
//! the best-fit and merge logic of the classic allocator applies unchanged.

use super::alloc::Request;
use super::block::Block;
use super::rules;
use super::{SegmentAction, Split};
use crate::driver::{Driver, PhysHandle, StreamId, VaRange};
use crate::error::Error;
use crate::expandable::Pool;

/// The pages of one reservation (PyTorch's `ExpandableSegment`).
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    /// The reservation.
    pub va: VaRange,
    /// Bytes per page (and per handle).
    pub page: u64,
    /// The handle mapped at each page, up to the last mapped one.
    pub handles: Vec<Option<PhysHandle>>,
    /// Pages that a failed driver call left held: a handle whose release failed, or a page whose unmap
    /// failed while a failed growth was rolled back. Counted as reserved, and given back on the release
    /// paths (see [`Split::release_stranded`]).
    pub stranded: Vec<Stranded>,
}

/// A page of physical memory the allocator could not give back yet (a driver call failed), and where it
/// is still mapped, if anywhere. No block uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stranded {
    /// The page's handle.
    pub handle: PhysHandle,
    /// The address it is still mapped at, if its unmap failed.
    pub mapped_at: Option<u64>,
}

impl ExpandableSegment {
    /// Pages `begin..end` covering `offset .. offset + size`, widened to whole pages.
    fn pages_covering(&self, offset: u64, size: u64) -> (usize, usize) {
        let begin = offset / self.page;
        let end = (offset + size).div_ceil(self.page);
        (begin as usize, end as usize)
    }

    /// Physical bytes this segment holds: its mapped pages and its stranded ones.
    pub fn held_bytes(&self) -> u64 {
        (self.mapped_pages() + self.stranded.len()) as u64 * self.page
    }

    /// PyTorch's `ExpandableSegment::map`: creates one handle per page of the pages covering
    /// `offset .. offset + size` (`offset` page aligned), maps them and sets access on the whole range.
    /// Returns the bytes mapped, or 0 if the device ran out of memory. On any failure nothing stays
    /// mapped: what was created or mapped is given back (PyTorch gives back only the handles of a failed
    /// `cuMemCreate`; its other failures throw), and what cannot be is kept as stranded. Stranded pages are
    /// retried first, since one may still be mapped in the range.
    fn map<D: Driver>(&mut self, driver: &mut D, offset: u64, size: u64) -> Result<u64, Error> {
        self.retry_stranded(driver)?;
        let (begin, end) = self.pages_covering(offset, size);
        let mut created = Vec::with_capacity(end - begin);
        for _ in begin..end {
            match driver.create(self.page) {
                Ok(h) => created.push((h, None)),
                Err(e) => {
                    self.give_back(driver, created);
                    return if e.is_out_of_memory() {
                        Ok(0)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        for entry in 0..created.len() {
            let addr = self.page_addr(begin + entry);
            if let Err(e) = driver.map(addr, self.page, created[entry].0) {
                self.give_back(driver, created);
                return Err(e.into());
            }
            created[entry].1 = Some(addr);
        }
        let bytes = (end - begin) as u64 * self.page;
        if let Err(e) = driver.set_access(self.page_addr(begin), bytes) {
            self.give_back(driver, created);
            return Err(e.into());
        }
        if self.handles.len() < end {
            self.handles.resize(end, None);
        }
        for (i, (handle, _)) in (begin..end).zip(created) {
            self.handles[i] = Some(handle);
        }
        Ok(bytes)
    }

    /// Unmaps (where mapped) and releases pages that a failed growth had obtained; whatever fails is kept
    /// in [`stranded`](Self::stranded).
    fn give_back<D: Driver>(&mut self, driver: &mut D, pages: Vec<(PhysHandle, Option<u64>)>) {
        for (handle, mapped_at) in pages {
            self.stranded.push(Stranded { handle, mapped_at });
        }
        if let Err(err) = self.retry_stranded(driver) {
            tracing::warn!(%err, "pytorch model: giving back the pages of a failed growth failed; kept for later");
        }
    }

    /// Tries again to unmap and release every stranded page. Returns the first failure; the pages that
    /// failed stay stranded.
    pub fn retry_stranded<D: Driver>(&mut self, driver: &mut D) -> Result<(), Error> {
        let mut first_err = None;
        for mut s in std::mem::take(&mut self.stranded) {
            if let Some(addr) = s.mapped_at {
                if let Err(e) = driver.unmap(addr, self.page) {
                    first_err.get_or_insert(e);
                    self.stranded.push(s);
                    continue;
                }
                s.mapped_at = None;
            }
            if let Err(e) = driver.release(s.handle) {
                first_err.get_or_insert(e);
                self.stranded.push(s);
            }
        }
        first_err.map_or(Ok(()), |e| Err(e.into()))
    }

    /// PyTorch's `ExpandableSegment::unmap`: unmaps and releases the whole pages inside
    /// `offset .. offset + size`, after synchronizing `stream`. Returns the offset and size unmapped (size 0
    /// if no whole page lies inside) and the first failure. A failed unmap stops there: the range returned
    /// is then the pages before it, which were unmapped.
    fn unmap<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        offset: u64,
        size: u64,
    ) -> (u64, u64, Result<(), Error>) {
        let begin = offset.div_ceil(self.page) as usize;
        let end = ((offset + size) / self.page) as usize;
        if begin >= end {
            return (offset, 0, Ok(()));
        }
        let (done, result) = self.unmap_handles(driver, stream, begin, end);
        (
            begin as u64 * self.page,
            (done - begin) as u64 * self.page,
            result,
        )
    }

    /// PyTorch's `unmapHandles`: synchronize the stream (unmapping does not wait for it), then unmap and
    /// release each page. Returns the page up to which everything was unmapped (`begin` if the
    /// synchronization failed, `end` unless an unmap failed) and the first failure. A handle whose
    /// release fails after its unmap is kept as stranded.
    fn unmap_handles<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        begin: usize,
        end: usize,
    ) -> (usize, Result<(), Error>) {
        if let Err(e) = driver.synchronize(stream) {
            return (begin, Err(e.into()));
        }
        let mut first_err = None;
        for i in begin..end {
            let Some(handle) = self.handles.get(i).copied().flatten() else {
                continue;
            };
            if let Err(e) = driver.unmap(self.page_addr(i), self.page) {
                self.trim_handles();
                return (i, Err(e.into()));
            }
            self.handles[i] = None;
            if let Err(e) = driver.release(handle) {
                self.stranded.push(Stranded {
                    handle,
                    mapped_at: None,
                });
                first_err.get_or_insert(e);
            }
        }
        self.trim_handles();
        (end, first_err.map_or(Ok(()), |e| Err(e.into())))
    }

    fn trim_handles(&mut self) {
        while self.handles.last().is_some_and(Option::is_none) {
            self.handles.pop();
        }
    }

    fn page_addr(&self, i: usize) -> u64 {
        self.va.start + i as u64 * self.page
    }

    /// Pages mapped now.
    pub fn mapped_pages(&self) -> usize {
        self.handles.iter().flatten().count()
    }

    /// Unmaps everything, gives back stranded pages and frees the reservation (PyTorch's destructor).
    /// On failure the segment keeps what it could not give back, and the call may be repeated.
    pub fn teardown<D: Driver>(&mut self, driver: &mut D, stream: StreamId) -> Result<(), Error> {
        self.retry_stranded(driver)?;
        if self.mapped_pages() > 0 {
            let end = self.handles.len();
            self.unmap_handles(driver, stream, 0, end).1?;
        }
        driver.free_reservation(self.va)?;
        Ok(())
    }
}

impl<D: Driver> Split<D> {
    /// PyTorch's `try_allocate_expandable_block`: maps enough pages at the lowest address of a segment of
    /// the request's (stream, pool) with room for it, and returns the free mapped block of at least
    /// `req.size` bytes made there (taken out of the pool); `None` if the device ran out of memory.
    pub(super) fn try_allocate_expandable_block(
        &mut self,
        req: &Request,
    ) -> Result<Option<u64>, Error> {
        let mut candidate = self.find_expandable_block(req)?;
        let block = self.blocks.at(candidate);
        if !block.mapped {
            match self.map_block(candidate, block.size.min(req.size))? {
                Some(addr) => candidate = addr,
                None => return Ok(None),
            }
        }
        while self.blocks.at(candidate).size < req.size {
            let remaining = req.size - self.blocks.at(candidate).size;
            let Some((next, next_block)) = self.blocks.next(candidate) else {
                return Ok(None);
            };
            match self.map_block(next, remaining.min(next_block.size))? {
                Some(addr) => candidate = addr,
                None => return Ok(None),
            }
        }
        let b = self.blocks.at(candidate);
        self.pool_mut(b.pool)
            .blocks
            .remove(&(b.stream, b.size, candidate));
        Ok(Some(candidate))
    }

    /// PyTorch's `find_expandable_block`: the lowest-addressed run of free (mapped or unmapped) blocks of
    /// the request's stream that starts at or just before an unmapped block and spans `req.size` bytes; a
    /// new segment if none does.
    fn find_expandable_block(&mut self, req: &Request) -> Result<u64, Error> {
        let starts: Vec<u64> = self
            .pool(req.pool)
            .unmapped
            .range((req.stream, 0)..)
            .take_while(|k| k.0 == req.stream)
            .map(|k| k.1)
            .collect();
        for start in starts {
            let mut c = start;
            if let Some((prev, p)) = self.blocks.prev(c)
                && !p.allocated
            {
                c = prev;
            }
            let mut bytes = 0;
            let mut b = Some((c, self.blocks.at(c)));
            while bytes < req.size {
                match b {
                    Some((addr, block)) if !block.allocated => {
                        bytes += block.size;
                        b = self.blocks.next(addr);
                    }
                    _ => break,
                }
            }
            if bytes >= req.size {
                return Ok(c);
            }
        }
        self.new_expandable_segment(req.stream, req.pool)
    }

    /// Reserves a segment of 1.125x device memory for (`stream`, `pool`), all of it one unmapped block.
    fn new_expandable_segment(&mut self, stream: StreamId, pool: Pool) -> Result<u64, Error> {
        let page = match pool {
            Pool::Small => rules::SMALL_BUFFER,
            Pool::Large => rules::LARGE_BUFFER,
        };
        let max_handles = (self.device_total + self.device_total / 8).div_ceil(page);
        let va = self.driver.reserve(max_handles * page)?;
        self.segments.insert(
            va.start,
            super::Segment {
                size: va.size,
                stream,
                pool,
                expandable: Some(ExpandableSegment {
                    va,
                    page,
                    handles: Vec::new(),
                    stranded: Vec::new(),
                }),
            },
        );
        self.blocks.insert(
            va.start,
            Block {
                size: va.size,
                requested: 0,
                allocated: false,
                stream,
                pool,
                segment: va.start,
                mapped: false,
                gc_count_base: 0,
            },
        );
        self.pool_mut(pool).unmapped.insert((stream, va.start));
        Ok(va.start)
    }

    /// PyTorch's `map_block`: maps the pages under the first `size` bytes of the unmapped block at `addr`,
    /// makes them a free mapped block (merged with free mapped neighbours) and caches it. Returns the
    /// cached block's address, or `None` if the device ran out of memory.
    fn map_block(&mut self, addr: u64, size: u64) -> Result<Option<u64>, Error> {
        let block = self.blocks.at(addr);
        let segment = self
            .segments
            .get_mut(&block.segment)
            .expect("block's segment exists");
        let es = segment.expandable.as_mut().expect("an expandable segment");
        let held = es.held_bytes();
        let result = es.map(&mut self.driver, addr - block.segment, size);
        let held_delta = i128::from(es.held_bytes()) - i128::from(held);
        self.adjust_held(block.pool, held_delta);
        let mapped = result?;
        if mapped == 0 {
            return Ok(None);
        }
        let pool = block.pool;
        self.pool_mut(pool).unmapped.remove(&(block.stream, addr));
        let mut to_map = block;
        to_map.mapped = true;
        if mapped < block.size {
            let remaining = Block {
                size: block.size - mapped,
                mapped: false,
                ..block
            };
            self.blocks.insert(addr + mapped, remaining);
            self.pool_mut(pool)
                .unmapped
                .insert((block.stream, addr + mapped));
            to_map.size = mapped;
        }
        self.blocks.insert(addr, to_map);
        let (merged, _) = self.try_merge_blocks(addr, true);
        let (merged, _) = self.try_merge_blocks(merged, false);
        self.insert_into_blocks(merged);
        self.counters.device_alloc += 1;
        self.record(SegmentAction::SegmentMap, addr, mapped, block.stream);
        Ok(Some(merged))
    }

    /// PyTorch's `unmap_block`: unmaps the whole pages inside the cached block at `addr`; the pieces
    /// before and after them stay cached. Returns the address of the unmapped block (merged with unmapped
    /// neighbours), or `None` if no whole page was inside. If a driver call fails part way, the pages
    /// unmapped before it are booked as unmapped all the same, and the failure is returned.
    pub(super) fn unmap_block(&mut self, addr: u64) -> Result<Option<u64>, Error> {
        let block = self.blocks.at(addr);
        let segment = self
            .segments
            .get_mut(&block.segment)
            .expect("block's segment exists");
        let stream = segment.stream;
        let es = segment.expandable.as_mut().expect("an expandable segment");
        let held = es.held_bytes();
        let (offset, size, result) =
            es.unmap(&mut self.driver, stream, addr - block.segment, block.size);
        let held_delta = i128::from(es.held_bytes()) - i128::from(held);
        self.adjust_held(block.pool, held_delta);
        if size == 0 {
            return result.map(|()| None);
        }
        self.counters.synchronizations += 1;
        let start = block.segment + offset;
        self.remove_from_pool(addr);
        self.blocks.remove(addr);
        let before = start - addr;
        if before > 0 {
            self.blocks.insert(
                addr,
                Block {
                    size: before,
                    ..block
                },
            );
            self.insert_into_blocks(addr);
        }
        let after = block.size - before - size;
        if after > 0 {
            self.blocks.insert(
                start + size,
                Block {
                    size: after,
                    ..block
                },
            );
            self.insert_into_blocks(start + size);
        }
        self.blocks.insert(
            start,
            Block {
                size,
                mapped: false,
                ..block
            },
        );
        let (merged, _) = self.try_merge_blocks(start, true);
        let (merged, _) = self.try_merge_blocks(merged, false);
        self.pool_mut(block.pool)
            .unmapped
            .insert((block.stream, merged));
        self.counters.device_free += 1;
        self.record(SegmentAction::SegmentUnmap, start, size, block.stream);
        result.map(|()| Some(merged))
    }

    /// PyTorch's `release_expandable_segment`: frees the reservation whose only block, unmapped, is at
    /// `addr`. If that fails, the segment stays as it was (a later `empty_cache` tries again).
    pub(super) fn release_expandable_segment(&mut self, addr: u64) -> Result<(), Error> {
        let block = self.blocks.at(addr);
        if block.mapped {
            return Ok(());
        }
        let Some(segment) = self.segments.get_mut(&block.segment) else {
            return Ok(());
        };
        let stream = segment.stream;
        if let Some(es) = segment.expandable.as_mut() {
            let held = es.held_bytes();
            let result = es.teardown(&mut self.driver, stream);
            let held_delta = i128::from(es.held_bytes()) - i128::from(held);
            self.adjust_held(block.pool, held_delta);
            result?;
        }
        self.remove_from_pool(addr);
        self.blocks.remove(addr);
        self.segments.remove(&block.segment);
        Ok(())
    }

    /// Tries again to give back every stranded page (see [`ExpandableSegment::stranded`]); returns the
    /// first failure. Called on the release paths, where the cache goes back to the driver.
    pub(super) fn release_stranded(&mut self) -> Result<(), Error> {
        let starts: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, s)| {
                s.expandable
                    .as_ref()
                    .is_some_and(|es| !es.stranded.is_empty())
            })
            .map(|(&start, _)| start)
            .collect();
        let mut first_err = None;
        for start in starts {
            let Some(segment) = self.segments.get_mut(&start) else {
                continue;
            };
            let pool = segment.pool;
            let Some(es) = segment.expandable.as_mut() else {
                continue;
            };
            let held = es.held_bytes();
            let result = es.retry_stranded(&mut self.driver);
            let held_delta = i128::from(es.held_bytes()) - i128::from(held);
            self.adjust_held(pool, held_delta);
            if let Err(e) = result {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Frees every reservation that has nothing mapped (one unmapped block covers it). PyTorch keeps such
    /// a reservation until the allocator is destroyed when its first mapping ran out of memory, or when
    /// freeing it failed; `empty_cache` here gives it back.
    pub(super) fn release_unmapped_segments(&mut self) -> Result<(), Error> {
        let empty: Vec<u64> = self
            .segments
            .iter()
            .filter(|&(&start, s)| {
                s.expandable.is_some()
                    && self
                        .blocks
                        .get(start)
                        .is_some_and(|b| !b.mapped && b.size == s.size)
            })
            .map(|(&start, _)| start)
            .collect();
        for start in empty {
            self.release_expandable_segment(start)?;
        }
        Ok(())
    }

    /// Adds `delta` (which may be negative) to the memory held from the device: PyTorch's
    /// `total_allocated_memory` and the reserved statistic of `pool`.
    fn adjust_held(&mut self, pool: Pool, delta: i128) {
        let total = i128::from(self.total_allocated_memory) + delta;
        self.total_allocated_memory = u64::try_from(total).unwrap_or(0);
        Self::adjust(&mut self.counters.reserved, pool, delta);
    }
}
