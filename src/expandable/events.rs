//! The allocator's side of blocks used on more than one stream (the types are in `streams.rs`): recording a
//! stream's use, parking a freed block behind events, polling and draining those events, synchronizing the
//! streams before memory is given back.

use super::Expandable;
use super::segment::FreeOutcome;
use super::streams::{Parked, StreamUses};
use crate::driver::{Driver, EventId, StreamId};
use crate::strategy::error::Error;
use crate::strategy::history::TraceAction;
use std::collections::hash_map::Entry;

impl<D: Driver> Expandable<D> {
    /// Records that the live block at `addr` is used by work on `stream` too. A no-op for the stream of
    /// the block's segment, whose reuse is stream-ordered, and for a stream already recorded.
    pub(super) fn record_stream_use(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let slot = self.slot_of(addr).ok_or(Error::UnknownAddress { addr })?;
        // A block whose free was deferred during a capture is freed already.
        if self.graphs.deferred.contains(&addr) {
            return Err(Error::UnknownAddress { addr });
        }
        // A live block must start at `addr`: found by its start, with no search for the block around it.
        if !(self.segment(slot).block_at(addr)).is_some_and(|block| block.is_live()) {
            return Err(Error::UnknownAddress { addr });
        }
        if stream == self.segment(slot).stream {
            return Ok(());
        }
        match self.stream_uses.entry(addr) {
            Entry::Occupied(mut uses) => uses.get_mut().insert(stream),
            Entry::Vacant(entry) => {
                entry.insert(StreamUses::new(stream));
            }
        }
        Ok(())
    }

    /// Frees the live block at `addr` in its segment `slot`, which other streams use: records an event on
    /// each of them and parks the block until they complete. If an event cannot be recorded, the block stays
    /// live, the events already recorded are destroyed, and the error is returned.
    pub(super) fn park_block(
        &mut self,
        slot: usize,
        addr: u64,
        streams: StreamUses,
    ) -> Result<(), Error> {
        // Each event goes straight to the back of its stream's queue; the streams are distinct, so a
        // failure takes back exactly one event from the back of each queue before it.
        let mut failure = None;
        for (recorded, stream) in streams.iter().enumerate() {
            match self.driver.record_event(stream) {
                Ok(event) => self.pending.queue_mut(stream).push_back((event, addr)),
                Err(err) => {
                    failure = Some((recorded, err));
                    break;
                }
            }
        }
        if let Some((recorded, err)) = failure {
            for stream in streams.iter().take(recorded) {
                let (event, _) = (self.pending.queue_mut(stream).pop_back())
                    .expect("the event just queued on this stream");
                if let Err(destroy_err) = self.destroy_event(event) {
                    tracing::warn!(%destroy_err, "cuvmm: destroying an event after a failed free; retried at the next poll");
                }
            }
            self.stream_uses.insert(addr, streams);
            return Err(err.into());
        }
        let FreeOutcome::Freed {
            size, requested, ..
        } = self.segment_mut(slot).park(addr)
        else {
            unreachable!("park_block is called for a live block start");
        };
        let pool = self.segment(slot).pool;
        self.count_block(pool, size, requested, false);
        let own = self.segment(slot).stream;
        self.record(TraceAction::FreeRequested, addr, requested, own);
        let left = streams.iter().count();
        self.pending.outstanding.insert(addr, Parked { slot, left });
        Ok(())
    }

    /// Polls the pending events, per stream in recording order up to the first incomplete one; destroys the
    /// completed ones and frees the blocks that wait for nothing more. Returns the bytes freed.
    #[inline]
    pub(super) fn process_events(&mut self) -> Result<u64, Error> {
        // Checked inline: most allocations find nothing pending.
        if self.pending.is_empty() {
            return Ok(0);
        }
        self.poll_events()
    }

    /// [`process_events`](Self::process_events) when something is pending.
    fn poll_events(&mut self) -> Result<u64, Error> {
        if !self.pending.undestroyed.is_empty() {
            self.destroy_undestroyed()?;
        }
        let mut freed = 0;
        // By index: freeing a block changes no queue, and no queue is added or removed here.
        for i in 0..self.pending.events.len() {
            while let Some(&(event, addr)) = self.pending.events[i].1.front() {
                if !self.driver.event_complete(event)? {
                    break;
                }
                // Done with once it completed: out of the queue before it is destroyed, so an event whose
                // destroy failed (and may have worked) is never queried again, only destroyed again.
                self.pending.events[i].1.pop_front();
                let Entry::Occupied(mut parked) = self.pending.outstanding.entry(addr) else {
                    unreachable!("a pending event's block is parked");
                };
                parked.get_mut().left -= 1;
                if parked.get().left == 0 {
                    let Parked { slot, .. } = parked.remove();
                    freed += self.release_parked(slot, addr);
                }
                self.destroy_event(event)?;
            }
        }
        Ok(freed)
    }

    /// Synchronizes every stream that has pending events, then frees every parked block.
    pub(super) fn drain_pending(&mut self) -> Result<(), Error> {
        let streams: Vec<StreamId> = self.pending.streams().collect();
        for stream in streams {
            self.synchronize(stream)?;
        }
        self.process_events()?;
        self.pending.drop_empty_queues();
        Ok(())
    }

    /// Frees the parked block at `addr` of segment `slot`, whose events all completed. Returns its size.
    fn release_parked(&mut self, slot: usize, addr: u64) -> u64 {
        let before = self.page_counts(slot);
        let size = self.segment_mut(slot).release_pending(addr);
        let (pool, stream) = (self.segment(slot).pool, self.segment(slot).stream);
        self.counters.count_inactive(pool, size);
        self.record(TraceAction::FreeCompleted, addr, size, stream);
        self.refresh_page_counts(slot, before);
        size
    }

    /// Waits for every stream the allocator knows of as a user of some memory (pending events, record_stream
    /// uses of live blocks) and destroys every pending event, leaving parked blocks parked. Used on drop,
    /// before everything is unmapped. Returns the first failure and goes on after it.
    pub(super) fn quiesce_streams(&mut self) -> Result<(), Error> {
        let mut streams: Vec<StreamId> = self.pending.streams().collect();
        streams.extend(self.stream_uses.values().flat_map(StreamUses::iter));
        streams.sort_unstable();
        streams.dedup();
        let mut first_err = None;
        for stream in streams {
            if let Err(err) = self.synchronize(stream) {
                first_err.get_or_insert(err);
            }
        }
        let events: Vec<EventId> = std::mem::take(&mut self.pending.events)
            .into_iter()
            .flat_map(|(_, queue)| queue)
            .map(|(event, _)| event)
            .collect();
        for event in events {
            if let Err(err) = self.destroy_event_settled(event) {
                first_err.get_or_insert(err.into());
            }
        }
        if let Err(err) = self.destroy_undestroyed() {
            first_err.get_or_insert(err.into());
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Destroys `event`, which the allocator no longer needs. If the driver refuses, the event is kept and
    /// destroyed again at the next poll ([`destroy_undestroyed`](Self::destroy_undestroyed), where
    /// `UnknownEvent` means this call had destroyed it after all), and the error is returned.
    pub(super) fn destroy_event(&mut self, event: EventId) -> Result<(), Error> {
        self.driver.destroy_event(event).map_err(|err| {
            self.pending.undestroyed.push(event);
            err.into()
        })
    }
}
