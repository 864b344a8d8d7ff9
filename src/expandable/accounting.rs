//! Accounting: the counters every operation keeps up to date, and the [`Stats`] made from them with what the
//! allocator derives on demand (PyTorch's `memory_stats` shapes), kept in [`Books`] with the page counts and
//! the history. A part that owns its state: it reads a segment's counts when told one changed, and knows
//! nothing of the driver.

use super::segment::Segment;
use crate::driver::{DriverCounters, StreamId};
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::history::{Events, TraceAction, TraceEntry, TraceTracker};
use crate::strategy::pool::Pool;
use crate::strategy::stats::{PoolArrays, Stat, StatArray, Stats};
use std::collections::BTreeMap;

/// Counters kept up to date by every operation; [`Counters::stats`] adds what is derived on demand.
/// Per-pool statistics are [`StatArray`]s, as PyTorch's.
#[derive(Debug, Default, Clone)]
pub(super) struct Counters {
    pub(super) allocated: StatArray,
    /// Allocated plus pending (freed, waiting for other streams' events) bytes.
    pub(super) active: StatArray,
    pub(super) requested: StatArray,
    pub(super) allocation: StatArray,
    /// Number of live plus pending blocks.
    pub(super) active_count: StatArray,
    /// Every handle held (mapped or pooled).
    pub(super) reserved: Stat,
    /// Mapped bytes per pool (pooled handles belong to no pool).
    pub(super) mapped: StatArray,
    /// Mapped bytes of each private pool's segments (PyTorch's `reserved_bytes_by_private_pools`), kept at
    /// 0 once the pool's memory is gone, with its peak and totals, until a reset.
    pub(super) mapped_by_graph: BTreeMap<GraphPool, StatArray>,
    pub(super) segment: StatArray,
    /// Bytes of touched pages that no active block uses.
    pub(super) inactive_split: StatArray,
    /// Free blocks that share a page with an active block.
    pub(super) inactive_split_count: StatArray,
    pub(super) oversize_allocations: Stat,
    /// Idle pages unmapped to serve a request (compaction).
    pub(super) compacted: u64,
    pub(super) retries: u64,
    pub(super) ooms: u64,
    pub(super) created: u64,
    pub(super) released: u64,
    pub(super) synchronizations: u64,
    pub(super) handles_reused: u64,
    /// `created` and `released` at the last `reset_accumulated_stats`: the statistics report the handles
    /// created and released since, while the invariants check the totals.
    pub(super) device_counts_base: (u64, u64),
}

impl Counters {
    /// PyTorch's `reset_peak_memory_stats`: every peak becomes the current value.
    pub(super) fn reset_peaks(&mut self) {
        self.reset_each(Stat::reset_peak);
    }

    /// PyTorch's `reset_accumulated_memory_stats`: the allocated and freed totals, retries, OOMs and
    /// synchronizations start again from zero; handles created and released are counted from here.
    pub(super) fn reset_accumulated(&mut self) {
        self.reset_each(Stat::reset_accumulated);
        (self.retries, self.ooms, self.synchronizations) = (0, 0, 0);
        self.device_counts_base = (self.created, self.released);
    }

    /// Applies a reset to every statistic; a private pool whose memory is gone, and whose peak and
    /// totals both resets have cleared, is no longer listed.
    fn reset_each(&mut self, reset: impl Fn(&mut Stat)) {
        for array in self.stat_arrays_mut() {
            array.reset(&reset);
        }
        reset(&mut self.reserved);
        reset(&mut self.oversize_allocations);
        StatArray::reset_by_pool(&mut self.mapped_by_graph, reset);
    }

    /// Every statistic kept per pool, for the resets.
    fn stat_arrays_mut(&mut self) -> impl Iterator<Item = &mut StatArray> {
        [
            &mut self.allocated,
            &mut self.active,
            &mut self.requested,
            &mut self.allocation,
            &mut self.active_count,
            &mut self.mapped,
            &mut self.segment,
            &mut self.inactive_split,
            &mut self.inactive_split_count,
        ]
        .into_iter()
    }

    /// `bytes` of `seg` were mapped (`up`) or unmapped: its pool's reserved bytes, and its private pool's.
    pub(super) fn count_mapped(&mut self, seg: &Segment, bytes: u64, up: bool) {
        let by_graph = (seg.graph).map(|graph| self.mapped_by_graph.entry(graph).or_default());
        for array in [Some(&mut self.mapped), by_graph].into_iter().flatten() {
            if up {
                array.add(seg.pool, bytes);
            } else {
                array.sub(seg.pool, bytes);
            }
        }
    }

    /// Counts a block of `size` bytes in `pool` as live (`live`: allocated and active) or as no longer
    /// allocated; it stays active until [`count_inactive`](Self::count_inactive), since a pending block
    /// leaves `allocated` at its free, and `active` and `requested` once its events complete. `oversize`: at least
    /// `max_split_size`.
    pub(super) fn count_block(
        &mut self,
        pool: Pool,
        size: u64,
        requested: u64,
        live: bool,
        oversize: bool,
    ) {
        if live {
            self.allocated.add(pool, size);
            self.requested.add(pool, requested);
            self.allocation.add(pool, 1);
            self.active.add(pool, size);
            self.active_count.add(pool, 1);
            if oversize {
                self.oversize_allocations.add(1);
            }
        } else {
            self.allocated.sub(pool, size);
            self.allocation.sub(pool, 1);
            if oversize {
                self.oversize_allocations.sub(1);
            }
        }
    }

    /// A block of `size` bytes in `pool`, for `requested` bytes, stops being active (freed, or its pending
    /// free completed): its requested bytes go with it, as PyTorch's `requested_bytes` in `free_block`.
    pub(super) fn count_inactive(&mut self, pool: Pool, size: u64, requested: u64) {
        self.active.sub(pool, size);
        self.active_count.sub(pool, 1);
        self.requested.sub(pool, requested);
    }

    /// The statistics: these counters, with what the allocator derives on demand.
    pub(super) fn stats(&self, derived: Derived) -> Stats {
        let c = self;
        Stats {
            // Pooled handles belong to no pool: the pools' reserved bytes are their mapped pages.
            reserved_bytes: c.reserved,
            num_alloc_retries: c.retries,
            num_ooms: c.ooms,
            num_device_alloc: c.created - c.device_counts_base.0,
            num_device_free: c.released - c.device_counts_base.1,
            num_synchronizations: c.synchronizations,
            largest_free_block: derived.largest_free_block,
            idle_mapped_bytes: derived.idle_mapped_bytes,
            idle_handle_bytes: derived.idle_handle_bytes,
            handles_reused: c.handles_reused,
            lent_bytes: derived.lent_bytes,
            graph_pool_bytes: derived.graph_pool_bytes,
            graph_pools: derived.graph_pools,
            asleep_bytes: derived.asleep_bytes,
            host_kept_bytes: derived.host_kept_bytes,
            driver: derived.driver,
            oversize_allocations: c.oversize_allocations,
            ..Stats::from_pools(PoolArrays {
                allocated_bytes: &c.allocated,
                active_bytes: &c.active,
                requested_bytes: &c.requested,
                reserved_bytes: &c.mapped,
                inactive_split_bytes: &c.inactive_split,
                allocation: &c.allocation,
                active: &c.active_count,
                segment: &c.segment,
                inactive_split: &c.inactive_split_count,
            })
        }
    }
}

/// What the allocator derives on demand for its statistics, beside the counters.
#[derive(Clone, Copy, Debug)]
pub(super) struct Derived {
    pub largest_free_block: u64,
    pub idle_mapped_bytes: u64,
    pub idle_handle_bytes: u64,
    pub lent_bytes: u64,
    pub graph_pool_bytes: u64,
    pub graph_pools: u64,
    pub asleep_bytes: u64,
    pub host_kept_bytes: u64,
    pub driver: DriverCounters,
}

/// The counts of one segment that the allocator-wide totals follow, read before and after a change.
#[derive(Clone, Copy, Debug)]
pub(super) struct SlotCounts {
    touched: usize,
    idle: usize,
    straddling: usize,
}

impl SlotCounts {
    /// The counts of `seg` now.
    pub(super) fn of(seg: &Segment) -> Self {
        Self {
            touched: seg.pages.touched_count(),
            idle: seg.pages.idle_count(),
            straddling: seg.straddling_count(),
        }
    }
}

/// The books: the counters, the page counts the statistics derive from (touched, idle and lent pages), the
/// block being carved, and the history recorded for snapshots.
#[derive(Debug)]
pub(super) struct Books {
    /// The counters; a plain record every operation updates.
    pub(super) counters: Counters,
    /// Pages touched by active blocks, per pool.
    touched_pages: [usize; 2],
    idle_pages: usize,
    /// Lent pages per pool of their home segment (touched there by their lent block, which uses nothing).
    lent_pages: [usize; 2],
    /// The block being backed with pages (pool, bytes): carved, not yet counted as allocated.
    carving: Option<(Pool, u64)>,
    /// Where events go: the history kept for snapshots, and the trace trackers.
    events: Events,
    page_size: u64,
    /// [`Config::max_split_size`](crate::Config): a block at least this large is oversize.
    max_split_size: Option<u64>,
}

impl Books {
    /// Empty books for pages of `page_size` bytes.
    pub(super) fn open(page_size: u64, max_split_size: Option<u64>) -> Self {
        Self {
            counters: Counters::default(),
            touched_pages: [0; 2],
            idle_pages: 0,
            lent_pages: [0; 2],
            carving: None,
            events: Events::default(),
            page_size,
            max_split_size,
        }
    }

    /// Re-reads the touched and idle page counts and the straddling free blocks of `seg` after it changed,
    /// keeping the allocator-wide counts and the non-releasable (inactive split) statistics of its pool in
    /// step: bytes of touched pages that no active (live or pending) block uses, and the free blocks that
    /// share such pages.
    pub(super) fn refresh(&mut self, seg: &Segment, before: SlotCounts) {
        let after = SlotCounts::of(seg);
        let pool = seg.pool;
        let p = pool.index();
        self.touched_pages[p] = self.touched_pages[p] + after.touched - before.touched;
        self.idle_pages = self.idle_pages + after.idle - before.idle;
        let carving = match self.carving {
            Some((carving_pool, bytes)) if carving_pool == pool => bytes,
            _ => 0,
        };
        let stranded = ((self.touched_pages[p] - self.lent_pages[p]) as u64 * self.page_size)
            .saturating_sub(self.counters.active.of(pool) + carving);
        self.counters.inactive_split.set(pool, stranded);
        if after.straddling != before.straddling {
            let count = self.counters.inactive_split_count.of(pool) + after.straddling as u64
                - before.straddling as u64;
            self.counters.inactive_split_count.set(pool, count);
        }
    }

    /// [`refresh`](Self::refresh) where pages of `seg` became idle or stopped being idle since `before`
    /// (pages mapped where no live block is: a tag's wake maps its graph pools' temporaries so).
    pub(super) fn refresh_if_idle_moved(&mut self, seg: &Segment, before: SlotCounts) {
        if seg.pages.idle_count() != before.idle {
            self.refresh(seg, before);
        }
    }

    /// Counts a block as live or no longer allocated ([`Counters::count_block`]).
    pub(super) fn count_block(&mut self, pool: Pool, size: u64, requested: u64, live: bool) {
        let oversize = self.max_split_size.is_some_and(|max| size >= max);
        (self.counters).count_block(pool, size, requested, live, oversize);
    }

    /// Records an event of memory of private pool `graph`, if any, for snapshots and trackers, if either
    /// wants it.
    #[inline]
    pub(super) fn record(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        graph: Option<GraphPool>,
    ) {
        (self.events).record(action, addr, size, stream, graph.unwrap_or_default());
    }

    /// Records an out-of-memory of a request of `size` bytes for private pool `graph`, if any, if recording
    /// or tracked.
    pub(super) fn record_oom(
        &mut self,
        size: u64,
        stream: StreamId,
        graph: Option<GraphPool>,
        device_free: u64,
    ) {
        (self.events).record_oom(size, stream, graph.unwrap_or_default(), device_free);
    }

    /// Starts (`Some(max_entries)`) or stops recording history.
    pub(super) fn record_history(&mut self, max_entries: Option<usize>) {
        self.events.keep(max_entries);
    }

    /// Calls `tracker` with every event from now on.
    pub(super) fn attach_trace_tracker(&mut self, tracker: TraceTracker) {
        self.events.track(tracker);
    }

    /// The history recorded, oldest first.
    pub(super) fn history_entries(&self) -> Vec<TraceEntry> {
        self.events.entries()
    }

    /// The block being backed with pages, if any (pool, bytes).
    pub(super) fn set_carving(&mut self, carving: Option<(Pool, u64)>) {
        self.carving = carving;
    }

    /// Idle pages, allocator-wide.
    pub(super) fn idle_pages(&self) -> usize {
        self.idle_pages
    }

    /// Pages touched by active blocks in `pool`.
    pub(super) fn touched_pages(&self, pool: Pool) -> usize {
        self.touched_pages[pool.index()]
    }

    /// Lent pages per pool.
    pub(super) fn lent_pages(&self) -> [usize; 2] {
        self.lent_pages
    }

    /// One more page of a chunk in `pool` lent (`up`) or back home.
    pub(super) fn count_lent(&mut self, pool: Pool, up: bool) {
        match up {
            true => self.lent_pages[pool.index()] += 1,
            false => self.lent_pages[pool.index()] -= 1,
        }
    }

    /// Forgets every lent page (teardown).
    pub(super) fn forget_lent(&mut self) {
        self.lent_pages = [0; 2];
    }
}
