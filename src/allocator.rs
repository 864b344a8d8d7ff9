//! The facade: a thread-safe [`Allocator`] handle around any [`Strategy`], and [`DeviceBuffer`], which frees
//! its memory when dropped.
//!
//! The strategies are plain `&mut self` state machines; this is the only place that locks. One
//! `parking_lot::Mutex` guards the strategy: every operation holds it for a few microseconds of bookkeeping,
//! plus driver calls on the cold paths (growth, compaction, release).

use crate::config::Config;
use crate::driver::{Driver, StreamId};
use crate::error::{Error, InvariantViolation};
use crate::expandable::Expandable;
use crate::stats::Stats;
use crate::strategy::Strategy;
use crate::sync::{Arc, Mutex};
use std::fmt;

struct Shared<S> {
    strategy: Mutex<S>,
    /// Errors raised where they could not be returned (freeing in `Drop`), kept for the program to collect.
    deferred: Mutex<Vec<Error>>,
}

/// A thread-safe allocator handle. Cloning it is cheap and shares the same allocator.
pub struct Allocator<S> {
    shared: Arc<Shared<S>>,
}

impl<S> Clone for Allocator<S> {
    fn clone(&self) -> Self {
        Self {
            shared: Arc::clone(&self.shared),
        }
    }
}

impl<S> fmt::Debug for Allocator<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator").finish_non_exhaustive()
    }
}

impl<D: Driver> Allocator<Expandable<D>> {
    /// cuvmm's expandable allocator on `driver`.
    pub fn expandable(driver: D, config: Config) -> Result<Self, Error> {
        Ok(Self::new(Expandable::new(driver, config)?))
    }
}

impl<S: Strategy> Allocator<S> {
    /// Wraps a strategy.
    pub fn new(strategy: S) -> Self {
        Self {
            shared: Arc::new(Shared {
                strategy: Mutex::new(strategy),
                deferred: Mutex::new(Vec::new()),
            }),
        }
    }

    /// Allocates `size` bytes on the default stream.
    pub fn alloc(&self, size: u64) -> Result<DeviceBuffer<S>, Error> {
        self.alloc_on(size, StreamId::DEFAULT)
    }

    /// Allocates `size` bytes for use on `stream`. The memory may be reused by later work on that stream as
    /// soon as the buffer is dropped.
    pub fn alloc_on(&self, size: u64, stream: StreamId) -> Result<DeviceBuffer<S>, Error> {
        let ptr = self.shared.strategy.lock().alloc(size, stream)?;
        Ok(DeviceBuffer {
            allocator: self.clone(),
            ptr,
            size,
            stream,
            live: true,
        })
    }

    /// Allocates without a guard: the caller must pass the address to [`free_raw`](Allocator::free_raw).
    pub fn alloc_raw(&self, size: u64, stream: StreamId) -> Result<u64, Error> {
        self.shared.strategy.lock().alloc(size, stream)
    }

    /// Frees an address from [`alloc_raw`](Allocator::alloc_raw).
    pub fn free_raw(&self, ptr: u64) -> Result<(), Error> {
        self.shared.strategy.lock().free(ptr)
    }

    /// Records that the allocation at `ptr` is also used by work queued on `stream`: once freed, its memory
    /// is reused only after that work has completed. See [`DeviceBuffer::record_stream`].
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), Error> {
        self.shared.strategy.lock().record_stream(ptr, stream)
    }

    /// A snapshot of the statistics.
    pub fn stats(&self) -> Stats {
        self.shared.strategy.lock().stats()
    }

    /// The statistics as PyTorch's `torch.cuda.memory_summary()` table, plus cuvmm's own rows
    /// ([`summary::memory_summary`](crate::summary::memory_summary)).
    pub fn memory_summary(&self) -> String {
        crate::summary::summary_of(&*self.shared.strategy.lock())
    }

    /// The segments and blocks now, with the events recorded since [`record_history`](Self::record_history)
    /// (PyTorch's `torch.cuda.memory._snapshot()`); `snapshot::pickle` pickles it for PyTorch's
    /// memory viewer.
    pub fn snapshot(&self) -> Result<crate::snapshot::MemorySnapshot, Error> {
        self.shared.strategy.lock().snapshot()
    }

    /// Starts recording events for [`snapshot`](Self::snapshot), keeping the last `max_entries`, or stops
    /// with `None` (PyTorch's `torch.cuda.memory._record_memory_history`).
    pub fn record_history(&self, max_entries: Option<usize>) -> Result<(), Error> {
        self.shared.strategy.lock().record_history(max_entries)
    }

    /// Gives all cached memory back to the driver.
    pub fn empty_cache(&self) -> Result<(), Error> {
        self.shared.strategy.lock().empty_cache()
    }

    /// Gives up to `bytes` of cached memory back to the driver; returns the bytes given back.
    pub fn trim(&self, bytes: u64) -> Result<u64, Error> {
        self.shared.strategy.lock().trim(bytes)
    }

    /// Walks the whole state for broken invariants (for tests).
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.shared.strategy.lock().check_invariants()
    }

    /// Runs `f` with the strategy locked (to reach the driver in tests, say).
    pub fn with_strategy<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.shared.strategy.lock())
    }

    /// Errors raised while dropping buffers, oldest first. Each was also reported through `tracing`.
    pub fn take_deferred_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.shared.deferred.lock())
    }
}

/// Device memory from an [`Allocator`], freed when dropped.
pub struct DeviceBuffer<S: Strategy> {
    allocator: Allocator<S>,
    ptr: u64,
    size: u64,
    stream: StreamId,
    live: bool,
}

impl<S: Strategy> DeviceBuffer<S> {
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

    /// Records that work queued on `stream` (not the buffer's own) uses the buffer, as PyTorch's
    /// `Tensor.record_stream`: when the buffer is freed, the allocator records an event on `stream` and
    /// hands the memory out again only once that event has completed. Call it for every other stream the
    /// buffer is used on, before the buffer is freed.
    pub fn record_stream(&self, stream: StreamId) -> Result<(), Error> {
        self.allocator.record_stream(self.ptr, stream)
    }

    /// Keeps an error raised where it could not be returned, for
    /// [`Allocator::take_deferred_errors`].
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn defer(&self, err: Error) {
        self.allocator.shared.deferred.lock().push(err);
    }

    /// Frees the buffer now and returns any error, instead of deferring it as `Drop` must.
    pub fn free(mut self) -> Result<(), Error> {
        self.live = false;
        self.allocator.free_raw(self.ptr)
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
        if let Err(err) = self.allocator.free_raw(self.ptr) {
            tracing::error!(%err, ptr = self.ptr, "cuvmm: freeing a DeviceBuffer failed");
            self.allocator.shared.deferred.lock().push(err);
        }
    }
}
