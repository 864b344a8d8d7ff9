//! The trace model: a sequence of allocations, frees, cross-stream uses and cache releases, each
//! allocation named by an id.

use cuvmm::driver::StreamId;
use rustc_hash::FxHashMap;

/// The largest request a trace file may hold: 2^50 bytes (1 PiB), beyond any device. The readers refuse
/// more, so sizes and their sums stay far from overflowing 64 bits.
pub const MAX_SIZE: u64 = 1 << 50;

/// One request in a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Event {
    /// Allocate `size` bytes on `stream`; later events name the allocation by `id`.
    Alloc {
        /// The allocation's name in the trace (not an address).
        id: u64,
        /// Bytes requested.
        size: u64,
        /// Stream the memory is used on.
        stream: StreamId,
    },
    /// Free the live allocation named `id`.
    Free {
        /// The allocation to free.
        id: u64,
    },
    /// The live allocation named `id` is used by work on `stream` too, not only on the stream it was
    /// allocated for (PyTorch's `record_stream`): its memory may be reused only once that work is done.
    RecordStream {
        /// The allocation used.
        id: u64,
        /// The other stream that uses it.
        stream: StreamId,
    },
    /// The program gave the allocator's cached memory back to the device (PyTorch's
    /// `torch.cuda.empty_cache()`): every allocator's [`Strategy::empty_cache`](cuvmm::strategy::Strategy::empty_cache).
    /// Device-wide: it names no allocation and no stream.
    EmptyCache,
}

impl Event {
    /// The allocation this event names; `None` for [`Event::EmptyCache`].
    pub fn id(&self) -> Option<u64> {
        match *self {
            Event::Alloc { id, .. } | Event::Free { id } | Event::RecordStream { id, .. } => {
                Some(id)
            }
            Event::EmptyCache => None,
        }
    }
}

/// A named workload: the requests an application makes, in order. Allocations still live at the end are
/// allowed (they are simply not freed).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Trace {
    /// The workload's name, as reports show it.
    pub name: String,
    /// The requests, in order.
    pub events: Vec<Event>,
}

/// A trace that no program could have produced.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum TraceError {
    /// An allocation of zero bytes.
    #[error("event {index}: allocation {id} asks for 0 bytes")]
    ZeroSize {
        /// Position of the event.
        index: usize,
        /// The allocation.
        id: u64,
    },
    /// An allocation whose id names an allocation that is still live.
    #[error("event {index}: allocation {id} is already live")]
    DuplicateId {
        /// Position of the event.
        index: usize,
        /// The id.
        id: u64,
    },
    /// A free of an id that was never allocated.
    #[error("event {index}: free of {id}, which was never allocated")]
    UnknownFree {
        /// Position of the event.
        index: usize,
        /// The id.
        id: u64,
    },
    /// A free of an id that was already freed.
    #[error("event {index}: free of {id}, which was already freed")]
    DoubleFree {
        /// Position of the event.
        index: usize,
        /// The id.
        id: u64,
    },
    /// A use on another stream of an id that is not live.
    #[error("event {index}: record_stream of {id}, which is not live")]
    RecordStreamNotLive {
        /// Position of the event.
        index: usize,
        /// The id.
        id: u64,
    },
}

impl Trace {
    /// An empty trace.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            events: Vec::new(),
        }
    }

    /// Number of [`Event::EmptyCache`] events.
    pub fn empty_cache_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, Event::EmptyCache))
            .count()
    }

    /// Number of allocation events.
    pub fn alloc_count(&self) -> usize {
        self.events
            .iter()
            .filter(|e| matches!(e, Event::Alloc { .. }))
            .count()
    }

    /// The most requested bytes live at once. Frees of unknown ids are ignored.
    ///
    /// Ids are mostly handed out in order from 0, so the live sizes sit in a vector indexed by id as far as
    /// `4 * events + 1024` (as the replay's id table), the rare larger id in a hash map: a replay reports
    /// this after its timed loop, and a hash map for every id cost about as much as a tenth of the loop.
    pub fn peak_live_bytes(&self) -> u64 {
        let limit = (self.events.len() as u64)
            .saturating_mul(4)
            .saturating_add(1024);
        let mut dense: Vec<u64> = Vec::new();
        let mut sparse: FxHashMap<u64, u64> = FxHashMap::default();
        let (mut current, mut peak) = (0u64, 0u64);
        for event in &self.events {
            match *event {
                Event::Alloc { id, size, .. } => {
                    current += size;
                    let old = if id < limit {
                        let i = id as usize;
                        if i >= dense.len() {
                            dense.resize((i + 1).next_power_of_two(), 0);
                        }
                        std::mem::replace(&mut dense[i], size)
                    } else {
                        sparse.insert(id, size).unwrap_or(0)
                    };
                    current -= old;
                    peak = peak.max(current);
                }
                Event::Free { id } => {
                    current -= if id < limit {
                        dense.get_mut(id as usize).map_or(0, std::mem::take)
                    } else {
                        sparse.remove(&id).unwrap_or(0)
                    }
                }
                Event::RecordStream { .. } | Event::EmptyCache => {}
            }
        }
        peak
    }

    /// Checks that every allocation asks for at least one byte under an id that is not live, and that every
    /// free and every record_stream names a live allocation. Returns the first problem found.
    pub fn validate(&self) -> Result<(), TraceError> {
        // Some(true): live; Some(false): freed.
        let mut state: FxHashMap<u64, bool> = FxHashMap::default();
        for (index, event) in self.events.iter().enumerate() {
            match *event {
                Event::Alloc { id, size, .. } => {
                    if size == 0 {
                        return Err(TraceError::ZeroSize { index, id });
                    }
                    if state.insert(id, true) == Some(true) {
                        return Err(TraceError::DuplicateId { index, id });
                    }
                }
                Event::Free { id } => match state.insert(id, false) {
                    Some(true) => {}
                    Some(false) => return Err(TraceError::DoubleFree { index, id }),
                    None => return Err(TraceError::UnknownFree { index, id }),
                },
                Event::RecordStream { id, .. } => {
                    if state.get(&id) != Some(&true) {
                        return Err(TraceError::RecordStreamNotLive { index, id });
                    }
                }
                Event::EmptyCache => {}
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: u64, size: u64) -> Event {
        Event::Alloc {
            id,
            size,
            stream: StreamId::DEFAULT,
        }
    }

    fn record(id: u64) -> Event {
        Event::RecordStream {
            id,
            stream: StreamId(1),
        }
    }

    fn trace(events: Vec<Event>) -> Trace {
        Trace {
            name: "t".into(),
            events,
        }
    }

    #[test]
    fn peak_live_is_the_highest_running_sum() {
        let t = trace(vec![
            alloc(1, 100),
            alloc(2, 50),
            record(2),
            Event::EmptyCache,
            Event::Free { id: 1 },
            alloc(3, 70),
            alloc(4, 10),
        ]);
        assert_eq!(t.peak_live_bytes(), 150);
        assert_eq!(t.alloc_count(), 4);
        assert_eq!(t.empty_cache_count(), 1);
        assert_eq!(t.events[3].id(), None);
        assert_eq!(t.events[4].id(), Some(1));
        assert_eq!(t.validate(), Ok(()));
    }

    #[test]
    fn validate_names_each_problem_and_its_index() {
        let cases = [
            (vec![alloc(1, 0)], TraceError::ZeroSize { index: 0, id: 1 }),
            (
                vec![alloc(1, 8), alloc(1, 8)],
                TraceError::DuplicateId { index: 1, id: 1 },
            ),
            (
                vec![alloc(1, 8), Event::Free { id: 2 }],
                TraceError::UnknownFree { index: 1, id: 2 },
            ),
            (
                vec![alloc(1, 8), Event::Free { id: 1 }, Event::Free { id: 1 }],
                TraceError::DoubleFree { index: 2, id: 1 },
            ),
            (
                vec![alloc(1, 8), Event::Free { id: 1 }, record(1)],
                TraceError::RecordStreamNotLive { index: 2, id: 1 },
            ),
            (
                vec![record(3)],
                TraceError::RecordStreamNotLive { index: 0, id: 3 },
            ),
        ];
        for (events, expected) in cases {
            assert_eq!(trace(events).validate(), Err(expected));
        }
    }

    #[test]
    fn an_id_may_be_reused_after_its_free() {
        let t = trace(vec![alloc(1, 8), Event::Free { id: 1 }, alloc(1, 16)]);
        assert_eq!(t.validate(), Ok(()));
        assert_eq!(t.peak_live_bytes(), 16);
    }
}
