//! cuvmm's expandable-segment allocator.
//!
//! Each (stream, pool) gets a segment: a virtual reservation much larger than the device, tiled by blocks.
//! Physical pages (one driver handle per page) are mapped only under the blocks that need them. A page that
//! no live block touches is *idle*; its handle can be unmapped and mapped wherever a request needs it
//! (compaction), so physical memory in use follows the pages live blocks touch, not the history of splits.
//!
//! Growth order for a request under `compaction:pressure` (the default): a free block whose pages are mapped
//! -> pooled handles -> new handles (20 MiB chunks in the large pool) while reserved memory stays under the
//! budget -> idle pages whose stream an event query shows done, oldest first, then idle pages of chunks in
//! use lent (`lending.rs`) -> the same after one synchronization per stream -> `create` -> on
//! out-of-memory, release the cache and retry once ->
//! [`Error::OutOfMemory`]. `compaction:eager` takes idle pages (synchronizing) before creating any. See
//! `docs/DESIGN.md` for why.
//!
//! A block used on other streams than its own (`record_stream`) is freed only once events recorded on those
//! streams at the free complete (`streams.rs`); until then it is *pending*: active, not allocated.

#![deny(unsafe_code)]

mod accounting;
mod alloc;
mod blocks;
mod events;
mod free_index;
mod graphs;
mod invariants;
mod lender;
mod lending;
mod limit;
mod physical;
mod segment;
mod settle;
mod sleep;
mod snapshot;
mod streams;
mod tag;

pub use segment::ROUND;

use crate::strategy::pool::Pool;

use crate::driver::{Driver, DriverCounters, PhysHandle, PhysPage, StreamId};
use crate::strategy::Strategy;
use crate::strategy::config::{Compaction, Config, ConfigError};
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use crate::strategy::history::{self, History, TraceAction};
use crate::strategy::snapshot::MemorySnapshot;
use crate::strategy::stats::Stats;
use accounting::{Counters, Derived};
use lender::Lender;
use rustc_hash::{FxHashMap, FxHashSet};
use segment::{FreeOutcome, Segment};
use streams::{PendingFrees, StreamUses};

/// Most chunks the set of chunk handles has room for when the allocator starts (16,384 chunks of 20 MiB are
/// 320 GiB); beyond, it grows as it fills.
const MAX_CHUNKS_RESERVED: u64 = 1 << 14;

/// cuvmm's allocator: per-(stream, pool) virtual segments whose pages are mapped on demand.
#[derive(Debug)]
pub struct Expandable<D: Driver> {
    driver: D,
    config: Config,
    page_size: u64,
    device_total: u64,
    segments: Vec<Option<Segment>>,
    /// `(reservation start, slot)` of every segment, sorted by start: a handful of segments, so a search of a
    /// vector is cheaper than a tree's on every free.
    by_addr: Vec<(u64, usize)>,
    by_key: FxHashMap<SegmentKey, Vec<usize>>,
    pooled: Vec<PhysHandle>,
    /// Unmapped chunks (multi-page handles) ready to map at a group of pages.
    pooled_chunks: Vec<PhysHandle>,
    /// Every chunk held (mapped or pooled).
    chunks: FxHashSet<PhysHandle>,
    /// The chunks with pages lent (`lending.rs`), and where each is mapped at home.
    lenders: FxHashMap<PhysHandle, Lender>,
    /// Lent pages mapped a second time, by address: the piece of its chunk each maps.
    aliases: FxHashMap<u64, PhysPage>,
    /// Lent pages per pool of their home segment (touched there by their lent block, which uses nothing).
    lent_pages: [usize; 2],
    /// Whether idle pages of chunks in use may be lent: false once the driver has said it cannot map part
    /// of a handle.
    lending: bool,
    /// Pages per large-pool handle: `config.large_handle` in pages under `compaction:pressure`, else 1.
    chunk_pages: usize,
    /// Reserved bytes under which `compaction:pressure` grows without reclaiming ([`Config::budget_bytes`]).
    budget: u64,
    /// The most bytes that may be reserved ([`Config::memory_limit`]); `None`: the device's memory.
    limit: Option<u64>,
    /// Counts frees, to order segments by when a block of theirs was last freed.
    free_clock: u64,
    /// The handles of the request being backed with pages; kept between requests so its buffer is reused.
    /// Empty outside `back_with_pages`: a handle is never only here.
    handle_queue: Vec<PhysPage>,
    /// The handles of a run being unmapped, as the page map gives them; kept so its buffer is reused.
    unmapped_scratch: Vec<PhysHandle>,
    /// Streams other than its segment's that use a live block, by block address.
    stream_uses: FxHashMap<u64, StreamUses>,
    /// Blocks freed while other streams may still use them, and their events.
    pending: PendingFrees,
    /// CUDA graphs' private pools, the captures underway and the frees they defer.
    graphs: graphs::Graphs,
    /// The tags allocations were made under, and which sleep (`sleep.rs`).
    tags: sleep::Tags,
    /// Pages touched by active blocks, per pool.
    touched_pages: [usize; 2],
    idle_pages: usize,
    counters: Counters,
    /// Events recorded for snapshots, when recording is on.
    history: Option<History>,
    /// The block being backed with pages (pool, bytes): carved, not yet counted as allocated.
    carving: Option<(Pool, u64)>,
}

/// The segments of one kind: a stream, a pool (small or large), the private pool they serve, if any, and
/// the tag their allocations were made under, if any.
type SegmentKey = (StreamId, Pool, Option<GraphPool>, Option<tag::TagId>);

/// The counts of one segment that the allocator-wide totals follow, read before and after a change.
#[derive(Clone, Copy, Debug)]
struct SlotCounts {
    touched: usize,
    idle: usize,
    straddling: usize,
}

impl<D: Driver> Expandable<D> {
    /// An allocator on `driver` configured by `config`. Fails if the configuration is invalid
    /// ([`Config::validate`]), if the page size is not a positive multiple of the driver's granularity, or if
    /// the device's size cannot be read.
    pub fn new(mut driver: D, config: Config) -> Result<Self, Error> {
        let granularity = driver.granularity();
        let page_size = config.page_size.unwrap_or(granularity);
        if page_size == 0 || granularity == 0 || page_size % granularity != 0 {
            return Err(ConfigError::BadValue {
                key: "page_size_mb".into(),
                value: page_size.to_string(),
                expected: "a positive multiple of the driver's allocation granularity",
            }
            .into());
        }
        config.validate()?;
        // The largest whole number of pages not above `large_handle`, at least one.
        let chunk_pages = match config.compaction {
            Compaction::Pressure => (config.large_handle / page_size).max(1) as usize,
            Compaction::Eager => 1,
        };
        let info = driver.mem_info()?;
        let device_total = info.total;
        let budget = config.budget_bytes(info.total, info.free);
        let limit = config.limit_bytes(info.total);
        // Lending maps a page of a chunk from its offset, which CUDA does not allow (`Driver::
        // maps_parts_of_handles`): only where the driver can.
        let lending = config.lend_chunk_pages && driver.maps_parts_of_handles();
        // Room for the chunks of a budget's worth of memory up front (about 0.5 KiB of host memory per GiB of
        // device memory), so that growing to the budget does not rehash the set each time it doubles
        // (1.4% of the replay's instructions on a trace that grows to 40 GiB).
        let chunk_room = match chunk_pages {
            1 => 0,
            k => (budget / (k as u64 * page_size)).min(MAX_CHUNKS_RESERVED) as usize,
        };
        Ok(Self {
            driver,
            config,
            page_size,
            device_total,
            segments: Vec::new(),
            by_addr: Vec::new(),
            by_key: FxHashMap::default(),
            pooled: Vec::new(),
            pooled_chunks: Vec::new(),
            chunks: FxHashSet::with_capacity_and_hasher(chunk_room, Default::default()),
            lenders: FxHashMap::default(),
            aliases: FxHashMap::default(),
            lent_pages: [0; 2],
            lending,
            chunk_pages,
            budget,
            limit,
            free_clock: 0,
            handle_queue: Vec::new(),
            unmapped_scratch: Vec::new(),
            stream_uses: FxHashMap::default(),
            pending: PendingFrees::default(),
            graphs: graphs::Graphs::default(),
            tags: sleep::Tags::default(),
            touched_pages: [0; 2],
            idle_pages: 0,
            counters: Counters::default(),
            history: None,
            carving: None,
        })
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The driver, mutably (tests use it to inject faults and write bytes).
    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.driver
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Bytes per physical page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// Segments that exist now: `(virtual range, stream, pool)`.
    pub fn segments(&self) -> Vec<(crate::driver::VaRange, StreamId, Pool)> {
        self.live_segments()
            .map(|s| (s.va, s.stream, s.pool))
            .collect()
    }

    fn live_segments(&self) -> impl Iterator<Item = &Segment> {
        self.segments.iter().flatten()
    }

    fn segment(&self, slot: usize) -> &Segment {
        self.segments[slot].as_ref().expect("segment slot in use")
    }

    fn segment_mut(&mut self, slot: usize) -> &mut Segment {
        self.segments[slot].as_mut().expect("segment slot in use")
    }

    /// Physical bytes held by no live block: idle mapped pages plus pooled handles.
    fn idle_bytes(&self) -> u64 {
        (self.idle_pages + self.pooled_pages()) as u64 * self.page_size
    }

    /// Pages held by pooled handles, single pages and chunks.
    fn pooled_pages(&self) -> usize {
        self.pooled.len() + self.pooled_chunks.len() * self.chunk_pages
    }

    /// Re-reads the touched and idle page counts and the straddling free blocks of one segment after it
    /// changed, keeping the allocator-wide counts and the non-releasable (inactive split) statistics of its
    /// pool in step: bytes of touched pages that no active (live or pending) block uses, and the free blocks
    /// that share such pages.
    fn refresh_page_counts(&mut self, slot: usize, before: SlotCounts) {
        let after = self.page_counts(slot);
        let pool = self.segment(slot).pool;
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

    fn page_counts(&self, slot: usize) -> SlotCounts {
        let seg = self.segment(slot);
        SlotCounts {
            touched: seg.pages.touched_count(),
            idle: seg.pages.idle_count(),
            straddling: seg.straddling_count(),
        }
    }

    /// Counts a block as live or no longer allocated ([`Counters::count_block`]).
    fn count_block(&mut self, pool: Pool, size: u64, requested: u64, live: bool) {
        let oversize = self.config.max_split_size.is_some_and(|max| size >= max);
        (self.counters).count_block(pool, size, requested, live, oversize);
    }

    /// Records an event for snapshots if recording is on.
    #[inline]
    fn record(&mut self, action: TraceAction, addr: u64, size: u64, stream: StreamId) {
        history::record(&mut self.history, action, addr, size, stream);
    }

    /// The segment whose reservation contains `addr`.
    fn slot_of(&self, addr: u64) -> Option<usize> {
        let at = self.by_addr.partition_point(|&(start, _)| start <= addr);
        let (_, slot) = self.by_addr[at.checked_sub(1)?];
        self.segment(slot).va.contains(addr).then_some(slot)
    }

    /// The largest request that can be served now without a driver call.
    pub fn largest_free_block(&self) -> u64 {
        self.live_segments()
            .map(Segment::largest_free_mapped)
            .max()
            .unwrap_or(0)
    }

    /// Allocates `size` bytes on `stream`, under `tag` if given.
    fn alloc_in(
        &mut self,
        size: u64,
        stream: StreamId,
        tag: Option<tag::TagId>,
    ) -> Result<u64, Error> {
        let graph = self.pool_for(stream)?;
        // Event queries are refused during a capture; pending frees wait until it ends.
        if !self.capturing() {
            self.poll_pending()?;
        }
        self.allocate(size, stream, graph, tag)
    }

    /// Frees the live block at `addr`: at once if only its segment's stream used it, else parked until
    /// events on the other streams complete.
    fn free_block(&mut self, addr: u64) -> Result<(), Error> {
        let slot = self.slot_of(addr).ok_or(Error::UnknownAddress { addr })?;
        if let Some(tag) = self.segment(slot).tag
            && !self.tags.is_awake(tag)
        {
            return Err(self.tag_asleep("free", tag));
        }
        let (size, requested, at) = match self.segment(slot).check_free(addr) {
            FreeOutcome::Freed {
                size,
                requested,
                at,
            } => (size, requested, at),
            FreeOutcome::AlreadyFree => return Err(Error::DoubleFree { addr }),
            FreeOutcome::NotABlockStart => return Err(Error::UnknownAddress { addr }),
        };
        // A block whose free was deferred is freed, though still live until its events are recorded.
        if !self.graphs.deferred.is_empty() && self.graphs.deferred.contains(&addr) {
            return Err(Error::DoubleFree { addr });
        }
        if !self.stream_uses.is_empty() {
            if self.capturing() {
                // No event may be recorded or queried now: the block stays live, with its streams, until
                // no capture is underway (`graphs.rs`).
                if self.stream_uses.contains_key(&addr) {
                    self.graphs.deferred.push(addr);
                    return Ok(());
                }
            } else if let Some(streams) = self.stream_uses.remove(&addr) {
                return self.park_block(slot, addr, streams);
            }
        }
        let before = self.page_counts(slot);
        let (pool, stream) = (self.segment(slot).pool, self.segment(slot).stream);
        self.free_clock += 1;
        let clock = self.free_clock;
        let seg = self.segment_mut(slot);
        seg.free_live(at, addr, size);
        seg.last_free = clock;
        self.count_block(pool, size, requested, false);
        self.counters.count_inactive(pool, size);
        self.record(TraceAction::FreeRequested, addr, requested, stream);
        self.record(TraceAction::FreeCompleted, addr, requested, stream);
        self.refresh_page_counts(slot, before);
        Ok(())
    }

    /// Gives idle memory beyond `max_idle_bytes` back to the driver. A failure keeps the memory idle (the next
    /// free or poll tries again) and is reported through `tracing`: it must not fail the free that caused it.
    fn release_excess_idle(&mut self) {
        if self.capturing() {
            // Releasing unmaps, which a capture forbids: the next free after it ends does it.
            return;
        }
        let excess = self.idle_bytes().saturating_sub(self.config.max_idle_bytes);
        if excess > 0
            && let Err(err) = self.release_idle(excess)
        {
            tracing::warn!(%err, excess, "cuvmm: releasing idle memory beyond max_idle_bytes failed; kept idle");
        }
    }

    /// Frees the pending blocks whose events completed, then keeps idle memory within its limit.
    fn poll_pending(&mut self) -> Result<(), Error> {
        if !self.graphs.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        if self.process_events()? > 0 {
            self.release_excess_idle();
        }
        Ok(())
    }

    /// Everything cached goes back to the driver: pending frees are drained (their streams synchronized),
    /// then every pooled handle and idle page is released.
    fn release_cache(&mut self) -> Result<u64, Error> {
        if !self.graphs.deferred.is_empty() {
            self.insert_deferred_events()?;
        }
        self.drain_pending()?;
        self.release_idle(u64::MAX)
    }
}

impl<D: Driver> Strategy for Expandable<D> {
    fn name(&self) -> &'static str {
        "cuvmm"
    }

    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        self.alloc_in(size, stream, None)
    }

    fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        Expandable::alloc_tagged(self, size, stream, tag)
    }

    fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error> {
        Expandable::sleep(self, tag, keep)
    }

    fn wake(&mut self, tag: &str) -> Result<(), Error> {
        Expandable::wake(self, tag)
    }

    fn asleep_tags(&self) -> Vec<(String, u64)> {
        Expandable::asleep_tags(self)
    }

    /// Frees the block at `addr`. Once the block is free this returns `Ok`: if giving idle memory beyond
    /// `max_idle_bytes` back to the driver then fails, the memory stays idle (the next free tries again) and
    /// the failure is reported through `tracing`, so a caller never sees an error for a free that happened.
    fn free(&mut self, addr: u64) -> Result<(), Error> {
        self.free_block(addr)?;
        self.release_excess_idle();
        Ok(())
    }

    fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        self.record_stream_use(addr, stream)
    }

    fn empty_cache(&mut self) -> Result<(), Error> {
        if self.capturing() {
            return Err(Error::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        self.release_cache()?;
        self.free_empty_segments()
    }

    /// Releases what is idle now. Pending blocks are not idle: the next allocation polls their events, and
    /// `empty_cache` waits for them.
    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        if self.capturing() {
            return Err(Error::CaptureUnderway { operation: "trim" });
        }
        self.release_idle(bytes)
    }

    fn begin_allocate_to_pool(
        &mut self,
        pool: GraphPool,
        filter: StreamFilter,
    ) -> Result<(), Error> {
        self.begin_pool(pool, filter, None)
    }

    fn end_allocate_to_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.end_pool(pool)
    }

    fn release_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.release_graph_pool(pool)
    }

    fn incref_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.incref_graph_pool(pool)
    }

    fn add_peer(&mut self, peer: usize) -> Result<(), Error> {
        self.grant_peer(peer)
    }

    fn captures_underway(&self) -> usize {
        self.graphs.underway_count()
    }

    fn stats(&self) -> Stats {
        let (graph_pool_bytes, graph_pools) = self.graph_pool_bytes();
        self.counters.stats(Derived {
            largest_free_block: self.largest_free_block(),
            idle_mapped_bytes: self.idle_pages as u64 * self.page_size,
            idle_handle_bytes: self.pooled_pages() as u64 * self.page_size,
            lent_bytes: (self.lent_pages[0] + self.lent_pages[1]) as u64 * self.page_size,
            graph_pool_bytes,
            graph_pools,
            asleep_bytes: self.asleep_bytes(),
            driver: self.driver.counters(),
        })
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
        self.counters.reserved.current
    }

    fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        Ok(self.memory_snapshot())
    }

    fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error> {
        self.history = max_entries.map(History::new);
        Ok(())
    }

    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error> {
        Ok(self.driver.memset_d8(addr, len, value)?)
    }

    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        Ok(self.driver.copy_to_host(addr, out)?)
    }

    fn reset_peak_stats(&mut self) -> Result<(), Error> {
        self.counters.reset_peaks();
        Ok(())
    }

    fn reset_accumulated_stats(&mut self) -> Result<(), Error> {
        self.counters.reset_accumulated();
        Ok(())
    }

    /// Also lowers the growth budget to the new limit when it is below it.
    fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::BadValue {
                key: "per_process_memory_fraction".into(),
                value: fraction.to_string(),
                expected: "a fraction in [0, 1]",
            }
            .into());
        }
        let limit = (fraction * self.device_total as f64) as u64;
        self.limit = Some(limit);
        self.budget = self.budget.min(limit);
        Ok(())
    }

    fn memory_fraction(&self) -> Option<f64> {
        let total = self.device_total.max(1) as f64;
        self.limit.map(|limit| limit as f64 / total)
    }
}

impl<D: Driver> Drop for Expandable<D> {
    /// Gives everything back to the driver: the allocator owns its reservations and handles, and nothing
    /// can use them once it is gone. Failures are reported through `tracing`, never silently dropped.
    fn drop(&mut self) {
        if let Err(err) = self.teardown() {
            tracing::error!(%err, "cuvmm: releasing device memory on drop failed");
        }
    }
}
