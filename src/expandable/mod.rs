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
//! use lent (`supply/lending.rs`) -> the same after one synchronization per stream -> `create` -> on
//! out-of-memory, release the cache and retry once, then give back what the caller holds back (the
//! facade's stream caches) and serve the request once more -> [`Error::OutOfMemory`]. `compaction:eager`
//! takes idle pages (synchronizing) before creating any. See `docs/DESIGN.md` for why.
//!
//! A block used on other streams than its own (`record_stream`) is freed only once events recorded on those
//! streams at the free complete (`streams.rs`); until then it is *pending*: active, not allocated.

#![deny(unsafe_code)]
//!
//! The allocator is a composition of parts that own their state, each behind a narrow interface, and of
//! policies that decide, driven by [`Expandable`], which holds them and sequences each operation. The parts:
//! - `segments.rs` (`Segments`): the reservations, found by slot, address and key;
//!   each a `segment.rs` (blocks in `blocks.rs`, free index in `free_index.rs`);
//! - `supply/` (`Supply`): the physical pages, the one part that creates, maps, unmaps, lends and releases
//!   handles: the handle pool, the chunks, the budget and the limit (`physical.rs`), the pages of chunks in
//!   use lent elsewhere (`lending.rs`); it is lent the other parts it needs for a call (`Parts`, `parts.rs`);
//! - `streams.rs` (`StreamWaits`): other streams' uses of live blocks, parked frees and their events;
//!   `compacting.rs` (`Compacting`): what one compaction knows of streams;
//! - `graphs.rs` (`Graphs`): private pools, captures underway, deferred frees;
//! - `tags.rs` (`Tags`): tags, asleep or awake, and what a sleeping tag keeps; `kept.rs` (`Kept`): a tag's
//!   host memory and the layout of its bytes in it (a sleep's or wake's copies, run without the caller's
//!   lock, are a `TagCopy` of `strategy/tags.rs`);
//! - `imports.rs` (`Imports`): memory other processes shared, mapped here;
//! - `accounting.rs` (`Books`): the counters, page counts and history behind the statistics;
//! - `settle.rs`: settling a failed driver call (functions of the driver).
//!
//! The policies, a trait each with one file per policy, chosen from the configuration in `policies.rs` (a
//! new policy is a new file and one line there):
//! - `compaction/` (`pressure.rs`, `eager.rs`): when growth reclaims idle pages, in what order, how, and
//!   which requests keep to whole pages;
//! - `handle_size/` (`chunks.rs`, `single_pages.rs`): chunks or single pages for new memory.
//!
//! The orchestration is layered, each file calling only the ones below it: `mod.rs` (the `Strategy`) ->
//! `sleep.rs` (sleep and wake) -> `request.rs` (a request, and all of out-of-memory: the one retry, what the
//! caller holds back, `held_back.rs`, the diagnosis) -> `alloc.rs` (the block path) -> `placement.rs` ->
//! `reservations.rs` -> the supply and `parked.rs` (the frees that wait) -> the parts; `pools.rs` (what
//! PyTorch's `MemPool` and cudagraph trees ask of a pool: use counts, `use_on_oom`, checkpoints, one pool's
//! `empty_cache`) calls `alloc.rs` and below; `carve.rs` (a block carved at a given address: a checkpoint's,
//! or an out-of-memory request's in a pool's free memory) calls the supply and below; `peers.rs` and
//! `sharing.rs` (exporting a block for another process) call the parts; `snapshot.rs` and `invariants.rs`
//! read them.

mod accounting;
mod alloc;
mod blocks;
mod carve;
mod compacting;
mod compaction;
mod free_index;
mod graphs;
mod handle_size;
mod held_back;
mod imports;
mod invariants;
mod kept;
mod parked;
mod parts;
mod peers;
mod placement;
mod policies;
mod pools;
mod request;
mod reservations;
mod segment;
mod segments;
mod settle;
mod sharing;
mod sleep;
mod snapshot;
mod strategy;
mod streams;
mod supply;
mod tags;

pub(crate) use held_back::HeldBack;
pub use segment::ROUND;

use crate::driver::{Driver, StreamId};
use crate::strategy::config::{Config, ConfigError};
use crate::strategy::error::Error;
use crate::strategy::pool::Pool;
use accounting::Books;
use graphs::Graphs;
use imports::Imports;
use policies::Policies;
use segments::Segments;
use streams::StreamWaits;
use supply::{Setup, Supply};
use tags::Tags;

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
    /// The device's free memory when the allocator was made: the budget when none is configured
    /// ([`Config::budget_bytes`]).
    device_free: u64,
    /// The reservations and their blocks.
    segments: Segments,
    /// The physical pages: the handle pool, the chunks, the budget and the limit, the pages lent.
    supply: Supply,
    /// The compaction and handle-size policies, chosen from `config`.
    policies: Policies,
    /// Other streams' uses of live blocks, and frees waiting for their events.
    waits: StreamWaits,
    /// CUDA graphs' private pools, the captures underway and the frees they defer.
    graphs: Graphs,
    /// The tags allocations were made under, and which sleep (`sleep.rs`).
    tags: Tags,
    /// Counters, page counts and history.
    books: Books,
    /// Memory other processes shared, mapped here (`imports.rs`).
    imports: Imports,
    /// Memory the caller holds back and gives back when a request runs out (`request.rs`).
    held_back: Option<Box<dyn HeldBack>>,
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
                value: format!(
                    "{page_size} bytes (the driver's granularity is {granularity} bytes)"
                ),
                expected: "a positive multiple of the driver's allocation granularity",
            }
            .into());
        }
        config.validate()?;
        let policies = Policies::chosen(&config, page_size);
        let chunk_pages = policies.handle_size.chunk_pages();
        let info = driver.mem_info()?;
        let device_total = info.total;
        let limit = config.limit_bytes(info.total);
        let budget = config.budget_bytes(info.total, info.free, limit);
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
        let setup = Setup {
            chunk_pages,
            page_size,
            budget,
            limit,
            margin: config.device_margin,
            chunk_room,
        };
        Ok(Self {
            driver,
            page_size,
            device_total,
            device_free: info.free,
            segments: Segments::default(),
            supply: Supply::set_up(setup, lending),
            policies,
            waits: StreamWaits::default(),
            graphs: Graphs::default(),
            tags: Tags::default(),
            books: Books::open(page_size, config.max_split_size),
            imports: Imports::default(),
            held_back: None,
            config,
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
        (self.segments.live())
            .map(|s| (s.va, s.stream, s.pool))
            .collect()
    }

    /// The largest request that can be served now without a driver call.
    pub fn largest_free_block(&self) -> u64 {
        self.segments.largest_free_mapped_block()
    }

    /// Turns on (or off) the capture query at each allocation, which finds captures the allocator was not
    /// told of: their allocations go to an implicit pool that is never released. Off by default (a trace
    /// replay has no captures); the facade turns it on.
    pub fn detect_captures(&mut self, on: bool) {
        self.graphs.set_detect(on);
    }

    /// Gives the allocator the memory its caller holds back (the facade's stream caches): a request that
    /// runs out of memory frees it and tries once more, as part of its one retry (`request.rs`).
    pub(crate) fn hold_back(&mut self, held: Box<dyn HeldBack>) {
        self.held_back = Some(held);
    }
}

impl<D: Driver> Drop for Expandable<D> {
    /// Gives everything back to the driver: the allocator owns its reservations and handles, and nothing
    /// can use them once it is gone. Failures are reported through `tracing`, never silently dropped.
    fn drop(&mut self) {
        if let Err(err) = self.imports.close_all(&mut self.driver) {
            tracing::error!(%err, "cuvmm: unmapping shared memory on drop failed");
        }
        if let Err(err) = self.teardown() {
            tracing::error!(%err, "cuvmm: releasing device memory on drop failed");
        }
    }
}
