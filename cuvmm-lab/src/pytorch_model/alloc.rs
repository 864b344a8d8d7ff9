//! The allocation path, PyTorch's `DeviceCachingAllocator::malloc`: round, look for a cached block,
//! else grow (after garbage collection), else release cached memory and retry, then carve the block.

use super::block::Block;
use super::rules;
use super::{NO_POOL, SegmentAction, Split};
use cuvmm::driver::{Driver, StreamId};
use cuvmm::strategy::Strategy;
use cuvmm::strategy::error::{Error, OutOfMemory, ReclaimStep};
use cuvmm::strategy::history::TraceAction;
use cuvmm::strategy::pool::Pool;

/// One request, as PyTorch's `AllocParams` carries it.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    /// Rounded size.
    pub size: u64,
    pub stream: StreamId,
    pub pool: Pool,
    /// Size of the segment to `cudaMalloc` if no cached block fits.
    pub alloc_size: u64,
}

impl<D: Driver> Split<D> {
    /// PyTorch's `malloc`: the address of a block of at least `orig_size` bytes for `stream`.
    pub(super) fn malloc(&mut self, orig_size: u64, stream: StreamId) -> Result<u64, Error> {
        if orig_size == 0 {
            return Err(Error::ZeroSize);
        }
        let Some(size) = rules::round_size(orig_size, &self.config.roundup_power2_divisions)
            .filter(|&s| s <= self.device_total)
        else {
            return Err(self.too_large(orig_size, stream)?);
        };
        let Some(alloc_size) = rules::allocation_size(size) else {
            return Err(self.too_large(orig_size, stream)?);
        };
        let req = Request {
            size,
            stream,
            pool: rules::pool_for(size),
            alloc_size,
        };
        let block = match self.get_free_block(&req) {
            Some(addr) => addr,
            None => {
                let marks = (self.counters.reserved.all.freed, self.counters.retries);
                match self.grow(&req)? {
                    Some(addr) => addr,
                    None => {
                        self.counters.ooms += 1;
                        let oom = self.out_of_memory(orig_size, &req, marks);
                        (self.events).record_oom(req.size, oom.stream, NO_POOL, oom.device_free);
                        tracing::info!(
                            allocator = self.name(),
                            requested = orig_size,
                            stream = stream.0,
                            allocated = oom.allocated,
                            reserved = oom.reserved,
                            "out of memory"
                        );
                        return Err(Error::OutOfMemory(Box::new(oom)));
                    }
                }
            }
        };
        let split = rules::should_split(
            req.pool,
            self.expandable,
            self.blocks.at(block).size,
            size,
            self.max_split_size(),
        );
        Ok(self.alloc_found_block(block, &req, orig_size, split))
    }

    /// The growth path of `malloc`: garbage collection, `alloc_block`, then releasing oversize cached
    /// blocks and retrying, then releasing every cached block and retrying once more (the retry PyTorch
    /// counts in `num_alloc_retries`).
    fn grow(&mut self, req: &Request) -> Result<Option<u64>, Error> {
        if self.gc_enabled() {
            self.garbage_collect_cached_blocks()?;
        }
        if let Some(addr) = self.alloc_block(req, false)? {
            return Ok(Some(addr));
        }
        let _span =
            tracing::debug_span!("grow", size = req.size, alloc_size = req.alloc_size).entered();
        if self.release_available_cached_blocks(req)?
            && let Some(addr) = self.alloc_block(req, false)?
        {
            return Ok(Some(addr));
        }
        tracing::info!(
            size = req.size,
            stream = req.stream.0,
            "device allocation failed; releasing cached blocks and retrying once"
        );
        self.release_cached_blocks()?;
        self.alloc_block(req, true)
    }

    /// PyTorch's `get_free_block`: the best fit among the pool's cached blocks of the request's stream
    /// (smallest size, then lowest address), taken out of the pool; `None` if there is none or the
    /// oversize rules refuse it.
    pub(super) fn get_free_block(&mut self, req: &Request) -> Option<u64> {
        let gc = self.gc_enabled();
        let pool = self.pool_mut(req.pool);
        if gc {
            pool.get_free_blocks_call_count += 1;
        }
        let mut range = pool.blocks.range((req.stream, req.size, 0)..);
        let mut key = *range.next()?;
        if key.0 != req.stream {
            return None;
        }
        if self.expandable && self.is_expandable_block(key.2) {
            // Best fit counts the unmapped space right after a block as part of it.
            let expandable_size = |s: &Self, addr: u64| {
                let b = s.blocks.at(addr);
                b.size
                    + s.blocks
                        .next(addr)
                        .filter(|(_, n)| !n.mapped)
                        .map_or(0, |(_, n)| n.size)
            };
            let keys: Vec<_> = self
                .pool(req.pool)
                .blocks
                .range((key.0, key.1, key.2 + 1)..)
                .take_while(|k| k.0 == req.stream)
                .copied()
                .collect();
            for next in keys {
                if !self.is_expandable_block(key.2)
                    || expandable_size(self, next.2) >= expandable_size(self, key.2)
                {
                    break;
                }
                key = next;
            }
        }
        if !rules::oversize_allows(
            req.size,
            key.1,
            self.max_split_size(),
            self.config.max_non_split_rounding,
        ) {
            return None;
        }
        self.pool_mut(req.pool).blocks.remove(&key);
        Some(key.2)
    }

    /// PyTorch's `alloc_block`: a new segment (or newly mapped pages) for the request; `None` when the
    /// device, or the memory fraction, has no room.
    fn alloc_block(&mut self, req: &Request, is_retry: bool) -> Result<Option<u64>, Error> {
        if is_retry {
            self.counters.retries += 1;
        }
        if let Some(max) = self.allowed_memory_maximum
            && self.total_allocated_memory.saturating_add(req.alloc_size) > max
        {
            return Ok(None);
        }
        if self.expandable {
            return self.try_allocate_expandable_block(req);
        }
        let ptr = match self.driver.malloc(req.alloc_size) {
            Ok(ptr) => ptr,
            Err(e) if e.is_out_of_memory() => return Ok(None),
            Err(e) => return Err(e.into()),
        };
        self.add_malloc_segment(ptr, req.alloc_size, req.stream, req.pool);
        self.record(SegmentAction::SegmentAlloc, ptr, req.alloc_size, req.stream);
        Ok(Some(ptr))
    }

    /// Books a `cudaMalloc`'d segment: one block covering it, not yet cached.
    pub(super) fn add_malloc_segment(&mut self, ptr: u64, size: u64, stream: StreamId, pool: Pool) {
        self.segments.insert(
            ptr,
            super::Segment {
                size,
                stream,
                pool,
                expandable: None,
            },
        );
        self.blocks.insert(
            ptr,
            Block {
                size,
                requested: 0,
                allocated: false,
                stream,
                pool,
                segment: ptr,
                mapped: true,
                gc_count_base: 0,
            },
        );
        self.total_allocated_memory += size;
        self.counters.segment.add(pool, 1);
        self.counters.reserved.add(pool, size);
        self.counters.device_alloc += 1;
        if self.is_oversize(size) {
            self.counters.oversize_segments.add(1);
        }
    }

    /// PyTorch's `alloc_found_block`: marks the block at `addr` allocated, first splitting off the
    /// remainder beyond `req.size` into a cached block if `split`. Returns the block's address.
    fn alloc_found_block(&mut self, addr: u64, req: &Request, orig_size: u64, split: bool) -> u64 {
        let already_split = self.blocks.is_split(addr);
        let expandable = self.is_expandable_block(addr);
        let mut block = self.blocks.at(addr);
        if split {
            let remaining = Block {
                size: block.size - req.size,
                ..block
            };
            self.blocks.insert(addr + req.size, remaining);
            self.insert_into_blocks(addr + req.size);
            block.size = req.size;
            if !expandable {
                let c = &mut self.counters;
                if already_split {
                    c.inactive_split_bytes.sub(block.pool, req.size);
                } else {
                    c.inactive_split_bytes.add(block.pool, remaining.size);
                    c.inactive_split.add(block.pool, 1);
                }
            }
        } else if already_split && !expandable {
            self.counters
                .inactive_split_bytes
                .sub(block.pool, block.size);
            self.counters.inactive_split.sub(block.pool, 1);
        }
        block.allocated = true;
        block.requested = orig_size;
        block.stream = req.stream;
        self.blocks.insert(addr, block);
        let c = &mut self.counters;
        c.allocation.add(block.pool, 1);
        c.allocated.add(block.pool, block.size);
        c.active.add(block.pool, block.size);
        c.requested.add(block.pool, orig_size);
        if self.is_oversize(block.size) {
            self.counters.oversize_allocations.add(1);
        }
        self.trace(TraceAction::Alloc, addr, orig_size, block.stream);
        addr
    }

    /// A request no device holds. PyTorch tries it like any other: `cudaMalloc` fails, so it releases every
    /// cached block, retries once, then counts and records the out-of-memory. The error says it never fits.
    fn too_large(&mut self, requested: u64, stream: StreamId) -> Result<Error, Error> {
        self.release_cached_blocks()?;
        self.counters.retries += 1;
        self.counters.ooms += 1;
        let device_free = self.driver.mem_info().map_or(0, |m| m.free);
        (self.events).record_oom(requested, stream, NO_POOL, device_free);
        Ok(Error::TooLarge {
            requested,
            capacity: self.device_total,
        })
    }

    /// The error for a request that failed even after releasing the cache and retrying, with the reclaim
    /// steps run since `marks` (bytes of reserved memory freed, retries) were read.
    fn out_of_memory(&mut self, requested: u64, req: &Request, marks: (u64, u64)) -> OutOfMemory {
        let device_free = self.driver.mem_info().map_or(0, |m| m.free);
        let c = &self.counters;
        let mut reclaim = Vec::new();
        if self.gc_enabled() {
            reclaim.push(ReclaimStep::GarbageCollection);
        }
        if c.reserved.all.freed > marks.0 {
            reclaim.push(ReclaimStep::ReleaseCache {
                bytes: c.reserved.all.freed - marks.0,
            });
        }
        if c.retries > marks.1 {
            reclaim.push(ReclaimStep::Retry);
        }
        OutOfMemory {
            allocator: self.name(),
            device: self.driver.ordinal(),
            requested,
            alloc_size: req.alloc_size,
            stream: req.stream,
            device_total: self.device_total,
            device_free,
            allowed: self.allowed_memory_maximum,
            margin: 0,
            allocated: c.allocated.current(),
            reserved: c.reserved.current(),
            idle: c.reserved.current().saturating_sub(c.allocated.current()),
            idle_handles: 0,
            stranded: 0,
            stranded_remedy: None,
            largest_free_block: self.largest_cached_block(),
            retried: true,
            graph_pool_bytes: 0,
            capturing: false,
            asleep: Vec::new(),
            reclaim,
        }
    }
}
