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
//!
//! A part that owns its state ([`StreamWaits`]): the streams recorded on live blocks and the parked blocks'
//! events. It records, polls and destroys events on the driver it is given; the blocks themselves are the
//! segments': a parked block whose events completed is handed to a `release` the orchestrator passes.

use super::accounting::Books;
use super::segments::Segments;
use super::settle::destroy_event_settled;
use crate::driver::{Driver, DriverError, EventId, StreamId};
use crate::strategy::error::{Error, InvariantViolation as V};
use rustc_hash::FxHashMap;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet, VecDeque};

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
struct Parked {
    /// The slot of the block's segment, which cannot go away while the block is parked.
    pub slot: usize,
    /// Events not completed yet; at least one.
    pub left: usize,
}

/// Parked blocks and the events they wait for.
#[derive(Debug, Default)]
struct PendingFrees {
    /// Per stream, in stream order, its pending events in recording order, each with the block it holds
    /// back. A queue that empties stays (with its capacity) for the stream's next events, since a program
    /// uses few streams; [`PendingFrees::drop_empty_queues`] removes the empty ones.
    pub(super) events: Vec<(StreamId, VecDeque<(EventId, u64)>)>,
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
    pub(super) fn queue_mut(&mut self, stream: StreamId) -> &mut VecDeque<(EventId, u64)> {
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
    pub(super) fn drop_empty_queues(&mut self) {
        self.events.retain(|(_, queue)| !queue.is_empty());
    }
}

/// Streams waited for: the streams recorded on live blocks, and the blocks parked behind events.
#[derive(Debug, Default)]
pub(super) struct StreamWaits {
    /// Streams other than its segment's that use a live block, by block address.
    uses: FxHashMap<u64, StreamUses>,
    /// Blocks freed while other streams may still use them, and their events.
    pending: PendingFrees,
}

/// Waits for `stream`'s queued work (before one of its pages is unmapped, or pending frees are drained).
pub(super) fn synchronize<D: Driver>(
    driver: &mut D,
    books: &mut Books,
    stream: StreamId,
) -> Result<(), Error> {
    driver.synchronize(stream)?;
    books.counters.synchronizations += 1;
    Ok(())
}

/// Waits for the whole device's queued work, every stream's.
pub(super) fn synchronize_device<D: Driver>(
    driver: &mut D,
    books: &mut Books,
) -> Result<(), Error> {
    driver.synchronize_device()?;
    books.counters.synchronizations += 1;
    Ok(())
}

impl StreamWaits {
    /// Whether any live block is used on a stream other than its segment's.
    #[inline]
    pub(super) fn any_uses(&self) -> bool {
        !self.uses.is_empty()
    }

    /// Whether the live block at `addr` is used on another stream than its segment's.
    pub(super) fn used_elsewhere(&self, addr: u64) -> bool {
        self.uses.contains_key(&addr)
    }

    /// Records that the live block at `addr` is used on `stream` too (not its segment's stream).
    pub(super) fn add_use(&mut self, addr: u64, stream: StreamId) {
        match self.uses.entry(addr) {
            Entry::Occupied(mut uses) => uses.get_mut().insert(stream),
            Entry::Vacant(entry) => {
                entry.insert(StreamUses::new(stream));
            }
        }
    }

    /// Takes the streams recorded on the block at `addr` (being freed).
    pub(super) fn take_uses(&mut self, addr: u64) -> Option<StreamUses> {
        self.uses.remove(&addr)
    }

    /// Gives the live block at `addr` back the streams [`take_uses`](Self::take_uses) took (its free failed).
    pub(super) fn restore_uses(&mut self, addr: u64, streams: StreamUses) {
        self.uses.insert(addr, streams);
    }

    /// Records an event on each of `streams` for the block at `addr`, being freed. If one cannot be
    /// recorded, the events already recorded are destroyed and the error is returned; else the number of
    /// events, for [`park`](Self::park).
    pub(super) fn record_events<D: Driver>(
        &mut self,
        driver: &mut D,
        addr: u64,
        streams: &StreamUses,
    ) -> Result<usize, Error> {
        // Each event goes straight to the back of its stream's queue; the streams are distinct, so a
        // failure takes back exactly one event from the back of each queue before it.
        let mut failure = None;
        for (recorded, stream) in streams.iter().enumerate() {
            match driver.record_event(stream) {
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
                if let Err(destroy_err) = self.destroy_or_keep(driver, event) {
                    tracing::warn!(%destroy_err, "cuvmm: destroying an event after a failed free; retried at the next poll");
                }
            }
            return Err(err.into());
        }
        Ok(streams.iter().count())
    }

    /// Parks the block at `addr` of segment `slot` behind its `left` events, just recorded.
    pub(super) fn park(&mut self, addr: u64, slot: usize, left: usize) {
        self.pending.outstanding.insert(addr, Parked { slot, left });
    }

    /// Polls the pending events, per stream in recording order up to the first incomplete one; destroys the
    /// completed ones and hands the blocks that wait for nothing more to `release` (slot, address), which
    /// returns the bytes freed. Returns the bytes freed.
    #[inline]
    pub(super) fn poll<D: Driver>(
        &mut self,
        driver: &mut D,
        release: impl FnMut(usize, u64) -> u64,
    ) -> Result<u64, Error> {
        // Checked inline: most allocations find nothing pending.
        if self.pending.is_empty() {
            return Ok(0);
        }
        self.poll_queues(driver, release)
    }

    /// [`poll`](Self::poll) when something is pending.
    fn poll_queues<D: Driver>(
        &mut self,
        driver: &mut D,
        mut release: impl FnMut(usize, u64) -> u64,
    ) -> Result<u64, Error> {
        if !self.pending.undestroyed.is_empty() {
            self.destroy_undestroyed(driver)?;
        }
        let mut freed = 0;
        // By index: freeing a block changes no queue, and no queue is added or removed here.
        for i in 0..self.pending.events.len() {
            while let Some(&(event, addr)) = self.pending.events[i].1.front() {
                if !driver.event_complete(event)? {
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
                    freed += release(slot, addr);
                }
                self.destroy_or_keep(driver, event)?;
            }
        }
        Ok(freed)
    }

    /// Hands every parked block to `release`, once the device was synchronized (so every event has
    /// completed); names no stream.
    pub(super) fn drain<D: Driver>(
        &mut self,
        driver: &mut D,
        release: impl FnMut(usize, u64) -> u64,
    ) -> Result<(), Error> {
        self.poll(driver, release)?;
        self.pending.drop_empty_queues();
        Ok(())
    }

    /// Whether any freed block is parked behind events.
    pub(super) fn any_parked(&self) -> bool {
        self.pending.streams().next().is_some()
    }

    /// The streams that used memory `inside` says is of interest: recorded on its live blocks, or waited
    /// for by its parked blocks.
    pub(super) fn streams_using(&self, inside: impl Fn(u64) -> bool) -> Vec<StreamId> {
        let mut streams = Vec::new();
        for (&addr, uses) in &self.uses {
            if inside(addr) {
                streams.extend(uses.iter());
            }
        }
        for (stream, queue) in &self.pending.events {
            if queue.iter().any(|&(_, addr)| inside(addr)) {
                streams.push(*stream);
            }
        }
        streams
    }

    /// Whether any stream is recorded on a live block or waited for by a parked one.
    pub(super) fn any(&self) -> bool {
        !self.uses.is_empty() || self.any_parked()
    }

    /// Destroys every pending event, leaving parked blocks parked. Used on drop, after the device was
    /// synchronized and before everything is unmapped. Returns the first failure and goes on after it.
    pub(super) fn forget_all<D: Driver>(&mut self, driver: &mut D) -> Result<(), Error> {
        let mut first_err = None;
        let events: Vec<EventId> = std::mem::take(&mut self.pending.events)
            .into_iter()
            .flat_map(|(_, queue)| queue)
            .map(|(event, _)| event)
            .collect();
        for event in events {
            if let Err(err) = destroy_event_settled(driver, event) {
                first_err.get_or_insert(err.into());
            }
        }
        if let Err(err) = self.destroy_undestroyed(driver) {
            first_err.get_or_insert(err.into());
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Whether `stream` has no queued work left: an event recorded on it now has already completed. An
    /// event that cannot be destroyed is destroyed again at the next poll.
    pub(super) fn stream_idle<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
    ) -> Result<bool, Error> {
        let event = driver.record_event(stream)?;
        let complete = driver.event_complete(event);
        let destroyed = self.destroy_or_keep(driver, event);
        let complete = complete?;
        destroyed?;
        Ok(complete)
    }

    /// Destroys `event`, which the allocator no longer needs. If the driver refuses, the event is kept and
    /// destroyed again at the next poll ([`destroy_undestroyed`](Self::destroy_undestroyed), where
    /// `UnknownEvent` means this call had destroyed it after all), and the error is returned.
    fn destroy_or_keep<D: Driver>(&mut self, driver: &mut D, event: EventId) -> Result<(), Error> {
        driver.destroy_event(event).map_err(|err| {
            self.pending.undestroyed.push(event);
            err.into()
        })
    }

    /// Destroys the events whose `destroy_event` failed earlier. One that the driver no longer knows
    /// (`UnknownEvent`) was destroyed by that earlier call; one that fails again is kept for the next try.
    /// Returns the first failure, after trying them all.
    pub(super) fn destroy_undestroyed<D: Driver>(
        &mut self,
        driver: &mut D,
    ) -> Result<(), DriverError> {
        let mut first = None;
        for event in std::mem::take(&mut self.pending.undestroyed) {
            match driver.destroy_event(event) {
                Ok(()) | Err(DriverError::UnknownEvent { .. }) => {}
                Err(err) => {
                    self.pending.undestroyed.push(event);
                    first.get_or_insert(err);
                }
            }
        }
        first.map_or(Ok(()), Err)
    }

    /// The parked-block part of `check_invariants()`: recorded stream uses never name the block's own
    /// segment stream, hold no duplicate, and belong to live blocks; every event is counted once for its
    /// block, a parked block waits for at least one, and there are `pending_blocks` parked blocks.
    pub(super) fn check_waits(&self, segments: &Segments, pending_blocks: usize) -> Result<(), V> {
        for (&addr, streams) in &self.uses {
            let Some(slot) = segments.slot_of(addr) else {
                return Err(V::StreamUse { addr });
            };
            let seg = segments.at(slot);
            let distinct: HashSet<_> = streams.iter().collect();
            if distinct.len() != streams.iter().count()
                || distinct.contains(&seg.stream)
                || !seg.block_at(addr).is_some_and(|block| block.is_live())
            {
                return Err(V::StreamUse { addr });
            }
        }
        let mut events: HashMap<u64, usize> = HashMap::new();
        for &(_, addr) in self.pending.queued() {
            *events.entry(addr).or_default() += 1;
        }
        for (&addr, parked) in &self.pending.outstanding {
            if parked.left == 0
                || events.get(&addr) != Some(&parked.left)
                || segments.slot_of(addr) != Some(parked.slot)
            {
                return Err(V::PendingFree { addr });
            }
        }
        if let Some(&addr) = events
            .keys()
            .find(|addr| !self.pending.outstanding.contains_key(addr))
        {
            return Err(V::PendingFree { addr });
        }
        if self.pending.outstanding.len() != pending_blocks {
            let addr = self.pending.outstanding.keys().min().copied().unwrap_or(0);
            return Err(V::PendingFree { addr });
        }
        Ok(())
    }

    /// Whether the block at `addr` is parked, waiting for at least one event.
    pub(super) fn is_parked(&self, addr: u64) -> bool {
        self.pending
            .outstanding
            .get(&addr)
            .is_some_and(|p| p.left > 0)
    }
}
