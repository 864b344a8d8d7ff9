//! What PyTorch's `MemPool` and cudagraph trees ask beyond capturing into a pool, in safe Rust on typed
//! values: use counts, `use_on_oom`, `no_split`, checkpoints and one pool's `empty_cache` for cuvmm's own
//! pools (`cuvmm::Allocator`'s pool operations), and the pools with an allocator of their own
//! ([`crate::foreign`]). `src/ffi.rs` converts the raw arguments and results.

use crate::error::AbiError;
use crate::foreign::{self, Fit, Released};
use crate::registry::Registry;
use cuvmm::stats::StatArray;
use cuvmm::{GraphPool, PoolBlock};

/// How many users `pool` of `device` has (begins and increfs not yet released; 0 for none).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn use_count(registry: &Registry, device: i32, pool: GraphPool) -> Result<usize, AbiError> {
    Ok(registry.allocator(device)?.pool_use_count(pool))
}

/// The reserved bytes of each private pool of `device`, cuvmm's own and those with an allocator of their own
/// (PyTorch's `reserved_bytes_by_private_pools`), by pool. A device never named has none, and asking does
/// not build its allocator.
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`].
pub fn reserved_by_private_pool(
    registry: &Registry,
    device: i32,
) -> Result<Vec<(GraphPool, StatArray)>, AbiError> {
    let mut pools =
        (registry.existing(device)?).map_or_else(Vec::new, |a| a.reserved_by_private_pool());
    pools.extend(foreign::reserved_by_private_pool(device));
    pools.sort_by_key(|&(pool, _)| pool);
    Ok(pools)
}

/// Says whether `pool`'s free memory may serve an allocation of `device` that would otherwise run out.
///
/// # Errors
/// As [`use_count`].
pub fn set_use_on_oom(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    on: bool,
) -> Result<(), AbiError> {
    registry.allocator(device)?.set_pool_use_on_oom(pool, on);
    Ok(())
}

/// From now on, each allocation in `pool` of `device` takes whole pages.
///
/// # Errors
/// As [`use_count`].
pub fn set_no_split(registry: &Registry, device: i32, pool: GraphPool) -> Result<(), AbiError> {
    registry.allocator(device)?.set_pool_no_split(pool);
    Ok(())
}

/// The live blocks of `pool` of `device`: a checkpoint.
///
/// # Errors
/// As [`use_count`].
pub fn blocks(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
) -> Result<Vec<PoolBlock>, AbiError> {
    Ok(registry.allocator(device)?.pool_blocks(pool))
}

/// Puts `pool` of `device` back as `checkpoint` found it; returns the blocks live in it before.
///
/// The blocks live before are freed (those of the checkpoint are made again), so their exports are
/// forgotten first, as a free forgets them: their descriptors must not outlive the handles. A refused
/// restore forgets them too; PyTorch then frees those blocks itself.
///
/// # Errors
/// As [`use_count`]; the allocator's refusal ([`cuvmm::Error::GraphPool`]).
pub fn restore(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    checkpoint: &[PoolBlock],
) -> Result<Vec<u64>, AbiError> {
    let allocator = registry.allocator(device)?;
    if crate::sharing::pending_exports() > 0 {
        for block in allocator.pool_blocks(pool) {
            crate::sharing::forget(registry, device, block.addr);
        }
    }
    Ok(allocator.restore_pool(pool, checkpoint)?)
}

/// Gives back the cached memory of the released `pool` of `device`; returns the bytes.
///
/// # Errors
/// As [`use_count`]; a capture underway; a driver failure.
pub fn empty_cache(registry: &Registry, device: i32, pool: GraphPool) -> Result<u64, AbiError> {
    Ok(registry.allocator(device)?.empty_pool_cache(pool)?)
}

/// A block of `size` bytes in `pool` of `device` (a pool with an allocator of its own) for `stream`, or
/// the size of the segment to get from that allocator first ([`foreign::malloc`]).
///
/// # Errors
/// [`AbiError::BadSize`] for `size <= 0`; as [`use_count`].
pub fn foreign_malloc(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    size: isize,
    stream: u64,
    no_split: bool,
) -> Result<Fit, AbiError> {
    let bytes = u64::try_from(size)
        .ok()
        .filter(|&b| b > 0)
        .ok_or(AbiError::BadSize { size })?;
    foreign::malloc(registry, device, pool, bytes, stream, no_split)
}

/// A segment its allocator made for `pool` of `device` ([`foreign::add_segment`]).
///
/// # Errors
/// [`AbiError::BadSize`]; an overlap with a known segment.
pub fn foreign_add_segment(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
    stream: u64,
    ptr: u64,
    size: u64,
) -> Result<(), AbiError> {
    registry.allocator(device)?;
    foreign::add_segment(registry, device, pool, stream, ptr, size)
}

/// Takes out the wholly free segments of `device`'s released pools with an allocator of their own (`pool`,
/// or all of them), for the caller to give back to their allocators.
///
/// # Errors
/// As [`use_count`]; a driver failure.
pub fn foreign_release(
    registry: &Registry,
    device: i32,
    pool: Option<GraphPool>,
) -> Result<Vec<Released>, AbiError> {
    foreign::release(registry, device, pool)
}

/// How many segments `pool` of `device` holds from its allocator of its own ([`foreign::segment_count`]).
///
/// # Errors
/// As [`use_count`].
pub fn foreign_segment_count(
    registry: &Registry,
    device: i32,
    pool: GraphPool,
) -> Result<usize, AbiError> {
    registry.allocator(device)?;
    Ok(foreign::segment_count(device, pool))
}

/// Allocates `size` bytes at `ptr` of `device`, in the free memory of one of its segments (PyTorch's
/// `allocateWithAddress`).
///
/// # Errors
/// [`AbiError::BadSize`] for `size <= 0`; as [`use_count`]; the allocator's refusal (not free memory there).
pub fn alloc_at(registry: &Registry, device: i32, ptr: u64, size: isize) -> Result<u64, AbiError> {
    let bytes = u64::try_from(size)
        .ok()
        .filter(|&b| b > 0)
        .ok_or(AbiError::BadSize { size })?;
    Ok(registry.allocator(device)?.alloc_at(ptr, bytes)?)
}
