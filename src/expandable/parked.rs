//! Frees that wait: a block that other streams used is *parked* behind events recorded on them at its free
//! (`streams.rs` keeps the events), a free made during a capture is *deferred* until no capture is underway
//! (`graphs.rs` keeps the list), and settling all of them (the device synchronized once) is the first step
//! of releasing the cache. Functions of the parts they touch ([`Parts`]), so that the block path and the
//! supply's release of the cache both use them.

use super::compacting::Compacting;
use super::segment::FreeOutcome;
use super::streams::StreamUses;
use super::supply::Parts;
use crate::driver::Driver;
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;

impl<D: Driver> Parts<'_, D> {
    /// Frees the live block at `addr` in its segment `slot`, which other streams use: records an event on
    /// each of them and parks the block until they complete. If an event cannot be recorded, the block stays
    /// live with its streams, the events already recorded are destroyed, and the error is returned.
    pub(super) fn park_block(
        &mut self,
        slot: usize,
        addr: u64,
        streams: StreamUses,
    ) -> Result<(), Error> {
        let left = match self.waits.record_events(&mut *self.driver, addr, &streams) {
            Ok(left) => left,
            Err(err) => {
                self.waits.restore_uses(addr, streams);
                return Err(err);
            }
        };
        self.free_pending(slot, addr);
        self.waits.park(addr, slot, left);
        Ok(())
    }

    /// Frees the live block at `addr` in its segment `slot`, which other streams use, during a capture: no
    /// event may be recorded now, so its events wait until no capture is underway. The block is freed at
    /// once all the same (no longer allocated, still active), as PyTorch's.
    pub(super) fn defer_block(&mut self, slot: usize, addr: u64, streams: StreamUses) {
        self.free_pending(slot, addr);
        self.graphs.defer(addr, streams);
    }

    /// Turns the live block at `addr` of segment `slot` into a pending one, and counts and traces its free.
    pub(super) fn free_pending(&mut self, slot: usize, addr: u64) {
        let FreeOutcome::Freed {
            size, requested, ..
        } = self.segments.at_mut(slot).park(addr)
        else {
            unreachable!("a block is parked or deferred at its live start");
        };
        let seg = self.segments.at(slot);
        let (pool, own, graph) = (seg.pool, seg.stream, seg.graph);
        self.books.count_block(pool, size, requested, false);
        self.books
            .record(TraceAction::FreeRequested, addr, requested, own, graph);
    }

    /// Records the events of the frees deferred during a capture and parks their blocks. Only once no
    /// capture is underway. A free whose events cannot be recorded stays deferred, and the error is returned.
    pub(super) fn insert_deferred_events(&mut self) -> Result<(), Error> {
        while let Some((addr, streams)) = self.graphs.last_deferred() {
            let slot = (self.segments.slot_of(addr)).ok_or(Error::UnknownAddress { addr })?;
            let left = self.waits.record_events(&mut *self.driver, addr, streams)?;
            self.waits.park(addr, slot, left);
            self.graphs.deferred_done();
        }
        Ok(())
    }

    /// Settles every free that waits: the deferred ones are parked, then, the device synchronized once if
    /// any is parked (in `compacting`, which then knows every stream done), every parked block is freed.
    pub(super) fn settle_frees(&mut self, compacting: &mut Compacting) -> Result<(), Error> {
        if self.graphs.any_deferred() {
            self.insert_deferred_events()?;
        }
        if self.waits.any_parked() {
            compacting.device_done(&mut *self.driver, &mut *self.books)?;
        }
        let (segments, books) = (&mut *self.segments, &mut *self.books);
        self.waits.drain(&mut *self.driver, |slot, addr| {
            segments.release_parked(books, slot, addr)
        })
    }
}
