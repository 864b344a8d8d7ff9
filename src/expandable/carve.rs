//! Carving a block at a given address of a segment's free memory, backed and counted as an allocation is:
//! what putting a pool back to a checkpoint does (`pools.rs`), and the fallback of an allocation that ran
//! out of memory to the free memory of a pool that lends it (`use_on_oom`), which `request.rs` asks for.

use super::Expandable;
use super::accounting::SlotCounts;
use super::segment::Kind;
use super::supply::Shortage;
use crate::base::size::round_up;
use crate::driver::{Driver, StreamId};
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;

/// How many of a segment's best-fitting free blocks the fallback to a pool compares.
const FIT_CANDIDATES: usize = 8;

impl<D: Driver> Expandable<D> {
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
                if seg.kind == Kind::WholePages && size % self.page_size != 0 {
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

    /// Whether `addr .. addr + size` lies inside one free block of segment `slot`.
    pub(super) fn is_free(&self, slot: usize, addr: u64, size: u64) -> bool {
        let end = addr.saturating_add(size);
        let mut over = self.segments.at(slot).blocks_overlapping(addr, end);
        match (over.next(), over.next()) {
            (Some((start, free)), None) => {
                !free.is_occupied() && start <= addr && end <= start + free.size
            }
            _ => false,
        }
    }

    /// Carves the live block `addr .. addr + size` (for `requested` bytes on `stream`) in segment `slot`,
    /// inside one free block, backs its pages and counts it, as an allocation does; on failure the block
    /// is free again.
    pub(super) fn place(
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
        // A pool's memory stays mapped while it lives, so this rarely maps a page; it releases no cache for
        // it (a checkpoint put back, or a request that already ran out).
        let (supply, mut parts) = self.supply_and_parts();
        let backed = supply.back_block(
            &mut parts,
            (slot, addr, size),
            &mut Shortage::allowing(false),
        );
        self.books.set_carving(None);
        if let Err(err) = backed {
            let before = SlotCounts::of(self.segments.at(slot));
            self.segments.at_mut(slot).free_live_at_addr(addr, size);
            self.books.refresh(self.segments.at(slot), before);
            return Err(err);
        }
        self.books.count_block(class, size, requested, true);
        let graph = self.segments.at(slot).graph;
        self.books
            .record(TraceAction::Alloc, addr, requested, stream, graph);
        Ok(())
    }
}
