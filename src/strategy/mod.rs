//! The interface every allocation strategy offers, so the facade, the replay engine and the tests can drive
//! any of them: cuvmm's expandable allocator, the laboratory's models of PyTorch's allocators, CUDA's own
//! pool. [`Strategy`] is what every one has; what only some have is a capability trait of its own
//! ([`capabilities`]): streams, graph pools, tags, sharing, peers, snapshots, device bytes, PyTorch's
//! controls. A strategy implements a capability only when it has it, and says so through the matching
//! `Strategy` method (`stream_uses()`, ...), so code holding a `dyn Strategy` (the replay engine) asks for it.

pub mod capabilities;
pub mod config;
pub mod error;
pub mod graph_pool;
pub mod history;
pub mod oom;
pub mod pool;
pub mod sharing;
pub mod snapshot;
pub mod stats;
pub mod tags;

pub use capabilities::{
    Controls, DeviceBytes, GraphPools, Peers, Sharing, Snapshots, StreamUses, Tags,
};

use crate::driver::{CaptureProbe, DriverCounters, StreamId};
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::stats::Stats;

/// An allocator's state machine: plain `&mut self`, no locks (the facade adds them). What every strategy
/// does; what only some do is a capability ([`capabilities`]), reached through the methods at the end.
pub trait Strategy {
    /// Short name used in reports and JSON: "cuvmm", "classic", "pytorch-expandable".
    fn name(&self) -> &'static str;

    /// Allocates `size` bytes for use on `stream` and returns the device address.
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error>;

    /// Frees an address returned by [`alloc`](Strategy::alloc).
    fn free(&mut self, addr: u64) -> Result<(), Error>;

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

    /// How many private pools are being allocated to now (captures underway that the allocator knows of).
    /// The facade bypasses its per-stream caches while this is not zero. 0 for a strategy without
    /// [`GraphPools`], the default.
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

    /// [`Error::Unsupported`] for `what` on this allocator: what a caller that needs a capability the
    /// strategy lacks reports.
    fn unsupported(&self, what: &'static str) -> Error {
        Error::Unsupported {
            what,
            allocator: self.name(),
        }
    }

    /// Its [`StreamUses`] (PyTorch's `recordStream`), if it has them. The default is `None`.
    fn stream_uses(&mut self) -> Option<&mut dyn StreamUses> {
        None
    }

    /// Its [`Snapshots`] (segments, blocks and recorded events), if it has them. The default is `None`.
    fn snapshots(&mut self) -> Option<&mut dyn Snapshots> {
        None
    }

    /// Its [`Tags`] (to read which sleep), if it has them. The default is `None`.
    fn tags(&self) -> Option<&dyn Tags> {
        None
    }

    /// Its [`DeviceBytes`] (writing and reading allocated memory, for `--touch` replays), if it has them.
    /// The default is `None`.
    fn device_bytes(&mut self) -> Option<&mut dyn DeviceBytes> {
        None
    }
}
