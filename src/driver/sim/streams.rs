//! Simulated streams: FIFO queues of pending work and events, whose progress the test controls.
//!
//! Streams are implicit: any [`StreamId`] is valid. Each stream has a queue of items in launch order:
//! **work** (a simulated kernel that reads and writes some device ranges) and **events** (markers recorded by
//! [`Driver::record_event`](crate::driver::Driver::record_event)). Nothing runs by itself: work completes when
//! the test advances the stream ([`SimDriver::advance`](super::SimDriver::advance)), completes an event or the
//! stream, or when the stream is synchronized. An event completes as soon as everything queued before it on
//! its stream has completed, so an event recorded on a stream with nothing pending is complete at once, as on
//! a GPU. The queue therefore never starts with an event: completed items leave it, and events at its front
//! leave with them.

use crate::driver::{DriverError, EventId, StreamId, VaRange};
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::VecDeque;

/// One item of a stream's queue.
#[derive(Debug, Clone)]
enum Item {
    /// A simulated kernel touching these ranges.
    Work { ranges: Vec<VaRange> },
    /// An event marker, by its number.
    Event(u64),
}

/// One recorded, not yet destroyed event.
#[derive(Debug, Clone, Copy)]
struct Event {
    stream: StreamId,
    complete: bool,
}

/// Every stream's queue and every live event.
#[derive(Debug, Clone, Default)]
pub(super) struct Streams {
    next_event: u64,
    next_work: u64,
    events: FxHashMap<u64, Event>,
    queues: FxHashMap<StreamId, VecDeque<Item>>,
    /// Streams the program destroyed: a call naming one is refused. Their queued work still completes.
    destroyed: FxHashSet<StreamId>,
}

impl Streams {
    /// Destroys `stream` (`cuStreamDestroy`): the work queued on it stays queued and completes as the test
    /// says, but a call that names it is refused from now on. Whether it was destroyed now: not one of
    /// CUDA's default streams, which cannot be destroyed, nor destroyed before.
    pub(super) fn destroy_stream(&mut self, stream: StreamId) -> bool {
        ![StreamId::DEFAULT, StreamId::LEGACY, StreamId::PER_THREAD].contains(&stream)
            && self.destroyed.insert(stream)
    }

    /// [`DriverError::StreamDestroyed`] for `call` if `stream` was destroyed.
    pub(super) fn alive(&self, call: &'static str, stream: StreamId) -> Result<(), DriverError> {
        if self.destroyed.contains(&stream) {
            return Err(DriverError::StreamDestroyed { call, stream });
        }
        Ok(())
    }

    /// Completes everything queued on every stream.
    pub(super) fn complete_all(&mut self) {
        let streams: Vec<StreamId> = self.queues.keys().copied().collect();
        for stream in streams {
            self.complete_stream(stream);
        }
    }

    /// Queues work touching `ranges` at the end of `stream`; returns its number.
    pub(super) fn launch(&mut self, stream: StreamId, ranges: &[VaRange]) -> u64 {
        self.next_work += 1;
        self.queues
            .entry(stream)
            .or_default()
            .push_back(Item::Work {
                ranges: ranges.to_vec(),
            });
        self.next_work
    }

    /// Numbers work launched on a capturing stream: a node of the graph, which is not queued and never runs.
    pub(super) fn launch_captured(&mut self) -> u64 {
        self.next_work += 1;
        self.next_work
    }

    /// Records an event on `stream` while it is capturing: a node of the graph, not queued, and never
    /// complete.
    pub(super) fn record_captured(&mut self, stream: StreamId) -> EventId {
        self.next_event += 1;
        let id = self.next_event;
        let complete = false;
        self.events.insert(id, Event { stream, complete });
        EventId(id)
    }

    /// Records an event at the end of `stream`: complete at once if nothing is pending there.
    pub(super) fn record(&mut self, stream: StreamId) -> EventId {
        self.next_event += 1;
        let id = self.next_event;
        let queue = self.queues.get_mut(&stream);
        let complete = queue.as_ref().is_none_or(|q| q.is_empty());
        self.events.insert(id, Event { stream, complete });
        if let Some(queue) = queue.filter(|_| !complete) {
            queue.push_back(Item::Event(id));
        }
        EventId(id)
    }

    /// Whether `event` has completed.
    pub(super) fn is_complete(&self, event: EventId) -> Result<bool, DriverError> {
        self.events
            .get(&event.0)
            .map(|e| e.complete)
            .ok_or(DriverError::UnknownEvent { event })
    }

    /// Forgets `event` (its marker leaves the queue; the work around it is unaffected).
    pub(super) fn destroy(&mut self, event: EventId) -> Result<(), DriverError> {
        let e = self
            .events
            .remove(&event.0)
            .ok_or(DriverError::UnknownEvent { event })?;
        if !e.complete
            && let Some(queue) = self.queues.get_mut(&e.stream)
        {
            queue.retain(|item| !matches!(item, Item::Event(id) if *id == event.0));
        }
        Ok(())
    }

    /// Completes `event` and everything queued before it on its stream.
    pub(super) fn complete(&mut self, event: EventId) -> Result<(), DriverError> {
        let e = *self
            .events
            .get(&event.0)
            .ok_or(DriverError::UnknownEvent { event })?;
        while !self.is_complete(event)? && self.pop(e.stream) {}
        Ok(())
    }

    /// Completes the first `n` work items of `stream` (and the events behind them that thereby complete).
    /// Returns how many work items completed: fewer than `n` if the queue ran out.
    pub(super) fn advance(&mut self, stream: StreamId, n: usize) -> usize {
        let mut done = 0;
        while done < n && self.pop(stream) {
            done += 1;
        }
        done
    }

    /// Completes everything queued on `stream`.
    pub(super) fn complete_stream(&mut self, stream: StreamId) {
        while self.pop(stream) {}
    }

    /// Events recorded on `stream` that have not completed (destroyed ones excluded).
    pub(super) fn pending_events(&self, stream: StreamId) -> Vec<EventId> {
        self.items(stream)
            .filter_map(|item| match item {
                Item::Event(id) => Some(EventId(*id)),
                Item::Work { .. } => None,
            })
            .collect()
    }

    /// Events recorded and not destroyed, complete or not.
    pub(super) fn live_events(&self) -> usize {
        self.events.len()
    }

    /// Work items queued on `stream` and not yet completed.
    pub(super) fn pending_work(&self, stream: StreamId) -> usize {
        self.items(stream)
            .filter(|item| matches!(item, Item::Work { .. }))
            .count()
    }

    /// The streams whose pending work touches `va .. va + size`, each once, in increasing order, with the
    /// first address of the range that it touches.
    pub(super) fn users_of(&self, va: u64, size: u64) -> Vec<(StreamId, u64)> {
        let end = va.saturating_add(size);
        let mut out: Vec<(StreamId, u64)> = Vec::new();
        for (&stream, queue) in &self.queues {
            let first = queue
                .iter()
                .filter_map(|item| match item {
                    Item::Work { ranges, .. } => Some(ranges),
                    Item::Event(_) => None,
                })
                .flatten()
                .filter(|r| r.size > 0 && r.start < end && r.end() > va)
                .map(|r| r.start.max(va))
                .min();
            if let Some(addr) = first {
                out.push((stream, addr));
            }
        }
        out.sort_unstable();
        out
    }

    fn items(&self, stream: StreamId) -> impl Iterator<Item = &Item> {
        self.queues.get(&stream).into_iter().flatten()
    }

    /// Completes the work item at the front of `stream` and the events that follow it up to the next work
    /// item. Returns false if the queue was empty.
    fn pop(&mut self, stream: StreamId) -> bool {
        let Some(queue) = self.queues.get_mut(&stream) else {
            return false;
        };
        let popped = queue.pop_front().is_some();
        while let Some(Item::Event(id)) = queue.front() {
            if let Some(e) = self.events.get_mut(id) {
                e.complete = true;
            }
            queue.pop_front();
        }
        if queue.is_empty() {
            self.queues.remove(&stream);
        }
        popped
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_queue_never_starts_with_an_event() {
        let mut s = Streams::default();
        let st = StreamId(1);
        let w1 = s.launch(st, &[VaRange::new(0, 10)]);
        let e1 = s.record(st);
        let e2 = s.record(st);
        s.launch(st, &[VaRange::new(100, 10)]);
        let e3 = s.record(st);
        assert_ne!(w1, 0);
        assert_eq!(s.pending_events(st), vec![e1, e2, e3]);
        assert_eq!(s.advance(st, 1), 1);
        assert!(s.is_complete(e1).unwrap() && s.is_complete(e2).unwrap());
        assert!(!s.is_complete(e3).unwrap());
        assert_eq!(s.users_of(0, 1000), vec![(st, 100)]);
        assert_eq!(s.advance(st, 5), 1);
        assert!(s.is_complete(e3).unwrap());
        assert!(s.queues.is_empty());
        assert_eq!(s.advance(st, 1), 0);
    }
}
