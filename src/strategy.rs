//! The interface every allocation strategy offers, so the facade, the replay engine and the tests can drive
//! any of them: cuvmm's expandable allocator, and (later) the classic split model and PyTorch's expandable mode.

use crate::driver::{DriverCounters, StreamId};
use crate::error::{Error, InvariantViolation};
use crate::stats::Stats;

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
}
