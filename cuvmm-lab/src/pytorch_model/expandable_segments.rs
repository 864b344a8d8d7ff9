//! PyTorch's expandable segments (`expandable_segments:True`): one virtual reservation of 1.125x device
//! memory per (stream, pool) and growth, mapped page by page: 2 MiB pages in the small pool, 20 MiB in
//! the large one. Each page gets its own physical handle when it is mapped and gives it back when it is
//! unmapped; handles are never reused. Pages are unmapped only on the release paths (`empty_cache`, and
//! before the retry on out-of-memory), after synchronizing the segment's stream.
//!
//! The segment's unmapped tail is a block too (`mapped: false`), kept in the pool's `unmapped` set, so
//! the best-fit and merge logic of the classic allocator applies unchanged.

mod segment;

pub(super) use segment::ExpandableSegment;

use super::alloc::Request;
use super::block::Block;
use super::rules;
use super::{SegmentAction, Split};
use cuvmm::driver::{Driver, StreamId};
use cuvmm::strategy::error::Error;
use cuvmm::strategy::pool::Pool;

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
