//! A memory snapshot in the shape of PyTorch's `torch.cuda.memory._snapshot()`: the segments the allocator
//! holds, each tiled exactly by its blocks, and the recorded history of events per device.
//!
//! A segment here is what PyTorch reports: one `cudaMalloc`'d segment, or one contiguous run of mapped
//! memory of an expandable reservation (for cuvmm, a run of mapped pages; a free block that runs past the
//! mapped pages is cut at the run's end). [`pickle`] writes it as the pickle PyTorch's memory viewer reads.

pub mod pickle;

use crate::driver::StreamId;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::TraceEntry;
use crate::strategy::pool::Pool;

/// What a block of a snapshot segment holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockState {
    /// Handed out (`active_allocated`).
    ActiveAllocated,
    /// Freed by the program but not reusable yet: other streams may still use it (`active_pending_free`).
    ActivePendingFree,
    /// Free (`inactive`).
    Inactive,
}

impl BlockState {
    /// PyTorch's name for the state.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::ActiveAllocated => "active_allocated",
            Self::ActivePendingFree => "active_pending_free",
            Self::Inactive => "inactive",
        }
    }

    /// Whether the block is in use (allocated or pending).
    pub fn is_active(self) -> bool {
        self != Self::Inactive
    }
}

/// One block of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SnapshotBlock {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes its owner asked for (0 for a free block).
    pub requested_size: u64,
    /// What it holds.
    pub state: BlockState,
}

/// One segment, tiled by its blocks in address order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SnapshotSegment {
    /// Device ordinal.
    pub device: usize,
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Its stream.
    pub stream: StreamId,
    /// Its pool.
    pub pool: Pool,
    /// Whether it is (part of) an expandable reservation.
    pub is_expandable: bool,
    /// The CUDA graph pool the segment serves (PyTorch's `segment_pool_id`); `{0, 0}` for none.
    pub graph_pool: GraphPool,
    /// The tag its allocations were made under (`alloc_tagged`), if any.
    pub tag: Option<String>,
    /// Whether the tag sleeps: the segment lists the live blocks of the tag's reservation, whose pages are
    /// unmapped until the tag wakes (not device memory now).
    pub asleep: bool,
    /// Its blocks, in address order, tiling it.
    pub blocks: Vec<SnapshotBlock>,
}

impl SnapshotSegment {
    /// Bytes of allocated blocks.
    pub fn allocated_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .map(|b| b.size)
            .sum()
    }

    /// Bytes of active (allocated or pending) blocks.
    pub fn active_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state.is_active())
            .map(|b| b.size)
            .sum()
    }

    /// Bytes requested by the owners of active blocks.
    pub fn requested_size(&self) -> u64 {
        self.blocks
            .iter()
            .filter(|b| b.state.is_active())
            .map(|b| b.requested_size)
            .sum()
    }
}

/// The allocator's state and history.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemorySnapshot {
    /// Segments, in address order.
    pub segments: Vec<SnapshotSegment>,
    /// Per device ordinal, the recorded events, oldest first (empty when history recording is off).
    pub device_traces: Vec<Vec<TraceEntry>>,
}

/// A segment whose blocks do not tile it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("segment {segment:#x}: expected a block at {expected:#x}, found {found:#x}")]
pub struct TilingError {
    /// Start of the segment.
    pub segment: u64,
    /// Where the next block (or the segment's end) should be.
    pub expected: u64,
    /// Where it is.
    pub found: u64,
}

impl MemorySnapshot {
    /// Bytes requested by the owners of blocks freed whose memory still waits (for other streams' events, or
    /// for their tag's wake): they count in `requested_bytes` until then, as PyTorch's until its events
    /// complete.
    pub fn pending_requested_bytes(&self) -> u64 {
        (self.segments.iter().flat_map(|s| &s.blocks))
            .filter(|b| b.state == BlockState::ActivePendingFree)
            .map(|b| b.requested_size)
            .sum()
    }

    /// Checks that the blocks of every segment follow each other from its start to its end, none empty.
    pub fn check_tiling(&self) -> Result<(), TilingError> {
        for seg in &self.segments {
            let mut expected = seg.address;
            for block in &seg.blocks {
                if block.address != expected || block.size == 0 {
                    return Err(TilingError {
                        segment: seg.address,
                        expected,
                        found: block.address,
                    });
                }
                expected += block.size;
            }
            if expected != seg.address + seg.total_size {
                return Err(TilingError {
                    segment: seg.address,
                    expected: seg.address + seg.total_size,
                    found: expected,
                });
            }
        }
        Ok(())
    }

    /// Bytes of all segments.
    pub fn reserved(&self) -> u64 {
        self.segments.iter().map(|s| s.total_size).sum()
    }

    /// Bytes of allocated blocks in all segments.
    pub fn allocated(&self) -> u64 {
        self.segments
            .iter()
            .map(SnapshotSegment::allocated_size)
            .sum()
    }

    /// A snapshot of `segments` on device `device` with its recorded `events`.
    pub fn new(device: usize, mut segments: Vec<SnapshotSegment>, events: Vec<TraceEntry>) -> Self {
        segments.sort_by_key(|s| s.address);
        let mut device_traces = vec![Vec::new(); device + 1];
        device_traces[device] = events;
        Self {
            segments,
            device_traces,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn block(address: u64, size: u64) -> SnapshotBlock {
        SnapshotBlock {
            address,
            size,
            requested_size: size,
            state: BlockState::ActiveAllocated,
        }
    }

    #[test]
    fn tiling_is_checked_from_start_to_end() {
        let mut snap = MemorySnapshot::new(
            0,
            vec![SnapshotSegment {
                device: 0,
                address: 0x1000,
                total_size: 0x400,
                stream: StreamId(0),
                pool: Pool::Small,
                graph_pool: GraphPool::NONE,
                tag: None,
                asleep: false,
                is_expandable: false,
                blocks: vec![block(0x1000, 0x200), block(0x1200, 0x200)],
            }],
            Vec::new(),
        );
        assert_eq!(snap.check_tiling(), Ok(()));
        assert_eq!(snap.allocated(), 0x400);
        snap.segments[0].blocks[1].address = 0x1300;
        assert!(snap.check_tiling().is_err());
        snap.segments[0].blocks[1] = block(0x1200, 0x100);
        let err = snap.check_tiling().unwrap_err();
        assert_eq!((err.expected, err.found), (0x1400, 0x1300));
    }
}
