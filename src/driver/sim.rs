//! SimDriver: a simulated device. CONTRACT STUB — the public API below is fixed; bodies are to be written.

use super::{
    Driver, DriverCounters, DriverError, EventId, MemInfo, Op, PhysHandle, StreamId, VaRange,
};
use crate::size::{GIB, MIB};

/// Per-call driver latency, in nanoseconds, for one call on one granularity-sized (2 MiB) page.
/// Calls on larger ranges cost proportionally more (see [`LatencyModel::cost_ns`]).
#[derive(Debug, Clone, PartialEq)]
pub struct LatencyModel {
    /// Nanoseconds per call of each operation, indexed like [`Op::ALL`], for a 2 MiB range.
    pub per_call_ns: [u64; Op::ALL.len()],
}

impl LatencyModel {
    /// Published A100 figures for 2 MiB pages: create 193 us, map 1.5 us, set_access 36 us, unmap 26 us;
    /// release as unmap until measured.
    pub fn a100() -> Self {
        todo!()
    }

    /// Estimated nanoseconds for one call of `op` covering `bytes` bytes.
    pub fn cost_ns(&self, op: Op, bytes: u64) -> u64 {
        let _ = (op, bytes);
        todo!()
    }
}

/// How a simulated device is built.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Physical memory in bytes.
    pub capacity: u64,
    /// Allocation granularity in bytes.
    pub granularity: u64,
    /// Latency model for estimated driver time.
    pub latency: LatencyModel,
    /// Whether bytes written through mapped addresses are stored (for integrity tests).
    pub backing_store: bool,
}

impl Default for SimConfig {
    fn default() -> Self {
        Self {
            capacity: 80 * GIB,
            granularity: 2 * MIB,
            latency: LatencyModel::a100(),
            backing_store: false,
        }
    }
}

impl SimConfig {
    /// Sets the capacity.
    pub fn with_capacity(mut self, bytes: u64) -> Self {
        self.capacity = bytes;
        self
    }
    /// Sets the granularity.
    pub fn with_granularity(mut self, bytes: u64) -> Self {
        self.granularity = bytes;
        self
    }
    /// Turns the byte backing store on or off.
    pub fn with_backing_store(mut self, on: bool) -> Self {
        self.backing_store = on;
        self
    }
}

/// What an injected fault looks like to the caller.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// [`DriverError::Injected`].
    Error,
    /// [`DriverError::OutOfMemory`].
    OutOfMemory,
}

/// Everything a simulated device still holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LeakReport {
    /// Handles created and not released: (handle, size).
    pub handles: Vec<(PhysHandle, u64)>,
    /// Mappings not unmapped.
    pub mappings: Vec<VaRange>,
    /// Reservations not freed.
    pub reservations: Vec<VaRange>,
    /// `malloc`s not freed.
    pub allocations: Vec<VaRange>,
}

impl LeakReport {
    /// Whether nothing is held.
    pub fn is_empty(&self) -> bool {
        self.handles.is_empty()
            && self.mappings.is_empty()
            && self.reservations.is_empty()
            && self.allocations.is_empty()
    }
}

/// A simulated device.
#[derive(Debug)]
pub struct SimDriver {
    config: SimConfig,
}

impl SimDriver {
    /// A device built as `config` says.
    pub fn new(config: SimConfig) -> Self {
        Self { config }
    }
    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }
    /// Physical bytes in use (handles not yet freed, and mallocs).
    pub fn used_bytes(&self) -> u64 {
        todo!()
    }
    /// Makes the `n`th call of `op` from now (1 = the next one) fail with `kind`.
    pub fn fail_nth(&mut self, op: Op, n: u64, kind: FaultKind) {
        let _ = (op, n, kind);
        todo!()
    }
    /// Makes each call of any of `ops` fail with `probability`, drawn from a generator seeded with `seed`.
    pub fn fail_randomly(&mut self, ops: &[Op], probability: f64, seed: u64) {
        let _ = (ops, probability, seed);
        todo!()
    }
    /// Removes all planned faults.
    pub fn clear_faults(&mut self) {
        todo!()
    }
    /// Marks one event complete.
    pub fn complete_event(&mut self, event: EventId) -> Result<(), DriverError> {
        let _ = event;
        todo!()
    }
    /// Marks every event recorded on `stream` complete.
    pub fn complete_stream(&mut self, stream: StreamId) {
        let _ = stream;
        todo!()
    }
    /// Writes `data` at device address `va` (backing store on).
    pub fn write(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        let _ = (va, data);
        todo!()
    }
    /// Reads `len` bytes at device address `va` (backing store on).
    pub fn read(&self, va: u64, len: usize) -> Result<Vec<u8>, DriverError> {
        let _ = (va, len);
        todo!()
    }
    /// What the device still holds.
    pub fn leak_report(&self) -> LeakReport {
        todo!()
    }
}

impl Driver for SimDriver {
    fn granularity(&self) -> u64 {
        self.config.granularity
    }
    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        let _ = size;
        todo!()
    }
    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        let _ = range;
        todo!()
    }
    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        let _ = size;
        todo!()
    }
    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        let _ = handle;
        todo!()
    }
    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        let _ = (va, size, handle);
        todo!()
    }
    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        let _ = (va, size);
        todo!()
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        let _ = (va, size);
        todo!()
    }
    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        todo!()
    }
    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        let _ = size;
        todo!()
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        let _ = ptr;
        todo!()
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        let _ = stream;
        todo!()
    }
    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        let _ = event;
        todo!()
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        let _ = event;
        todo!()
    }
    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        let _ = stream;
        todo!()
    }
    fn counters(&self) -> DriverCounters {
        todo!()
    }
}
