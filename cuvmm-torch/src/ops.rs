//! The operations behind the exported functions, in safe Rust on typed values: addresses and streams are
//! `u64`, sizes are checked here, and every failure is an [`AbiError`]. `src/ffi.rs` only converts the raw
//! arguments and results.

use crate::error::AbiError;
use crate::registry::{Registry, TorchAllocator};
use crate::structs::{CDeviceStats, COomInfo, OwnedSnapshot};
use cuvmm::history::TraceEntry;
use cuvmm::{GraphPool, Strategy as _, StreamFilter, StreamId};
use std::cell::RefCell;
use std::path::Path;

thread_local! {
    /// The tag this thread's allocations are made under ([`set_tag`]); `None`: untagged.
    static TAG: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// From now on, this thread's allocations ([`malloc`]) are made under `tag` (`None`: untagged), on every
/// device: memory that [`sleep`] can give back and [`wake`] map again at the same addresses.
pub fn set_tag(tag: Option<String>) {
    TAG.with(|current| *current.borrow_mut() = tag);
}

/// Puts `tag` of `device` to sleep, keeping its bytes on the host if `keep`; returns the bytes given back.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; the allocator's refusal (a capture underway, pages
/// lent elsewhere, a driver failure).
pub fn sleep(registry: &Registry, device: i32, tag: &str, keep: bool) -> Result<u64, AbiError> {
    let allocator = registry.allocator(device)?;
    // Shared memory of the tag: importers keep what they mapped, but its descriptors here would outlive
    // the pages the sleep gives back.
    if crate::sharing::pending_exports() > 0 {
        let ranges: Vec<(u64, u64)> = (allocator.snapshot()?.segments.iter())
            .filter(|s| s.tag.as_deref() == Some(tag))
            .map(|s| (s.address, s.address + s.total_size))
            .collect();
        crate::sharing::forget_in(registry, device, &ranges);
    }
    Ok(allocator.sleep(tag, keep)?)
}

/// Wakes `tag` of `device`: its memory is mapped again at the same addresses, with its bytes if kept.
///
/// # Errors
/// As [`sleep`]; out of memory when the device has too little free.
pub fn wake(registry: &Registry, device: i32, tag: &str) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.wake(tag)?)
}

/// Pins the host memory the next sleep of `tag` of `device` with its bytes copies into; returns the bytes
/// pinned (0 for a device cuvmm never allocated on, which asking does not open).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; the allocator's refusal (a capture underway) or
/// failure (host memory that could not be pinned).
pub fn prepare_sleep(registry: &Registry, device: i32, tag: &str) -> Result<u64, AbiError> {
    let Some(allocator) = registry.existing(device)? else {
        return Ok(0);
    };
    Ok(allocator.prepare_sleep(tag)?)
}

/// Frees the page-locked host memory `device`'s tags keep for their next sleep (`tag`'s alone, or every
/// tag's with `None`), never the bytes of a sleeping tag; returns the bytes freed.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; the allocator's refusal (a tag being copied).
pub fn release_host_buffers(
    registry: &Registry,
    device: i32,
    tag: Option<&str>,
) -> Result<u64, AbiError> {
    Ok(registry.allocator(device)?.release_host_buffers(tag)?)
}

/// Copies into `out` the bytes at `ptr` on that a sleeping tag of `device` kept in host memory; returns
/// whether it did (`false`: no sleeping tag's memory, whose bytes are on the device; a device cuvmm never
/// allocated on has none, and asking does not open it).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; the allocator's refusal (the sleep kept no bytes
/// there, a tag being copied).
pub fn read_kept(
    registry: &Registry,
    device: i32,
    ptr: u64,
    out: &mut [u8],
) -> Result<bool, AbiError> {
    let Some(allocator) = registry.existing(device)? else {
        return Ok(false);
    };
    Ok(allocator.read_kept(ptr, out)?.is_some())
}

/// `device`'s tags as a JSON array: each one's name, state, live bytes, the bytes its wake would map,
/// whether its bytes are kept and the host memory it holds. A device cuvmm never allocated on has none
/// (`[]`), and asking does not open it: the frameworks' sleep calls ask every device.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn tags_json(registry: &Registry, device: i32) -> Result<String, AbiError> {
    let tags = (registry.existing(device)?).map_or_else(Vec::new, |allocator| allocator.tags());
    Ok(serde_json::to_string(&tags)?)
}

/// The number of devices the registry serves (device numbers `0..count`).
pub fn device_count(registry: &Registry) -> usize {
    registry.device_count()
}

/// Allocates `size` bytes on `device` for use on `stream` (a raw `CUstream`; 0 is the legacy default stream),
/// under this thread's tag if [`set_tag`] set one.
///
/// # Errors
/// [`AbiError::BadSize`] for `size <= 0`; [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; the
/// allocator's refusal ([`AbiError::Allocator`]: out of memory, larger than the device).
pub fn malloc(registry: &Registry, size: isize, device: i32, stream: u64) -> Result<u64, AbiError> {
    let bytes = u64::try_from(size)
        .ok()
        .filter(|&b| b > 0)
        .ok_or(AbiError::BadSize { size })?;
    let allocator = registry.allocator(device)?;
    let tagged = TAG.with(|tag| {
        (tag.borrow().as_deref())
            .map(|tag| allocator.alloc_tagged_raw(bytes, StreamId(stream), tag))
    });
    tagged
        .unwrap_or_else(|| allocator.alloc_raw(bytes, StreamId(stream)))
        .map_err(|error| match error {
            cuvmm::Error::TooLarge {
                requested,
                capacity,
            } => never_fits(allocator, error, requested, capacity),
            other => other.into(),
        })
}

/// A request larger than the device as an out-of-memory ([`AbiError::NeverFits`]), with the numbers PyTorch's
/// out-of-memory observers take. The device is not asked on this path: its free bytes are those cuvmm does
/// not hold.
fn never_fits(
    allocator: &TorchAllocator,
    error: cuvmm::Error,
    requested: u64,
    capacity: u64,
) -> AbiError {
    let stats = allocator.stats();
    let reserved = stats.reserved_bytes.current;
    let info = COomInfo {
        requested,
        alloc_size: requested,
        device_total: capacity,
        device_free: capacity.saturating_sub(reserved),
        allowed: (allocator.memory_fraction()).map_or(0, |f| (f * capacity as f64) as u64),
        allocated: stats.allocated_bytes.current,
        reserved,
    };
    AbiError::NeverFits { error, info }
}

/// Frees `ptr` on `device`. A null pointer is nothing to free (as C's `free(NULL)`). The size and stream
/// PyTorch passes are not needed: cuvmm knows both from the address.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] for an address this
/// device's allocator never handed out, or a second free.
pub fn free(registry: &Registry, ptr: u64, device: i32) -> Result<(), AbiError> {
    if ptr == 0 {
        return Ok(());
    }
    if let Some(freed) = crate::foreign::free(registry, ptr) {
        return freed;
    }
    let allocator = registry.allocator(device)?;
    crate::sharing::forget(registry, device, ptr);
    Ok(allocator.free_raw(ptr)?)
}

/// Records that work on `stream` uses the live allocation at `ptr` (PyTorch's `Tensor.record_stream`).
///
/// # Errors
/// As [`free`], for an address that is not a live allocation.
pub fn record_stream(
    registry: &Registry,
    ptr: u64,
    device: i32,
    stream: u64,
) -> Result<(), AbiError> {
    if let Some(recorded) = crate::foreign::record_stream(ptr, stream) {
        return recorded;
    }
    Ok(registry
        .allocator(device)?
        .record_stream(ptr, StreamId(stream))?)
}

/// The statistics of `device` as one JSON object: PyTorch's `memory_stats()` keys and cuvmm's own
/// (`cuvmm.*`), every value an integer.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn memory_stats_json(registry: &Registry, device: i32) -> Result<String, AbiError> {
    let mut stats = registry.allocator(device)?.stats();
    crate::foreign::merge_stats(device, &mut stats);
    let mut keys = stats.to_pytorch_keys();
    // As PyTorch's memory_stats() flattens the pool ids: `reserved_bytes_by_private_pools.0_1.all.current`.
    for (pool, reserved) in crate::pools::reserved_by_private_pool(registry, device)? {
        let name = format!("reserved_bytes_by_private_pools.{}_{}", pool.0, pool.1);
        reserved.insert_pytorch_keys(&name, &mut keys);
    }
    Ok(serde_json::to_string(&keys)?)
}

/// PyTorch's `memory_summary()` table for `device`, with cuvmm's rows.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn memory_summary(registry: &Registry, device: i32) -> Result<String, AbiError> {
    Ok(registry.allocator(device)?.memory_summary())
}

/// Gives `device`'s cached memory back to the driver.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; a driver failure ([`AbiError::Allocator`]).
pub fn empty_cache(registry: &Registry, device: i32) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.empty_cache()?)
}

/// Gives back `device`'s idle pages stranded in multi-page handles that live allocations still touch
/// ([`cuvmm::Allocator::release_stranded`]: the live bytes move, so the caller says no other thread
/// launches work meanwhile); returns the bytes given back.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; a capture underway or a driver failure
/// ([`AbiError::Allocator`]).
pub fn release_stranded(registry: &Registry, device: i32) -> Result<u64, AbiError> {
    Ok(registry.allocator(device)?.release_stranded()?)
}

/// Writes `device`'s segments and blocks to `path` as the pickle PyTorch's memory viewer reads
/// (`torch.cuda.memory._dump_snapshot`).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Snapshot`] if the file cannot be
/// written.
pub fn dump_snapshot(registry: &Registry, device: i32, path: &Path) -> Result<(), AbiError> {
    let snapshot = registry.allocator(device)?.snapshot()?;
    cuvmm::snapshot::pickle::write_file(path, &snapshot)?;
    Ok(())
}

/// From now on, allocations of `device` on the streams `filter` accepts come from the private pool `pool`
/// (PyTorch's `beginAllocateToPool`).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] for pool `{0, 0}` or a pool
/// already being allocated to.
pub fn begin_allocate_to_pool(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    filter: StreamFilter,
) -> Result<(), AbiError> {
    Ok(registry
        .allocator(device)?
        .begin_allocate_to_pool(pool, filter)?)
}

/// Allocations of `device` stop going to `pool` (PyTorch's `endAllocateToPool`).
///
/// # Errors
/// As [`begin_allocate_to_pool`], for a pool not being allocated to.
pub fn end_allocate_to_pool(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.end_allocate_to_pool(pool)?)
}

/// From now on the caller marks every capture of `device` ([`mark_capture`]): a pool begun with no capture
/// is then no capture (PyTorch 2.13's `use_mem_pool`).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn mark_captures(registry: &Registry, device: i32) -> Result<(), AbiError> {
    registry.allocator(device)?.mark_captures();
    Ok(())
}

/// A capture of `device` begins (`begun`) or ends (PyTorch's `markCaptureBegin` / `markCaptureEnd`).
///
/// # Errors
/// As [`mark_captures`].
pub fn mark_capture(registry: &Registry, device: i32, begun: bool) -> Result<(), AbiError> {
    let allocator = registry.allocator(device)?;
    if begun {
        allocator.mark_capture_begin();
    } else {
        allocator.mark_capture_end();
    }
    Ok(())
}

/// A graph that used `pool` of `device` is gone (PyTorch's `releasePool`).
///
/// # Errors
/// As [`begin_allocate_to_pool`], for a pool that is not live.
pub fn release_pool(registry: &Registry, device: i32, pool: GraphPool) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.release_pool(pool)?)
}

/// One more user of `pool` of `device` (PyTorch's `createOrIncrefPool`).
///
/// # Errors
/// As [`begin_allocate_to_pool`], for pool `{0, 0}`.
pub fn incref_pool(registry: &Registry, device: i32, pool: GraphPool) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.incref_pool(pool)?)
}

/// Device `peer` may reach every range of `device` mapped now and later.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`] for `device`; [`AbiError::BadPeer`] for a negative peer;
/// [`AbiError::Allocator`] if the driver refuses the peer.
pub fn add_peer(registry: &Registry, device: i32, peer: i32) -> Result<(), AbiError> {
    let peer = usize::try_from(peer).map_err(|_| AbiError::BadPeer { peer })?;
    Ok(registry.allocator(device)?.add_peer(peer)?)
}

/// Frees `ptr` on whichever device's allocator handed it out (PyTorch's `raw_delete`, which names no
/// device). The devices already in use are asked in order; on the CUDA backend addresses are unique
/// across devices, on the simulated one two devices may hand out the same address, and the first wins.
///
/// # Errors
/// [`AbiError::Allocator`] with [`cuvmm::Error::UnknownAddress`] if no device's allocator knows `ptr`; a
/// double free.
pub fn free_any(registry: &Registry, ptr: u64) -> Result<(), AbiError> {
    if ptr == 0 {
        return Ok(());
    }
    if let Some(freed) = crate::foreign::free(registry, ptr) {
        return freed;
    }
    for (device, allocator) in registry.built() {
        // An export of `ptr` on `device` exists only while `ptr` is live there: forgetting it where `ptr` is
        // not live forgets nothing.
        crate::sharing::forget(registry, device, ptr);
        match allocator.free_raw(ptr) {
            Err(cuvmm::Error::UnknownAddress { .. }) => continue,
            other => return Ok(other?),
        }
    }
    Err(cuvmm::Error::UnknownAddress { addr: ptr }.into())
}

/// `device`'s statistics in PyTorch's `DeviceStats` layout: zeros for a device never named, whose
/// allocator this does not build ([`Registry::existing`]).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn device_stats(registry: &Registry, device: i32) -> Result<CDeviceStats, AbiError> {
    let mut stats = (registry.existing(device)?).map_or_else(Default::default, |a| a.stats());
    crate::foreign::merge_stats(device, &mut stats);
    Ok(CDeviceStats::new(
        &stats,
        registry.settings().config.max_split_size,
    ))
}

/// Sets every peak of `device`'s statistics to its current value (nothing to do on a device never named).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn reset_peak_stats(registry: &Registry, device: i32) -> Result<(), AbiError> {
    let Some(allocator) = registry.existing(device)? else {
        return Ok(());
    };
    allocator.reset_peak_stats()?;
    crate::foreign::reset_peaks(device, &allocator.with_strategy(|s| s.stats()));
    Ok(())
}

/// Sets every cumulative count of `device`'s statistics to 0 (nothing to do on a device never named).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn reset_accumulated_stats(registry: &Registry, device: i32) -> Result<(), AbiError> {
    let Some(allocator) = registry.existing(device)? else {
        return Ok(());
    };
    allocator.reset_accumulated_stats()?;
    crate::foreign::reset_accumulated(device);
    Ok(())
}

/// Counts `device`'s last out-of-memory as recovered from: the caller freed memory of its own and the
/// request then succeeded ([`cuvmm::Allocator::count_recovered_oom`]).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn recovered_oom(registry: &Registry, device: i32) -> Result<(), AbiError> {
    registry.allocator(device)?.count_recovered_oom();
    Ok(())
}

/// Sets the bytes of every device that a request's growth leaves free, counting other processes' use
/// (torch_memory_saver's process-wide `memory_margin_bytes`), from now on, devices opened later included.
pub fn set_device_margin(registry: &Registry, bytes: u64) {
    registry.set_device_margin(bytes);
}

/// Limits what `device`'s allocator may reserve to `fraction` of the device's memory, from now on.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] for a fraction outside
/// [0, 1] (or NaN).
pub fn set_memory_fraction(
    registry: &Registry,
    device: i32,
    fraction: f64,
) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.set_memory_fraction(fraction)?)
}

/// `device`'s memory limit as a fraction of its memory; 1 when none is set (as PyTorch answers).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn memory_fraction(registry: &Registry, device: i32) -> Result<f64, AbiError> {
    Ok(registry.allocator(device)?.memory_fraction().unwrap_or(1.0))
}

/// `device`'s segments, blocks and recorded events, laid out for C.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] if a cached buffer could
/// not be given back first.
pub fn snapshot(registry: &Registry, device: i32) -> Result<OwnedSnapshot, AbiError> {
    let mut snapshot = registry.allocator(device)?.snapshot()?;
    snapshot
        .segments
        .extend(crate::foreign::snapshot(device, None));
    snapshot.segments.sort_by_key(|s| s.address);
    Ok(OwnedSnapshot::new(&snapshot))
}

/// Calls `tracker` with each of `device`'s events from now on (PyTorch's `attachAllocatorTraceTracker`).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn attach_trace_tracker(
    registry: &Registry,
    device: i32,
    tracker: impl Fn(&TraceEntry) + Send + Sync + 'static,
) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.attach_trace_tracker(tracker)?)
}

/// Starts recording `device`'s events for snapshots, keeping the last `max_entries`, or stops and forgets
/// them with 0.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn record_history(
    registry: &Registry,
    device: i32,
    max_entries: usize,
) -> Result<(), AbiError> {
    let keep = (max_entries > 0).then_some(max_entries);
    Ok(registry.allocator(device)?.record_history(keep)?)
}
