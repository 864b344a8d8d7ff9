//! Page-locked host memory (`cuMemHostAlloc`): what a sleeping tag's bytes are kept in, so that the copies
//! of a sleep and a wake run at the link's speed rather than through the driver's pageable staging.

use super::calls::keeping_current_context;
use super::errors;
use crate::driver::HostBytes;
use cudarc::driver::DriverError as CuError;
use cudarc::driver::{CudaContext, sys};
use std::mem::MaybeUninit;
use std::ptr::NonNull;
use std::sync::Arc;

/// `len` bytes of page-locked host memory of `ctx`, freed with `cuMemFreeHost` when dropped. It holds the
/// context (`Some` until the drop), so the memory outlives neither.
pub(super) struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Option<Arc<CudaContext>>,
}

// SAFETY: `Pinned` owns its memory alone (no other pointer to it is handed out but the borrows of
// `bytes` / `bytes_mut`, which the borrow checker ties to it), and page-locked host memory may be used and
// freed from any thread.
unsafe impl Send for Pinned {}

impl Pinned {
    /// `len` (at least 1) bytes of page-locked memory of `ctx`, zeroed, or the driver's error. The calling
    /// thread's current context is left as it was.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        len: usize,
    ) -> Result<Self, cudarc::driver::DriverError> {
        let ptr = keeping_current_context(|| {
            ctx.bind_to_thread()?;
            mem_host_alloc(len)
        })?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).expect("cuMemHostAlloc succeeded with a null pointer");
        // SAFETY: `ptr` is valid for writes of `len` bytes: the allocation just made is that long.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self {
            ptr,
            len,
            ctx: Some(Arc::clone(ctx)),
        })
    }
}

impl HostBytes for Pinned {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `ptr` is valid for `len` bytes, initialized at `new`, until `self` drops; `&self` keeps any
        // writer out while the slice lives.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, and `&mut self` makes this the only borrow.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    fn pinned(&self) -> bool {
        true
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        let Some(ctx) = self.ctx.take() else {
            return;
        };
        let ptr = self.ptr.as_ptr().cast();
        // The context is let go inside too: where this was its last holder (a tag asleep when the allocator
        // is dropped, after the driver), cudarc's release makes it current, and the thread gets its own back.
        let freed = keeping_current_context(move || {
            ctx.bind_to_thread()?;
            // SAFETY: the pointer came from `cuMemHostAlloc` in this context, which `ctx` keeps alive, and is
            // freed once: no borrow of it outlives `self`.
            let freed = unsafe { mem_free_host(ptr) };
            drop(ctx);
            freed
        });
        if let Err(e) = freed {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, bytes = self.len, "cuvmm: cuMemFreeHost failed: the memory leaks");
        }
    }
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
