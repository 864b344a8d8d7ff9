//! The interface every allocation strategy offers, so the facade, the replay engine and the tests can drive
//! any of them: cuvmm's expandable allocator, and (later) the classic split model and PyTorch's expandable mode.

pub mod config;
pub mod error;
pub mod graph_pool;
pub mod history;
pub mod oom;
pub mod pool;
pub mod sharing;
pub mod snapshot;
pub mod stats;

use crate::driver::{CaptureProbe, DriverCounters, DriverError, Op, StreamId};
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use crate::strategy::sharing::{SharedMemory, SharedPart};
use crate::strategy::snapshot::MemorySnapshot;
use crate::strategy::stats::Stats;
use std::os::fd::BorrowedFd;

/// An allocator's state machine: plain `&mut self`, no locks (the facade adds them).
pub trait Strategy {
    /// Short name used in reports and JSON: "cuvmm", "classic", "pytorch-expandable".
    fn name(&self) -> &'static str;

    /// Allocates `size` bytes for use on `stream` and returns the device address.
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error>;

    /// Frees an address returned by [`alloc`](Strategy::alloc).
    fn free(&mut self, addr: u64) -> Result<(), Error>;

    /// Records that the live allocation at `addr` is also used by work queued on `stream` (PyTorch's
    /// `recordStream`): when it is freed, its memory is reused only once that work has completed.
    ///
    /// The default implementation returns [`Error::Unsupported`], for allocators that do not track streams.
    fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let _ = (addr, stream);
        Err(Error::Unsupported {
            what: "record_stream",
            allocator: self.name(),
        })
    }

    /// From now on, allocations on the streams `filter` accepts come from the private pool `pool` (PyTorch's
    /// `beginAllocateToPool`, called before a CUDA graph capture begins). See [`crate::strategy::graph_pool`].
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn begin_allocate_to_pool(
        &mut self,
        pool: GraphPool,
        filter: StreamFilter,
    ) -> Result<(), Error> {
        let _ = (pool, filter);
        Err(self.unsupported("begin_allocate_to_pool"))
    }

    /// Allocations stop going to `pool` (PyTorch's `endAllocateToPool`, after the capture ended); its
    /// memory stays the pool's.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn end_allocate_to_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        let _ = pool;
        Err(self.unsupported("end_allocate_to_pool"))
    }

    /// A graph that used `pool` is gone (PyTorch's `releasePool`, once per begin): once none is left, the
    /// pool's memory goes back to common use as its blocks are freed.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn release_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        let _ = pool;
        Err(self.unsupported("release_pool"))
    }

    /// One more user of `pool` without allocating to it (PyTorch's `createOrIncrefPool`): it stays live
    /// until [`release_pool`](Strategy::release_pool) has been called once more.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn incref_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        let _ = pool;
        Err(self.unsupported("incref_pool"))
    }

    /// Lets device `peer` read and write every range mapped now and every one mapped later (PyTorch's
    /// `enablePeerAccess` for expandable segments).
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn add_peer(&mut self, peer: usize) -> Result<(), Error> {
        let _ = peer;
        Err(self.unsupported("add_peer"))
    }

    /// Allocates `size` bytes for use on `stream` under the tag `tag`, whose memory
    /// [`sleep`](Strategy::sleep) can give back and [`wake`](Strategy::wake) map again at the same
    /// addresses. Tagged memory shares no page with other memory.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        let _ = (size, stream, tag);
        Err(self.unsupported("alloc_tagged"))
    }

    /// Puts `tag` to sleep: waits for the streams that used its memory, keeps its bytes on the host if
    /// `keep`, and gives its physical memory back; its addresses stay reserved. Returns the bytes unmapped.
    /// Idempotent. See docs/DESIGN.md, "Sleep and wake".
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error> {
        let _ = (tag, keep);
        Err(self.unsupported("sleep"))
    }

    /// Wakes `tag`: maps memory at the same addresses and puts back the bytes kept. Idempotent.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn wake(&mut self, tag: &str) -> Result<(), Error> {
        let _ = tag;
        Err(self.unsupported("wake"))
    }

    /// The tags asleep and the bytes each gave back, by name. The default is none.
    fn asleep_tags(&self) -> Vec<(String, u64)> {
        Vec::new()
    }

    /// Exports the memory under the live allocation that starts at `addr`, for another process to map
    /// with [`open_shared`](Strategy::open_shared): the whole mappings that cover it, each handle as a file
    /// descriptor. The allocation must stay live while the other process uses it (PyTorch's IPC reference
    /// counting sees to that). See [`crate::strategy::sharing`].
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn share(&mut self, addr: u64) -> Result<SharedMemory, Error> {
        let _ = addr;
        Err(self.unsupported("share"))
    }

    /// Maps memory another process shared ([`share`](Strategy::share)), the parts back to back in a range
    /// of its own, readable and writable; returns the range's start. The descriptors stay the caller's.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn open_shared(&mut self, parts: &[SharedPart<BorrowedFd<'_>>]) -> Result<u64, Error> {
        let _ = parts;
        Err(self.unsupported("open_shared"))
    }

    /// Unmaps shared memory that [`open_shared`](Strategy::open_shared) mapped at `addr` and gives its
    /// handles and addresses back. The caller's work on it must have finished.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn close_shared(&mut self, addr: u64) -> Result<(), Error> {
        let _ = addr;
        Err(self.unsupported("close_shared"))
    }

    /// How many private pools are being allocated to now (captures underway that the allocator knows of).
    /// The facade bypasses its per-stream caches while this is not zero. The default is 0.
    fn captures_underway(&self) -> usize {
        0
    }

    /// How to ask, without the strategy, whether a stream is being captured when no pool was begun for the
    /// capture: `Some` when the strategy gives such a capture a pool of its own (capture detection), so that
    /// the facade's stream caches, which serve requests without the strategy, serve none of a capturing
    /// stream's. The default is `None`.
    fn capture_probe(&self) -> Option<CaptureProbe> {
        None
    }

    /// [`Error::Unsupported`] for `what` on this allocator.
    fn unsupported(&self, what: &'static str) -> Error {
        Error::Unsupported {
            what,
            allocator: self.name(),
        }
    }

    /// Gives every cached (unused) byte back to the driver.
    fn empty_cache(&mut self) -> Result<(), Error>;

    /// Gives up to `bytes` of cached memory back to the driver; returns how many bytes were given back.
    fn trim(&mut self, bytes: u64) -> Result<u64, Error>;

    /// A snapshot of the statistics.
    fn stats(&self) -> Stats;

    /// Walks the whole state and reports the first broken invariant (ARCHITECTURE.md's list). Costs a full
    /// scan; tests and fuzzers call it after every operation, production code never does.
    fn check_invariants(&self) -> Result<(), InvariantViolation>;

    /// Driver calls made so far.
    fn driver_counters(&self) -> DriverCounters;

    /// Physical bytes held now (`stats().reserved_bytes.current`, without computing the rest of the
    /// statistics). Called after every operation by replays that look for the peak.
    fn reserved_bytes(&self) -> u64 {
        self.stats().reserved_bytes.current
    }

    /// The ordinal of the device the allocator runs on (its driver's [`Driver::ordinal`](crate::Driver::ordinal)).
    /// The default is 0.
    fn ordinal(&self) -> usize {
        0
    }

    /// The allocator's segments and blocks now, and the events recorded since
    /// [`record_history`](Strategy::record_history) turned recording on (PyTorch's
    /// `torch.cuda.memory._snapshot()`).
    ///
    /// The default implementation returns [`Error::Unsupported`], for allocators that cannot list their
    /// blocks.
    fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        Err(Error::Unsupported {
            what: "snapshot",
            allocator: self.name(),
        })
    }

    /// Starts recording events for [`snapshot`](Strategy::snapshot), keeping the last `max_entries`
    /// (PyTorch's `_record_memory_history(max_entries=...)`), or stops and forgets them with `None`.
    /// Recording is off until this is called; off, it costs nothing measurable.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error> {
        let _ = max_entries;
        Err(Error::Unsupported {
            what: "record_history",
            allocator: self.name(),
        })
    }

    /// Sets `len` bytes from `addr` (inside a live allocation) to `value` on the device, through the
    /// driver's [`memset_d8`](crate::Driver::memset_d8). For `--touch` replays and tests, not a fast path.
    ///
    /// The default implementation returns [`DriverError::Unsupported`].
    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error> {
        let _ = (addr, len, value);
        Err(DriverError::Unsupported { op: Op::Memset }.into())
    }

    /// Copies `out.len()` bytes from `addr` (inside a live allocation) to `out`, through the driver's
    /// [`copy_to_host`](crate::Driver::copy_to_host).
    ///
    /// The default implementation returns [`DriverError::Unsupported`].
    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        let _ = (addr, out);
        Err(DriverError::Unsupported { op: Op::CopyToHost }.into())
    }
    /// Sets every statistic's peak to its current value (PyTorch's `reset_peak_memory_stats`).
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn reset_peak_stats(&mut self) -> Result<(), Error> {
        Err(Error::Unsupported {
            what: "reset_peak_stats",
            allocator: self.name(),
        })
    }

    /// Sets every cumulative count (each statistic's `allocated` and `freed`, retries, OOMs, device
    /// allocations and frees, synchronizations) to 0 (PyTorch's `reset_accumulated_memory_stats`).
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn reset_accumulated_stats(&mut self) -> Result<(), Error> {
        Err(Error::Unsupported {
            what: "reset_accumulated_stats",
            allocator: self.name(),
        })
    }

    /// Limits the memory the allocator may reserve to `fraction` (in [0, 1]) of the device's, from now on
    /// (PyTorch's `set_per_process_memory_fraction`); memory already reserved above it is not taken back.
    ///
    /// The default implementation returns [`Error::Unsupported`].
    fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), Error> {
        let _ = fraction;
        Err(Error::Unsupported {
            what: "set_memory_fraction",
            allocator: self.name(),
        })
    }

    /// The memory limit as a fraction of the device's memory; `None` when no limit is set. The default is
    /// `None`.
    fn memory_fraction(&self) -> Option<f64> {
        None
    }
}
