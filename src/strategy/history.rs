//! The allocator's event history for snapshots: PyTorch's `torch.cuda.memory._record_memory_history`.
//!
//! Recording is off until [`Snapshots::record_history`](crate::strategy::Snapshots::record_history) turns it on, and
//! then keeps the last `max_entries` events in a ring buffer, as PyTorch's `alloc_buffer` does, each with
//! its time (microseconds since the Unix epoch, as PyTorch's `time_us`). Off, it costs each operation one
//! test of an `Option`.

use crate::driver::StreamId;
use serde::Serialize;
use std::collections::VecDeque;
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
    /// For `oom`: the bytes the device reported free.
    pub device_free: Option<u64>,
    /// When it happened: microseconds since the Unix epoch (PyTorch's `time_us`).
    pub time_us: u64,
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

/// Records `action` in `history` if recording is on. Inlined so that, off, an event costs one branch.
#[inline]
pub fn record(
    history: &mut Option<History>,
    action: TraceAction,
    addr: u64,
    size: u64,
    stream: StreamId,
) {
    if let Some(h) = history {
        h.push(TraceEntry {
            action,
            addr,
            size,
            stream,
            device_free: None,
            time_us: now_us(),
        });
    }
}

/// Records an out-of-memory of a request of `size` bytes on `stream` in `history`, if recording is on, with
/// the device's free bytes at that moment (PyTorch's `TraceEntry::OOM`).
pub fn record_oom(history: &mut Option<History>, size: u64, stream: StreamId, device_free: u64) {
    if let Some(h) = history {
        h.push(TraceEntry {
            action: TraceAction::Oom,
            addr: 0,
            size,
            stream,
            device_free: Some(device_free),
            time_us: now_us(),
        });
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
        let mut on = Some(History::new(4));
        let before = now_us();
        record(&mut on, TraceAction::Alloc, 1, 512, StreamId(0));
        std::thread::sleep(std::time::Duration::from_millis(20));
        record_oom(&mut on, 1 << 30, StreamId(0), 0);
        let after = now_us();
        let times: Vec<u64> = on.unwrap().entries().iter().map(|e| e.time_us).collect();
        assert!(before <= times[0] && times[1] <= after, "{times:?}");
        assert!(times[1] - times[0] >= 15_000, "{times:?}");
    }

    #[test]
    fn off_records_nothing_and_names_round_trip() {
        let mut off: Option<History> = None;
        record(&mut off, TraceAction::Oom, 0, 1, StreamId(0));
        assert!(off.is_none());
        for name in ["alloc", "free_completed", "segment_unmap", "oom"] {
            assert_eq!(TraceAction::from_name(name).unwrap().as_str(), name);
        }
        assert_eq!(TraceAction::from_name("snapshot"), None);
    }
}
