//! `snapshot()`: the segments as PyTorch reports expandable ones, one per run of mapped pages, each tiled
//! by the blocks (or the parts of free blocks) that lie on those pages.

use super::Expandable;
use super::blocks::BlockState as State;
use super::segment::Segment;
use crate::driver::Driver;
use crate::strategy::snapshot::{BlockState, MemorySnapshot, SnapshotBlock, SnapshotSegment};

impl<D: Driver> Expandable<D> {
    /// The snapshot: for every run of mapped pages of every reservation, a segment whose blocks are the
    /// live and pending blocks on it and the free blocks cut to it. A live or pending block never crosses
    /// a run's end (its pages are all mapped), so only free blocks are cut. Lent pages are left out.
    pub(super) fn memory_snapshot(&self) -> MemorySnapshot {
        let device = self.driver.ordinal();
        let mut segments = Vec::new();
        for seg in self.segments.live() {
            if self.tags.sleeps(seg.tag) {
                segments.extend(self.asleep_segments(seg, device));
                continue;
            }
            for run in seg.pages.mapped_runs(0..seg.pages.len()) {
                let (start, end) = (seg.page_addr(run.start), seg.page_addr(run.end));
                // A lent page's memory is mapped elsewhere too, and reported there: its lent block ends
                // one segment and the next starts after it.
                let mut from = start;
                let mut blocks = Vec::new();
                for (addr, block) in seg.blocks_overlapping(start, end) {
                    let lo = addr.max(start);
                    let hi = (addr + block.size).min(end);
                    let (state, requested_size) = match block.state {
                        State::Lent => {
                            if lo > from {
                                segments.push(segment(seg, device, from, lo, blocks));
                            }
                            blocks = Vec::new();
                            from = hi;
                            continue;
                        }
                        // A free block (the only one `shown` leaves out here) is inactive.
                        state => shown(state).unwrap_or((BlockState::Inactive, 0)),
                    };
                    blocks.push(SnapshotBlock {
                        address: lo,
                        size: hi - lo,
                        requested_size,
                        state,
                    });
                }
                if end > from {
                    segments.push(segment(seg, device, from, end, blocks));
                }
            }
        }
        for s in &mut segments {
            if s.tag.is_none()
                && let Some(slot) = self.segments.slot_of(s.address)
                && let Some(id) = self.segments.at(slot).tag
            {
                s.tag = Some(self.tags.name(id).to_owned());
            }
        }
        let events = self.books.history_entries();
        MemorySnapshot::new(device, segments, events)
    }
}

impl<D: Driver> Expandable<D> {
    /// A sleeping tag's segment as the snapshot shows it: one segment per live or pending block (a pending
    /// one was freed while asleep, its memory waits for the wake), marked asleep: its pages are not mapped,
    /// so no run of mapped pages would show it.
    fn asleep_segments<'a>(
        &'a self,
        seg: &'a Segment,
        device: usize,
    ) -> impl Iterator<Item = SnapshotSegment> + 'a {
        seg.blocks().filter_map(move |(addr, block)| {
            let (state, requested_size) = shown(block.state)?;
            let blocks = vec![SnapshotBlock {
                address: addr,
                size: block.size,
                requested_size,
                state,
            }];
            let mut out = segment(seg, device, addr, addr + block.size, blocks);
            out.tag = seg.tag.map(|id| self.tags.name(id).to_owned());
            out.asleep = true;
            Some(out)
        })
    }
}

/// How the snapshot shows a block the program holds or has freed, with its requested bytes: a live block as
/// allocated, a pending one as freed but still active. `None` for a free or lent block.
fn shown(state: State) -> Option<(BlockState, u64)> {
    match state {
        State::Live { requested } => Some((BlockState::ActiveAllocated, requested)),
        State::Pending { requested } => Some((BlockState::ActivePendingFree, requested)),
        State::Free | State::Lent => None,
    }
}

/// The segment `start .. end` of `seg`, tiled by `blocks`.
fn segment(
    seg: &Segment,
    device: usize,
    start: u64,
    end: u64,
    blocks: Vec<SnapshotBlock>,
) -> SnapshotSegment {
    SnapshotSegment {
        device,
        address: start,
        total_size: end - start,
        stream: seg.stream,
        pool: seg.pool,
        is_expandable: true,
        graph_pool: seg.graph.unwrap_or_default(),
        tag: None,
        asleep: false,
        blocks,
    }
}
