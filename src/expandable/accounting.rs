//! Accounting: the counters every operation keeps up to date, and the [`Stats`] made from them with what the
//! allocator derives on demand (PyTorch's `memory_stats` shapes). A part that owns its state: it knows
//! nothing of segments or the driver.

use crate::driver::DriverCounters;
use crate::strategy::pool::Pool;
use crate::strategy::stats::{PoolStats, Stat, StatArray, Stats};

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
        let c = self;
        for array in c.stat_arrays_mut() {
            array.all.reset_peak();
            array.pool.iter_mut().for_each(Stat::reset_peak);
        }
        c.reserved.reset_peak();
        c.oversize_allocations.reset_peak();
    }

    /// PyTorch's `reset_accumulated_memory_stats`: the allocated and freed totals, retries, OOMs and
    /// synchronizations start again from zero; handles created and released are counted from here.
    pub(super) fn reset_accumulated(&mut self) {
        let forget = |stat: &mut Stat| (stat.allocated, stat.freed) = (0, 0);
        let c = self;
        for array in c.stat_arrays_mut() {
            forget(&mut array.all);
            array.pool.iter_mut().for_each(forget);
        }
        forget(&mut c.reserved);
        forget(&mut c.oversize_allocations);
        (c.retries, c.ooms, c.synchronizations) = (0, 0, 0);
        c.device_counts_base = (c.created, c.released);
    }

    /// Every statistic kept per pool, for the resets.
    fn stat_arrays_mut(&mut self) -> [&mut StatArray; 9] {
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
    }

    /// Counts a block of `size` bytes in `pool` as live (`live`: allocated and active) or as no longer
    /// allocated; it stays active until [`count_inactive`](Self::count_inactive), since a pending block
    /// leaves `allocated` at its free and `active` once its events complete. `oversize`: at least
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
            self.requested.sub(pool, requested);
            self.allocation.sub(pool, 1);
            if oversize {
                self.oversize_allocations.sub(1);
            }
        }
    }

    /// A block of `size` bytes in `pool` stops being active (freed, or its pending free completed).
    pub(super) fn count_inactive(&mut self, pool: Pool, size: u64) {
        self.active.sub(pool, size);
        self.active_count.sub(pool, 1);
    }

    /// The statistics: these counters, with what the allocator derives on demand.
    pub(super) fn stats(&self, derived: Derived) -> Stats {
        let c = self;
        let pool_stats = |pool: Pool| {
            let i = pool.index();
            PoolStats {
                allocated_bytes: c.allocated.pool[i],
                active_bytes: c.active.pool[i],
                requested_bytes: c.requested.pool[i],
                reserved_bytes: c.mapped.pool[i],
                inactive_split_bytes: c.inactive_split.pool[i],
                allocation: c.allocation.pool[i],
                active: c.active_count.pool[i],
                segment: c.segment.pool[i],
                inactive_split: c.inactive_split_count.pool[i],
            }
        };
        Stats {
            allocated_bytes: c.allocated.all,
            reserved_bytes: c.reserved,
            active_bytes: c.active.all,
            requested_bytes: c.requested.all,
            inactive_split_bytes: c.inactive_split.all,
            allocation: c.allocation.all,
            segment: c.segment.all,
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
            driver: derived.driver,
            active: c.active_count.all,
            inactive_split: c.inactive_split_count.all,
            large_pool: pool_stats(Pool::Large),
            small_pool: pool_stats(Pool::Small),
            oversize_allocations: c.oversize_allocations,
            oversize_segments: Stat::default(),
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
    pub driver: DriverCounters,
}
