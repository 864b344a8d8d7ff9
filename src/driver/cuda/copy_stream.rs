//! The stream a `CudaDriver`'s copy jobs run on (`copies.rs`), shared with the page-locked memory whose
//! copies may still run on it (`host.rs`).

use super::calls::keeping_current_context;
use super::errors;
use super::result;
use crate::driver::StreamId;
use cudarc::driver::DriverError as CuError;
use cudarc::driver::{CudaContext, sys};
use std::sync::Arc;

/// The driver's own stream for copies, destroyed when the last holder lets go of it.
#[derive(Debug)]
pub(super) struct CopyStream {
    raw: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: a CUDA stream may be used from any thread, and `raw` is destroyed once, in `drop`.
unsafe impl Send for CopyStream {}
// SAFETY: as `Send`; the methods only pass the handle to the driver, which is thread-safe.
unsafe impl Sync for CopyStream {}

impl CopyStream {
    /// A new non-blocking stream in `ctx`; the calling thread's context is left as it was.
    pub(super) fn new(ctx: &Arc<CudaContext>) -> Result<Arc<Self>, CuError> {
        let raw = keeping_current_context(|| {
            ctx.bind_to_thread()?;
            result::stream_create_non_blocking()
        })?;
        Ok(Arc::new(Self {
            raw: raw as usize,
            ctx: Arc::clone(ctx),
        }))
    }

    /// The raw `CUstream`.
    pub(super) fn raw(&self) -> sys::CUstream {
        self.raw as sys::CUstream
    }

    /// The stream's name in errors (an `unmap` refused while it copies).
    pub(super) fn id(&self) -> StreamId {
        StreamId(self.raw as u64)
    }

    /// Waits for everything queued on the stream.
    pub(super) fn synchronize(&self) -> Result<(), CuError> {
        self.in_context(|| {
            // SAFETY: the stream is this one's, alive until `self` drops (point 1).
            unsafe { result::stream_synchronize(self.raw()) }
        })
    }

    /// Runs `f` with the stream's context current, giving the thread its own back.
    fn in_context<T>(&self, f: impl FnOnce() -> Result<T, CuError>) -> Result<T, CuError> {
        keeping_current_context(|| {
            self.ctx.bind_to_thread()?;
            f()
        })
    }
}

impl Drop for CopyStream {
    fn drop(&mut self) {
        let destroyed = self.in_context(|| {
            // SAFETY: the stream was created by `new` and is destroyed once, here; nothing holds it any more
            // (point 2): every job and every piece of memory with a copy pending holds this `Arc`.
            unsafe { result::stream_destroy(self.raw()) }
        });
        if let Err(e) = destroyed {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, "cuvmm: destroying the copy stream failed");
        }
    }
}
