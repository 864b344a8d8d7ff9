//! Page-locked host memory: what a sleeping tag's bytes are kept in, so that the copies of a sleep and a
//! wake run at the link's speed rather than through the driver's pageable staging. It is ordinary memory
//! faulted in ahead and registered (`cuMemHostRegister`, `host_pages.rs`), or `cuMemHostAlloc`'s, as the
//! copy plan's [`HostPinning`] says; where registering fails, `cuMemHostAlloc`'s.
//!
//! A copy job (`copies.rs`) copies into and out of this memory asynchronously, on the driver's copy stream,
//! after the call that enqueued the copy has returned. So the memory knows the copies that may still touch
//! it: reading or writing its bytes from Rust, and freeing it, first waits for the copy stream, unless the
//! job that enqueued them has waited for them already (then nothing waits: a drop under the allocator's
//! lock does not wait for another tag's copies running on the same stream meanwhile). Memory
//! pinned for a job is not zeroed (zeroing gigabytes would cost what the copies do): the memory remembers
//! which bytes copies have written, and the first read from Rust zeroes the others.

use super::calls::keeping_current_context;
use super::copy_stream::CopyStream;
use super::errors;
use super::host_pages::HostPages;
use crate::driver::{HostBytes, HostPinning};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::{CudaContext, sys};
use std::any::Any;
use std::mem::MaybeUninit;
use std::ops::Range;
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, PoisonError};

/// `len` bytes of page-locked host memory of `ctx`, given back when dropped: freed with `cuMemFreeHost`,
/// or unregistered and unmapped. It holds the context (`Some` until the drop), so the memory outlives
/// neither.
pub(super) struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Option<Arc<CudaContext>>,
    /// The registered mapping behind `ptr`; `None` for `cuMemHostAlloc`'s memory.
    pages: Option<HostPages>,
    /// Which bytes are written, and the copies that may still run.
    state: Mutex<Written>,
}

/// What is known of a [`Pinned`]'s bytes.
#[derive(Default)]
struct Written {
    /// `None`: every byte is written (zeroed, or copied into); else the ranges copies wrote, sorted and
    /// disjoint. A byte outside them has never been written.
    ranges: Option<Vec<Range<usize>>>,
    /// Copies enqueued on a copy stream that may still read or write the memory, and the ranges they write.
    pending: Option<(Arc<CopyStream>, Vec<Range<usize>>)>,
}

/// Adds `range` to the sorted, disjoint `ranges`, merging what touches.
fn insert_merged(ranges: &mut Vec<Range<usize>>, range: Range<usize>) {
    let at = ranges.partition_point(|r| r.start < range.start);
    ranges.insert(at, range);
    let mut merged: Vec<Range<usize>> = Vec::with_capacity(ranges.len());
    for r in ranges.drain(..) {
        match merged.last_mut() {
            Some(last) if r.start <= last.end => last.end = last.end.max(r.end),
            _ => merged.push(r),
        }
    }
    *ranges = merged;
}

impl Written {
    /// Adds a range written.
    fn add(&mut self, range: Range<usize>) {
        if let Some(ranges) = &mut self.ranges {
            insert_merged(ranges, range);
        }
    }

    /// Waits for the copies that may still run; whether they are over. The ranges they wrote count as
    /// written once the stream says they completed.
    fn settle(&mut self) -> bool {
        let Some((stream, written)) = self.pending.take() else {
            return true;
        };
        match stream.synchronize() {
            Ok(()) => {
                written.into_iter().for_each(|r| self.add(r));
                true
            }
            Err(e) => {
                let (code, name) = errors::code_and_name(&e);
                tracing::error!(code, %name, "cuvmm: waiting for copies into page-locked memory failed");
                false
            }
        }
    }
}

// SAFETY: `Pinned` owns its memory alone (no other pointer to it is handed out but the borrows of
// `bytes` / `bytes_mut`, which the borrow checker ties to it, and the pointers of `dma`, whose copies every
// access waits for), and page-locked host memory may be used and freed from any thread.
unsafe impl Send for Pinned {}

impl Pinned {
    /// `len` (at least 1) bytes of page-locked memory of `ctx`, zeroed, or the driver's error. The calling
    /// thread's current context is left as it was.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<Self, cudarc::driver::DriverError> {
        let pinned = Self::unwritten(ctx, len)?;
        // SAFETY: `ptr` is valid for writes of `len` bytes: the allocation just made is that long.
        unsafe { std::ptr::write_bytes(pinned.ptr.as_ptr(), 0, len) };
        pinned.lock().ranges = None;
        Ok(pinned)
    }

    /// `len` (at least 1) bytes of page-locked memory of `ctx`, not written yet (for copies to fill), or
    /// the driver's error. The calling thread's current context is left as it was.
    pub(super) fn unwritten(
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<Self, cudarc::driver::DriverError> {
        let ptr = keeping_current_context(|| {
            ctx.bind_to_thread()?;
            mem_host_alloc(len)
        })?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).expect("cuMemHostAlloc succeeded with a null pointer");
        Ok(Self {
            ptr,
            len,
            ctx: Some(Arc::clone(ctx)),
            pages: None,
            state: Mutex::new(Written {
                ranges: Some(Vec::new()),
                pending: None,
            }),
        })
    }

    /// `len` (at least 1) bytes of page-locked memory of `ctx` for copies to fill, pinned as `pinning`
    /// says: registered where it asks for that and the host and driver allow it (else, with one warning per
    /// process, as below), else `cuMemHostAlloc`'s ([`unwritten`](Self::unwritten)), or that call's error.
    /// The calling thread's current context is left as it was.
    pub(super) fn pin(
        ctx: &Arc<CudaContext>,
        len: usize,
        pinning: HostPinning,
    ) -> Result<Self, cudarc::driver::DriverError> {
        if pinning.register {
            match Self::registered(ctx, len) {
                Ok(pinned) => return Ok(pinned),
                Err(reason) => warn_once(&reason, len),
            }
        }
        Self::unwritten(ctx, len)
    }

    /// `len` bytes of ordinary memory faulted in on this thread, then registered with `ctx`
    /// (`cuMemHostRegister`): zero throughout, since the kernel zeroes the pages it faults in.
    fn registered(ctx: &Arc<CudaContext>, len: usize) -> Result<Self, NotRegistered> {
        let pages = HostPages::fault_in(len).map_err(NotRegistered::Map)?;
        let (ptr, mapped) = (pages.ptr(), pages.len());
        let registered = keeping_current_context(|| {
            ctx.bind_to_thread()?;
            // SAFETY: `ptr .. ptr + mapped` is the mapping `pages` owns, registered once; `Pinned`'s drop
            // unregisters it before `pages` unmaps it (point 1).
            unsafe { mem_host_register(ptr.as_ptr().cast(), mapped) }
        });
        if let Err(e) = registered {
            let (code, name) = errors::code_and_name(&e);
            return Err(NotRegistered::Register { code, name });
        }
        Ok(Self {
            ptr,
            len,
            ctx: Some(Arc::clone(ctx)),
            pages: Some(pages),
            state: Mutex::new(Written::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Written> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The address of `range` for a copy to enqueue on `stream`: from now on, every access to the bytes and
    /// the drop wait for `stream` first. Copies pending on another stream are waited for now. `None` if
    /// `range` is not inside the memory.
    pub(super) fn dma(&mut self, range: Range<usize>, stream: &Arc<CopyStream>) -> Option<*mut u8> {
        if range.start > range.end || range.end > self.len {
            return None;
        }
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if state
            .pending
            .as_ref()
            .is_some_and(|(s, _)| !Arc::ptr_eq(s, stream))
        {
            state.settle();
        }
        state
            .pending
            .get_or_insert_with(|| (Arc::clone(stream), Vec::new()));
        // SAFETY: `range.start <= len`, so the pointer stays inside the allocation (or one past its end).
        Some(unsafe { self.ptr.as_ptr().add(range.start) })
    }

    /// A copy enqueued on the pending stream ([`dma`](Self::dma)) writes `range`: written once it completes.
    pub(super) fn writing(&mut self, range: Range<usize>) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, written)) = &mut state.pending {
            // Ranges merge as they come (a piece's copies are end to end), so the list stays short however
            // many jobs copy before the bytes are read.
            insert_merged(written, range);
        }
    }

    /// Every copy pending is known complete (the job's event was waited for): its ranges count as written
    /// and no access or drop waits for the copy stream again.
    pub(super) fn copies_done(&mut self) {
        let state = self.state.get_mut().unwrap_or_else(PoisonError::into_inner);
        if let Some((_, written)) = state.pending.take() {
            written.into_iter().for_each(|r| state.add(r));
        }
    }

    /// Waits for pending copies and zeroes the bytes no copy wrote, so that every byte may be read.
    fn make_readable(&self) {
        let mut state = self.lock();
        if !state.settle() {
            // A failed wait leaves the context broken: CUDA runs none of its work any more.
            state.pending = None;
        }
        let Some(ranges) = state.ranges.take() else {
            return;
        };
        let mut at = 0;
        for r in ranges
            .iter()
            .cloned()
            .chain(std::iter::once(self.len..self.len))
        {
            if at < r.start {
                // SAFETY: `at .. r.start` lies inside the allocation; no copy touches it (none is pending)
                // and no borrow of the bytes exists yet (they were not readable before this).
                unsafe { std::ptr::write_bytes(self.ptr.as_ptr().add(at), 0, r.start - at) };
            }
            at = at.max(r.end);
        }
    }
}

impl HostBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        self.make_readable();
        // SAFETY: `ptr` is valid for `len` bytes until `self` drops, every one written (`make_readable`),
        // and no copy is pending (a new one needs `&mut self`, which the returned borrow keeps out).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        self.make_readable();
        // SAFETY: as `bytes`, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn len(&self) -> usize {
        self.len
    }

    fn pinned(&self) -> bool {
        true
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let Some(ctx) = self.ctx.take() else {
            return;
        };
        if !self.lock().settle() {
            // The copies may not be over: the memory is left to them rather than freed under them.
            tracing::error!(
                bytes = self.len,
                "cuvmm: page-locked memory leaked: its copies may still run"
            );
            std::mem::forget(self.pages.take());
            return;
        }
        let ptr = self.ptr.as_ptr().cast();
        let registered = self.pages.is_some();
        // The context is let go inside too: where this was its last holder (a tag asleep when the allocator
        // is dropped, after the driver), cudarc's release makes it current, and the thread gets its own back.
        let freed = keeping_current_context(move || {
            ctx.bind_to_thread()?;
            let freed = if registered {
                // SAFETY: the pointer was registered in this context, which `ctx` keeps alive, by
                // `registered`, and is unregistered once: no copy into it is pending (settled above).
                unsafe { mem_host_unregister(ptr) }
            } else {
                // SAFETY: the pointer came from `cuMemHostAlloc` in this context, which `ctx` keeps alive,
                // and is freed once: no borrow of it outlives `self`, and no copy into it is pending
                // (settled above).
                unsafe { mem_free_host(ptr) }
            };
            drop(ctx);
            freed
        });
        if let Err(e) = freed {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, bytes = self.len, "cuvmm: giving back page-locked memory failed: it leaks");
            // Registered memory the driver may still reach is not unmapped under it.
            std::mem::forget(self.pages.take());
        }
    }
}

/// Why host memory could not be registered.
#[derive(Debug, thiserror::Error)]
enum NotRegistered {
    /// The host would not map it.
    #[error("mmap failed: {0}")]
    Map(std::io::Error),
    /// The driver would not register it.
    #[error("cuMemHostRegister failed: {name} ({code})")]
    Register { code: u32, name: String },
}

/// Says, once per process, that registering host memory failed and `cuMemHostAlloc` pins instead: a host
/// that refuses once (no `mmap` of that size, or a driver that cannot register) refuses every piece.
fn warn_once(reason: &NotRegistered, len: usize) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    WARNED.call_once(|| {
        tracing::warn!(%reason, len, "cuvmm: registering host memory failed; pinning with cuMemHostAlloc instead (said once)");
    });
}

/// `len` bytes of page-locked host memory in the current context (`cuMemHostAlloc`, no flags).
///
/// See [cuMemHostAlloc() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g572ca4011bfcb25034888a14d4e035b9)
fn mem_host_alloc(len: usize) -> Result<*mut std::ffi::c_void, CuError> {
    let mut ptr = MaybeUninit::uninit();
    // SAFETY: `ptr` is valid for the call and written before success; new memory affects nothing that exists.
    unsafe {
        sys::cuMemHostAlloc(ptr.as_mut_ptr(), len, 0).result()?;
        Ok(ptr.assume_init())
    }
}

/// Page-locks `len` bytes of host memory at `ptr` for the current context (`cuMemHostRegister`, no flags),
/// so that copies reach it at the link's speed.
///
/// See [cuMemHostRegister() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1gf0a9fe11544326dabd743b7aa6b54223)
///
/// # Safety
/// 1. `ptr .. ptr + len` is host memory the caller owns, mapped until [`mem_host_unregister`] of `ptr`
///    has returned, and registered once.
unsafe fn mem_host_register(ptr: *mut std::ffi::c_void, len: usize) -> Result<(), CuError> {
    // SAFETY: the range is the caller's memory, which outlives its registration (point 1).
    unsafe { sys::cuMemHostRegister_v2(ptr, len, 0).result() }
}

/// Ends the registration of host memory (`cuMemHostUnregister`).
///
/// See [cuMemHostUnregister() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g63f450c8125359be87b7623b1c0b2a14)
///
/// # Safety
/// 1. `ptr` was registered by [`mem_host_register`] in the current context, is unregistered once, and no
///    copy into or out of it is still running.
unsafe fn mem_host_unregister(ptr: *mut std::ffi::c_void) -> Result<(), CuError> {
    // SAFETY: the pointer is a live registration that nothing uses any more (point 1).
    unsafe { sys::cuMemHostUnregister(ptr).result() }
}

/// Frees page-locked host memory (`cuMemFreeHost`).
///
/// See [cuMemFreeHost() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__MEM.html#group__CUDA__MEM_1g62e0fdbe181dab6b1c90fa1a51c7b92c)
///
/// # Safety
/// 1. `ptr` came from [`mem_host_alloc`] in the current context and is not used or freed again.
unsafe fn mem_free_host(ptr: *mut std::ffi::c_void) -> Result<(), CuError> {
    // SAFETY: the pointer is a live page-locked allocation freed once (point 1).
    unsafe { sys::cuMemFreeHost(ptr).result() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn written_ranges_merge() {
        let mut w = Written {
            ranges: Some(Vec::new()),
            pending: None,
        };
        w.add(10..20);
        w.add(0..5);
        w.add(5..10);
        w.add(30..40);
        w.add(15..32);
        assert_eq!(w.ranges, Some(std::iter::once(0..40).collect()));
        let mut whole = Written::default();
        whole.add(0..1);
        assert_eq!(whole.ranges, None, "all written stays all written");
    }
}
