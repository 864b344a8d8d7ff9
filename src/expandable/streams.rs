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

use crate::driver::{EventId, StreamId};
use rustc_hash::FxHashMap;
use std::collections::VecDeque;

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
