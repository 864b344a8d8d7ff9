//! cudarc interop (feature `cuda`): memory from an [`Allocator`] for a cudarc [`CudaStream`], which cudarc's
//! copies, memsets and kernel launches take like its own `CudaSlice`.
//!
//! [`Allocator::alloc_on_stream`] allocates for the caller's stream (cuvmm records its events on that
//! stream and synchronizes it: the allocator's `StreamId` is the stream's raw `CUstream`). The
//! [`CudaBuffer`] it returns implements cudarc's [`DevicePtr`] / [`DevicePtrMut`] for bytes; its typed
//! views ([`CudaBuffer::view`], [`CudaBuffer::view_mut`]) do so for any element type. The ordering is
//! the one cudarc expects of a `DevicePtr`:
//! - used on its own stream, nothing is added: the work is ordered by the stream, and the allocator reuses
//!   the memory in stream order after the buffer is dropped;
//! - used on another stream, that stream first waits for the work queued on the buffer's own stream so far
//!   (including the work of a previous owner of the memory, which stream-ordered reuse allows), and the
//!   other stream is recorded with the allocator ([`CudaBuffer::record_stream`], PyTorch's
//!   `record_stream`), so the memory is reused or unmapped only after that stream's work completes;
//! - when cudarc manages synchronization between streams (its context is in multi-stream mode with event
//!   tracking on), the buffer also keeps cudarc's read and write events: a read waits for the last write,
//!   a write for the last read and write, and the buffer's own stream waits for both before the buffer is
//!   freed, as a `CudaSlice` does.
//!
//! cudarc's own calls (copies, events, waits) make its context current as cudarc always does; cuvmm's
//! driver calls leave the calling thread's context as they found it.
//!
//! For a kernel argument, take the pointer as cudarc suggests for a `DevicePtr`:
//! `let (ptr, _record) = view.device_ptr_mut(&stream); builder.arg(&ptr);` — the guard records the use
//! once the launch is queued.

use crate::driver::StreamId;
use crate::driver::cuda::keeping_current_context;
use crate::facade::allocator::Allocator;
use crate::facade::device_buffer::DeviceBuffer;
use crate::strategy::Strategy;
use crate::strategy::StreamUses;
use crate::strategy::error::Error;
use cudarc::driver::{
    CudaEvent, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop, sys,
};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, OnceLock};

impl<S: Strategy + StreamUses> Allocator<S> {
    /// Allocates `size` bytes for work on the cudarc `stream`: [`alloc_on`](Allocator::alloc_on) with
    /// [`StreamId::from_cuda`]. The stream must belong to the allocator's device (its primary context,
    /// which cudarc's `CudaContext::new` retains) and stay alive while the buffer lives.
    ///
    /// Fails with [`Error::WrongDevice`] for a stream of another device.
    pub fn alloc_on_stream(
        &self,
        size: u64,
        stream: &Arc<CudaStream>,
    ) -> Result<CudaBuffer<S>, Error> {
        let device = self.with_strategy(|s| s.ordinal());
        let stream_device = stream.context().ordinal();
        if stream_device != device {
            return Err(Error::WrongDevice {
                stream_device,
                device,
            });
        }
        let buffer = self.alloc_on(size, StreamId::from_cuda(stream))?;
        Ok(CudaBuffer {
            buffer,
            stream: Arc::clone(stream),
            read: OnceLock::new(),
            write: OnceLock::new(),
        })
    }
}

/// Device memory from [`Allocator::alloc_on_stream`], for work on a cudarc stream; freed when dropped.
/// cudarc's copies and memsets take it as bytes, and its [`view`](Self::view) /
/// [`view_mut`](Self::view_mut) as elements of any type.
pub struct CudaBuffer<S: Strategy + StreamUses> {
    buffer: DeviceBuffer<S>,
    stream: Arc<CudaStream>,
    /// cudarc's read event, created on the first read while cudarc manages synchronization.
    read: OnceLock<Option<CudaEvent>>,
    /// cudarc's write event, likewise.
    write: OnceLock<Option<CudaEvent>>,
}

impl<S: Strategy + StreamUses> CudaBuffer<S> {
    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.buffer.ptr()
    }

    /// The size asked for, in bytes.
    pub fn len(&self) -> u64 {
        self.buffer.len()
    }

    /// Always false: zero-byte requests are refused.
    pub fn is_empty(&self) -> bool {
        self.buffer.is_empty()
    }

    /// The stream the buffer was allocated for.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The allocation itself.
    pub fn buffer(&self) -> &DeviceBuffer<S> {
        &self.buffer
    }

    /// Records that work queued on `stream` uses the buffer (PyTorch's `record_stream`): once freed, its
    /// memory is reused only after that work completes. The [`DevicePtr`] methods do it themselves for a
    /// stream that is not the buffer's own; call it when the pointer reaches another stream some other way.
    pub fn record_stream(&self, stream: &CudaStream) -> Result<(), Error> {
        self.buffer.record_stream(StreamId::from_cuda(stream))
    }

    /// The buffer as `len() / size_of::<T>()` elements of `T`, for cudarc calls that read it.
    pub fn view<T>(&self) -> TypedView<'_, T, S> {
        TypedView {
            len: elements::<T>(self.len()),
            buf: self,
            elem: PhantomData,
        }
    }

    /// The buffer as `len() / size_of::<T>()` elements of `T`, for cudarc calls that write it.
    pub fn view_mut<T>(&mut self) -> TypedViewMut<'_, T, S> {
        TypedViewMut {
            len: elements::<T>(self.len()),
            buf: self,
            elem: PhantomData,
        }
    }

    /// Orders a use on `stream` after what it must follow (see the module's documentation).
    fn order_use(&self, stream: &CudaStream, write: bool) {
        let ctx = stream.context();
        if stream.cu_stream() != self.stream.cu_stream() {
            // The memory may still be in use by earlier work on the buffer's own stream.
            ctx.record_err(stream.join(&self.stream));
            if let Err(err) = self.record_stream(stream) {
                tracing::error!(%err, "cuvmm: recording a cudarc stream's use of a buffer failed");
                self.buffer.defer(err);
            }
        }
        if ctx.is_managing_stream_synchronization() {
            let earlier = if write {
                [self.read.get(), self.write.get()]
            } else {
                [None, self.write.get()]
            };
            for event in earlier.into_iter().flatten().flatten() {
                ctx.record_err(stream.wait(event));
            }
        }
    }

    /// The guard that records this use in cudarc's read or write event, created on first need.
    fn record_use<'a>(&'a self, stream: &'a CudaStream, write: bool) -> SyncOnDrop<'a> {
        let ctx = stream.context();
        if !ctx.is_managing_stream_synchronization() {
            return SyncOnDrop::Sync(None);
        }
        let cell = if write { &self.write } else { &self.read };
        let event = cell.get_or_init(|| match ctx.new_event(None) {
            Ok(event) => Some(event),
            Err(err) => {
                ctx.record_err(Err::<(), _>(err));
                None
            }
        });
        SyncOnDrop::record_event(event, stream)
    }

    fn read_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.order_use(stream, false);
        (self.ptr(), self.record_use(stream, false))
    }

    fn write_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.order_use(stream, true);
        (self.ptr(), self.record_use(stream, true))
    }
}

/// Elements of `T` in `bytes` bytes (0 for a zero-sized `T`).
fn elements<T>(bytes: u64) -> usize {
    let bytes = usize::try_from(bytes).unwrap_or(usize::MAX);
    bytes.checked_div(size_of::<T>()).unwrap_or(0)
}

impl<S: Strategy + StreamUses> Drop for CudaBuffer<S> {
    /// Makes the buffer's own stream wait for the uses cudarc recorded on other streams, so the
    /// allocator's stream-ordered reuse comes after them, and destroys those events; the memory is freed
    /// next (the `DeviceBuffer` field's drop). The calling thread keeps its current context.
    fn drop(&mut self) {
        let (read, write) = (
            std::mem::take(&mut self.read),
            std::mem::take(&mut self.write),
        );
        if read.get().is_none() && write.get().is_none() {
            return;
        }
        keeping_current_context(|| {
            for event in [read.get(), write.get()].into_iter().flatten().flatten() {
                let ctx = self.stream.context();
                ctx.record_err(self.stream.wait(event));
            }
            drop((read, write));
        });
    }
}

impl<S: Strategy + StreamUses> fmt::Debug for CudaBuffer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CudaBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr()))
            .field("len", &self.len())
            .field("stream", &StreamId::from_cuda(&self.stream))
            .finish()
    }
}

impl<S: Strategy + StreamUses> DeviceSlice<u8> for CudaBuffer<S> {
    fn len(&self) -> usize {
        elements::<u8>(self.buffer.len())
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }
}

impl<S: Strategy + StreamUses> DevicePtr<u8> for CudaBuffer<S> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.read_ptr(stream)
    }
}

impl<S: Strategy + StreamUses> DevicePtrMut<u8> for CudaBuffer<S> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.write_ptr(stream)
    }
}

/// A [`CudaBuffer`] read as elements of `T` ([`CudaBuffer::view`]).
pub struct TypedView<'a, T, S: Strategy + StreamUses> {
    buf: &'a CudaBuffer<S>,
    len: usize,
    elem: PhantomData<T>,
}

/// A [`CudaBuffer`] written as elements of `T` ([`CudaBuffer::view_mut`]).
pub struct TypedViewMut<'a, T, S: Strategy + StreamUses> {
    buf: &'a mut CudaBuffer<S>,
    len: usize,
    elem: PhantomData<T>,
}

impl<T, S: Strategy + StreamUses> DeviceSlice<T> for TypedView<'_, T, S> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buf.stream
    }
}

impl<T, S: Strategy + StreamUses> DevicePtr<T> for TypedView<'_, T, S> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.buf.read_ptr(stream)
    }
}

impl<T, S: Strategy + StreamUses> DeviceSlice<T> for TypedViewMut<'_, T, S> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        &self.buf.stream
    }
}

impl<T, S: Strategy + StreamUses> DevicePtr<T> for TypedViewMut<'_, T, S> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.buf.read_ptr(stream)
    }
}

impl<T, S: Strategy + StreamUses> DevicePtrMut<T> for TypedViewMut<'_, T, S> {
    fn device_ptr_mut<'a>(
        &'a mut self,
        stream: &'a CudaStream,
    ) -> (sys::CUdeviceptr, SyncOnDrop<'a>) {
        self.buf.write_ptr(stream)
    }
}
