//! `snapshot()`, as PyTorch's `DeviceCachingAllocator::snapshot`: one segment per `cudaMalloc`'d segment,
//! and for expandable segments one per contiguous run of mapped blocks.

use super::Split;
use cuvmm::driver::Driver;
use cuvmm::strategy::snapshot::{BlockState, MemorySnapshot, SnapshotBlock, SnapshotSegment};

impl<D: Driver> Split<D> {
    /// The snapshot of every segment, with the events recorded so far.
    pub(super) fn memory_snapshot(&self) -> MemorySnapshot {
        let device = self.driver.ordinal();
        let mut segments: Vec<SnapshotSegment> = Vec::new();
        for (&start, seg) in &self.segments {
            let mut current: Option<SnapshotSegment> = None;
            for (addr, b) in self.blocks.of_segment(start) {
                if !b.mapped {
                    segments.extend(current.take());
                    continue;
                }
                let segment = current.get_or_insert_with(|| SnapshotSegment {
                    device,
                    address: addr,
                    total_size: 0,
                    stream: seg.stream,
                    pool: seg.pool,
                    is_expandable: seg.expandable.is_some(),
                    graph_pool: super::NO_POOL,
                    tag: None,
                    asleep: false,
                    blocks: Vec::new(),
                });
                segment.total_size += b.size;
                segment.blocks.push(SnapshotBlock {
                    address: addr,
                    size: b.size,
                    requested_size: b.requested,
                    state: if b.allocated {
                        BlockState::ActiveAllocated
                    } else {
                        BlockState::Inactive
                    },
                });
            }
            segments.extend(current);
        }
        MemorySnapshot::new(device, segments, self.events.entries())
    }
}
