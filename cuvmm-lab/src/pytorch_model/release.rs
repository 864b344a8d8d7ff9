//! Giving memory back: PyTorch's `release_block`, `release_available_cached_blocks` (oversize blocks,
//! on out-of-memory), `release_cached_blocks` (every unsplit cached segment: `empty_cache`, and the last
//! resort before an out-of-memory error) and `garbage_collect_cached_blocks`.

use super::alloc::Request;
use super::block::SizeKey;
use super::{SegmentAction, Split};
use cuvmm::driver::Driver;
use cuvmm::strategy::error::Error;
use cuvmm::strategy::pool::Pool;

impl<D: Driver> Split<D> {
    /// PyTorch's `release_block`: `cudaFree`s the cached segment whose only block is at `addr`.
    pub(super) fn release_block(&mut self, addr: u64) -> Result<(), Error> {
        let block = self.blocks.at(addr);
        self.driver.free(addr)?;
        self.record(SegmentAction::SegmentFree, addr, block.size, block.stream);
        self.counters.device_free += 1;
        self.total_allocated_memory -= block.size;
        self.counters.segment.sub(block.pool, 1);
        self.counters.reserved.sub(block.pool, block.size);
        if self.is_oversize(block.size) {
            self.counters.oversize_segments.sub(1);
        }
        self.remove_from_pool(addr);
        self.blocks.remove(addr);
        self.segments.remove(&addr);
        Ok(())
    }

    /// PyTorch's `release_available_cached_blocks`: with `max_split_size` set, frees the smallest cached
    /// oversize block of the request's stream that is at least as large as the request (or
    /// `max_split_size`), else the largest oversize blocks until as much is freed. Whether enough was freed.
    pub(super) fn release_available_cached_blocks(&mut self, req: &Request) -> Result<bool, Error> {
        let Some(max_split) = self.config.max_split_size else {
            return Ok(false);
        };
        let key_size = req.size.max(max_split);
        let pool = self.pool(req.pool);
        let lower: Option<SizeKey> = pool
            .blocks
            .range((req.stream, key_size, 0)..)
            .next()
            .copied();
        if let Some(k) = lower.filter(|k| k.0 == req.stream && !self.is_expandable_block(k.2)) {
            self.release_block(k.2)?;
            return Ok(true);
        }
        // No single block is large enough: free oversize blocks from the largest down.
        let candidates: Vec<SizeKey> = pool
            .blocks
            .range(..lower.unwrap_or((req.stream, key_size, 0)))
            .rev()
            .take_while(|k| k.1 >= max_split && k.0 == req.stream)
            .copied()
            .collect();
        let mut released = 0;
        for k in candidates {
            if released >= key_size {
                break;
            }
            if !self.is_expandable_block(k.2) {
                self.release_block(k.2)?;
                released += k.1;
            }
        }
        Ok(released >= key_size)
    }

    /// PyTorch's `release_cached_blocks`: frees every cached block that is a whole segment, large pool
    /// first; in expandable segments, unmaps every whole page of every cached block and frees reservations
    /// left with nothing mapped.
    pub(super) fn release_cached_blocks(&mut self) -> Result<(), Error> {
        let _span = tracing::debug_span!("release_cached_blocks").entered();
        self.release_stranded()?;
        self.release_blocks(Pool::Large)?;
        self.release_blocks(Pool::Small)
    }

    /// PyTorch's `release_blocks` for one pool.
    fn release_blocks(&mut self, pool: Pool) -> Result<(), Error> {
        let keys: Vec<SizeKey> = self.pool(pool).blocks.iter().copied().collect();
        let mut to_unmap = Vec::new();
        for (_, _, addr) in keys {
            if self.is_expandable_block(addr) {
                to_unmap.push(addr);
            } else if !self.blocks.is_split(addr) {
                self.release_block(addr)?;
            }
        }
        for addr in to_unmap {
            if let Some(unmapped) = self.unmap_block(addr)?
                && !self.blocks.is_split(unmapped)
            {
                self.release_expandable_segment(unmapped)?;
            }
        }
        Ok(())
    }

    /// PyTorch's `garbage_collect_cached_blocks`: once the memory held exceeds
    /// `garbage_collection_threshold` x the allowed maximum, frees unsplit cached large blocks that have
    /// waited at least the average number of free-block searches, until the excess is freed or no block is
    /// old enough.
    pub(super) fn garbage_collect_cached_blocks(&mut self) -> Result<(), Error> {
        let (Some(threshold), Some(allowed)) = (
            self.config.garbage_collection_threshold,
            self.allowed_memory_maximum,
        ) else {
            return Ok(());
        };
        let gc_threshold = (threshold * allowed as f64) as u64;
        if self.total_allocated_memory <= gc_threshold {
            return Ok(());
        }
        let target = self.total_allocated_memory - gc_threshold;
        let count = self.pool(Pool::Large).get_free_blocks_call_count;
        let age = |s: &Self, addr: u64| count.saturating_sub(s.blocks.at(addr).gc_count_base);
        let freeable = |s: &Self| -> Vec<u64> {
            s.pool(Pool::Large)
                .blocks
                .iter()
                .map(|k| k.2)
                .filter(|&a| !s.blocks.is_split(a) && !s.is_expandable_block(a))
                .collect()
        };
        let blocks = freeable(self);
        let mut total_age: u64 = blocks.iter().map(|&a| age(self, a)).sum();
        let mut freeable_count = blocks.len() as u64;
        let mut reclaimed = 0;
        let mut freed_one = true;
        while reclaimed < target && freed_one && freeable_count > 0 {
            let age_threshold = total_age as f64 / freeable_count as f64;
            freed_one = false;
            for addr in freeable(self) {
                let a = age(self, addr);
                if a as f64 >= age_threshold {
                    freed_one = true;
                    reclaimed += self.blocks.at(addr).size;
                    total_age -= a;
                    freeable_count -= 1;
                    self.release_block(addr)?;
                }
            }
        }
        Ok(())
    }

    /// `trim`, which PyTorch lacks: releases cached memory as `empty_cache` does, segment by segment in the
    /// same order, until at least `bytes` were released. Returns the bytes released.
    pub(super) fn release_some(&mut self, bytes: u64) -> Result<u64, Error> {
        let start = self.total_allocated_memory;
        self.release_stranded()?;
        for pool in [Pool::Large, Pool::Small] {
            let keys: Vec<SizeKey> = self.pool(pool).blocks.iter().copied().collect();
            for (_, _, addr) in keys {
                if start - self.total_allocated_memory >= bytes {
                    return Ok(start - self.total_allocated_memory);
                }
                if self.is_expandable_block(addr) {
                    if let Some(unmapped) = self.unmap_block(addr)?
                        && !self.blocks.is_split(unmapped)
                    {
                        self.release_expandable_segment(unmapped)?;
                    }
                } else if !self.blocks.is_split(addr) {
                    self.release_block(addr)?;
                }
            }
        }
        Ok(start - self.total_allocated_memory)
    }

    /// Gives every segment back to the driver, live or not (on drop).
    pub(super) fn teardown(&mut self) -> Result<(), Error> {
        let segments: Vec<u64> = self.segments.keys().copied().collect();
        let mut first_err = None;
        for start in segments {
            let Some(segment) = self.segments.remove(&start) else {
                continue;
            };
            let result = match segment.expandable {
                None => self.driver.free(start).map_err(Error::from),
                Some(mut es) => es.teardown(&mut self.driver, segment.stream),
            };
            if let Err(e) = result {
                first_err.get_or_insert(e);
            }
        }
        self.blocks = Default::default();
        self.pools = Default::default();
        first_err.map_or(Ok(()), Err)
    }
}
