//! The models of PyTorch's allocators: [`Split`], a faithful model of PyTorch's native
//! `CUDACachingAllocator` (the classic block-splitting allocator), and of its `expandable_segments:True`
//! mode. These are PyTorch's, measured against; cuvmm's own allocator is [`cuvmm::expandable`].
//!
//! Requests round to 512 B (or to a power-of-two division, `roundup_power2_divisions`) and go to the small
//! pool (<= 1 MiB) or the large pool. Each pool caches free blocks per stream; a request takes the best fit
//! (smallest block, then lowest address) of its stream and splits off the remainder when PyTorch would. With
//! no fit, a segment is `cudaMalloc`'d (2 MiB small, 20 MiB for large requests below 10 MiB, else the
//! request rounded to 2 MiB); on out-of-memory the cached oversize blocks are released, then every cached
//! segment, and the request is retried once. Freed blocks merge with free neighbours and stay cached until
//! `empty_cache`.
//!
//! With [`Config::expandable_segments`] the segments are instead virtual reservations of 1.125x device
//! memory per (stream, pool), mapped page by page (2 MiB pages small, 20 MiB large), as PyTorch's
//! `ExpandableSegment` does; [`Strategy::name`] is then `"pytorch-expandable"`.
//!
//! Each file mirrors a part of PyTorch's code: `rules.rs` the sizing rules, `block.rs` the blocks and pools,
//! `alloc.rs` `malloc`, `free.rs` `free`, `release.rs` the release paths, `expandable_segments.rs` the
//! expandable segments (`expandable_segments/segment.rs` one segment's pages), `seed.rs` adopting a
//! recorded state, `invariants.rs` the checks. See `docs/laboratory.md`, "The PyTorch models".

#![deny(unsafe_code)]

mod alloc;
mod block;
mod expandable_segments;
mod free;
mod invariants;
mod release;
pub mod rules;
mod seed;
mod snapshot;

pub use seed::{SeedBlock, SeedError, SeedSegment};

use block::{BlockPool, Blocks};
use cuvmm::driver::{Driver, DriverCounters, StreamId, VaRange};
use cuvmm::strategy::config::{Config, ConfigError};
use cuvmm::strategy::error::{Error, InvariantViolation};
use cuvmm::strategy::graph_pool::GraphPool;
use cuvmm::strategy::history::{Events, TraceAction, TraceTracker};
use cuvmm::strategy::pool::Pool;
use cuvmm::strategy::snapshot::MemorySnapshot;
use cuvmm::strategy::stats::{PoolArrays, Stat, StatArray, Stats};
use cuvmm::strategy::{DeviceBytes, Snapshots, Strategy};
use expandable_segments::ExpandableSegment;
use serde::Serialize;
use std::collections::BTreeMap;

/// The private pool of every event: the models serve no CUDA graph, so all their memory is in the device's
/// pools.
const NO_POOL: GraphPool = GraphPool::NONE;

/// What the allocator did to the device: PyTorch's `segment_alloc` / `segment_free` (`cudaMalloc` /
/// `cudaFree`) and `segment_map` / `segment_unmap` (expandable segments) trace entries.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum SegmentAction {
    /// A segment was `cudaMalloc`'d.
    SegmentAlloc,
    /// A segment was `cudaFree`'d.
    SegmentFree,
    /// Pages were mapped into an expandable segment.
    SegmentMap,
    /// Pages were unmapped from an expandable segment.
    SegmentUnmap,
}

impl SegmentAction {
    /// PyTorch's name for the action in a memory snapshot.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::SegmentAlloc => "segment_alloc",
            Self::SegmentFree => "segment_free",
            Self::SegmentMap => "segment_map",
            Self::SegmentUnmap => "segment_unmap",
        }
    }

    /// Whether the action gives memory to the allocator (alloc, map) rather than back (free, unmap).
    pub fn grows(self) -> bool {
        matches!(self, Self::SegmentAlloc | Self::SegmentMap)
    }
}

/// One segment event, as PyTorch records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct SegmentEvent {
    /// What happened.
    pub action: SegmentAction,
    /// Start of the memory concerned.
    pub addr: u64,
    /// Its size in bytes.
    pub size: u64,
    /// The stream of the segment.
    pub stream: StreamId,
}

/// A segment: memory from one `cudaMalloc`, or one expandable reservation.
#[derive(Debug)]
pub(crate) struct Segment {
    /// Bytes: the `cudaMalloc` size, or the whole reservation.
    pub size: u64,
    pub stream: StreamId,
    pub pool: Pool,
    /// The reservation's pages, for an expandable segment.
    pub expandable: Option<ExpandableSegment>,
}

/// Counters kept up to date by every operation.
#[derive(Debug, Default, Clone)]
struct Counters {
    allocated: StatArray,
    requested: StatArray,
    active: StatArray,
    allocation: StatArray,
    reserved: StatArray,
    segment: StatArray,
    inactive_split_bytes: StatArray,
    inactive_split: StatArray,
    oversize_allocations: Stat,
    oversize_segments: Stat,
    retries: u64,
    ooms: u64,
    device_alloc: u64,
    device_free: u64,
    synchronizations: u64,
}

/// PyTorch's caching allocator over a [`Driver`]: "classic" (`cudaMalloc` segments) or
/// "pytorch-expandable" (`expandable_segments:True`), as [`Config::expandable_segments`] says.
#[derive(Debug)]
pub struct Split<D: Driver> {
    driver: D,
    config: Config,
    expandable: bool,
    device_total: u64,
    blocks: Blocks,
    pools: [BlockPool; 2],
    segments: BTreeMap<u64, Segment>,
    /// PyTorch's `total_allocated_memory`: bytes taken from the device.
    total_allocated_memory: u64,
    /// PyTorch's `allowed_memory_maximum`, once a memory fraction is set.
    allowed_memory_maximum: Option<u64>,
    counters: Counters,
    log: Option<Vec<SegmentEvent>>,
    /// Where events go: the history kept for snapshots, and the trace trackers.
    events: Events,
}

impl<D: Driver> Split<D> {
    /// An allocator on `driver` configured by `config`: the classic model, or PyTorch's expandable segments
    /// when `config.expandable_segments` is set (whose 2 MiB and 20 MiB pages must then be multiples of the
    /// driver's granularity). Fails if the configuration is invalid or the device's size cannot be read.
    pub fn new(mut driver: D, config: Config) -> Result<Self, Error> {
        config.validate()?;
        let granularity = driver.granularity().max(1);
        if config.expandable_segments
            && (rules::SMALL_BUFFER % granularity != 0 || rules::LARGE_BUFFER % granularity != 0)
        {
            return Err(ConfigError::BadValue {
                key: "expandable_segments".into(),
                value: format!("True with a granularity of {granularity} bytes"),
                expected: "a driver granularity that divides 2 MiB (PyTorch's page sizes are 2 and 20 MiB)",
            }
            .into());
        }
        let device_total = driver.mem_info()?.total;
        Ok(Self {
            driver,
            expandable: config.expandable_segments,
            config,
            device_total,
            blocks: Blocks::default(),
            pools: Default::default(),
            segments: BTreeMap::new(),
            total_allocated_memory: 0,
            allowed_memory_maximum: None,
            counters: Counters::default(),
            log: None,
            events: Events::default(),
        })
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The driver, mutably (tests use it to inject faults).
    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.driver
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Whether this is the model of PyTorch's expandable segments.
    pub fn is_expandable(&self) -> bool {
        self.expandable
    }

    /// PyTorch's `setMemoryFraction`: the allocator may hold at most `fraction` of device memory, and
    /// `garbage_collection_threshold` (which PyTorch applies only once a fraction is set) starts to act.
    ///
    /// # Errors
    /// [`ConfigError::BadValue`] if `fraction` is not in `[0, 1]`.
    pub fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), ConfigError> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::BadValue {
                key: "memory_fraction".into(),
                value: fraction.to_string(),
                expected: "a number between 0 and 1",
            });
        }
        self.allowed_memory_maximum = Some((fraction * self.device_total as f64) as u64);
        Ok(())
    }

    /// Starts (or stops) recording segment events; see [`take_segment_events`](Self::take_segment_events).
    pub fn record_segment_events(&mut self, on: bool) {
        self.log = on.then(Vec::new);
    }

    /// The segment events recorded since the last call, oldest first.
    pub fn take_segment_events(&mut self) -> Vec<SegmentEvent> {
        self.log.as_mut().map(std::mem::take).unwrap_or_default()
    }

    /// Segments that exist now: `(range, stream, pool)`, in address order. For an expandable segment the
    /// range is the whole reservation.
    pub fn segments(&self) -> Vec<(VaRange, StreamId, Pool)> {
        self.segments
            .iter()
            .map(|(&a, s)| (VaRange::new(a, s.size), s.stream, s.pool))
            .collect()
    }

    /// The largest cached block (PyTorch's `cacheInfo` without the free-memory guess).
    pub fn largest_cached_block(&self) -> u64 {
        self.pools
            .iter()
            .flat_map(|p| p.blocks.iter())
            .map(|&(_, size, _)| size)
            .max()
            .unwrap_or(0)
    }

    fn pool(&self, pool: Pool) -> &BlockPool {
        &self.pools[pool_index(pool)]
    }

    fn pool_mut(&mut self, pool: Pool) -> &mut BlockPool {
        &mut self.pools[pool_index(pool)]
    }

    /// `max_split_size`, `usize::MAX` in PyTorch when unset.
    fn max_split_size(&self) -> u64 {
        self.config.max_split_size.unwrap_or(u64::MAX)
    }

    /// Whether garbage collection is on: a threshold and a memory fraction are both set.
    fn gc_enabled(&self) -> bool {
        self.allowed_memory_maximum.is_some() && self.config.garbage_collection_threshold.is_some()
    }

    /// PyTorch's `BlockPool::insert_into_blocks`: caches the free mapped block at `addr`.
    fn insert_into_blocks(&mut self, addr: u64) {
        let block = self.blocks.at(addr);
        let pool = self.pool_mut(block.pool);
        let count = pool.get_free_blocks_call_count;
        pool.blocks.insert((block.stream, block.size, addr));
        if let Some(b) = self.blocks.get_mut(addr) {
            b.gc_count_base = count;
        }
    }

    /// Removes the block at `addr` from its pool's free sets.
    fn remove_from_pool(&mut self, addr: u64) {
        let block = self.blocks.at(addr);
        let pool = self.pool_mut(block.pool);
        if block.mapped {
            pool.blocks.remove(&(block.stream, block.size, addr));
        } else {
            pool.unmapped.remove(&(block.stream, addr));
        }
    }

    fn is_expandable_block(&self, addr: u64) -> bool {
        self.blocks
            .get(addr)
            .and_then(|b| self.segments.get(&b.segment))
            .is_some_and(|s| s.expandable.is_some())
    }

    fn record(&mut self, action: SegmentAction, addr: u64, size: u64, stream: StreamId) {
        tracing::debug!(
            action = action.as_str(),
            addr,
            size,
            stream = stream.0,
            "segment event"
        );
        let traced = match action {
            SegmentAction::SegmentAlloc => TraceAction::SegmentAlloc,
            SegmentAction::SegmentFree => TraceAction::SegmentFree,
            SegmentAction::SegmentMap => TraceAction::SegmentMap,
            SegmentAction::SegmentUnmap => TraceAction::SegmentUnmap,
        };
        self.events.record(traced, addr, size, stream, NO_POOL);
        if let Some(log) = &mut self.log {
            log.push(SegmentEvent {
                action,
                addr,
                size,
                stream,
            });
        }
    }

    /// Records a block event for snapshots and trackers, if either wants it.
    #[inline]
    fn trace(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        self.events.record(action, addr, size, stream, NO_POOL);
    }

    /// Adds `delta` (which may be negative) to a statistic of `pool`.
    fn adjust(stat: &mut StatArray, pool: Pool, delta: i128) {
        if delta > 0 {
            stat.add(pool, delta as u64);
        } else if delta < 0 {
            stat.sub(pool, delta.unsigned_abs() as u64);
        }
    }

    /// Whether a block or segment of `size` bytes is oversize (PyTorch: at least `max_split_size`).
    fn is_oversize(&self, size: u64) -> bool {
        size >= self.max_split_size()
    }
}

fn pool_index(pool: Pool) -> usize {
    pool.index()
}

impl<D: Driver> Strategy for Split<D> {
    fn name(&self) -> &'static str {
        if self.expandable {
            "pytorch-expandable"
        } else {
            "classic"
        }
    }

    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        self.malloc(size, stream)
    }

    fn free(&mut self, addr: u64) -> Result<(), Error> {
        self.free_addr(addr)
    }

    fn empty_cache(&mut self) -> Result<(), Error> {
        self.release_cached_blocks()?;
        self.release_unmapped_segments()
    }

    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        self.release_some(bytes)
    }

    fn stats(&self) -> Stats {
        let c = &self.counters;
        Stats {
            num_alloc_retries: c.retries,
            num_ooms: c.ooms,
            num_device_alloc: c.device_alloc,
            num_device_free: c.device_free,
            num_synchronizations: c.synchronizations,
            largest_free_block: self.largest_cached_block(),
            idle_mapped_bytes: c.reserved.current().saturating_sub(c.active.current()),
            driver: self.driver.counters(),
            oversize_allocations: c.oversize_allocations,
            oversize_segments: c.oversize_segments,
            ..Stats::from_pools(PoolArrays {
                allocated_bytes: &c.allocated,
                active_bytes: &c.active,
                requested_bytes: &c.requested,
                reserved_bytes: &c.reserved,
                inactive_split_bytes: &c.inactive_split_bytes,
                allocation: &c.allocation,
                // No record_stream: a block is active exactly while it is allocated.
                active: &c.allocation,
                segment: &c.segment,
                inactive_split: &c.inactive_split,
            })
        }
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        invariants::check(self)
    }

    fn driver_counters(&self) -> DriverCounters {
        self.driver.counters()
    }

    fn ordinal(&self) -> usize {
        self.driver.ordinal()
    }

    fn reserved_bytes(&self) -> u64 {
        self.counters.reserved.current()
    }

    fn snapshots(&mut self) -> Option<&mut dyn Snapshots> {
        Some(self)
    }

    fn device_bytes(&mut self) -> Option<&mut dyn DeviceBytes> {
        Some(self)
    }
}

impl<D: Driver> Snapshots for Split<D> {
    fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        Ok(self.memory_snapshot())
    }

    fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error> {
        self.events.keep(max_entries);
        Ok(())
    }

    fn attach_trace_tracker(&mut self, tracker: TraceTracker) -> Result<(), Error> {
        self.events.track(tracker);
        Ok(())
    }

    fn record_event(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPool,
    ) {
        self.events.record(action, addr, size, stream, pool);
    }
}

impl<D: Driver> DeviceBytes for Split<D> {
    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error> {
        Ok(self.driver.memset_d8(addr, len, value)?)
    }

    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        Ok(self.driver.copy_to_host(addr, out)?)
    }
}

impl<D: Driver> Drop for Split<D> {
    /// Gives every segment back to the driver, live blocks included: nothing can use them once the
    /// allocator is gone. Failures are reported through `tracing`, never silently dropped.
    fn drop(&mut self) {
        if let Err(err) = self.teardown() {
            tracing::error!(%err, "split allocator: releasing device memory on drop failed");
        }
    }
}
