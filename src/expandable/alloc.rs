//! The block path: serving a request places a block (`placement.rs`), carves it and has the supply back it
//! with pages, rolling it back if that fails (what then happens is the request's, `request.rs`); a free frees
//! the block at once or parks it behind events (`parked.rs`); a `record_stream` notes another stream's use;
//! each allocation first frees the pending blocks whose events completed.

use super::Expandable;
use super::accounting::SlotCounts;
use super::segment::{FreeOutcome, TagId};
use super::supply::Shortage;
use crate::driver::{Driver, StreamId};
use crate::strategy::error::Error;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::TraceAction;
use crate::strategy::pool::Pool;

/// A request, rounded, with the pool and the segments it goes to.
#[derive(Clone, Copy, Debug)]
pub(super) struct Request {
    /// Bytes asked for.
    pub size: u64,
    /// `size` rounded up to [`ROUND`](super::ROUND).
    pub rounded: u64,
    pub stream: StreamId,
    pub pool: Pool,
    /// The private pool it goes to, if any.
    pub graph: Option<GraphPool>,
    /// The tag it is made under, if any.
    pub tag: Option<TagId>,
}

/// Why serving a request failed.
#[derive(Debug)]
pub(super) enum Unserved {
    /// No block could be placed (reserving a segment, or asking a stream whether it is idle, failed).
    Placing(Error),
    /// The block could not be backed with pages; it is free again.
    Backing(Error),
}

impl<D: Driver> Expandable<D> {
    /// Serves `request`: places a block, carves it and backs it with pages (the supply may release the cache
    /// once as `shortage` allows). A block that cannot be backed is freed again; the page map says what is
    /// mapped and every handle obtained is pooled.
    pub(super) fn serve(
        &mut self,
        request: Request,
        shortage: &mut Shortage,
    ) -> Result<u64, Unserved> {
        let Request {
            size,
            rounded,
            stream,
            pool,
            graph,
            tag,
        } = request;
        let (slot, addr, borrowed) =
            (self.find_block(rounded, stream, pool, (graph, tag))).map_err(Unserved::Placing)?;
        let before = SlotCounts::of(self.segments.at(slot));
        self.segments.at_mut(slot).carve(addr, rounded, size);
        // Counted only once its pages are there: a request that fails must not move a statistic or its
        // peak (PyTorch counts a block when it hands it out). Meanwhile it is `carving`, so the
        // non-releasable bytes of its pages stay right.
        self.books.set_carving(Some((pool, rounded)));
        self.books.refresh(self.segments.at(slot), before);
        let (supply, mut parts) = self.supply_and_parts();
        let backed = supply.back_block(&mut parts, (slot, addr, rounded), shortage);
        self.books.set_carving(None);
        match backed {
            Ok(()) => {
                self.books.count_block(pool, rounded, size, true);
                if borrowed {
                    // Work on `stream` will use a block of another stream's segment: its free must wait.
                    self.waits.add_use(addr, stream);
                }
                (self.books).record(TraceAction::Alloc, addr, size, stream, graph);
                Ok(addr)
            }
            Err(err) => {
                let before = SlotCounts::of(self.segments.at(slot));
                self.segments.at_mut(slot).free_live_at_addr(addr, rounded);
                self.books.refresh(self.segments.at(slot), before);
                Err(Unserved::Backing(err))
            }
        }
    }

    /// Maps the missing pages of each range `(address, size)` (a tag's wake: its live blocks, and pages of
    /// its graph pools' segments no live block touches, which come back idle).
    pub(super) fn back_blocks(
        &mut self,
        blocks: &[(u64, u64)],
        shortage: &mut Shortage,
    ) -> Result<(), Error> {
        for &(addr, size) in blocks {
            let slot = self
                .segments
                .slot_of(addr)
                .ok_or(Error::UnknownAddress { addr })?;
            let (supply, mut parts) = self.supply_and_parts();
            supply.back_block(&mut parts, (slot, addr, size), shortage)?;
        }
        Ok(())
    }

    /// Frees the live block at `addr`: at once if only its segment's stream used it, else parked until
    /// events on the other streams complete. A block of a tag that is not awake is pending until its wake
    /// (`sleep.rs`), as the layout of the tag's kept bytes needs, and made free then.
    pub(super) fn free_block(&mut self, addr: u64) -> Result<(), Error> {
        let slot = self
            .segments
            .slot_of(addr)
            .ok_or(Error::UnknownAddress { addr })?;
        let (size, requested, at) = match self.segments.at(slot).check_free(addr) {
            FreeOutcome::Freed {
                size,
                requested,
                at,
            } => (size, requested, at),
            FreeOutcome::AlreadyFree => return Err(Error::DoubleFree { addr }),
            FreeOutcome::NotABlockStart => return Err(Error::UnknownAddress { addr }),
        };
        if let Some(id) = self.segments.at(slot).tag
            && !self.tags.is_awake(id)
        {
            // The sleep waited for every stream that used the block, and its memory is unmapped since:
            // no work can still use it, and its streams are forgotten.
            self.waits.take_uses(addr);
            self.parts().free_pending(slot, addr);
            self.tags.free_at_wake(id, addr);
            return Ok(());
        }
        if self.waits.any_uses() {
            if self.graphs.capturing() {
                // No event may be recorded or queried now: the block's events wait until no capture is
                // underway (`graphs.rs`).
                if let Some(streams) = self.waits.take_uses(addr) {
                    self.parts().defer_block(slot, addr, streams);
                    return Ok(());
                }
            } else if let Some(streams) = self.waits.take_uses(addr) {
                return self.parts().park_block(slot, addr, streams);
            }
        }
        let before = SlotCounts::of(self.segments.at(slot));
        let seg = self.segments.at(slot);
        let (pool, stream, graph) = (seg.pool, seg.stream, seg.graph);
        let clock = self.segments.tick_free_clock();
        let seg = self.segments.at_mut(slot);
        seg.free_live(at, addr, size);
        seg.last_free = clock;
        self.books.count_block(pool, size, requested, false);
        self.books.counters.count_inactive(pool, size, requested);
        self.books
            .record(TraceAction::FreeRequested, addr, requested, stream, graph);
        self.books
            .record(TraceAction::FreeCompleted, addr, requested, stream, graph);
        self.books.refresh(self.segments.at(slot), before);
        Ok(())
    }

    /// Gives idle memory beyond `max_idle_bytes` back to the driver. A failure keeps the memory idle (the next
    /// free or poll tries again) and is reported through `tracing`: it must not fail the free that caused it.
    pub(super) fn release_excess_idle(&mut self) {
        if self.graphs.capturing() {
            // Releasing unmaps, which a capture forbids: the next free after it ends does it.
            return;
        }
        let excess =
            (self.supply.idle_bytes(&self.books)).saturating_sub(self.config.max_idle_bytes);
        if excess > 0 {
            let (supply, mut parts) = self.supply_and_parts();
            if let Err(err) = supply.release_idle(&mut parts, excess) {
                tracing::warn!(%err, excess, "cuvmm: releasing idle memory beyond max_idle_bytes failed; kept idle");
            }
        }
    }

    /// Frees the pending blocks whose events completed, then keeps idle memory within its limit.
    pub(super) fn poll_pending(&mut self) -> Result<(), Error> {
        if self.graphs.any_deferred() {
            self.parts().insert_deferred_events()?;
        }
        if self.poll_events()? > 0 {
            self.release_excess_idle();
        }
        Ok(())
    }

    /// Polls the pending events and frees the parked blocks whose events all completed
    /// ([`StreamWaits::poll`](super::streams::StreamWaits::poll)). Returns the bytes freed.
    #[inline]
    pub(super) fn poll_events(&mut self) -> Result<u64, Error> {
        let (segments, books) = (&mut self.segments, &mut self.books);
        self.waits.poll(&mut self.driver, |slot, addr| {
            segments.release_parked(books, slot, addr)
        })
    }

    /// Records that the live block at `addr` is used by work on `stream` too. A no-op for the stream of
    /// the block's segment, whose reuse is stream-ordered, and for a stream already recorded.
    pub(super) fn record_stream_use(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let slot = self
            .segments
            .slot_of(addr)
            .ok_or(Error::UnknownAddress { addr })?;
        // A live block must start at `addr`: found by its start, with no search for the block around it.
        if !(self.segments.at(slot).block_at(addr)).is_some_and(|block| block.is_live()) {
            return Err(Error::UnknownAddress { addr });
        }
        if stream == self.segments.at(slot).stream {
            return Ok(());
        }
        self.waits.add_use(addr, stream);
        Ok(())
    }
}
