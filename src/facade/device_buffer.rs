//! [`DeviceBuffer`]: device memory from an [`Allocator`] that frees itself when dropped, and the
//! allocator's calls that return one.

use crate::base::sync::Arc;
use crate::driver::StreamId;
use crate::facade::allocator::Allocator;
use crate::strategy::Strategy;
use crate::strategy::capabilities::{StreamUses, Tags};
use crate::strategy::error::Error;
use std::fmt;

impl<S: Strategy> Allocator<S> {
    /// Allocates `size` bytes on the default stream.
    pub fn alloc(&self, size: u64) -> Result<DeviceBuffer<S>, Error> {
        self.alloc_on(size, StreamId::DEFAULT)
    }

    /// Allocates `size` bytes for use on `stream`. The memory may be reused by later work on that stream as
    /// soon as the buffer is dropped.
    pub fn alloc_on(&self, size: u64, stream: StreamId) -> Result<DeviceBuffer<S>, Error> {
        let (ptr, in_capture) = self.allocate(size, stream, true, |s| s.alloc(size, stream))?;
        Ok(DeviceBuffer::new(
            self.buffer_handle(),
            ptr,
            size,
            stream,
            !in_capture,
        ))
    }
}

/// Device memory from an [`Allocator`], freed when dropped.
pub struct DeviceBuffer<S: Strategy> {
    /// The allocating thread's handle (`facade/thread_handles.rs`), which keeps the allocator alive.
    allocator: Arc<Allocator<S>>,
    ptr: u64,
    size: u64,
    stream: StreamId,
    live: bool,
    /// False for memory allocated while a capture was underway (perhaps a graph pool's): never kept in a
    /// stream cache, where a request outside the pool could take it.
    cacheable: bool,
}

impl<S: Strategy> DeviceBuffer<S> {
    /// The guard of a live allocation of `allocator`; `cacheable`: its free may keep it in its stream's
    /// cache.
    fn new(
        allocator: Arc<Allocator<S>>,
        ptr: u64,
        size: u64,
        stream: StreamId,
        cacheable: bool,
    ) -> Self {
        Self {
            allocator,
            ptr,
            size,
            stream,
            live: true,
            cacheable,
        }
    }

    /// The device address.
    pub fn ptr(&self) -> u64 {
        self.ptr
    }

    /// The size asked for, in bytes.
    pub fn len(&self) -> u64 {
        self.size
    }

    /// Always false: zero-byte requests are refused.
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// The stream the buffer was allocated for.
    pub fn stream(&self) -> StreamId {
        self.stream
    }

    /// Keeps an error raised where it could not be returned, for
    /// [`Allocator::take_deferred_errors`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn defer(&self, err: Error) {
        self.allocator.defer(err);
    }

    /// Frees the buffer now and returns any error, instead of deferring it as `Drop` must.
    pub fn free(mut self) -> Result<(), Error> {
        self.live = false;
        self.release()
    }

    fn release(&self) -> Result<(), Error> {
        (self.allocator).free_buffer(self.ptr, self.size, self.stream, self.cacheable)
    }
}

impl<S: Strategy> fmt::Debug for DeviceBuffer<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("ptr", &format_args!("{:#x}", self.ptr))
            .field("len", &self.size)
            .field("stream", &self.stream)
            .finish()
    }
}

impl<S: Strategy> Drop for DeviceBuffer<S> {
    fn drop(&mut self) {
        if !self.live {
            return;
        }
        if let Err(err) = self.release() {
            tracing::error!(%err, ptr = self.ptr, "cuvmm: freeing a DeviceBuffer failed");
            self.allocator.defer(err);
        }
    }
}

impl<S: Strategy + Tags> Allocator<S> {
    /// Allocates `size` bytes for use on `stream` under the tag `tag`: memory that
    /// [`sleep`](Self::sleep) can give back while its addresses stay reserved, and [`wake`](Self::wake)
    /// maps again at the same addresses. Tagged memory shares no page with other memory and never enters
    /// a stream cache. Refused with [`Error::TagAsleep`] while the tag sleeps.
    pub fn alloc_tagged(
        &self,
        size: u64,
        stream: StreamId,
        tag: &str,
    ) -> Result<DeviceBuffer<S>, Error> {
        let (ptr, _) = self.allocate(size, stream, false, |s| s.alloc_tagged(size, stream, tag))?;
        Ok(DeviceBuffer::new(
            self.buffer_handle(),
            ptr,
            size,
            stream,
            false,
        ))
    }
}

impl<S: Strategy + StreamUses> DeviceBuffer<S> {
    /// Records that work queued on `stream` (not the buffer's own) uses the buffer, as PyTorch's
    /// `Tensor.record_stream`: when the buffer is freed, the allocator records an event on `stream` and
    /// hands the memory out again only once that event has completed. Call it for every other stream the
    /// buffer is used on, before the buffer is freed.
    pub fn record_stream(&self, stream: StreamId) -> Result<(), Error> {
        self.allocator.record_stream(self.ptr, stream)
    }
}
