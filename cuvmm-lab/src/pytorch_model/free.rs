//! The free path, PyTorch's `free` and `free_block`: the block returns to its pool's cache, merged with
//! free neighbours of the same segment.

use super::Split;
use cuvmm::driver::Driver;
use cuvmm::strategy::error::Error;
use cuvmm::strategy::history::TraceAction;

impl<D: Driver> Split<D> {
    /// PyTorch's `free`: frees the live block that starts at `addr`.
    pub(super) fn free_addr(&mut self, addr: u64) -> Result<(), Error> {
        let block = match self.blocks.get(addr) {
            Some(b) if b.mapped => *b,
            _ => return Err(Error::UnknownAddress { addr }),
        };
        if !block.allocated {
            return Err(Error::DoubleFree { addr });
        }
        self.counters.allocation.sub(block.pool, 1);
        self.counters.allocated.sub(block.pool, block.size);
        if self.is_oversize(block.size) {
            self.counters.oversize_allocations.sub(1);
        }
        self.trace(
            TraceAction::FreeRequested,
            addr,
            block.requested,
            block.stream,
        );
        self.free_block(addr);
        Ok(())
    }

    /// PyTorch's `free_block`: caches the block at `addr` (already counted as no longer allocated),
    /// merging it with its free neighbours. Returns the merged block's address.
    pub(super) fn free_block(&mut self, addr: u64) -> u64 {
        let expandable = self.is_expandable_block(addr);
        let original = self.blocks.at(addr);
        self.trace(
            TraceAction::FreeCompleted,
            addr,
            original.requested,
            original.stream,
        );
        if let Some(b) = self.blocks.get_mut(addr) {
            b.allocated = false;
            b.requested = 0;
        }
        let mut net_blocks: i128 = 0;
        let mut net_size: i128 = 0;
        let mut addr = addr;
        for before in [true, false] {
            let (merged, subsumed) = self.try_merge_blocks(addr, before);
            addr = merged;
            if subsumed > 0 {
                net_blocks -= 1;
                net_size -= i128::from(subsumed);
            }
        }
        self.insert_into_blocks(addr);
        if self.blocks.is_split(addr) {
            net_blocks += 1;
            net_size += i128::from(self.blocks.at(addr).size);
        }
        let c = &mut self.counters;
        if !expandable {
            Self::adjust(&mut c.inactive_split, original.pool, net_blocks);
            Self::adjust(&mut c.inactive_split_bytes, original.pool, net_size);
        }
        c.active.sub(original.pool, original.size);
        c.requested.sub(original.pool, original.requested);
        addr
    }

    /// PyTorch's `try_merge_blocks`: merges the block at `dst` with its neighbour before it (or after it)
    /// if that neighbour is free and mapped alike, taking the neighbour out of its pool. Returns the
    /// merged block's address and the bytes subsumed (0 if nothing merged).
    pub(super) fn try_merge_blocks(&mut self, dst: u64, before: bool) -> (u64, u64) {
        let neighbour = if before {
            self.blocks.prev(dst)
        } else {
            self.blocks.next(dst)
        };
        let Some((src, src_block)) = neighbour else {
            return (dst, 0);
        };
        let mut dst_block = self.blocks.at(dst);
        if src_block.allocated || src_block.mapped != dst_block.mapped {
            return (dst, 0);
        }
        self.remove_from_pool(src);
        self.blocks.remove(src);
        dst_block.size += src_block.size;
        if before {
            self.blocks.remove(dst);
            self.blocks.insert(src, dst_block);
            (src, src_block.size)
        } else {
            self.blocks.insert(dst, dst_block);
            (dst, src_block.size)
        }
    }
}
