//! What cuvmm is measured against on a GPU, as safe calls: cudarc's default allocation
//! ([`cudarc_alloc`]) and the device's default memory pool through cuMemAllocAsync / cuMemFreeAsync
//! ([`AsyncPool`]), kept whole (release threshold at its maximum) so that a repeated request is served from
//! what the pool already reserved, as a caching allocator's would be. `cuvmm bench-threads --backend cuda`
//! and the `cuda-async` comparison allocator use them.
//!
//! Plain cuMemAlloc / cuMemFree need nothing here: [`CudaDriver`](super::CudaDriver)'s `malloc` and `free`
//! make exactly those calls.

use super::calls::cuda_error;
use super::errors;
use super::result;
use crate::driver::{DriverError, Op, StreamId};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::result as cu;
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, sys};
use rustc_hash::FxHashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// cudarc's default allocation of `size` bytes on `stream`: `CudaStream::alloc`, which is cuMemAllocAsync
/// on the device's current pool where the device has memory pools (with cudarc's event tracking when it is
/// on, as it is by default), freed on drop with cuMemFreeAsync.
pub fn cudarc_alloc(stream: &Arc<CudaStream>, size: usize) -> Result<CudaSlice<u8>, DriverError> {
    // SAFETY: the memory is unset, which cudarc makes the caller acknowledge: every bit pattern is a valid
    // `u8`, so whatever the caller later copies out of it is a valid value. The stream is a live cudarc
    // stream (the `Arc` keeps it), and cudarc binds its context before the call.
    unsafe { stream.alloc::<u8>(size) }.map_err(|e| cuda_error(Op::Malloc, &e))
}

/// Allocations from a device's default memory pool with cuMemAllocAsync, each freed with cuMemFreeAsync
/// on the stream it was allocated on. Keeps the address, size and stream of every live allocation, so that
/// only what it handed out, once, is freed.
#[derive(Debug)]
pub struct AsyncPool {
    ctx: Arc<CudaContext>,
    pool: sys::CUmemoryPool,
    /// Live allocations: address -> (size, raw stream).
    live: FxHashMap<u64, (u64, u64)>,
}

// SAFETY: `CUmemoryPool` is a handle the driver accepts from any thread; the pool is the device's default
// one, which lives as long as the context `ctx` retains.
unsafe impl Send for AsyncPool {}

impl AsyncPool {
    /// The default memory pool of CUDA device `ordinal`, its release threshold set to the maximum (the pool
    /// keeps what it reserved across synchronizations), and its reserved high watermark reset.
    ///
    /// # Errors
    /// [`DriverError::NoDriver`] without libcuda, a device or the calls; a driver failure.
    pub fn new(ordinal: usize) -> Result<Self, DriverError> {
        super::open::load_driver()?;
        let ctx = CudaContext::new(ordinal).map_err(|e| setup("cuDevicePrimaryCtxRetain", &e))?;
        ctx.bind_to_thread()
            .map_err(|e| setup("cuCtxSetCurrent", &e))?;
        // SAFETY: `cu_device` is the device the context was made for, from `cuDeviceGet`.
        let pool = unsafe { cu::device::get_default_mem_pool(ctx.cu_device()) }
            .map_err(|e| setup("cuDeviceGetDefaultMemPool", &e))?;
        let this = Self {
            ctx,
            pool,
            live: FxHashMap::default(),
        };
        let mut keep = u64::MAX;
        // SAFETY: the pool is the device's default pool (valid while the context lives); the release
        // threshold is a `cuuint64_t`, which `keep` is.
        unsafe {
            cu::mem_pool::set_attribute(
                this.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
                (&raw mut keep).cast::<c_void>(),
            )
        }
        .map_err(|e| setup("cuMemPoolSetAttribute", &e))?;
        this.reset_high()?;
        Ok(this)
    }

    /// The device's context (its primary one).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// `size` bytes for use on `stream` (a raw `CUstream` of this device's context; 0 is the legacy default
    /// stream).
    ///
    /// # Errors
    /// [`DriverError::OutOfMemory`] when the pool cannot grow; another driver failure.
    pub fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, DriverError> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(Op::Malloc, &e))?;
        // SAFETY: the stream is the caller's, a live stream of this context (the `StreamId` contract,
        // docs/driver.md "Streams and contexts"); the memory is only handed out as an address, never read
        // here; its uses are the caller's, ordered on `stream` as cuMemAllocAsync requires.
        let ptr = unsafe { cu::malloc_async(stream.0 as usize as sys::CUstream, bytes(size)) }
            .map_err(|e| self.failure(Op::Malloc, size, &e))?;
        self.live.insert(ptr, (size, stream.0));
        Ok(ptr)
    }

    /// Frees `ptr`, from [`alloc`](Self::alloc), on the stream it was allocated for.
    ///
    /// # Errors
    /// [`DriverError::UnknownPointer`] for an address this pool did not hand out or already freed; a driver
    /// failure.
    pub fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        let (_, stream) = self.live.remove(&ptr).ok_or(DriverError::UnknownPointer {
            op: Op::Free,
            addr: ptr,
        })?;
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error(Op::Free, &e))?;
        // SAFETY: `ptr` came from cuMemAllocAsync on `stream` and was not freed (it was in `live`, which it
        // has just left); `stream` is the caller's live stream, as at the allocation.
        unsafe { cu::free_async(ptr, stream as usize as sys::CUstream) }
            .map_err(|e| cuda_error(Op::Free, &e))
    }

    /// The size of the live allocation at `ptr`, if it is one.
    pub fn size_of(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).map(|&(size, _)| size)
    }

    /// Allocations and bytes handed out and not freed.
    pub fn allocated(&self) -> (usize, u64) {
        (
            self.live.len(),
            self.live.values().map(|(size, _)| size).sum(),
        )
    }

    /// The pool's reserved bytes now and their high watermark since [`reset_high`](Self::reset_high).
    ///
    /// # Errors
    /// A driver failure.
    pub fn reserved(&self) -> Result<(u64, u64), DriverError> {
        Ok((
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT)?,
            self.attribute(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH)?,
        ))
    }

    /// Resets the reserved high watermark to what is reserved now.
    ///
    /// # Errors
    /// A driver failure.
    pub fn reset_high(&self) -> Result<(), DriverError> {
        let mut zero = 0u64;
        // SAFETY: the pool is valid while the context lives; resetting the high watermark takes a
        // `cuuint64_t` that must be 0, which `zero` is.
        unsafe {
            cu::mem_pool::set_attribute(
                self.pool,
                sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RESERVED_MEM_HIGH,
                (&raw mut zero).cast::<c_void>(),
            )
        }
        .map_err(|e| setup("cuMemPoolSetAttribute", &e))
    }

    /// Waits for the device, then gives back to the driver what the pool reserves beyond `keep` bytes.
    ///
    /// # Errors
    /// A driver failure.
    pub fn trim_to(&mut self, keep: u64) -> Result<(), DriverError> {
        self.ctx
            .synchronize()
            .map_err(|e| cuda_error(Op::Synchronize, &e))?;
        // SAFETY: the pool is valid while the context lives.
        unsafe { cu::mem_pool::trim_to(self.pool, bytes(keep)) }
            .map_err(|e| cuda_error(Op::Release, &e))
    }

    fn attribute(&self, attr: sys::CUmemPool_attribute) -> Result<u64, DriverError> {
        let mut value = 0u64;
        // SAFETY: the pool is valid while the context lives; both reserved-memory attributes are
        // `cuuint64_t`, which `value` is.
        unsafe { cu::mem_pool::get_attribute(self.pool, attr, (&raw mut value).cast::<c_void>()) }
            .map_err(|e| setup("cuMemPoolGetAttribute", &e))?;
        Ok(value)
    }

    fn failure(&self, op: Op, requested: u64, err: &CuError) -> DriverError {
        if !errors::is_out_of_memory(err) {
            return cuda_error(op, err);
        }
        let free = result::mem_get_info().map_or(0, |(free, _)| free as u64);
        DriverError::OutOfMemory {
            op,
            requested,
            free,
        }
    }
}

impl Drop for AsyncPool {
    fn drop(&mut self) {
        for ptr in self.live.keys().copied().collect::<Vec<_>>() {
            if let Err(err) = self.free(ptr) {
                tracing::error!(%err, ptr, "cuvmm: freeing a cuMemAllocAsync allocation failed");
            }
        }
    }
}

fn setup(call: &'static str, err: &CuError) -> DriverError {
    let (code, name) = errors::code_and_name(err);
    DriverError::CudaSetup { call, code, name }
}

/// A byte count as the driver takes it (saturating beyond `usize`, which no 64-bit host reaches).
fn bytes(size: u64) -> usize {
    usize::try_from(size).unwrap_or(usize::MAX)
}
