//! Blocks used on more than one stream: `record_stream`, and frees that wait for events.
//!
//! A block belongs to the stream of its segment, and reuse on that stream is stream-ordered, so it needs no
//! event. Any other stream that uses the block is recorded (`record_stream`, or the requesting stream of a
//! block borrowed from another stream's segment). Freeing a block with such streams records an event on each
//! and *parks* the block: it leaves `allocated_bytes` at once but stays in `active_bytes`, and stays a user
//! of its pages, so they can be neither handed out nor unmapped. At the start of every allocation the
//! pending events are polled, as PyTorch's `process_events` does: per stream, in recording order, up to the
//! first that has not completed. A block whose last event completed is really freed. `empty_cache` and the
//! out-of-memory path synchronize the streams with pending events first and drain them all, as PyTorch's
//! `synchronize_and_free_events`.

use super::Expandable;
use super::segment::FreeOutcome;
use crate::driver::{Driver, EventId, StreamId};
use crate::error::Error;
use crate::history::TraceAction;
use rustc_hash::FxHashMap;
use std::collections::VecDeque;
use std::collections::hash_map::Entry;

/// The streams other than its segment's that use one live block, distinct, in recording order. The first
/// is held inline and only further ones in a vector, so the usual block used on one other stream costs no
/// heap allocation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct StreamUses {
    first: StreamId,
    rest: Vec<StreamId>,
}

impl StreamUses {
    /// Use by `stream` alone.
    pub fn new(stream: StreamId) -> Self {
        Self {
            first: stream,
            rest: Vec::new(),
        }
    }

    /// Adds `stream` unless it is already recorded.
    pub fn insert(&mut self, stream: StreamId) {
        if !self.contains(stream) {
            self.rest.push(stream);
        }
    }

    /// Whether `stream` is recorded.
    pub fn contains(&self, stream: StreamId) -> bool {
        self.first == stream || self.rest.contains(&stream)
    }

    /// The streams, in recording order.
    pub fn iter(&self) -> impl Iterator<Item = StreamId> + '_ {
        std::iter::once(self.first).chain(self.rest.iter().copied())
    }
}

/// A parked block: the segment it lies in and how many of its events have not completed yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Parked {
    /// The slot of the block's segment, which cannot go away while the block is parked.
    pub slot: usize,
    /// Events not completed yet; at least one.
    pub left: usize,
}

/// Parked blocks and the events they wait for.
#[derive(Debug, Default)]
pub(super) struct PendingFrees {
    /// Per stream, in stream order, its pending events in recording order, each with the block it holds
    /// back. A queue that empties stays (with its capacity) for the stream's next events, since a program
    /// uses few streams; [`PendingFrees::drop_empty_queues`] removes the empty ones.
    events: Vec<(StreamId, VecDeque<(EventId, u64)>)>,
    /// Per parked block (by address), its segment and outstanding events.
    pub outstanding: FxHashMap<u64, Parked>,
    /// Events the allocator no longer waits for whose `destroy_event` failed: destroyed again at the next
    /// poll, so none is left behind (and never queried again: the failed call may have destroyed one).
    pub undestroyed: Vec<EventId>,
}

impl PendingFrees {
    /// Whether no block is parked and no event waits to be destroyed.
    pub fn is_empty(&self) -> bool {
        self.outstanding.is_empty() && self.undestroyed.is_empty()
    }

    /// The streams with pending events, in stream order.
    pub fn streams(&self) -> impl Iterator<Item = StreamId> + '_ {
        self.events
            .iter()
            .filter(|(_, queue)| !queue.is_empty())
            .map(|&(stream, _)| stream)
    }

    /// Every pending event with the block it holds back.
    pub fn queued(&self) -> impl Iterator<Item = &(EventId, u64)> {
        self.events.iter().flat_map(|(_, queue)| queue)
    }

    /// The queue of `stream`, created (in stream order) if it has none.
    fn queue_mut(&mut self, stream: StreamId) -> &mut VecDeque<(EventId, u64)> {
        let i = match self.events.binary_search_by_key(&stream, |&(s, _)| s) {
            Ok(i) => i,
            Err(i) => {
                self.events.insert(i, (stream, VecDeque::new()));
                i
            }
        };
        &mut self.events[i].1
    }

    /// Removes the queues of streams with no pending event.
    fn drop_empty_queues(&mut self) {
        self.events.retain(|(_, queue)| !queue.is_empty());
    }
}

impl<D: Driver> Expandable<D> {
    /// Records that the live block at `addr` is used by work on `stream` too. A no-op for the stream of
    /// the block's segment, whose reuse is stream-ordered, and for a stream already recorded.
    pub(super) fn record_stream_use(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let slot = self.slot_of(addr).ok_or(Error::UnknownAddress { addr })?;
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
        let FreeOutcome::Freed { size, requested } = self.segment_mut(slot).park(addr) else {
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
        self.count_inactive(pool, size);
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
