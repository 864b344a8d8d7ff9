//! Pools with an allocator of their own (PyTorch's `MemPool(allocator=...)`: vLLM's sleep-mode
//! `CuMemAllocator`, NCCL's `ncclMemAlloc` pools), kept as PyTorch's caching allocator keeps them. The pool's
//! memory comes from its allocator in segments, which the C++ layer asks that allocator for when
//! [`malloc`] says so ([`Fit::Grow`]: 2 MiB for a request up to 1 MiB, 20 MiB up to 10 MiB, else the
//! request rounded up to 2 MiB, PyTorch's sizes); blocks are carved in them by best fit on the request's
//! stream, split as PyTorch splits a segment (never in a `no_split` pool) and merged when freed. A segment
//! goes back to its allocator ([`release`]) once wholly free and its pool released (no user left in cuvmm's
//! count, which the C++ layer keeps for these pools too), at `emptyCache`. None of cuvmm's device memory is
//! involved.
//!
//! **Streams.** A block used on other streams (`record_stream`) is reusable once events recorded on them at
//! its free have completed; the events go through the device's driver, and while a capture is underway the
//! free waits until it ends (no event may be recorded or queried then), as cuvmm's own frees do.
//!
//! **Events.** Their segments and blocks are recorded with the device's events (the history of snapshots,
//! the trace trackers), with their pool, as PyTorch's allocator records them: `segment_alloc` when a segment
//! is added, `segment_free` when it is taken out to go back (before the C++ layer frees it), and each block's
//! `alloc`, `free_requested` and `free_completed`.
//!
//! **Statistics.** The pools' memory counts in the device's statistics, as in PyTorch's: allocations,
//! segments, allocated, reserved, active and requested bytes ([`merge_stats`]). Their peaks are those of
//! the sum: seen at each event of these pools, and, between them, cuvmm's own peak plus the least these
//! pools held since the peaks were reset; exact when the sum peaks at one of these pools' events, or while
//! their memory stays as it is (weights loaded into one, then a model run: vLLM's pattern).

use crate::error::AbiError;
use crate::registry::{Registry, TorchAllocator};
use crate::structs::CForeignSegment;
use cuvmm::driver::EventId;
use cuvmm::history::TraceAction;
use cuvmm::pool::Pool;
use cuvmm::snapshot::{BlockState, SnapshotBlock, SnapshotSegment};
use cuvmm::stats::{PoolStats, StatArray};
use cuvmm::strategy::Snapshots as _;
use cuvmm::{Driver as _, GraphPool, Stat, Stats, Strategy as _, StreamId};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{LazyLock, Mutex, MutexGuard};

const ROUND: u64 = 512;
const SMALL_SIZE: u64 = 1 << 20;
const SMALL_BUFFER: u64 = 2 << 20;
const LARGE_BUFFER: u64 = 20 << 20;
const MIN_LARGE_ALLOC: u64 = 10 << 20;
const ROUND_LARGE: u64 = 2 << 20;

/// What [`malloc`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fit {
    /// The block's address.
    Block(u64),
    /// No free block fits: ask the pool's allocator for a segment of this many bytes, hand it to
    /// [`add_segment`], and ask again.
    Grow(u64),
}

/// The segment PyTorch's allocator asks a pool's allocator for, for a request of `rounded` bytes.
pub fn segment_size(rounded: u64) -> u64 {
    if rounded <= SMALL_SIZE {
        SMALL_BUFFER
    } else if rounded < MIN_LARGE_ALLOC {
        LARGE_BUFFER
    } else {
        rounded.div_ceil(ROUND_LARGE) * ROUND_LARGE
    }
}

#[derive(Debug, Clone)]
enum State {
    Free,
    /// Handed out, with the other streams that used it.
    Live {
        requested: u64,
        streams: Vec<u64>,
    },
    /// Freed during a capture while other streams used it: its events are recorded once no capture is
    /// underway.
    Deferred {
        requested: u64,
        streams: Vec<u64>,
    },
    /// Freed, reusable once these events complete.
    Pending {
        requested: u64,
        events: Vec<EventId>,
    },
}

#[derive(Debug, Clone)]
struct Block {
    size: u64,
    state: State,
}

#[derive(Debug)]
struct Segment {
    device: i32,
    pool: GraphPool,
    stream: u64,
    size: u64,
    class: Pool,
    /// By address, tiling the segment.
    blocks: BTreeMap<u64, Block>,
}

/// A device's statistics of these pools.
#[derive(Debug, Default)]
struct Books {
    own: Stats,
    /// Peaks of the sum with cuvmm's own statistics, as seen at these pools' events.
    tracked: Stats,
    /// The least these pools held (`current`) since the peaks were reset.
    floor: Stats,
    /// Each pool's reserved bytes (PyTorch's `reserved_bytes_by_private_pools`), listed until both resets
    /// have cleared a pool whose memory is gone.
    by_pool: BTreeMap<GraphPool, StatArray>,
}

#[derive(Debug, Default)]
struct Pools {
    /// By start address.
    segments: BTreeMap<u64, Segment>,
    books: HashMap<i32, Books>,
}

static POOLS: LazyLock<Mutex<Pools>> = LazyLock::new(Mutex::default);
/// Whether any segment was ever added: frees and `record_stream` look here only then.
static ANY: AtomicBool = AtomicBool::new(false);

fn pools() -> MutexGuard<'static, Pools> {
    // A panic while locked left it whole enough to go on: every change is made before the next check.
    POOLS
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// The statistics these pools keep, in one order (totals, then the small and the large pool's share).
#[derive(Clone, Copy)]
enum Field {
    Allocation,
    AllocatedBytes,
    Active,
    ActiveBytes,
    RequestedBytes,
    Segment,
    ReservedBytes,
}

const FIELDS: [Field; 7] = [
    Field::Allocation,
    Field::AllocatedBytes,
    Field::Active,
    Field::ActiveBytes,
    Field::RequestedBytes,
    Field::Segment,
    Field::ReservedBytes,
];

fn total(s: &mut Stats, field: Field) -> &mut Stat {
    match field {
        Field::Allocation => &mut s.allocation,
        Field::AllocatedBytes => &mut s.allocated_bytes,
        Field::Active => &mut s.active,
        Field::ActiveBytes => &mut s.active_bytes,
        Field::RequestedBytes => &mut s.requested_bytes,
        Field::Segment => &mut s.segment,
        Field::ReservedBytes => &mut s.reserved_bytes,
    }
}

fn share(p: &mut PoolStats, field: Field) -> &mut Stat {
    match field {
        Field::Allocation => &mut p.allocation,
        Field::AllocatedBytes => &mut p.allocated_bytes,
        Field::Active => &mut p.active,
        Field::ActiveBytes => &mut p.active_bytes,
        Field::RequestedBytes => &mut p.requested_bytes,
        Field::Segment => &mut p.segment,
        Field::ReservedBytes => &mut p.reserved_bytes,
    }
}

/// Every statistic these pools keep, of `s`: totals and both pools' shares.
fn each(s: &mut Stats, mut f: impl FnMut(&mut Stat)) {
    for field in FIELDS {
        f(total(s, field));
        f(share(&mut s.small_pool, field));
        f(share(&mut s.large_pool, field));
    }
}

/// The same statistics of two `Stats`, pairwise.
fn each_pair(a: &mut Stats, b: &mut Stats, mut f: impl FnMut(&mut Stat, &mut Stat)) {
    for field in FIELDS {
        f(total(a, field), total(b, field));
        f(
            share(&mut a.small_pool, field),
            share(&mut b.small_pool, field),
        );
        f(
            share(&mut a.large_pool, field),
            share(&mut b.large_pool, field),
        );
    }
}

impl Books {
    fn count(&mut self, class: Pool, field: Field, n: u64, up: bool) {
        let pool = match class {
            Pool::Small => &mut self.own.small_pool,
            Pool::Large => &mut self.own.large_pool,
        };
        for stat in [share(pool, field)] {
            if up { stat.add(n) } else { stat.sub(n) }
        }
        let stat = total(&mut self.own, field);
        if up { stat.add(n) } else { stat.sub(n) }
    }

    /// Notes the sum with cuvmm's own statistics `core` now: its peaks, and the least these pools held.
    fn track(&mut self, core: &Stats) {
        let (mut sums, mut own) = (*core, self.own);
        each_pair(&mut sums, &mut own, |s, o| s.current += o.current);
        each_pair(&mut self.tracked, &mut sums, |t, s| {
            t.peak = t.peak.max(s.current)
        });
        each_pair(&mut self.floor, &mut own, |f, o| {
            f.current = f.current.min(o.current)
        });
    }
}

/// Reads cuvmm's own statistics of `device` as the strategy has them (without draining the stream caches,
/// whose buffers it counts as allocated).
fn core_stats(registry: &Registry, device: i32) -> Result<Stats, AbiError> {
    Ok(registry.allocator(device)?.with_strategy(|s| s.stats()))
}

fn capturing(registry: &Registry, device: i32) -> Result<bool, AbiError> {
    Ok(registry
        .allocator(device)?
        .with_strategy(|s| s.captures_underway())
        > 0)
}

/// A block for `size` bytes on `stream` in `pool` of `device`, or the segment size to get from the pool's
/// allocator first. `no_split`: the block found is handed out whole.
///
/// # Errors
/// [`AbiError::BadSize`] for 0 bytes; [`AbiError::DeviceOutOfRange`], [`AbiError::Init`]; a driver failure
/// recording or querying an event of a block freed earlier.
pub fn malloc(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    size: u64,
    stream: u64,
    no_split: bool,
) -> Result<Fit, AbiError> {
    let rounded = size.checked_next_multiple_of(ROUND).filter(|&r| r > 0);
    let rounded = rounded.ok_or(AbiError::BadSize {
        size: size as isize,
    })?;
    let class = if rounded <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    };
    let allocator = registry.allocator(device)?;
    let mut p = pools();
    poll(registry, &mut p, device)?;
    let best = (p.segments.iter())
        .filter(|(_, s)| {
            s.device == device && s.pool == pool && s.stream == stream && s.class == class
        })
        .flat_map(|(&start, s)| s.blocks.iter().map(move |(&addr, b)| (start, addr, b)))
        .filter(|(_, _, b)| matches!(b.state, State::Free) && b.size >= rounded)
        .map(|(start, addr, b)| (b.size, addr, start))
        .min();
    let Some((block_size, addr, start)) = best else {
        return Ok(Fit::Grow(segment_size(rounded)));
    };
    let rest = block_size - rounded;
    let split = !no_split
        && match class {
            Pool::Small => rest >= ROUND,
            Pool::Large => rest > SMALL_SIZE,
        };
    let taken = if split { rounded } else { block_size };
    let seg = p.segments.get_mut(&start).expect("found above");
    seg.blocks.insert(
        addr,
        Block {
            size: taken,
            state: State::Live {
                requested: size,
                streams: Vec::new(),
            },
        },
    );
    if split {
        seg.blocks.insert(
            addr + taken,
            Block {
                size: rest,
                state: State::Free,
            },
        );
    }
    record(allocator, seg, TraceAction::Alloc, addr, size);
    let core = core_stats(registry, device)?;
    let books = p.books.entry(device).or_default();
    books.count(class, Field::Allocation, 1, true);
    books.count(class, Field::AllocatedBytes, taken, true);
    books.count(class, Field::Active, 1, true);
    books.count(class, Field::ActiveBytes, taken, true);
    books.count(class, Field::RequestedBytes, size, true);
    books.track(&core);
    Ok(Fit::Block(addr))
}

/// A segment of `size` bytes at `ptr`, from the allocator of `pool` of `device`, for `stream`'s requests.
///
/// # Errors
/// [`AbiError::BadSize`] for an empty segment; [`AbiError::SegmentOverlap`] for one that overlaps a
/// segment already known.
pub fn add_segment(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    stream: u64,
    ptr: u64,
    size: u64,
) -> Result<(), AbiError> {
    if size == 0 || ptr.checked_add(size).is_none() {
        return Err(AbiError::BadSize {
            size: size as isize,
        });
    }
    let allocator = registry.allocator(device)?;
    let mut p = pools();
    let overlaps = (p.segments.range(..ptr + size).next_back())
        .is_some_and(|(&start, s)| start + s.size > ptr);
    if overlaps {
        return Err(AbiError::SegmentOverlap { ptr, size });
    }
    // Only requests of the small pool get 2 MiB segments (`segment_size`).
    let class = if size == SMALL_BUFFER {
        Pool::Small
    } else {
        Pool::Large
    };
    let blocks = BTreeMap::from([(
        ptr,
        Block {
            size,
            state: State::Free,
        },
    )]);
    let seg = Segment {
        device,
        pool,
        stream,
        size,
        class,
        blocks,
    };
    record(allocator, &seg, TraceAction::SegmentAlloc, ptr, size);
    p.segments.insert(ptr, seg);
    ANY.store(true, Ordering::Release);
    let core = core_stats(registry, device)?;
    let books = p.books.entry(device).or_default();
    books.count(class, Field::Segment, 1, true);
    books.count(class, Field::ReservedBytes, size, true);
    books.by_pool.entry(pool).or_default().add(class, size);
    books.own.num_device_alloc += 1;
    books.track(&core);
    Ok(())
}

/// The segment holding `ptr`, if these pools have one.
fn segment_of(p: &mut Pools, ptr: u64) -> Option<&mut Segment> {
    let (&start, seg) = p.segments.range_mut(..=ptr).next_back()?;
    (ptr < start + seg.size).then_some(seg)
}

/// Records `action` of the memory at `addr` of segment `seg` with its device's events.
fn record(allocator: &TorchAllocator, seg: &Segment, action: TraceAction, addr: u64, size: u64) {
    allocator.with_strategy(|s| s.record_event(action, addr, size, StreamId(seg.stream), seg.pool));
}

/// Frees `ptr` if it is a block of these pools; `None` if it is not theirs.
pub fn free(registry: &Registry, ptr: u64) -> Option<Result<(), AbiError>> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let mut p = pools();
    let seg = segment_of(&mut p, ptr)?;
    let device = seg.device;
    Some(free_in(registry, &mut p, device, ptr))
}

fn free_in(registry: &Registry, p: &mut Pools, device: i32, ptr: u64) -> Result<(), AbiError> {
    let allocator = registry.allocator(device)?;
    let seg = segment_of(p, ptr).expect("the caller found it");
    let (class, own_stream) = (seg.class, seg.stream);
    let block = seg.blocks.get(&ptr).cloned();
    let (size, requested, streams) = match block {
        Some(Block {
            size,
            state: State::Live { requested, streams },
        }) => (size, requested, streams),
        Some(_) => return Err(cuvmm::Error::DoubleFree { addr: ptr }.into()),
        None => return Err(cuvmm::Error::UnknownAddress { addr: ptr }.into()),
    };
    let streams: Vec<u64> = streams.into_iter().filter(|&s| s != own_stream).collect();
    let state = if streams.is_empty() {
        None
    } else if capturing(registry, device)? {
        Some(State::Deferred { requested, streams })
    } else {
        Some(State::Pending {
            requested,
            events: record_events(registry, device, &streams)?,
        })
    };
    // Counted once the free cannot fail: a refused one leaves the block live, and the figures with it.
    let books = p.books.entry(device).or_default();
    books.count(class, Field::Allocation, 1, false);
    books.count(class, Field::AllocatedBytes, size, false);
    let seg = segment_of(p, ptr).expect("found above");
    record(allocator, seg, TraceAction::FreeRequested, ptr, requested);
    match state {
        Some(state) => {
            seg.blocks.insert(ptr, Block { size, state });
        }
        None => release_block(allocator, p, device, ptr),
    }
    let core = core_stats(registry, device)?;
    p.books.entry(device).or_default().track(&core);
    Ok(())
}

fn record_events(
    registry: &Registry,
    device: i32,
    streams: &[u64],
) -> Result<Vec<EventId>, AbiError> {
    let allocator = registry.allocator(device)?;
    allocator.with_strategy(|s| {
        let mut events = Vec::with_capacity(streams.len());
        for &stream in streams {
            match s.driver_mut().record_event(StreamId(stream)) {
                Ok(event) => events.push(event),
                Err(err) => {
                    for event in events {
                        let _ = s.driver_mut().destroy_event(event);
                    }
                    return Err(cuvmm::Error::from(err).into());
                }
            }
        }
        Ok(events)
    })
}

/// Makes the freed block at `ptr` free, merging it with free neighbours, and counts it inactive.
fn release_block(allocator: &TorchAllocator, p: &mut Pools, device: i32, ptr: u64) {
    let seg = segment_of(p, ptr).expect("the caller found it");
    let class = seg.class;
    let Some(block) = seg.blocks.get(&ptr).cloned() else {
        return;
    };
    let requested = match block.state {
        State::Live { requested, .. }
        | State::Deferred { requested, .. }
        | State::Pending { requested, .. } => requested,
        State::Free => return,
    };
    record(allocator, seg, TraceAction::FreeCompleted, ptr, requested);
    let (mut start, mut size) = (ptr, block.size);
    if let Some((&next, b)) = seg.blocks.range(ptr + 1..).next()
        && matches!(b.state, State::Free)
        && next == ptr + block.size
    {
        size += b.size;
        seg.blocks.remove(&next);
    }
    if let Some((&prev, b)) = seg.blocks.range(..ptr).next_back()
        && matches!(b.state, State::Free)
        && prev + b.size == ptr
    {
        start = prev;
        size += b.size;
        seg.blocks.remove(&ptr);
    }
    seg.blocks.insert(
        start,
        Block {
            size,
            state: State::Free,
        },
    );
    let books = p.books.entry(device).or_default();
    books.count(class, Field::Active, 1, false);
    books.count(class, Field::ActiveBytes, block.size, false);
    books.count(class, Field::RequestedBytes, requested, false);
}

/// Records the events of deferred frees (once no capture is underway) and frees the pending blocks whose
/// events completed, on `device`.
fn poll(registry: &Registry, p: &mut Pools, device: i32) -> Result<(), AbiError> {
    let waiting: Vec<u64> = (p.segments.values())
        .filter(|s| s.device == device)
        .flat_map(|s| s.blocks.iter())
        .filter(|(_, b)| matches!(b.state, State::Deferred { .. } | State::Pending { .. }))
        .map(|(&addr, _)| addr)
        .collect();
    if waiting.is_empty() || capturing(registry, device)? {
        return Ok(());
    }
    let allocator = registry.allocator(device)?;
    for addr in waiting {
        let seg = segment_of(p, addr).expect("listed above");
        let block = seg.blocks[&addr].clone();
        match block.state {
            State::Deferred { requested, streams } => {
                let events = record_events(registry, device, &streams)?;
                let state = State::Pending { requested, events };
                let seg = segment_of(p, addr).expect("listed above");
                seg.blocks.insert(
                    addr,
                    Block {
                        size: block.size,
                        state,
                    },
                );
            }
            State::Pending { events, .. } => {
                let done = allocator.with_strategy(|s| -> Result<bool, cuvmm::DriverError> {
                    for &event in &events {
                        if !s.driver_mut().event_complete(event)? {
                            return Ok(false);
                        }
                    }
                    for &event in &events {
                        s.driver_mut().destroy_event(event)?;
                    }
                    Ok(true)
                });
                if done.map_err(cuvmm::Error::from)? {
                    release_block(allocator, p, device, addr);
                }
            }
            State::Free | State::Live { .. } => {}
        }
    }
    Ok(())
}

/// Notes that work on `stream` uses the block at `ptr` if it is one of these pools'; `None` if not.
pub fn record_stream(ptr: u64, stream: u64) -> Option<Result<(), AbiError>> {
    if !ANY.load(Ordering::Acquire) {
        return None;
    }
    let mut p = pools();
    let seg = segment_of(&mut p, ptr)?;
    let own = seg.stream;
    Some(match seg.blocks.get_mut(&ptr) {
        Some(Block {
            state: State::Live { streams, .. },
            ..
        }) => {
            if stream != own && !streams.contains(&stream) {
                streams.push(stream);
            }
            Ok(())
        }
        _ => Err(cuvmm::Error::UnknownAddress { addr: ptr }.into()),
    })
}

/// A segment taken out of these pools, for the C++ layer to give back to its pool's allocator.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Released {
    /// The pool whose allocator made it.
    pub pool: GraphPool,
    /// Where it starts.
    pub ptr: u64,
    /// Its size.
    pub size: u64,
}

/// Takes out the wholly free segments of `device`'s released pools (`pool`, or every one for `None`),
/// once the device's work is done with their blocks freed on other streams. Nothing while a pool is being
/// allocated to (a capture may be underway).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`], [`AbiError::Init`]; a driver failure.
pub fn release(
    registry: &Registry,
    device: i32,
    pool: Option<GraphPool>,
) -> Result<Vec<Released>, AbiError> {
    if !ANY.load(Ordering::Acquire) {
        return Ok(Vec::new());
    }
    // Giving memory back (cudaFree, cuMemRelease) is refused during a capture: it waits until no pool is
    // being allocated to.
    if capturing(registry, device)? {
        return Ok(Vec::new());
    }
    let allocator = registry.allocator(device)?;
    let mut p = pools();
    let chosen = |s: &Segment| {
        s.device == device
            && pool.is_none_or(|pool| s.pool == pool)
            && allocator.pool_use_count(s.pool) == 0
    };
    // Frees deferred during a capture get their events first, so that the wait below covers them too.
    poll(registry, &mut p, device)?;
    let pending = (p.segments.values())
        .filter(|s| chosen(s))
        .flat_map(|s| s.blocks.values())
        .any(|b| matches!(b.state, State::Pending { .. }));
    if pending {
        allocator
            .with_strategy(|s| s.driver_mut().synchronize_device())
            .map_err(cuvmm::Error::from)?;
        poll(registry, &mut p, device)?;
    }
    let free: Vec<u64> = (p.segments.iter())
        .filter(|(_, s)| chosen(s))
        .filter(|(_, s)| {
            s.blocks.len() == 1 && s.blocks.values().all(|b| matches!(b.state, State::Free))
        })
        .map(|(&start, _)| start)
        .collect();
    let mut out = Vec::with_capacity(free.len());
    for start in free {
        let seg = p.segments.remove(&start).expect("listed above");
        // Before the C++ layer gives it back, as PyTorch records it before freeing it (a tracker that
        // registered it deregisters it now).
        record(allocator, &seg, TraceAction::SegmentFree, start, seg.size);
        let books = p.books.entry(device).or_default();
        books.count(seg.class, Field::Segment, 1, false);
        books.count(seg.class, Field::ReservedBytes, seg.size, false);
        (books.by_pool.entry(seg.pool).or_default()).sub(seg.class, seg.size);
        books.own.num_device_free += 1;
        out.push(Released {
            pool: seg.pool,
            ptr: start,
            size: seg.size,
        });
    }
    if !out.is_empty() {
        let core = core_stats(registry, device)?;
        p.books.entry(device).or_default().track(&core);
    }
    Ok(out)
}

/// Adds these pools' share to `device`'s statistics `stats` (cuvmm's own): currents and totals summed,
/// peaks those of the sum (see the module's doc). Nothing changes for a device they never held memory of.
pub fn merge_stats(device: i32, stats: &mut Stats) {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let mut p = pools();
    let Some(books) = p.books.get_mut(&device) else {
        return;
    };
    let core_peaks = {
        let mut peaks = Vec::with_capacity(21);
        each(stats, |s| peaks.push(s.peak));
        peaks
    };
    let (mut own, mut tracked, mut floor) = (books.own, books.tracked, books.floor);
    let mut i = 0;
    each_pair(stats, &mut own, |c, o| {
        c.current += o.current;
        c.allocated += o.allocated;
        c.freed += o.freed;
    });
    each_pair(stats, &mut tracked, |c, t| {
        c.peak = c.peak.max(t.peak).max(c.current)
    });
    each_pair(stats, &mut floor, |c, f| {
        c.peak = c.peak.max(core_peaks[i] + f.current);
        i += 1;
    });
    stats.num_device_alloc += books.own.num_device_alloc;
    stats.num_device_free += books.own.num_device_free;
}

/// Sets these pools' peaks on `device` to the current sum with cuvmm's own statistics `core` (read after
/// cuvmm's own reset).
pub fn reset_peaks(device: i32, core: &Stats) {
    let mut p = pools();
    if let Some(books) = p.books.get_mut(&device) {
        each(&mut books.own, Stat::reset_peak);
        books.tracked = Stats::default();
        books.floor = books.own;
        books.track(core);
        StatArray::reset_by_pool(&mut books.by_pool, Stat::reset_peak);
    }
}

/// Sets these pools' cumulative counts on `device` to 0.
pub fn reset_accumulated(device: i32) {
    let mut p = pools();
    if let Some(books) = p.books.get_mut(&device) {
        each(&mut books.own, Stat::reset_accumulated);
        books.own.num_device_alloc = 0;
        books.own.num_device_free = 0;
        StatArray::reset_by_pool(&mut books.by_pool, Stat::reset_accumulated);
    }
}

/// The reserved bytes of each of these pools on `device` (PyTorch's `reserved_bytes_by_private_pools`).
pub fn reserved_by_private_pool(device: i32) -> Vec<(GraphPool, StatArray)> {
    if !ANY.load(Ordering::Acquire) {
        return Vec::new();
    }
    let p = pools();
    (p.books.get(&device)).map_or_else(Vec::new, |books| {
        books
            .by_pool
            .iter()
            .map(|(&pool, &array)| (pool, array))
            .collect()
    })
}

/// How many segments `pool` of `device` holds from its allocator, free or not: once the pool is released
/// and holds none, nothing will ask that allocator again.
pub fn segment_count(device: i32, pool: GraphPool) -> usize {
    if !ANY.load(Ordering::Acquire) {
        return 0;
    }
    (pools().segments.values())
        .filter(|s| s.device == device && s.pool == pool)
        .count()
}

/// The segments of these pools on `device` (of `pool` only, when given), as a snapshot lists them.
pub fn snapshot(device: i32, pool: Option<GraphPool>) -> Vec<SnapshotSegment> {
    if !ANY.load(Ordering::Acquire) {
        return Vec::new();
    }
    let p = pools();
    (p.segments.iter())
        .filter(|(_, s)| s.device == device && pool.is_none_or(|pool| s.pool == pool))
        .map(|(&start, s)| SnapshotSegment {
            device: device as usize,
            address: start,
            total_size: s.size,
            stream: StreamId(s.stream),
            pool: s.class,
            is_expandable: false,
            graph_pool: s.pool,
            tag: None,
            asleep: false,
            blocks: (s.blocks.iter())
                .map(|(&address, b)| {
                    let (state, requested_size) = match b.state {
                        State::Free => (BlockState::Inactive, 0),
                        State::Live { requested, .. } => (BlockState::ActiveAllocated, requested),
                        State::Deferred { requested, .. } | State::Pending { requested, .. } => {
                            (BlockState::ActivePendingFree, requested)
                        }
                    };
                    SnapshotBlock {
                        address,
                        size: b.size,
                        requested_size,
                        state,
                    }
                })
                .collect(),
        })
        .collect()
}

impl From<Released> for CForeignSegment {
    fn from(r: Released) -> Self {
        Self {
            pool_a: r.pool.0,
            pool_b: r.pool.1,
            address: r.ptr,
            size: r.size,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// PyTorch's `get_allocation_size`.
    #[test]
    fn segments_have_pytorchs_sizes() {
        let mib = 1 << 20;
        assert_eq!(segment_size(512), 2 * mib);
        assert_eq!(segment_size(mib), 2 * mib);
        assert_eq!(segment_size(mib + 512), 20 * mib);
        assert_eq!(segment_size(10 * mib - 512), 20 * mib);
        assert_eq!(segment_size(10 * mib), 10 * mib);
        assert_eq!(segment_size(11 * mib), 12 * mib);
    }
}
