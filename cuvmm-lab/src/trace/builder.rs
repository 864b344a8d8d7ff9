//! Building a trace by naming allocations as they are made: what the workload generators write.

use super::event::{Event, Trace};
use cuvmm::driver::StreamId;

/// Appends events to a trace and hands out fresh ids.
#[derive(Debug)]
pub struct TraceBuilder {
    trace: Trace,
    next_id: u64,
}

impl TraceBuilder {
    /// A builder for a trace called `name`.
    pub fn new(name: &str) -> Self {
        Self {
            trace: Trace::new(name),
            next_id: 0,
        }
    }

    /// Appends an allocation of `size` bytes (at least 1) on `stream` and returns its id.
    pub fn alloc(&mut self, size: u64, stream: StreamId) -> u64 {
        debug_assert!(size > 0, "workload generated a 0-byte allocation");
        let id = self.next_id;
        self.next_id += 1;
        self.trace.events.push(Event::Alloc { id, size, stream });
        id
    }

    /// Appends a free of `id`.
    pub fn free(&mut self, id: u64) {
        self.trace.events.push(Event::Free { id });
    }

    /// Appends a use of the live allocation `id` on `stream` (a stream other than its own).
    pub fn record_stream(&mut self, id: u64, stream: StreamId) {
        self.trace.events.push(Event::RecordStream { id, stream });
    }

    /// Appends a release of the allocator's cached memory ([`Event::EmptyCache`]).
    pub fn empty_cache(&mut self) {
        self.trace.events.push(Event::EmptyCache);
    }

    /// Appends frees of all of `ids`, in order.
    pub fn free_all(&mut self, ids: impl IntoIterator<Item = u64>) {
        for id in ids {
            self.free(id);
        }
    }

    /// Events appended so far.
    pub fn len(&self) -> usize {
        self.trace.events.len()
    }

    /// Whether no event was appended yet.
    pub fn is_empty(&self) -> bool {
        self.trace.events.is_empty()
    }

    /// The trace built.
    pub fn finish(self) -> Trace {
        self.trace
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_are_fresh_and_events_in_order() {
        let mut b = TraceBuilder::new("x");
        let a = b.alloc(10, StreamId(1));
        let c = b.alloc(20, StreamId::DEFAULT);
        b.free_all([a, c]);
        assert_ne!(a, c);
        assert_eq!(b.len(), 4);
        let t = b.finish();
        assert_eq!(t.name, "x");
        assert_eq!(t.events[3], Event::Free { id: c });
        assert_eq!(t.validate(), Ok(()));
    }
}
