//! Statistics in the shape of PyTorch's `torch.cuda.memory_stats()`, plus what PyTorch lacks.

use crate::driver::DriverCounters;
use crate::strategy::pool::Pool;
use serde::Serialize;
use std::collections::BTreeMap;

/// One statistic with PyTorch's four views: current value, peak, and cumulative increases and decreases.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stat {
    /// The value now.
    pub current: u64,
    /// The highest value since creation (or the last [`Stat::reset_peak`]).
    pub peak: u64,
    /// Sum of all increases.
    pub allocated: u64,
    /// Sum of all decreases.
    pub freed: u64,
}

impl Stat {
    /// Its four values under PyTorch's names.
    pub fn views(&self) -> [(&'static str, u64); 4] {
        [
            ("current", self.current),
            ("peak", self.peak),
            ("allocated", self.allocated),
            ("freed", self.freed),
        ]
    }

    /// Adds `n` to the current value.
    #[inline]
    pub fn add(&mut self, n: u64) {
        self.current += n;
        self.allocated += n;
        self.peak = self.peak.max(self.current);
    }

    /// Subtracts `n` from the current value.
    ///
    /// # Panics
    /// In debug builds, if `n` exceeds the current value: a counter going negative is an allocator bug.
    #[inline]
    pub fn sub(&mut self, n: u64) {
        debug_assert!(
            n <= self.current,
            "stat underflow: {} - {}",
            self.current,
            n
        );
        self.current -= n;
        self.freed += n;
    }

    /// Sets the peak to the current value (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peak(&mut self) {
        self.peak = self.current;
    }

    /// Zeroes the cumulative increases and decreases (PyTorch's `reset_accumulated_memory_stats`).
    pub fn reset_accumulated(&mut self) {
        (self.allocated, self.freed) = (0, 0);
    }

    /// Moves the current value to `value`, counting the change as an increase or a decrease.
    #[inline]
    pub fn set(&mut self, value: u64) {
        if value > self.current {
            self.add(value - self.current);
        } else {
            self.sub(self.current - value);
        }
    }
}

/// One pool's share of the statistics PyTorch breaks down by pool (`<stat>.large_pool.*`,
/// `<stat>.small_pool.*`): what `memory_summary` prints as "from large pool" and "from small pool".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct PoolStats {
    /// Bytes of live allocations in this pool.
    pub allocated_bytes: Stat,
    /// Bytes of live and not yet reusable (pending) allocations in this pool.
    pub active_bytes: Stat,
    /// Bytes requested by callers in this pool.
    pub requested_bytes: Stat,
    /// Physical bytes backing this pool's segments. For cuvmm, mapped pages only: pooled handles belong to no
    /// pool (they are [`Stats::idle_handle_bytes`]), so the two pools add up to the total less those.
    pub reserved_bytes: Stat,
    /// Free bytes this pool cannot give back because they share a segment (classic) or a page (cuvmm) with
    /// active blocks.
    pub inactive_split_bytes: Stat,
    /// Number of live allocations in this pool.
    pub allocation: Stat,
    /// Number of live and pending allocations in this pool.
    pub active: Stat,
    /// Number of segments of this pool.
    pub segment: Stat,
    /// Number of free blocks counted in `inactive_split_bytes`.
    pub inactive_split: Stat,
}

/// A statistic kept for all pools and for each pool, as PyTorch's `StatArray`: every change to one pool
/// changes the total by the same amount, so each has its own true peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatArray {
    /// All pools together.
    pub all: Stat,
    /// Per pool, indexed by [`Pool::index`].
    pub pool: [Stat; 2],
}

impl StatArray {
    /// Inserts this array into `out` under PyTorch's `memory_stats()` key names below `name`
    /// (`{name}.{all,large_pool,small_pool}.{current,peak,allocated,freed}`).
    pub fn insert_pytorch_keys(&self, name: &str, out: &mut BTreeMap<String, u64>) {
        let (small, large) = (
            self.pool[Pool::Small.index()],
            self.pool[Pool::Large.index()],
        );
        for (pool, stat) in [
            ("all", self.all),
            ("large_pool", large),
            ("small_pool", small),
        ] {
            for (view, value) in stat.views() {
                out.insert(format!("{name}.{pool}.{view}"), value);
            }
        }
    }

    /// Applies a reset (such as [`Stat::reset_peak`]) to the total and to each pool.
    pub fn reset(&mut self, reset: impl Fn(&mut Stat)) {
        reset(&mut self.all);
        self.pool.iter_mut().for_each(reset);
    }

    /// Applies a reset to each private pool's array in `by_pool`, then forgets the pools it left all zero:
    /// a pool whose memory is gone, and whose peak and totals both resets have cleared, is no longer
    /// listed (as PyTorch's `reserved_bytes_by_private_pools`).
    pub fn reset_by_pool<K: Ord>(by_pool: &mut BTreeMap<K, StatArray>, reset: impl Fn(&mut Stat)) {
        for array in by_pool.values_mut() {
            array.reset(&reset);
        }
        by_pool.retain(|_, array| array.all != Stat::default());
    }

    /// Adds `n` to `pool` (and to the total).
    #[inline]
    pub fn add(&mut self, pool: Pool, n: u64) {
        self.all.add(n);
        self.pool[pool.index()].add(n);
    }

    /// Subtracts `n` from `pool` (and from the total).
    #[inline]
    pub fn sub(&mut self, pool: Pool, n: u64) {
        self.all.sub(n);
        self.pool[pool.index()].sub(n);
    }

    /// Moves `pool`'s current value to `value` (and the total by as much).
    #[inline]
    pub fn set(&mut self, pool: Pool, value: u64) {
        let current = self.pool[pool.index()].current;
        if value == current {
            // Nothing moves (a subtraction of 0 would leave every field as it is).
        } else if value > current {
            self.add(pool, value - current);
        } else {
            self.sub(pool, current - value);
        }
    }

    /// The current total.
    #[inline]
    pub fn current(&self) -> u64 {
        self.all.current
    }

    /// The current value of `pool`.
    #[inline]
    pub fn of(&self, pool: Pool) -> u64 {
        self.pool[pool.index()].current
    }
}

/// The per-pool statistics a strategy keeps, as PyTorch's `DeviceStats` arrays, borrowed to make a
/// [`Stats`] ([`Stats::from_pools`]): the one path from counters to statistics for every strategy.
#[derive(Clone, Copy, Debug)]
pub struct PoolArrays<'a> {
    /// Bytes of allocated blocks (PyTorch's `allocated_bytes`).
    pub allocated_bytes: &'a StatArray,
    /// Bytes of allocated blocks and blocks waiting for other streams (`active_bytes`).
    pub active_bytes: &'a StatArray,
    /// Bytes the program asked for, before rounding (`requested_bytes`).
    pub requested_bytes: &'a StatArray,
    /// Physical bytes held (`reserved_bytes`).
    pub reserved_bytes: &'a StatArray,
    /// Bytes of free blocks split off a segment a live block also uses (`inactive_split_bytes`).
    pub inactive_split_bytes: &'a StatArray,
    /// Allocated blocks (`allocation`).
    pub allocation: &'a StatArray,
    /// Active blocks (`active`).
    pub active: &'a StatArray,
    /// Segments (`segment`).
    pub segment: &'a StatArray,
    /// Inactive split blocks (`inactive_split`).
    pub inactive_split: &'a StatArray,
}

impl PoolArrays<'_> {
    /// One pool's share.
    fn pool(&self, pool: Pool) -> PoolStats {
        let i = pool.index();
        PoolStats {
            allocated_bytes: self.allocated_bytes.pool[i],
            active_bytes: self.active_bytes.pool[i],
            requested_bytes: self.requested_bytes.pool[i],
            reserved_bytes: self.reserved_bytes.pool[i],
            inactive_split_bytes: self.inactive_split_bytes.pool[i],
            allocation: self.allocation.pool[i],
            active: self.active.pool[i],
            segment: self.segment.pool[i],
            inactive_split: self.inactive_split.pool[i],
        }
    }
}

/// A snapshot of an allocator's statistics (a `Copy` value: take it, compare it, print it).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Stats {
    /// Bytes of live allocations, rounded as the allocator rounds them (PyTorch `allocated_bytes`).
    pub allocated_bytes: Stat,
    /// Physical bytes held from the driver (PyTorch `reserved_bytes`): for cuvmm, mapped pages plus
    /// unmapped handles kept for reuse; for the classic allocator, `cudaMalloc`'d segments.
    pub reserved_bytes: Stat,
    /// Bytes of allocations not yet reusable: live ones, and freed ones whose streams have not finished
    /// with them (PyTorch `active_bytes`).
    pub active_bytes: Stat,
    /// Bytes as requested by callers, before rounding (PyTorch `requested_bytes`).
    pub requested_bytes: Stat,
    /// Free bytes in segments that also hold live blocks (PyTorch `inactive_split_bytes`).
    pub inactive_split_bytes: Stat,
    /// Number of live allocations (PyTorch `allocation`).
    pub allocation: Stat,
    /// Number of segments (PyTorch `segment`).
    pub segment: Stat,
    /// Allocations that failed at first and were retried after releasing the cache.
    pub num_alloc_retries: u64,
    /// Requests that failed with out-of-memory.
    pub num_ooms: u64,
    /// Physical allocations made (`cuMemCreate` or `cudaMalloc`).
    pub num_device_alloc: u64,
    /// Physical allocations given back (`cuMemRelease` or `cudaFree`).
    pub num_device_free: u64,
    /// Stream synchronizations the allocator made before unmapping.
    pub num_synchronizations: u64,
    /// Largest request that can be served right now without any driver call.
    pub largest_free_block: u64,
    /// Physical bytes mapped but touched by no live block.
    pub idle_mapped_bytes: u64,
    /// Physical bytes held as unmapped handles, ready to map.
    pub idle_handle_bytes: u64,
    /// Pages mapped with a handle that already existed instead of a new `cuMemCreate`.
    pub handles_reused: u64,
    /// Physical bytes of chunks in use that are lent: mapped a second time where a request needed them,
    /// under memory pressure (counted once, at home, in `reserved_bytes`).
    pub lent_bytes: u64,
    /// Mapped bytes of the segments of live CUDA graph pools: memory that stays where graphs use it.
    pub graph_pool_bytes: u64,
    /// Live CUDA graph pools (begun more times than released).
    pub graph_pools: u64,
    /// Bytes of pages under the live allocations of sleeping tags: unmapped, given back to the device,
    /// mapped again at the same addresses by `wake`.
    pub asleep_bytes: u64,
    /// Bytes of host memory tags hold: the bytes of sleeping tags kept, and the page-locked buffers kept
    /// after a wake for the next sleep (`keep_host_buffers`), also those a sleep or wake is copying now.
    pub host_kept_bytes: u64,
    /// Driver calls and their (estimated) time.
    pub driver: DriverCounters,
    /// Number of live and pending allocations (PyTorch `active`).
    pub active: Stat,
    /// Number of free blocks counted in `inactive_split_bytes` (PyTorch `inactive_split`).
    pub inactive_split: Stat,
    /// The large pool's share of the statistics (PyTorch `<stat>.large_pool`).
    pub large_pool: PoolStats,
    /// The small pool's share of the statistics (PyTorch `<stat>.small_pool`).
    pub small_pool: PoolStats,
    /// Live allocations of at least `max_split_size` bytes (PyTorch `oversize_allocations`); 0 while
    /// `max_split_size_mb` is unset.
    pub oversize_allocations: Stat,
    /// Segments of at least `max_split_size` bytes (PyTorch `oversize_segments`); 0 while
    /// `max_split_size_mb` is unset, and always 0 for cuvmm, whose segments are virtual reservations.
    pub oversize_segments: Stat,
}

impl Stats {
    /// The statistics PyTorch keeps per pool, totals and pools, from `arrays`; every other field is its
    /// default, for the strategy to fill (`Stats { num_ooms, .., ..Stats::from_pools(arrays) }`).
    pub fn from_pools(arrays: PoolArrays<'_>) -> Self {
        Self {
            allocated_bytes: arrays.allocated_bytes.all,
            reserved_bytes: arrays.reserved_bytes.all,
            active_bytes: arrays.active_bytes.all,
            requested_bytes: arrays.requested_bytes.all,
            inactive_split_bytes: arrays.inactive_split_bytes.all,
            allocation: arrays.allocation.all,
            segment: arrays.segment.all,
            active: arrays.active.all,
            inactive_split: arrays.inactive_split.all,
            large_pool: arrays.pool(Pool::Large),
            small_pool: arrays.pool(Pool::Small),
            ..Self::default()
        }
    }

    /// The statistics under PyTorch's `memory_stats()` key names (`allocated_bytes.all.current`, ...),
    /// plus cuvmm's own under `cuvmm.`.
    pub fn to_pytorch_keys(&self) -> BTreeMap<String, u64> {
        let mut out = BTreeMap::new();
        for (name, all, large, small) in self.pool_rows() {
            let mut pool = [Stat::default(); 2];
            (pool[Pool::Small.index()], pool[Pool::Large.index()]) = (small, large);
            StatArray { all, pool }.insert_pytorch_keys(name, &mut out);
        }
        for (name, stat) in [
            ("oversize_allocations", &self.oversize_allocations),
            ("oversize_segments", &self.oversize_segments),
        ] {
            for (view, value) in stat.views() {
                out.insert(format!("{name}.{view}"), value);
            }
        }
        for (name, value) in [
            ("num_alloc_retries", self.num_alloc_retries),
            ("num_ooms", self.num_ooms),
            ("num_device_alloc", self.num_device_alloc),
            ("num_device_free", self.num_device_free),
            ("num_sync_all_streams", self.num_synchronizations),
            ("cuvmm.largest_free_block", self.largest_free_block),
            ("cuvmm.idle_mapped_bytes", self.idle_mapped_bytes),
            ("cuvmm.idle_handle_bytes", self.idle_handle_bytes),
            ("cuvmm.handles_reused", self.handles_reused),
            ("cuvmm.lent_bytes", self.lent_bytes),
            ("cuvmm.graph_pool_bytes", self.graph_pool_bytes),
            ("cuvmm.graph_pools", self.graph_pools),
            ("cuvmm.asleep_bytes", self.asleep_bytes),
            ("cuvmm.host_kept_bytes", self.host_kept_bytes),
            ("cuvmm.driver_calls", self.driver.total()),
            ("cuvmm.driver_time_ns", self.driver.time_ns),
        ] {
            out.insert(name.to_string(), value);
        }
        out
    }

    /// PyTorch's pool-split statistics in `memory_summary`'s order: `(PyTorch key, all, large pool, small
    /// pool)`.
    pub fn pool_rows(&self) -> [(&'static str, Stat, Stat, Stat); 9] {
        let (l, s) = (&self.large_pool, &self.small_pool);
        [
            (
                "allocated_bytes",
                self.allocated_bytes,
                l.allocated_bytes,
                s.allocated_bytes,
            ),
            (
                "active_bytes",
                self.active_bytes,
                l.active_bytes,
                s.active_bytes,
            ),
            (
                "requested_bytes",
                self.requested_bytes,
                l.requested_bytes,
                s.requested_bytes,
            ),
            (
                "reserved_bytes",
                self.reserved_bytes,
                l.reserved_bytes,
                s.reserved_bytes,
            ),
            (
                "inactive_split_bytes",
                self.inactive_split_bytes,
                l.inactive_split_bytes,
                s.inactive_split_bytes,
            ),
            ("allocation", self.allocation, l.allocation, s.allocation),
            ("active", self.active, l.active, s.active),
            ("segment", self.segment, l.segment, s.segment),
            (
                "inactive_split",
                self.inactive_split,
                l.inactive_split,
                s.inactive_split,
            ),
        ]
    }

    /// Peak allocated over peak reserved: how much of the memory taken from the device was ever put to use.
    pub fn utilization(&self) -> f64 {
        if self.reserved_bytes.peak == 0 {
            1.0
        } else {
            self.allocated_bytes.peak as f64 / self.reserved_bytes.peak as f64
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_tracks_peak_and_totals() {
        let mut s = Stat::default();
        s.add(10);
        s.add(5);
        s.sub(12);
        s.add(1);
        assert_eq!(
            s,
            Stat {
                current: 4,
                peak: 15,
                allocated: 16,
                freed: 12
            }
        );
        s.reset_peak();
        assert_eq!(s.peak, 4);
        s.reset_accumulated();
        assert_eq!((s.current, s.peak, s.allocated, s.freed), (4, 4, 0, 0));
    }

    #[test]
    fn a_private_pool_is_forgotten_once_both_resets_cleared_it() {
        let mut by_pool = BTreeMap::new();
        let (mut kept, mut gone) = (StatArray::default(), StatArray::default());
        kept.add(Pool::Large, 8);
        gone.add(Pool::Small, 4);
        gone.sub(Pool::Small, 4);
        by_pool.extend([(1, kept), (2, gone)]);
        StatArray::reset_by_pool(&mut by_pool, Stat::reset_peak);
        assert_eq!(by_pool[&2].pool[Pool::Small.index()].peak, 0);
        assert_eq!(by_pool.len(), 2, "its totals still show");
        StatArray::reset_by_pool(&mut by_pool, Stat::reset_accumulated);
        assert_eq!(by_pool.keys().collect::<Vec<_>>(), [&1]);
        assert_eq!(
            by_pool[&1].all,
            Stat {
                current: 8,
                peak: 8,
                allocated: 0,
                freed: 0
            }
        );
    }

    #[test]
    fn pytorch_keys_use_pytorch_names() {
        let mut stats = Stats::default();
        stats.allocated_bytes.add(512);
        stats.num_ooms = 2;
        let keys = stats.to_pytorch_keys();
        assert_eq!(keys["allocated_bytes.all.current"], 512);
        assert_eq!(keys["allocated_bytes.all.peak"], 512);
        assert_eq!(keys["num_ooms"], 2);
    }
}
