//! What PyTorch's `MemPool` and cudagraph trees ask of a private pool beyond capturing into it
//! (`graphs.rs`): how many users it has, its free memory serving an allocation that would otherwise run
//! out (`use_on_oom`), its live blocks as a checkpoint keeps them and the pool put back to a checkpoint,
//! and one pool's cached memory given back (`emptyCache(pool)`). A pool that splits no page (`no_split`)
//! is a rounding of the request in `alloc.rs`.
//!
//! A live pool's pages stay mapped where they are (`graphs.rs`), so putting it back to a checkpoint maps
//! nothing: its blocks allocated since are freed, and the blocks live at the checkpoint are carved again at
//! their addresses, in the free memory the pool kept.

use super::Expandable;
use super::accounting::SlotCounts;
use super::reclaim::{Compacting, Wait};
use super::settle::free_reservation_settled;
use crate::base::size::round_up;
use crate::driver::{Driver, StreamId};
use crate::strategy::error::Error;
use crate::strategy::graph_pool::{GraphPool, PoolBlock};
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;

/// How many of a segment's best-fitting free blocks the fallback of a pool compares.
const FIT_CANDIDATES: usize = 8;

impl<D: Driver> Expandable<D> {
    /// How many users `pool` has: begins and increfs not yet released; 0 for a pool that is not live
    /// (PyTorch's `MemPool.use_count()`).
    pub fn pool_use_count(&self, pool: GraphPool) -> usize {
        self.graphs.use_count(pool)
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
                if let super::blocks::BlockState::Live { requested } = block.state
                    && !self.graphs.is_deferred(addr)
                {
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
    /// over memory still in use, or a live block of the pool still used on another stream
    /// (`record_stream`); nothing is changed then, except for an overlap found once blocks were freed. A
    /// driver failure mapping a page the pool lost (its pages stay mapped while it is live, so none is
    /// expected).
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
            let end = block.addr + block.size;
            let fits = {
                let mut over = self.segments.at(slot).blocks_overlapping(block.addr, end);
                match (over.next(), over.next()) {
                    (Some((start, free)), None) => {
                        !free.is_occupied() && start <= block.addr && end <= start + free.size
                    }
                    _ => false,
                }
            };
            if !fits {
                return Err(refuse(
                    "a block of the checkpoint overlaps memory in use since",
                ));
            }
            let stream = self.segments.at(slot).stream;
            self.place(slot, block.addr, block.size, block.requested, stream)?;
        }
        Ok(now.iter().map(|b| b.addr).collect())
    }

    /// Gives back the cached memory of `pool`, once released (PyTorch's `emptyCache(pool)`, which a
    /// `MemPool` calls when deleted): the idle pages of its segments and its empty segments. A live pool
    /// keeps its memory. Waits for the device once if there is something to unmap. Returns the bytes
    /// released to the driver.
    ///
    /// # Errors
    /// [`Error::CaptureUnderway`] while a pool is being allocated to; a driver failure.
    pub fn empty_pool_cache(&mut self, pool: GraphPool) -> Result<u64, Error> {
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        if self.graphs.pool_is_live(pool) || !self.segments.any_of_graph(pool) {
            return Ok(0);
        }
        self.poll_events()?;
        let slots: Vec<usize> = (self.segments.slotted())
            .filter(|(_, seg)| seg.graph == Some(pool))
            .map(|(slot, _)| slot)
            .collect();
        let reserved = self.books.counters.reserved.current;
        let mut compacting = Compacting::by_device();
        let mut handles = Vec::new();
        for &slot in &slots {
            let stream = self.segments.at(slot).stream;
            let mut end = self.segments.at(slot).pages.len();
            while let Some(run) = self.segments.at(slot).pages.last_idle_run_before(end) {
                end = run.start;
                let run = (self.physical).whole_chunks(&self.lending, self.segments.at(slot), run);
                if run.is_empty() || !self.stream_done(stream, Wait::Block, &mut compacting)? {
                    continue;
                }
                self.unmap_idle_run(slot, run, &mut handles)?;
            }
        }
        let pages = handles.len() as u64;
        self.put_back(handles);
        (self.physical).release_pooled(
            &mut self.driver,
            &mut self.books,
            pages * self.page_size,
        )?;
        for slot in slots {
            let seg = self.segments.at(slot);
            if seg.occupied_count() > 0 || seg.pages.mapped_count() > 0 {
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
        Ok(reserved.saturating_sub(self.books.counters.reserved.current))
    }

    /// An allocation outside every pool that ran out of memory, served from the free memory of a pool that
    /// lends it (`use_on_oom`), as PyTorch's allocator does before giving up: the best-fitting free block
    /// of the pool's segments of the request's stream and class whose pages are all mapped. No page is
    /// mapped for it. Returns its address, or `None` if no such pool has such a block.
    pub(super) fn serve_from_pools(
        &mut self,
        requested: u64,
        rounded: u64,
        stream: StreamId,
        class: Pool,
    ) -> Result<Option<u64>, Error> {
        for pool in self.graphs.use_on_oom() {
            let size = match self.graphs.no_split(Some(pool)) {
                true => round_up(rounded, self.page_size).unwrap_or(rounded),
                false => rounded,
            };
            let key = (stream, class, Some(pool), None);
            let mut best: Option<(u64, usize, u64)> = None;
            for slot in self.segments.of_key(&key) {
                let seg = self.segments.at(slot);
                if seg.whole_pages && size % self.page_size != 0 {
                    continue;
                }
                if let Some((0, block_size, addr)) = seg.mapped_fit(size, FIT_CANDIDATES, false)
                    && best.is_none_or(|(smallest, ..)| block_size < smallest)
                {
                    best = Some((block_size, slot, addr));
                }
            }
            if let Some((_, slot, addr)) = best {
                self.place(slot, addr, size, requested, stream)?;
                tracing::info!(%pool, requested, "cuvmm: out of memory; served from a pool's free memory");
                return Ok(Some(addr));
            }
        }
        Ok(None)
    }

    /// Carves the live block `addr .. addr + size` (for `requested` bytes on `stream`) in segment `slot`,
    /// inside one free block, backs its pages and counts it, as an allocation does; on failure the block
    /// is free again.
    fn place(
        &mut self,
        slot: usize,
        addr: u64,
        size: u64,
        requested: u64,
        stream: StreamId,
    ) -> Result<(), Error> {
        let class = self.segments.at(slot).pool;
        let before = SlotCounts::of(self.segments.at(slot));
        self.segments.at_mut(slot).carve(addr, size, requested);
        self.books.set_carving(Some((class, size)));
        self.books.refresh(self.segments.at(slot), before);
        let backed = self.back_with_pages(slot, addr, size);
        self.books.set_carving(None);
        if let Err(err) = backed {
            let before = SlotCounts::of(self.segments.at(slot));
            self.segments.at_mut(slot).free_live_at_addr(addr, size);
            self.books.refresh(self.segments.at(slot), before);
            return Err(err);
        }
        self.books.count_block(class, size, requested, true);
        self.books
            .record(TraceAction::Alloc, addr, requested, stream);
        Ok(())
    }
}
