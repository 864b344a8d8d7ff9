//! Simulated streams and events, whose completion the test controls.
//!
//! Streams are implicit: any [`StreamId`] is valid. An event recorded on a stream stays pending until the
//! test completes it ([`SimDriver::complete_event`](super::SimDriver::complete_event)), completes its
//! stream ([`SimDriver::complete_stream`](super::SimDriver::complete_stream)), or the stream is
//! synchronized.

use crate::driver::{DriverError, EventId, StreamId};
use std::collections::{BTreeSet, HashMap};

/// One recorded, not yet destroyed event.
#[derive(Debug, Clone, Copy)]
struct Event {
    stream: StreamId,
    complete: bool,
}

/// Every live event, and the pending ones per stream.
#[derive(Debug, Clone, Default)]
pub(super) struct Events {
    next: u64,
    events: HashMap<u64, Event>,
    pending: HashMap<StreamId, BTreeSet<u64>>,
}

impl Events {
    /// Records a pending event at the end of `stream`.
    pub(super) fn record(&mut self, stream: StreamId) -> EventId {
        self.next += 1;
        let id = self.next;
        self.events.insert(
            id,
            Event {
                stream,
                complete: false,
            },
        );
        self.pending.entry(stream).or_default().insert(id);
        EventId(id)
    }

    /// Whether `event` has completed.
    pub(super) fn is_complete(&self, event: EventId) -> Result<bool, DriverError> {
        self.events
            .get(&event.0)
            .map(|e| e.complete)
            .ok_or(DriverError::UnknownEvent { event })
    }

    /// Forgets `event`.
    pub(super) fn destroy(&mut self, event: EventId) -> Result<(), DriverError> {
        let e = self
            .events
            .remove(&event.0)
            .ok_or(DriverError::UnknownEvent { event })?;
        if !e.complete {
            self.unpend(e.stream, event.0);
        }
        Ok(())
    }

    /// Marks `event` complete.
    pub(super) fn complete(&mut self, event: EventId) -> Result<(), DriverError> {
        let e = self
            .events
            .get_mut(&event.0)
            .ok_or(DriverError::UnknownEvent { event })?;
        if !e.complete {
            e.complete = true;
            let stream = e.stream;
            self.unpend(stream, event.0);
        }
        Ok(())
    }

    /// Marks every event recorded on `stream` so far complete.
    pub(super) fn complete_stream(&mut self, stream: StreamId) {
        let Some(ids) = self.pending.remove(&stream) else {
            return;
        };
        for id in ids {
            if let Some(e) = self.events.get_mut(&id) {
                e.complete = true;
            }
        }
    }

    /// Events recorded on `stream` that have not completed (destroyed ones excluded).
    pub(super) fn pending(&self, stream: StreamId) -> usize {
        self.pending.get(&stream).map_or(0, BTreeSet::len)
    }

    fn unpend(&mut self, stream: StreamId, id: u64) {
        if let Some(set) = self.pending.get_mut(&stream) {
            set.remove(&id);
            if set.is_empty() {
                self.pending.remove(&stream);
            }
        }
    }
}
