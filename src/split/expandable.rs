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
}

impl ExpandableSegment {
    /// Pages `begin..end` covering `offset .. offset + size`, widened to whole pages.
    fn pages_covering(&self, offset: u64, size: u64) -> (usize, usize) {
        let begin = offset / self.page;
        let end = (offset + size).div_ceil(self.page);
        (begin as usize, end as usize)
    }

    /// PyTorch's `ExpandableSegment::map`: creates one handle per page of the pages covering
    /// `offset .. offset + size` (`offset` page aligned), maps them and sets access on the whole range.
    /// Returns the bytes mapped, or 0 if the device ran out of memory (nothing is kept then).
    fn map<D: Driver>(&mut self, driver: &mut D, offset: u64, size: u64) -> Result<u64, Error> {
        let (begin, end) = self.pages_covering(offset, size);
        if self.handles.len() < end {
            self.handles.resize(end, None);
        }
        for i in begin..end {
            match driver.create(self.page) {
                Ok(h) => self.handles[i] = Some(h),
                Err(e) => {
                    for j in begin..i {
                        if let Some(h) = self.handles[j].take() {
                            driver.release(h)?;
                        }
                    }
                    self.trim_handles();
                    return if e.is_out_of_memory() {
                        Ok(0)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        for i in begin..end {
            let handle = self.handles[i].expect("handle created above");
            driver.map(self.page_addr(i), self.page, handle)?;
        }
        let bytes = (end - begin) as u64 * self.page;
        driver.set_access(self.page_addr(begin), bytes)?;
        Ok(bytes)
    }

    /// PyTorch's `ExpandableSegment::unmap`: unmaps and releases the whole pages inside
    /// `offset .. offset + size`, after synchronizing `stream`. Returns the offset and size unmapped (size 0
    /// if no whole page lies inside).
    fn unmap<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        offset: u64,
        size: u64,
    ) -> Result<(u64, u64), Error> {
        let begin = offset.div_ceil(self.page) as usize;
        let end = ((offset + size) / self.page) as usize;
        if begin >= end {
            return Ok((offset, 0));
        }
        self.unmap_handles(driver, stream, begin, end)?;
        Ok((begin as u64 * self.page, (end - begin) as u64 * self.page))
    }

    /// PyTorch's `unmapHandles`: synchronize the stream (unmapping does not wait for it), then unmap and
    /// release each page.
    fn unmap_handles<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        begin: usize,
        end: usize,
    ) -> Result<(), Error> {
        driver.synchronize(stream)?;
        for i in begin..end {
            if let Some(h) = self.handles.get_mut(i).and_then(Option::take) {
                driver.unmap(self.page_addr(i), self.page)?;
                driver.release(h)?;
            }
        }
        self.trim_handles();
        Ok(())
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

    /// Unmaps everything and frees the reservation (PyTorch's destructor).
    pub fn teardown<D: Driver>(mut self, driver: &mut D, stream: StreamId) -> Result<(), Error> {
        if self.mapped_pages() > 0 {
            let end = self.handles.len();
            self.unmap_handles(driver, stream, 0, end)?;
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
        let mapped = es.map(&mut self.driver, addr - block.segment, size)?;
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
        self.total_allocated_memory += mapped;
        self.counters.reserved.add(pool, mapped);
        self.counters.device_alloc += 1;
        self.record(SegmentAction::SegmentMap, addr, mapped, block.stream);
        Ok(Some(merged))
    }

    /// PyTorch's `unmap_block`: unmaps the whole pages inside the cached block at `addr`; the pieces
    /// before and after them stay cached. Returns the address of the unmapped block (merged with unmapped
    /// neighbours), or `None` if no whole page was inside.
    pub(super) fn unmap_block(&mut self, addr: u64) -> Result<Option<u64>, Error> {
        let block = self.blocks.at(addr);
        let segment = self
            .segments
            .get_mut(&block.segment)
            .expect("block's segment exists");
        let stream = segment.stream;
        let es = segment.expandable.as_mut().expect("an expandable segment");
        let (offset, size) =
            es.unmap(&mut self.driver, stream, addr - block.segment, block.size)?;
        if size == 0 {
            return Ok(None);
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
        self.total_allocated_memory -= size;
        self.counters.reserved.sub(block.pool, size);
        self.counters.device_free += 1;
        self.record(SegmentAction::SegmentUnmap, start, size, block.stream);
        Ok(Some(merged))
    }

    /// PyTorch's `release_expandable_segment`: frees the reservation whose only block, unmapped, is at
    /// `addr`.
    pub(super) fn release_expandable_segment(&mut self, addr: u64) -> Result<(), Error> {
        let block = self.blocks.at(addr);
        if block.mapped {
            return Ok(());
        }
        self.remove_from_pool(addr);
        self.blocks.remove(addr);
        if let Some(segment) = self.segments.remove(&block.segment)
            && let Some(es) = segment.expandable
        {
            es.teardown(&mut self.driver, segment.stream)?;
        }
        Ok(())
    }
}
