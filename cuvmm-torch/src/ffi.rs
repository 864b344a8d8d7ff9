//! The exported C functions (declared in `cuvmm_torch.h`): thin shells that turn raw arguments into typed
//! values, call `ops`, and turn the result back, with the body run under [`std::panic::catch_unwind`] so no
//! panic crosses into PyTorch. A failure returns null, nonzero or nothing, after being logged and recorded
//! for `cuvmm_last_error`.
//!
//! The shells of `MemPool`'s and cudagraph trees' pool operations, of the pools with an allocator of their
//! own and of the PyTorch version are in the child module `ffi/pools.rs`, re-exported here.
//!
//! The only `unsafe` of the crate is here (and in `ffi/pools.rs`): `#[unsafe(no_mangle)]` on each export (the symbol names are
//! cuvmm's own, prefixed `cuvmm_`, so they clash with nothing), reading or taking back the C strings
//! that the callers of two functions promise are valid, writing a struct where the caller says, and taking
//! back a snapshot handed out.
#![allow(unsafe_code)]

mod pools;
mod shell;
pub use pools::*;
use shell::{address, shell, stream_id, to_c};

use crate::error::{self, AbiError};
use crate::ops;
use crate::registry::global;
use crate::sharing;
use crate::structs::{CDeviceStats, COomInfo, CSnapshot, CTraceEntry, OwnedSnapshot};
use cuvmm::history::TraceEntry;
use cuvmm::{GraphPool, StreamFilter, StreamId};
use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::panic;
use std::path::Path;
use std::ptr;

/// PyTorch's allocation function: `size` bytes on `device` for `stream`; null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_malloc(size: isize, device: c_int, stream: *mut c_void) -> *mut c_void {
    shell("cuvmm_malloc", ptr::null_mut(), || {
        let addr = ops::malloc(global()?, size, device, stream_id(stream))?;
        Ok(ptr::with_exposed_provenance_mut(addr as usize))
    })
}

/// PyTorch's free function: frees `ptr` on `device` (`size` and `stream` are not needed). Null is ignored.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_free(ptr: *mut c_void, size: isize, device: c_int, stream: *mut c_void) {
    let _ = (size, stream);
    shell("cuvmm_free", (), || {
        ops::free(global()?, address(ptr), device)
    })
}

/// Records that work on `stream` uses the live allocation `ptr` of `device`.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_record_stream(ptr: *mut c_void, device: c_int, stream: *mut c_void) {
    shell("cuvmm_record_stream", (), || {
        ops::record_stream(global()?, address(ptr), device, stream_id(stream))
    })
}

/// `device`'s statistics as a JSON object (free it with [`cuvmm_string_free`]); null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_memory_stats_json(device: c_int) -> *mut c_char {
    shell("cuvmm_memory_stats_json", ptr::null_mut(), || {
        to_c(ops::memory_stats_json(global()?, device)?)
    })
}

/// `device`'s `memory_summary()` table (free it with [`cuvmm_string_free`]); null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_memory_summary(device: c_int) -> *mut c_char {
    shell("cuvmm_memory_summary", ptr::null_mut(), || {
        to_c(ops::memory_summary(global()?, device)?)
    })
}

/// Gives `device`'s cached memory back to the driver.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_empty_cache(device: c_int) {
    shell("cuvmm_empty_cache", (), || {
        ops::empty_cache(global()?, device)
    })
}

/// Gives back `device`'s idle pages stranded in multi-page handles that live allocations touch; returns
/// the bytes, or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_release_stranded(device: c_int) -> i64 {
    shell("cuvmm_release_stranded", -1, || {
        let bytes = ops::release_stranded(global()?, device)?;
        Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
    })
}

/// Writes `device`'s snapshot pickle to `path`; 0 on success, -1 on failure.
///
/// # Safety
/// `path` is null (an error) or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_dump_snapshot(device: c_int, path: *const c_char) -> c_int {
    shell("cuvmm_dump_snapshot", -1, || {
        if path.is_null() {
            return Err(AbiError::NullArgument { what: "path" });
        }
        // SAFETY: `path` is not null, and the caller promises it is a NUL-terminated string valid for
        // the call; it is only read, and copied into a Path before the call returns.
        let text = unsafe { CStr::from_ptr(path) };
        let text = text.to_str().map_err(|_| AbiError::PathNotUtf8)?;
        ops::dump_snapshot(global()?, device, Path::new(text))?;
        Ok(0)
    })
}

/// Frees a string returned by [`cuvmm_memory_stats_json`] or [`cuvmm_memory_summary`]. Null is ignored.
///
/// # Safety
/// `text` is null or a pointer one of those functions returned, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_string_free(text: *mut c_char) {
    shell("cuvmm_string_free", (), || {
        if !text.is_null() {
            // SAFETY: the caller promises `text` came from `CString::into_raw` in `to_c` and is freed once.
            drop(unsafe { CString::from_raw(text) });
        }
        Ok(())
    })
}

/// PyTorch's stream filter as C passes it: nonzero when allocations on `stream` go to the pool.
pub type StreamFilterFn = unsafe extern "C" fn(context: *mut c_void, stream: *mut c_void) -> c_int;

/// Allocations of `device` on the streams `filter` accepts go to pool `{pool_a, pool_b}`; 0 or -1.
///
/// # Safety
/// `filter` is null (an error) or a function that may be called with `context` from any thread that
/// allocates, until [`cuvmm_end_allocate_to_pool`] for this pool has returned; it must not call cuvmm.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_begin_allocate_to_pool(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    filter: Option<StreamFilterFn>,
    context: *mut c_void,
) -> c_int {
    shell("cuvmm_begin_allocate_to_pool", -1, || {
        let filter = filter.ok_or(AbiError::NullArgument { what: "filter" })?;
        // Kept as an address: the caller, not Rust, vouches that it may be used from any thread.
        let context = context.expose_provenance();
        let accepts = move |stream: StreamId| {
            // SAFETY: the caller promises `filter` may be called with `context` from any allocating thread
            // until the pool's end_allocate_to_pool returned, which is as long as the allocator keeps this
            // closure; both arguments are passed through as the caller gave them.
            unsafe {
                filter(
                    ptr::with_exposed_provenance_mut(context),
                    ptr::with_exposed_provenance_mut(stream.0 as usize),
                ) != 0
            }
        };
        let pool = GraphPool(pool_a, pool_b);
        ops::begin_allocate_to_pool(
            global()?,
            device,
            pool,
            StreamFilter::Custom(Box::new(accepts)),
        )?;
        Ok(0)
    })
}

/// Allocations of `device` on the streams capturing with `capture_id` go to pool `{pool_a, pool_b}`; 0 or
/// -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_begin_allocate_to_pool_capture(
    device: c_int,
    pool_a: u64,
    pool_b: u64,
    capture_id: u64,
) -> c_int {
    shell("cuvmm_begin_allocate_to_pool_capture", -1, || {
        let pool = GraphPool(pool_a, pool_b);
        ops::begin_allocate_to_pool(global()?, device, pool, StreamFilter::Capture(capture_id))?;
        Ok(0)
    })
}

/// Allocations of `device` stop going to pool `{pool_a, pool_b}`; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_end_allocate_to_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    shell("cuvmm_end_allocate_to_pool", -1, || {
        ops::end_allocate_to_pool(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(0)
    })
}

/// From now on the caller marks every capture of `device` with [`cuvmm_mark_capture`]; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_mark_captures(device: c_int) -> c_int {
    shell("cuvmm_mark_captures", -1, || {
        ops::mark_captures(global()?, device)?;
        Ok(0)
    })
}

/// A capture of `device` begins (`begun` nonzero) or ends; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_mark_capture(device: c_int, begun: c_int) -> c_int {
    shell("cuvmm_mark_capture", -1, || {
        ops::mark_capture(global()?, device, begun != 0)?;
        Ok(0)
    })
}

/// A graph that used pool `{pool_a, pool_b}` of `device` is gone; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_release_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    shell("cuvmm_release_pool", -1, || {
        ops::release_pool(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(0)
    })
}

/// One more user of pool `{pool_a, pool_b}` of `device` (PyTorch's `createOrIncrefPool`); 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_incref_pool(device: c_int, pool_a: u64, pool_b: u64) -> c_int {
    shell("cuvmm_incref_pool", -1, || {
        ops::incref_pool(global()?, device, GraphPool(pool_a, pool_b))?;
        Ok(0)
    })
}

/// Reads a tag the caller passes: not null, NUL-terminated, UTF-8.
///
/// # Safety
/// `tag` is null (an error) or points to a NUL-terminated string that stays valid during the call.
unsafe fn tag_arg(tag: *const c_char) -> Result<String, AbiError> {
    if tag.is_null() {
        return Err(AbiError::NullArgument { what: "tag" });
    }
    // SAFETY: `tag` is not null, and the caller promises a NUL-terminated string valid for the call; it is
    // only read, and copied before the call returns.
    let text = unsafe { CStr::from_ptr(tag) };
    Ok(text.to_str().map_err(|_| AbiError::TagNotUtf8)?.to_owned())
}

/// This thread's later allocations are made under `tag` (NULL: untagged again); 0 or -1.
///
/// # Safety
/// `tag` is null or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_set_tag(tag: *const c_char) -> c_int {
    shell("cuvmm_set_tag", -1, || {
        let tag = match tag.is_null() {
            true => None,
            // SAFETY: the caller's promise, passed on.
            false => Some(unsafe { tag_arg(tag) }?),
        };
        ops::set_tag(tag);
        Ok(0)
    })
}

/// Puts `tag` of `device` to sleep (its bytes kept on the host if `keep` is nonzero); returns the bytes
/// given back, or -1.
///
/// # Safety
/// `tag` is null (an error) or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_sleep(device: c_int, tag: *const c_char, keep: c_int) -> i64 {
    shell("cuvmm_sleep", -1, || {
        // SAFETY: the caller's promise, passed on.
        let tag = unsafe { tag_arg(tag) }?;
        let bytes = ops::sleep(global()?, device, &tag, keep != 0)?;
        Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
    })
}

/// Wakes `tag` of `device`: its memory is mapped again at the same addresses; 0 or -1.
///
/// # Safety
/// `tag` is null (an error) or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_wake(device: c_int, tag: *const c_char) -> c_int {
    shell("cuvmm_wake", -1, || {
        // SAFETY: the caller's promise, passed on.
        let tag = unsafe { tag_arg(tag) }?;
        ops::wake(global()?, device, &tag)?;
        Ok(0)
    })
}

/// Pins the page-locked host memory the next sleep of `tag` of `device` with its bytes copies into;
/// returns the bytes pinned, or -1.
///
/// # Safety
/// `tag` is null (an error) or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_prepare_sleep(device: c_int, tag: *const c_char) -> i64 {
    shell("cuvmm_prepare_sleep", -1, || {
        // SAFETY: the caller's promise, passed on.
        let tag = unsafe { tag_arg(tag) }?;
        let bytes = ops::prepare_sleep(global()?, device, &tag)?;
        Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
    })
}

/// Frees the page-locked host memory `device`'s tags keep for their next sleep (`tag`'s, or every tag's
/// for NULL), never a sleeping tag's bytes; returns the bytes freed, or -1.
///
/// # Safety
/// `tag` is null or points to a NUL-terminated string that stays valid during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_release_host_buffers(device: c_int, tag: *const c_char) -> i64 {
    shell("cuvmm_release_host_buffers", -1, || {
        let tag = match tag.is_null() {
            true => None,
            // SAFETY: the caller's promise, passed on.
            false => Some(unsafe { tag_arg(tag) }?),
        };
        let bytes = ops::release_host_buffers(global()?, device, tag.as_deref())?;
        Ok(i64::try_from(bytes).unwrap_or(i64::MAX))
    })
}

/// Copies into `out` the `len` bytes at `ptr` of `device` that a sleeping tag kept in host memory (what
/// that memory holds again at the wake): 1; 0 for memory of no sleeping tag (its bytes are on the
/// device), `out` untouched; -1 (the sleep kept no bytes there, a tag being copied, a null `out`).
///
/// # Safety
/// `out` is null (an error unless `len` is 0) or points to `len` writable bytes, not read or written by
/// anyone else during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_read_kept(
    device: c_int,
    ptr: *mut c_void,
    out: *mut c_void,
    len: usize,
) -> c_int {
    shell("cuvmm_read_kept", -1, || {
        let out: &mut [u8] = match (out.is_null(), len) {
            (_, 0) => &mut [],
            (true, _) => return Err(AbiError::NullArgument { what: "out" }),
            // SAFETY: `out` is not null, and the caller promises `len` writable bytes that nothing else
            // touches during the call; the slice does not outlive it.
            (false, _) => unsafe { std::slice::from_raw_parts_mut(out.cast::<u8>(), len) },
        };
        Ok(c_int::from(ops::read_kept(
            global()?,
            device,
            address(ptr),
            out,
        )?))
    })
}

/// The number of devices cuvmm serves (devices `0..count`), or -1 (no CUDA driver, a bad setting).
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_device_count() -> c_int {
    shell("cuvmm_device_count", -1, || {
        Ok(c_int::try_from(ops::device_count(global()?)).unwrap_or(c_int::MAX))
    })
}

/// `device`'s tags as a JSON array (`[]` for a device never allocated on, which is not opened; free it
/// with [`cuvmm_string_free`]); null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_tags_json(device: c_int) -> *mut c_char {
    shell("cuvmm_tags_json", ptr::null_mut(), || {
        to_c(ops::tags_json(global()?, device)?)
    })
}

/// Device `peer` may reach every range of `device` mapped now and later; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_add_peer(device: c_int, peer: c_int) -> c_int {
    shell("cuvmm_add_peer", -1, || {
        ops::add_peer(global()?, device, peer)?;
        Ok(0)
    })
}

/// The handle string that shares the live allocation at `ptr` of `device` with another process (PyTorch's
/// `shareIpcHandle`): its bytes (free them with [`cuvmm_bytes_free`]), their number in `*len` and the
/// allocation's offset in the range the importer maps in `*offset`; null on failure.
///
/// # Safety
/// `len` and `offset` are null (an error) or valid for one write each.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_ipc_share(
    device: c_int,
    ptr: *mut c_void,
    len: *mut usize,
    offset: *mut u64,
) -> *mut u8 {
    shell("cuvmm_ipc_share", ptr::null_mut(), || {
        if len.is_null() || offset.is_null() {
            return Err(AbiError::NullArgument {
                what: "len or offset",
            });
        }
        let (bytes, at) = sharing::share(global()?, device, address(ptr))?;
        // SAFETY: both are not null and the caller promises each is valid for one write.
        unsafe {
            len.write(bytes.len());
            offset.write(at);
        }
        Ok(Box::into_raw(bytes.into_boxed_slice()).cast::<u8>())
    })
}

/// Frees the bytes [`cuvmm_ipc_share`] returned (`len` of them). Null is ignored.
///
/// # Safety
/// `bytes` is null or came from [`cuvmm_ipc_share`], with the `len` it gave, and is freed once.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_bytes_free(bytes: *mut u8, len: usize) {
    shell("cuvmm_bytes_free", (), || {
        if !bytes.is_null() {
            // SAFETY: the caller promises `bytes .. bytes + len` is the boxed slice `cuvmm_ipc_share` leaked.
            drop(unsafe { Box::from_raw(ptr::slice_from_raw_parts_mut(bytes, len)) });
        }
        Ok(())
    })
}

/// Maps on `device` the shared memory a handle string from [`cuvmm_ipc_share`] (in this or another process
/// of the same user) describes (PyTorch's `getIpcDevPtr`): the start of the range, where the allocation lies
/// at the offset the exporter returned; null on failure. Unmap it with [`cuvmm_ipc_close`].
///
/// # Safety
/// `bytes` is null (an error) or valid for reads of `len` bytes during the call.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_ipc_open(
    device: c_int,
    bytes: *const u8,
    len: usize,
) -> *mut c_void {
    shell("cuvmm_ipc_open", ptr::null_mut(), || {
        if bytes.is_null() {
            return Err(AbiError::NullArgument { what: "handle" });
        }
        // SAFETY: not null, and the caller promises `len` readable bytes that stay valid during the call.
        let handle = unsafe { std::slice::from_raw_parts(bytes, len) };
        let addr = sharing::open(global()?, device, handle)?;
        Ok(ptr::with_exposed_provenance_mut(addr as usize))
    })
}

/// Unmaps shared memory [`cuvmm_ipc_open`] mapped at `ptr` of `device`, once the caller's work on it is
/// done; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_ipc_close(device: c_int, ptr: *mut c_void) -> c_int {
    shell("cuvmm_ipc_close", -1, || {
        sharing::close(global()?, device, address(ptr))?;
        Ok(0)
    })
}

/// Frees `ptr` on whichever device handed it out (PyTorch's `raw_delete`). Null is ignored.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_free_any(ptr: *mut c_void) {
    shell("cuvmm_free_any", (), || {
        ops::free_any(global()?, address(ptr))
    })
}

/// Writes `device`'s statistics to `*out` (zeros for a device never named, whose allocator this does not
/// build); 0 on success, -1 on failure (`*out` untouched).
///
/// # Safety
/// `out` is null (an error) or points to writable memory for one `cuvmm_device_stats`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_get_device_stats(device: c_int, out: *mut CDeviceStats) -> c_int {
    shell("cuvmm_get_device_stats", -1, || {
        if out.is_null() {
            return Err(AbiError::NullArgument { what: "out" });
        }
        let stats = ops::device_stats(global()?, device)?;
        // SAFETY: `out` is not null and the caller promises it is valid for one write of this struct;
        // `write` does not read (or drop) what was there.
        unsafe { out.write(stats) };
        Ok(0)
    })
}

/// Sets every peak of `device`'s statistics to its current value; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_reset_peak_stats(device: c_int) -> c_int {
    shell("cuvmm_reset_peak_stats", -1, || {
        ops::reset_peak_stats(global()?, device).map(|()| 0)
    })
}

/// Sets every cumulative count of `device`'s statistics to 0; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_reset_accumulated_stats(device: c_int) -> c_int {
    shell("cuvmm_reset_accumulated_stats", -1, || {
        ops::reset_accumulated_stats(global()?, device).map(|()| 0)
    })
}

/// Counts `device`'s last out-of-memory as recovered from (the C++ layer, after PyTorch's free-memory
/// callbacks freed memory and the request succeeded); 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_recovered_oom(device: c_int) -> c_int {
    shell("cuvmm_recovered_oom", -1, || {
        ops::recovered_oom(global()?, device).map(|()| 0)
    })
}

/// Every device's growth for a request leaves `bytes` of it free from now on (0: none); 0, or -1 when the
/// library could not be set up.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_set_device_margin(bytes: u64) -> c_int {
    shell("cuvmm_set_device_margin", -1, || {
        ops::set_device_margin(global()?, bytes);
        Ok(0)
    })
}

/// Limits `device`'s reserved memory to `fraction` of the device's; 0 on success, -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_set_memory_fraction(device: c_int, fraction: f64) -> c_int {
    shell("cuvmm_set_memory_fraction", -1, || {
        ops::set_memory_fraction(global()?, device, fraction).map(|()| 0)
    })
}

/// `device`'s memory limit as a fraction of its memory (1 without one); -1 on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_memory_fraction(device: c_int) -> f64 {
    shell("cuvmm_memory_fraction", -1.0, || {
        ops::memory_fraction(global()?, device)
    })
}

/// Starts (`max_entries` > 0) or stops (0) recording `device`'s events for snapshots; 0 or -1.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_record_history(device: c_int, max_entries: usize) -> c_int {
    shell("cuvmm_record_history", -1, || {
        ops::record_history(global()?, device, max_entries).map(|()| 0)
    })
}

/// A trace tracker as C passes it: called with `context`, the device and each event as it happens.
pub type TraceTrackerFn =
    unsafe extern "C" fn(context: *mut c_void, device: c_int, entry: *const CTraceEntry);

/// Calls `tracker` with each of `device`'s events from now on, recording or not (PyTorch's
/// `attachAllocatorTraceTracker`); 0 or -1.
///
/// # Safety
/// `tracker` is null (an error) or a function that may be called with `context` from any thread that uses
/// the device, for the life of the process, while cuvmm holds the device's lock: it must not call cuvmm, and
/// must not unwind.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_attach_trace_tracker(
    device: c_int,
    tracker: Option<TraceTrackerFn>,
    context: *mut c_void,
) -> c_int {
    shell("cuvmm_attach_trace_tracker", -1, || {
        let tracker = tracker.ok_or(AbiError::NullArgument { what: "tracker" })?;
        // Kept as an address: the caller, not Rust, vouches that it may be used from any thread.
        let context = context.expose_provenance();
        let call = move |entry: &TraceEntry| {
            let entry = CTraceEntry::from(entry);
            // SAFETY: the caller promises `tracker` may be called with `context` from any thread for the
            // life of the process; `entry` lives on this stack for the call, and is only read.
            unsafe { tracker(ptr::with_exposed_provenance_mut(context), device, &entry) }
        };
        ops::attach_trace_tracker(global()?, device, call)?;
        Ok(0)
    })
}

/// `device`'s segments, blocks and recorded events; free it with [`cuvmm_snapshot_free`]. Null on failure.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_snapshot_take(device: c_int) -> *mut CSnapshot {
    shell("cuvmm_snapshot_take", ptr::null_mut(), || {
        let owned = Box::new(ops::snapshot(global()?, device)?);
        // `OwnedSnapshot` is `repr(C)` with the view as its first field: the pointers are the same.
        Ok(Box::into_raw(owned).cast::<CSnapshot>())
    })
}

/// Frees a snapshot from [`cuvmm_snapshot_take`]. Null is ignored.
///
/// # Safety
/// `snapshot` is null or a pointer `cuvmm_snapshot_take` returned, not yet freed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_snapshot_free(snapshot: *mut CSnapshot) {
    shell("cuvmm_snapshot_free", (), || {
        if !snapshot.is_null() {
            // SAFETY: the caller promises it came from `Box::into_raw` of an `OwnedSnapshot` in
            // `cuvmm_snapshot_take` (cast to its first field) and is freed once.
            drop(unsafe { Box::from_raw(snapshot.cast::<OwnedSnapshot>()) });
        }
        Ok(())
    })
}

/// If the last cuvmm call on this thread failed with out-of-memory: writes its numbers to `*out` (when
/// not null) and returns 1. Otherwise returns 0. Like [`cuvmm_last_error`], it leaves the record as it is.
///
/// # Safety
/// `out` is null or points to writable memory for one `cuvmm_oom_info`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuvmm_last_oom(out: *mut COomInfo) -> c_int {
    panic::catch_unwind(|| match error::last_oom() {
        None => 0,
        Some(info) => {
            if !out.is_null() {
                // SAFETY: `out` is not null and the caller promises it is valid for one write.
                unsafe { out.write(info) };
            }
            1
        }
    })
    .unwrap_or(0)
}

/// This thread's last error, or null if the last cuvmm call on this thread succeeded. The text stays valid
/// until the next cuvmm call on this thread; copy it before then.
#[unsafe(no_mangle)]
pub extern "C" fn cuvmm_last_error() -> *const c_char {
    panic::catch_unwind(error::last_error_ptr).unwrap_or(ptr::null())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_in_a_body_returns_the_error_value_and_is_recorded() {
        let got = shell("test_op", -1, || -> Result<i32, AbiError> {
            panic!("boom {}", 7)
        });
        assert_eq!(got, -1);
        let error = error::last_error().unwrap();
        assert!(
            error.contains("test_op") && error.contains("boom 7"),
            "{error}"
        );
        // The next successful call clears it.
        assert_eq!(shell("test_op", -1, || Ok(3)), 3);
        assert!(error::last_error().is_none());
        assert!(cuvmm_last_error().is_null());
    }
}
