//! The exported shells of what PyTorch's `MemPool` and cudagraph trees ask of a pool (`crate::pools`), of
//! the pools with an allocator of their own (`crate::foreign`), and of the PyTorch version the handles of
//! shared memory are written for. Same rules as the rest of `ffi`: a shell converts, calls, and records a
//! failure; no panic crosses.

use super::shell::{address, shell, stream_id};
use crate::error::AbiError;
use crate::foreign::Fit;
use crate::pools;
use crate::registry::global;
use crate::structs::{CForeignSegment, CPoolBlock, CPrivatePoolStat};
use cuvmm::GraphPool;
use std::ffi::{c_int, c_void};
use std::ptr;

/// How many users pool `{pool_a, pool_b}` of `device` has (PyTorch's `getPoolUseCount`); -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_pool_use_count(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    shell("cuvmm_pool_use_count", -1, || {
        let count = pools::use_count(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(c_int::try_from(count).unwrap_or(c_int::MAX))
    })
}

/// Whether the pool's free memory may serve an allocation that would otherwise run out (PyTorch's
/// `setUseOnOOM`); 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_set_use_on_oom(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    on: c_int,
) -> c_int {
    shell("cuvmm_set_use_on_oom", -1, || {
        pools::set_use_on_oom(global()?, device, GraphPool(pool_a, pool_b), on != 0)?;
        Ok(0)
    })
}

/// From now on each allocation in the pool takes whole pages (PyTorch's `setNoSplit`); 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_set_no_split(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    shell("cuvmm_set_no_split", -1, || {
        pools::set_no_split(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(0)
    })
}

/// Writes up to `cap` of the pool's live blocks to `out` (a checkpoint); returns how many it has (call
/// again with more room if that is above `cap`), or -1.
///
/// # Safety
/// `out` is null (only with `cap` 0) or valid for `cap` writes of `cuvmm_pool_block`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_pool_blocks(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    out: *mut CPoolBlock,
    cap: usize,
) -> i64 {
    shell("cuvmm_pool_blocks", -1, || {
        if out.is_null() && cap > 0 {
            return Err(AbiError::NullArgument { what: "out" });
        }
        let blocks = pools::blocks(global()?, device, GraphPool(pool_a, pool_b))?;
        for (i, block) in blocks.iter().take(cap).enumerate() {
            // SAFETY: `out` is not null (cap > 0 here) and the caller promises `cap` writable elements;
            // `i < cap`.
            unsafe { out.add(i).write(CPoolBlock::from(*block)) };
        }
        Ok(i64::try_from(blocks.len()).unwrap_or(i64::MAX))
    })
}

/// Puts the pool back as the checkpoint `blocks` (`n` of them, from cuvmm_pool_blocks) found it: its
/// blocks allocated since are freed, the checkpoint's live again at their addresses; 0 or -1.
///
/// # Safety
/// `blocks` is null (only with `n` 0) or valid for `n` reads of `cuvmm_pool_block`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_pool_restore(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    blocks: *const CPoolBlock,
    n: usize,
) -> c_int {
    shell("cuvmm_pool_restore", -1, || {
        let checkpoint: Vec<cuvmm::PoolBlock> = match n {
            0 => Vec::new(),
            _ if blocks.is_null() => return Err(AbiError::NullArgument { what: "blocks" }),
            // SAFETY: not null, and the caller promises `n` readable elements during the call; copied.
            _ => unsafe { std::slice::from_raw_parts(blocks, n) }
                .iter()
                .map(|&b| b.into())
                .collect(),
        };
        pools::restore(global()?, device, GraphPool(pool_a, pool_b), &checkpoint)?;
        Ok(0)
    })
}

/// Writes up to `cap` of `device`'s private pools' reserved bytes to `out` (PyTorch's
/// `reserved_bytes_by_private_pools`), by pool; returns how many pools there are (call again with more room
/// if that is above `cap`), or -1.
///
/// # Safety
/// `out` is null (only with `cap` 0) or valid for `cap` writes of `cuvmm_private_pool_stat`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_private_pool_stats(
    device: c_int,
    out: *mut CPrivatePoolStat,
    cap: usize,
) -> i64 {
    shell("cuvmm_private_pool_stats", -1, || {
        if out.is_null() && cap > 0 {
            return Err(AbiError::NullArgument { what: "out" });
        }
        let pools = pools::reserved_by_private_pool(global()?, device)?;
        for (i, &(pool, reserved)) in pools.iter().take(cap).enumerate() {
            let entry = CPrivatePoolStat {
                pool_a: pool.0,
                pool_b: pool.1,
                reserved_bytes: reserved.into(),
            };
            // SAFETY: `out` is not null (cap > 0 here) and the caller promises `cap` writable elements;
            // `i < cap`.
            unsafe { out.add(i).write(entry) };
        }
        Ok(i64::try_from(pools.len()).unwrap_or(i64::MAX))
    })
}

/// Gives back the cached memory of the released pool (PyTorch's `emptyCache(pool)`); returns the bytes,
/// or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_empty_pool_cache(device: c_int, pool_a: u64, pool_b: u64) -> i64 {
    shell("cuvmm_empty_pool_cache", -1, || {
        let bytes = pools::empty_cache(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
    })
}

/// `size` bytes at `ptr` of `device`, which must lie in the free memory of one of its segments (PyTorch's
/// `allocateWithAddress`); `ptr`, or null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_malloc_at(device: c_int, ptr: *mut c_void, size: isize) -> *mut c_void {
    shell("cuvmm_malloc_at", ptr::null_mut(), || {
        let addr = pools::alloc_at(global()?, device, address(ptr), size)?;
        Ok(ptr::with_exposed_provenance_mut(addr as usize))
    })
}

/// A block of `size` bytes for `stream` in a pool with an allocator of its own; or null with `*grow` the
/// bytes of a segment to get from that allocator (then cuvmm_foreign_add_segment and call again), or null
/// with `*grow` 0 on failure.
///
/// # Safety
/// `grow` is null (an error) or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_foreign_malloc(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    size: isize,
    stream: *mut c_void,
    no_split: c_int,
    grow: *mut usize,
) -> *mut c_void {
    shell("cuvmm_foreign_malloc", ptr::null_mut(), || {
        if grow.is_null() {
            return Err(AbiError::NullArgument { what: "grow" });
        }
        // SAFETY: not null, and the caller promises it is valid for one write.
        unsafe { grow.write(0) };
        let pool = GraphPool(pool_a, pool_b);
        let fit = pools::foreign_malloc(
            global()?,
            device,
            pool,
            size,
            stream_id(stream),
            no_split != 0,
        )?;
        match fit {
            Fit::Block(addr) => Ok(ptr::with_exposed_provenance_mut(addr as usize)),
            Fit::Grow(bytes) => {
                // SAFETY: as above.
                unsafe { grow.write(usize::try_from(bytes).unwrap_or(usize::MAX)) };
                Ok(ptr::null_mut())
            }
        }
    })
}

/// A segment of `size` bytes at `ptr` that the pool's own allocator made, for `stream`; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_foreign_add_segment(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    stream: *mut c_void,
    ptr: *mut c_void,
    size: usize,
) -> c_int {
    shell("cuvmm_foreign_add_segment", -1, || {
        let pool = GraphPool(pool_a, pool_b);
        pools::foreign_add_segment(
            global()?,
            device,
            pool,
            stream_id(stream),
            address(ptr),
            size as u64,
        )?;
        Ok(0)
    })
}

/// Takes out the wholly free segments of `device`'s released pools with an allocator of their own (that
/// pool, or all of them when `all` is nonzero) and returns them (`*len` of them; free with
/// cuvmm_foreign_segments_free) for the caller to give back to the pools' allocators. Null with `*len` 0
/// when there are none, or on failure.
///
/// # Safety
/// `len` is null (an error) or valid for one write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_foreign_release(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    all: c_int,
    len: *mut usize,
) -> *mut CForeignSegment {
    shell("cuvmm_foreign_release", ptr::null_mut(), || {
        if len.is_null() {
            return Err(AbiError::NullArgument { what: "len" });
        }
        // SAFETY: not null, and the caller promises it is valid for one write.
        unsafe { len.write(0) };
        let pool = (all == 0).then_some(GraphPool(pool_a, pool_b));
        let released = pools::foreign_release(global()?, device, pool)?;
        if released.is_empty() {
            return Ok(ptr::null_mut());
        }
        let out: Box<[CForeignSegment]> = released.into_iter().map(CForeignSegment::from).collect();
        // SAFETY: as above.
        unsafe { len.write(out.len()) };
        Ok(Box::into_raw(out).cast::<CForeignSegment>())
    })
}

/// How many segments pool `{pool_a, pool_b}` of `device` holds from its allocator of its own, free or not;
/// -1 on failure. Once the pool is released and holds none, the caller may let go of that allocator.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_foreign_segment_count(device: c_int, pool_a: u64, pool_b: u64) -> isize {
    shell("cuvmm_foreign_segment_count", -1, || {
        let count = pools::foreign_segment_count(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(isize::try_from(count).unwrap_or(isize::MAX))
    })
}

/// Frees what cuvmm_foreign_release returned (`len` of them). Null is ignored.
///
/// # Safety
/// `segments` is null or came from cuvmm_foreign_release with this `len`, and is freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_foreign_segments_free(segments: *mut CForeignSegment, len: usize) {
    shell("cuvmm_foreign_segments_free", (), || {
        if !segments.is_null() {
            // SAFETY: the caller promises it is the boxed slice cuvmm_foreign_release leaked, with its length.
            drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(segments, len)) });
        }
        Ok(())
    })
}

/// The PyTorch this process runs under (the C++ layer says so when installed): the handles of shared memory
/// are written in its layout (`torch_handle.rs`).
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_set_torch_version(major: c_int, minor: c_int) {
    shell("cuvmm_set_torch_version", (), || {
        let (major, minor) = (u32::try_from(major), u32::try_from(minor));
        if let (Ok(major), Ok(minor)) = (major, minor) {
            crate::torch_handle::set_torch_version(major, minor);
        }
        Ok(())
    })
}
