//! Page-locked host memory (`cuMemHostAlloc`): what a sleeping tag's bytes are kept in, so that the copies
//! of a sleep and a wake run at the link's speed rather than through the driver's pageable staging.

use super::calls::keeping_current_context;
use super::errors;
use super::result;
use crate::driver::HostBytes;
use cudarc::driver::CudaContext;
use std::ptr::NonNull;
use std::sync::Arc;

/// `len` bytes of page-locked host memory of `ctx`, freed with `cuMemFreeHost` when dropped. It holds the
/// context, so the memory outlives neither.
pub(super) struct Pinned {
    ptr: NonNull<u8>,
    len: usize,
    ctx: Arc<CudaContext>,
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
            result::mem_host_alloc(len)
        })?;
        let ptr =
            NonNull::new(ptr.cast::<u8>()).expect("cuMemHostAlloc succeeded with a null pointer");
        // SAFETY: `ptr` is valid for writes of `len` bytes: the allocation just made is that long.
        unsafe { std::ptr::write_bytes(ptr.as_ptr(), 0, len) };
        Ok(Self {
            ptr,
            len,
            ctx: Arc::clone(ctx),
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
        let freed = keeping_current_context(|| {
            self.ctx.bind_to_thread()?;
            // SAFETY: the pointer came from `cuMemHostAlloc` in this context, which `self.ctx` keeps alive,
            // and is freed once: no borrow of it outlives `self`.
            unsafe { result::mem_free_host(self.ptr.as_ptr().cast()) }
        });
        if let Err(e) = freed {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, bytes = self.len, "cuvmm: cuMemFreeHost failed: the memory leaks");
        }
    }
}
