//! The allocator's state at its peak: which operation of a replay first brought reserved memory to its
//! highest value, and the state right after it.
//!
//! A replay is deterministic, so two passes find it without slowing the replay loop: the first watches
//! [`Strategy::reserved_bytes`] after every operation and notes the first one at the maximum; the second,
//! on a fresh allocator, stops for a moment right after that operation to let the caller look at the
//! strategy (its `memory_summary`, its snapshot), then finishes. Both passes wrap the strategy in `Watch`,
//! which forwards every call and counts the operations (alloc, free, and record_stream where the strategy
//! has it).

use super::{ReplayError, ReplayOptions, ReplayResult, replay};
use crate::trace::event::Trace;
use cuvmm::driver::{DriverCounters, StreamId};
use cuvmm::strategy::error::{Error, InvariantViolation};
use cuvmm::strategy::stats::Stats;
use cuvmm::strategy::{DeviceBytes, Snapshots, Strategy, StreamUses};

/// Where the peak was: the operation (counted from 1) after which reserved bytes first reached `reserved`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    /// Operations (alloc, free, record_stream calls) replayed up to and including the peak's.
    pub operation: usize,
    /// Reserved bytes at the peak.
    pub reserved: u64,
}

/// A strategy that forwards everything to `inner`, counting operations; after operation `capture_at` it
/// calls `on_capture` with the strategy once.
struct Watch<'a, 'f> {
    inner: &'a mut dyn Strategy,
    operations: usize,
    peak: Peak,
    capture_at: Option<usize>,
    on_capture: &'f mut dyn FnMut(&dyn Strategy),
}

impl Watch<'_, '_> {
    fn after_operation(&mut self) {
        self.operations += 1;
        let reserved = self.inner.reserved_bytes();
        if reserved > self.peak.reserved || self.peak.operation == 0 {
            self.peak = Peak {
                operation: self.operations,
                reserved,
            };
        }
        if self.capture_at == Some(self.operations) {
            (self.on_capture)(&*self.inner);
        }
    }
}

impl Strategy for Watch<'_, '_> {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        let result = self.inner.alloc(size, stream);
        self.after_operation();
        result
    }
    fn free(&mut self, addr: u64) -> Result<(), Error> {
        let result = self.inner.free(addr);
        self.after_operation();
        result
    }
    fn empty_cache(&mut self) -> Result<(), Error> {
        self.inner.empty_cache()
    }
    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        self.inner.trim(bytes)
    }
    fn stats(&self) -> Stats {
        self.inner.stats()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        self.inner.check_invariants()
    }
    fn driver_counters(&self) -> DriverCounters {
        self.inner.driver_counters()
    }
    fn reserved_bytes(&self) -> u64 {
        self.inner.reserved_bytes()
    }
    fn ordinal(&self) -> usize {
        self.inner.ordinal()
    }
    fn stream_uses(&mut self) -> Option<&mut dyn StreamUses> {
        // Counted as an operation when the strategy has it, as an alloc or a free is.
        match self.inner.stream_uses() {
            Some(_) => Some(self),
            None => None,
        }
    }
    fn snapshots(&mut self) -> Option<&mut dyn Snapshots> {
        self.inner.snapshots()
    }
    fn device_bytes(&mut self) -> Option<&mut dyn DeviceBytes> {
        self.inner.device_bytes()
    }
}

impl StreamUses for Watch<'_, '_> {
    fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        let result = match self.inner.stream_uses() {
            Some(inner) => inner.record_stream(addr, stream),
            None => Err(self.inner.unsupported("record_stream")),
        };
        self.after_operation();
        result
    }
}

/// Replays `trace` through `strategy` and returns the result and where reserved memory first peaked.
/// With nothing reserved at any point, the peak is the first operation.
///
/// # Errors
/// As [`replay`].
pub fn find_peak(
    strategy: &mut dyn Strategy,
    trace: &Trace,
    options: &ReplayOptions,
) -> Result<(ReplayResult, Peak), ReplayError> {
    let mut ignore = |_: &dyn Strategy| {};
    let mut watch = Watch {
        inner: strategy,
        operations: 0,
        peak: Peak::default(),
        capture_at: None,
        on_capture: &mut ignore,
    };
    let result = replay(&mut watch, trace, options)?;
    Ok((result, watch.peak))
}

/// Replays `trace` through `strategy`, calling `capture` with the strategy right after operation
/// `operation` (a [`Peak::operation`] from [`find_peak`] on an identical allocator), and returns the result.
///
/// # Errors
/// As [`replay`].
pub fn replay_capturing(
    strategy: &mut dyn Strategy,
    trace: &Trace,
    options: &ReplayOptions,
    operation: usize,
    capture: &mut dyn FnMut(&dyn Strategy),
) -> Result<ReplayResult, ReplayError> {
    let mut watch = Watch {
        inner: strategy,
        operations: 0,
        peak: Peak::default(),
        capture_at: Some(operation),
        on_capture: capture,
    };
    replay(&mut watch, trace, options)
}
