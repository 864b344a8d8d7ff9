//! How many times each driver operation was called, and the driver time the calls cost.

use super::Op;
use serde::Serialize;

/// How many times each driver operation was called, and the driver time they cost.
///
/// On [`sim::SimDriver`](super::sim::SimDriver) the time is estimated from its latency model; on a real device it is measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverCounters {
    /// Calls per operation, indexed like [`Op::ALL`].
    pub calls: [u64; Op::ALL.len()],
    /// Driver time spent (or estimated) in all calls, in nanoseconds.
    pub time_ns: u64,
    /// Per operation, the 2 MiB units its calls covered (each call at least one; see
    /// `sim::LatencyModel::units`), so the time can be estimated again under another calibration. The
    /// simulator fills it; other backends leave it 0.
    pub units: [u64; Op::ALL.len()],
    /// Per operation, the mappings its successful calls covered beyond the first (`set_access` and `unmap`
    /// over several mappings, whose latency is per mapping), so the fixed part of a latency model can be
    /// charged per mapping. The simulator fills it; other backends leave it 0.
    pub extra_mappings: [u64; Op::ALL.len()],
}

impl DriverCounters {
    /// Calls of one operation.
    #[inline]
    pub fn get(&self, op: Op) -> u64 {
        self.calls[op as usize]
    }

    /// Counts one call of `op` that cost `ns` nanoseconds.
    #[inline]
    pub fn record(&mut self, op: Op, ns: u64) {
        self.calls[op as usize] += 1;
        self.time_ns += ns;
    }

    /// Counts `calls` calls of `op` that cost `ns` nanoseconds each.
    pub fn record_many(&mut self, op: Op, calls: u64, ns: u64) {
        self.calls[op as usize] += calls;
        self.time_ns += calls * ns;
    }

    /// Counts `calls` calls of `op` covering `units` 2 MiB units each.
    #[inline]
    pub fn record_units(&mut self, op: Op, calls: u64, units: u64) {
        self.units[op as usize] += calls * units;
    }

    /// Counts `extra` mappings covered by a call of `op` beyond its first.
    #[inline]
    pub fn record_extra_mappings(&mut self, op: Op, extra: u64) {
        self.extra_mappings[op as usize] += extra;
    }

    /// Adds `other`'s calls, time, units and mappings (calls counted apart, such as a copy job's).
    pub fn add(&mut self, other: &DriverCounters) {
        for i in 0..Op::ALL.len() {
            self.calls[i] += other.calls[i];
            self.units[i] += other.units[i];
            self.extra_mappings[i] += other.extra_mappings[i];
        }
        self.time_ns += other.time_ns;
    }

    /// Calls of all operations together.
    pub fn total(&self) -> u64 {
        self.calls.iter().sum()
    }

    /// Driver time in microseconds.
    pub fn time_us(&self) -> f64 {
        self.time_ns as f64 / 1_000.0
    }
}
