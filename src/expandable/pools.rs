//! What PyTorch's `MemPool` and cudagraph trees ask of a private pool beyond capturing into it
//! (`graphs.rs`): how many users it has, its free memory serving an allocation that would otherwise run
//! out (`use_on_oom`), its live blocks as a checkpoint keeps them and the pool put back to a checkpoint,
//! and one pool's cached memory given back (`emptyCache(pool)`). A pool that splits no page (`no_split`)
//! is a rounding of the request in `request.rs`; the out-of-memory fallback to a pool is `carve.rs`.
//!
//! A live pool's pages stay mapped where they are (`graphs.rs`), so putting it back to a checkpoint maps
//! nothing: its blocks allocated since are freed, and the blocks live at the checkpoint are carved again at
//! their addresses (`carve.rs`), in the free memory the pool kept.

use super::settle::free_reservation_settled;
use super::{Expandable, ROUND};
use crate::base::size::round_up;
use crate::driver::Driver;
use crate::strategy::error::Error;
use crate::strategy::graph_pool::{GraphPool, PoolBlock};
use crate::strategy::stats::StatArray;

impl<D: Driver> Expandable<D> {
    /// How many users `pool` has: begins and increfs not yet released; 0 for a pool that is not live
    /// (PyTorch's `MemPool.use_count()`).
    pub fn pool_use_count(&self, pool: GraphPool) -> usize {
        self.graphs.use_count(pool)
    }

    /// The reserved bytes of each private pool that ever had memory mapped (PyTorch's
    /// `reserved_bytes_by_private_pools`): its segments' mapped pages, with their peak and totals, per
    /// small and large pool. A pool whose memory is gone stays listed, at 0, until both
    /// `reset_peak_stats` and `reset_accumulated_stats` have cleared its peak and totals.
    pub fn reserved_by_private_pool(&self) -> Vec<(GraphPool, StatArray)> {
        (self.books.counters.mapped_by_graph.iter())
            .map(|(&pool, &array)| (pool, array))
            .collect()
    }

    /// Says whether `pool`'s free memory may serve an allocation outside every pool that would otherwise
    /// run out of memory (PyTorch's `MemPool(use_on_oom=True)`): the block is carved in the pool's memory,
    /// on the request's stream, and is the pool's once freed. Only while the pool is live.
    pub fn set_pool_use_on_oom(&mut self, pool: GraphPool, on: bool) {
        self.graphs.set_use_on_oom(pool, on);
    }

    /// From now on, each allocation in `pool` takes whole pages, so that no two share a page (PyTorch's
    /// `MemPool(no_split=True)`: no block of the pool is split between two allocations).
    pub fn set_pool_no_split(&mut self, pool: GraphPool) {
        self.graphs.set_no_split(pool);
    }

    /// The live blocks of `pool`'s segments, in address order of each segment (a checkpoint of the pool).
    pub fn pool_blocks(&self, pool: GraphPool) -> Vec<PoolBlock> {
        let mut blocks = Vec::new();
        for seg in self.segments.live().filter(|seg| seg.graph == Some(pool)) {
            for (addr, block) in seg.blocks() {
                if let super::blocks::BlockState::Live { requested } = block.state {
                    blocks.push(PoolBlock {
                        addr,
                        size: block.size,
                        requested,
                    });
                }
            }
        }
        blocks
    }

    /// Puts the live `pool` back as `checkpoint` (from [`pool_blocks`](Self::pool_blocks)) found it: its
    /// live blocks not in the checkpoint are freed, and the checkpoint's blocks not live are carved again at
    /// their addresses. Returns the addresses of every block live in the pool when called (PyTorch's
    /// `setCheckpointPoolState` reports them all freed, and the checkpoint's all allocated).
    ///
    /// # Errors
    /// [`Error::GraphPool`] for a pool that is not live, a checkpoint block outside the pool's segments or
    /// over memory still in use, memory of the pool asleep (a tag), or a live block of the pool still used on
    /// another stream (`record_stream`); nothing is changed then: every refusal is found before a block is
    /// freed (PyTorch still holds the live blocks, and frees them itself if the restore fails). A driver
    /// failure mapping a page the pool lost (its pages stay mapped while it is live, so none is expected).
    pub fn restore_pool(
        &mut self,
        pool: GraphPool,
        checkpoint: &[PoolBlock],
    ) -> Result<Vec<u64>, Error> {
        let refuse = |problem| Error::GraphPool {
            operation: "restore_pool",
            pool,
            problem,
        };
        if !self.graphs.pool_is_live(pool) {
            return Err(refuse("the pool is not live"));
        }
        let slot_of = |this: &Self, addr: u64| {
            (this.segments.slot_of(addr)).filter(|&slot| this.segments.at(slot).graph == Some(pool))
        };
        if checkpoint.iter().any(|b| slot_of(self, b.addr).is_none()) {
            return Err(refuse(
                "a block of the checkpoint lies outside the pool's segments",
            ));
        }
        let now = self.pool_blocks(pool);
        let kept = |b: &PoolBlock| {
            checkpoint
                .iter()
                .any(|c| c.addr == b.addr && c.size == b.size)
        };
        let to_free: Vec<u64> = now.iter().filter(|b| !kept(b)).map(|b| b.addr).collect();
        if to_free.iter().any(|&addr| self.waits.used_elsewhere(addr)) {
            return Err(refuse(
                "a block of the pool is still used on another stream (record_stream)",
            ));
        }
        let asleep = |this: &Self, addr: u64| {
            slot_of(this, addr).is_some_and(|slot| this.tags.sleeps(this.segments.at(slot).tag))
        };
        let checkpoint_addrs = checkpoint.iter().map(|b| b.addr);
        if (to_free.iter().copied().chain(checkpoint_addrs)).any(|addr| asleep(self, addr)) {
            return Err(refuse("the pool's memory is asleep (its tag sleeps)"));
        }
        // A block of the checkpoint to carve again must lie on memory that is free, or that the blocks
        // about to be freed give back: anything else (a block freed but still waited for, one allocated
        // since on another key) refuses before a block is freed.
        let overlaps_in_use = |this: &Self, block: &PoolBlock| {
            let end = block.addr.saturating_add(block.size);
            slot_of(this, block.addr).is_none_or(|slot| {
                let seg = this.segments.at(slot);
                end > seg.va.end()
                    || (seg.blocks_overlapping(block.addr, end))
                        .any(|(start, b)| b.is_occupied() && !to_free.contains(&start))
            })
        };
        if checkpoint
            .iter()
            .filter(|c| !now.iter().any(|b| b.addr == c.addr && b.size == c.size))
            .any(|c| overlaps_in_use(self, c))
        {
            return Err(refuse(
                "a block of the checkpoint overlaps memory in use since",
            ));
        }
        for &addr in &to_free {
            self.free_block(addr)?;
        }
        for block in checkpoint {
            if now
                .iter()
                .any(|b| b.addr == block.addr && b.size == block.size)
            {
                continue;
            }
            let slot = slot_of(self, block.addr).ok_or(refuse("the pool's segment is gone"))?;
            if !self.is_free(slot, block.addr, block.size) {
                return Err(refuse(
                    "a block of the checkpoint overlaps memory in use since",
                ));
            }
            let stream = self.segments.at(slot).stream;
            self.place(slot, block.addr, block.size, block.requested, stream)?;
        }
        Ok(now.iter().map(|b| b.addr).collect())
    }

    /// Allocates `size` bytes at `addr` (512-byte aligned), which must lie in the free memory of one
    /// segment (PyTorch's `allocateWithAddress`): carved there, on the segment's stream and in its pool,
    /// with its pages backed.
    ///
    /// # Errors
    /// [`Error::ZeroSize`]; [`Error::UnknownAddress`] for an address outside the free memory of every
    /// segment (or unaligned, or a sleeping tag's); out of memory backing its pages.
    pub fn alloc_at(&mut self, addr: u64, size: u64) -> Result<u64, Error> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let rounded = round_up(size, ROUND).ok_or(Error::TooLarge {
            requested: size,
            capacity: self.device_total,
        })?;
        let slot = (self.segments.slot_of(addr))
            .filter(|&slot| addr % ROUND == 0 && self.is_free(slot, addr, rounded))
            .filter(|&slot| !self.tags.sleeps(self.segments.at(slot).tag))
            .ok_or(Error::UnknownAddress { addr })?;
        let stream = self.segments.at(slot).stream;
        self.place(slot, addr, rounded, size, stream)?;
        Ok(addr)
    }

    /// Gives back the cached memory of `pool`, once released (PyTorch's `emptyCache(pool)`, which a
    /// `MemPool` calls when deleted): the idle pages of its segments and its empty segments. A live pool
    /// keeps its memory. Waits for the device once if there is something to unmap. Returns the bytes
    /// released to the driver.
    ///
    /// # Errors
    /// [`Error::CaptureUnderway`] while a pool is being allocated to and this device holds memory of `pool`
    /// to give back (a `MemPool` deleted on one device while another captures is no error); a driver
    /// failure.
    pub fn empty_pool_cache(&mut self, pool: GraphPool) -> Result<u64, Error> {
        if self.graphs.pool_is_live(pool) || !self.segments.any_of_graph(pool) {
            return Ok(0);
        }
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        self.poll_events()?;
        let slots: Vec<usize> = (self.segments.slotted())
            .filter(|(_, seg)| seg.graph == Some(pool))
            .map(|(slot, _)| slot)
            .collect();
        let (supply, mut parts) = self.supply_and_parts();
        let released = supply.release_idle_of(&mut parts, &slots)?;
        for slot in slots {
            let seg = self.segments.at(slot);
            // A sleeping tag's segment stays reserved, as in `free_empty_segments`.
            if seg.occupied_count() > 0 || seg.pages.mapped_count() > 0 || self.tags.sleeps(seg.tag)
            {
                continue;
            }
            let (va, class) = (seg.va, seg.pool);
            free_reservation_settled(&mut self.driver, va)?;
            self.segments.take_out(slot);
            self.books.counters.segment.sub(class, 1);
        }
        if !self.segments.any_of_graph(pool) {
            self.graphs.forget_released(pool);
        }
        Ok(released)
    }
}
