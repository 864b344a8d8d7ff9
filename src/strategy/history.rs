//! The allocator's events: the history kept for snapshots (PyTorch's `torch.cuda.memory._record_memory_history`)
//! and the trackers called with each event as it happens (PyTorch's `attachAllocatorTraceTracker`).
//!
//! Recording is off until [`Snapshots::record_history`](crate::strategy::Snapshots::record_history) turns it on, and
//! then keeps the last `max_entries` events in a ring buffer, as PyTorch's `alloc_buffer` does, each with
//! its time (microseconds since the Unix epoch, as PyTorch's `time_us`). Trackers are called whether or not
//! it records, as PyTorch calls them. With neither, an event costs each operation two tests.

use crate::driver::StreamId;
use crate::strategy::graph_pool::GraphPool;
use serde::Serialize;
use std::collections::VecDeque;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Arc;
use std::time::{SystemTime, UNIX_EPOCH};

/// What happened, under PyTorch's names for trace entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum TraceAction {
    /// A block was handed out.
    Alloc,
    /// The program freed a block.
    FreeRequested,
    /// The freed block became reusable (at once, or once other streams' events completed).
    FreeCompleted,
    /// A segment was `cudaMalloc`'d.
    SegmentAlloc,
    /// A segment was `cudaFree`'d.
    SegmentFree,
    /// Pages were mapped.
    SegmentMap,
    /// Pages were unmapped.
    SegmentUnmap,
    /// A request failed with out-of-memory.
    Oom,
}

impl TraceAction {
    /// PyTorch's name for the action.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Alloc => "alloc",
            Self::FreeRequested => "free_requested",
            Self::FreeCompleted => "free_completed",
            Self::SegmentAlloc => "segment_alloc",
            Self::SegmentFree => "segment_free",
            Self::SegmentMap => "segment_map",
            Self::SegmentUnmap => "segment_unmap",
            Self::Oom => "oom",
        }
    }

    /// The action PyTorch calls `name`.
    pub fn from_name(name: &str) -> Option<Self> {
        [
            Self::Alloc,
            Self::FreeRequested,
            Self::FreeCompleted,
            Self::SegmentAlloc,
            Self::SegmentFree,
            Self::SegmentMap,
            Self::SegmentUnmap,
            Self::Oom,
        ]
        .into_iter()
        .find(|a| a.as_str() == name)
    }
}

/// One recorded event, as PyTorch's `TraceEntry`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct TraceEntry {
    /// What happened.
    pub action: TraceAction,
    /// The address concerned (0 for `oom`).
    pub addr: u64,
    /// Bytes: requested bytes for alloc and frees, segment or mapping bytes for segment events, the
    /// (rounded) request for `oom`.
    pub size: u64,
    /// The stream.
    pub stream: StreamId,
    /// The private pool the memory is of (PyTorch's `mempool_`; for `oom`, the pool asked of);
    /// [`GraphPool::NONE`] for none.
    pub pool: GraphPool,
    /// For `oom`: the bytes the device reported free.
    pub device_free: Option<u64>,
    /// When it happened: microseconds since the Unix epoch (PyTorch's `time_us`).
    pub time_us: u64,
}

impl TraceEntry {
    /// `action` happening now.
    fn now(action: TraceAction, addr: u64, size: u64, stream: StreamId, pool: GraphPool) -> Self {
        TraceEntry {
            action,
            addr,
            size,
            stream,
            pool,
            device_free: None,
            time_us: now_us(),
        }
    }
}

/// Now, in microseconds since the Unix epoch (0 for a clock set before it).
fn now_us() -> u64 {
    (SystemTime::now().duration_since(UNIX_EPOCH)).map_or(0, |d| d.as_micros() as u64)
}

/// The last `max_entries` events, oldest first.
#[derive(Clone, Debug)]
pub struct History {
    max_entries: usize,
    entries: VecDeque<TraceEntry>,
}

impl History {
    /// An empty history keeping at most `max_entries` events (at least one).
    pub fn new(max_entries: usize) -> Self {
        let max_entries = max_entries.max(1);
        Self {
            max_entries,
            entries: VecDeque::with_capacity(max_entries.min(1 << 16)),
        }
    }

    /// Appends an event, dropping the oldest when full.
    pub fn push(&mut self, entry: TraceEntry) {
        if self.entries.len() == self.max_entries {
            self.entries.pop_front();
        }
        self.entries.push_back(entry);
    }

    /// The events kept, oldest first.
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.entries.iter().copied().collect()
    }
}

/// A function called with each event as it happens (PyTorch's allocator trace tracker: NCCL's and
/// torchcomms' memory-registration hooks read the `segment_map` and `segment_unmap` events). It is called on
/// the thread the event happens on, under the allocator's lock, as PyTorch calls its trackers, so it must not
/// call the allocator (that thread would wait for itself). A panic in it is caught and logged, and the
/// operation goes on.
pub type TraceTracker = Arc<dyn Fn(&TraceEntry) + Send + Sync>;

/// Where a strategy's events go: the history kept for snapshots, while recording, and the trackers.
#[derive(Clone, Default)]
pub struct Events {
    kept: Option<History>,
    trackers: Vec<TraceTracker>,
}

impl fmt::Debug for Events {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Events")
            .field("kept", &self.kept)
            .field("trackers", &self.trackers.len())
            .finish()
    }
}

impl Events {
    /// Starts keeping the last `max_entries` events (`Some`), or stops and forgets them (`None`).
    pub fn keep(&mut self, max_entries: Option<usize>) {
        self.kept = max_entries.map(History::new);
    }

    /// Calls `tracker` with every event from now on, after the trackers attached before it (PyTorch's
    /// trackers cannot be detached either).
    pub fn track(&mut self, tracker: TraceTracker) {
        self.trackers.push(tracker);
    }

    /// Whether an event goes anywhere.
    #[inline]
    fn on(&self) -> bool {
        self.kept.is_some() || !self.trackers.is_empty()
    }

    /// The events kept, oldest first (none while not recording).
    pub fn entries(&self) -> Vec<TraceEntry> {
        self.kept.as_ref().map(History::entries).unwrap_or_default()
    }

    /// Records `action` of memory of `pool` ([`GraphPool::NONE`] for none). Inlined so that, with nowhere to
    /// go, an event costs two tests.
    #[inline]
    pub fn record(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPool,
    ) {
        if self.on() {
            self.push(TraceEntry::now(action, addr, size, stream, pool));
        }
    }

    /// Records an out-of-memory of a request of `size` bytes on `stream` for `pool`, with the device's free
    /// bytes at that moment (PyTorch's `TraceEntry::OOM`).
    pub fn record_oom(&mut self, size: u64, stream: StreamId, pool: GraphPool, device_free: u64) {
        if self.on() {
            let entry = TraceEntry::now(TraceAction::Oom, 0, size, stream, pool);
            self.push(TraceEntry {
                device_free: Some(device_free),
                ..entry
            });
        }
    }

    fn push(&mut self, entry: TraceEntry) {
        for tracker in &self.trackers {
            // Unwinding out of the middle of an operation would leave the allocator half changed.
            if catch_unwind(AssertUnwindSafe(|| tracker(&entry))).is_err() {
                tracing::error!(
                    ?entry,
                    "cuvmm: an allocator trace tracker panicked; the event is dropped for it"
                );
            }
        }
        if let Some(kept) = &mut self.kept {
            kept.push(entry);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(addr: u64) -> TraceEntry {
        TraceEntry {
            action: TraceAction::Alloc,
            addr,
            size: 512,
            stream: StreamId(0),
            pool: GraphPool::NONE,
            device_free: None,
            time_us: 0,
        }
    }

    #[test]
    fn the_ring_buffer_keeps_the_newest_entries_in_order() {
        let mut h = History::new(3);
        for addr in 1..=5 {
            h.push(entry(addr));
        }
        let addrs: Vec<u64> = h.entries().iter().map(|e| e.addr).collect();
        assert_eq!(addrs, [3, 4, 5]);
    }

    #[test]
    fn each_event_carries_its_own_time() {
        let mut on = Events::default();
        on.keep(Some(4));
        let before = now_us();
        on.record(TraceAction::Alloc, 1, 512, StreamId(0), GraphPool::NONE);
        std::thread::sleep(std::time::Duration::from_millis(20));
        on.record_oom(1 << 30, StreamId(0), GraphPool::NONE, 0);
        let after = now_us();
        let times: Vec<u64> = on.entries().iter().map(|e| e.time_us).collect();
        assert!(before <= times[0] && times[1] <= after, "{times:?}");
        assert!(times[1] - times[0] >= 15_000, "{times:?}");
    }

    #[test]
    fn off_records_nothing_and_names_round_trip() {
        let mut off = Events::default();
        off.record(TraceAction::Oom, 0, 1, StreamId(0), GraphPool::NONE);
        assert!(off.entries().is_empty());
        off.keep(Some(2));
        off.keep(None);
        off.record(TraceAction::Alloc, 0, 1, StreamId(0), GraphPool::NONE);
        assert!(off.entries().is_empty(), "stopped recording keeps nothing");
        for name in ["alloc", "free_completed", "segment_unmap", "oom"] {
            assert_eq!(TraceAction::from_name(name).unwrap().as_str(), name);
        }
        assert_eq!(TraceAction::from_name("snapshot"), None);
    }

    #[test]
    fn trackers_see_every_event_with_or_without_recording_and_a_panic_in_one_is_contained() {
        use std::sync::Mutex;
        let seen = Arc::new(Mutex::new(Vec::new()));
        let mut events = Events::default();
        events.track(Arc::new(|_: &TraceEntry| panic!("a tracker's bug")));
        let sink = Arc::clone(&seen);
        events.track(Arc::new(move |e: &TraceEntry| {
            sink.lock().unwrap().push((e.action, e.addr, e.pool))
        }));
        let (graph, none) = (GraphPool(0, 3), GraphPool::NONE);
        events.record(
            TraceAction::SegmentMap,
            1 << 21,
            2 << 20,
            StreamId(0),
            graph,
        );
        events.keep(Some(1));
        events.record(TraceAction::Alloc, 1 << 21, 512, StreamId(0), none);
        events.keep(None);
        events.record_oom(1 << 40, StreamId(0), graph, 7);
        let seen = seen.lock().unwrap().clone();
        assert_eq!(
            seen,
            [
                (TraceAction::SegmentMap, 1 << 21, graph),
                (TraceAction::Alloc, 1 << 21, none),
                (TraceAction::Oom, 0, graph)
            ],
            "the tracker after the panicking one still sees each event, with its pool"
        );
        assert!(events.entries().is_empty(), "recording stopped");
    }
}
