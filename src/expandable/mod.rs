//! The expandable-segment allocator. CONTRACT STUB — public API fixed, bodies in progress.

use crate::config::Config;
use crate::driver::{Driver, DriverCounters, StreamId};
use crate::error::{Error, InvariantViolation};
use crate::stats::Stats;
use crate::strategy::Strategy;

/// cuvmm's allocator: per-(stream, pool) virtual segments whose pages are mapped on demand.
#[derive(Debug)]
pub struct Expandable<D: Driver> {
    driver: D,
    config: Config,
}

impl<D: Driver> Expandable<D> {
    /// An allocator on `driver` configured by `config`. Fails if the configuration does not fit the driver
    /// (a page size that is not a multiple of its granularity, say).
    pub fn new(driver: D, config: Config) -> Result<Self, Error> {
        Ok(Self { driver, config })
    }

    /// The driver.
    pub fn driver(&self) -> &D {
        &self.driver
    }

    /// The driver, mutably (tests use it to inject faults and write bytes).
    pub fn driver_mut(&mut self) -> &mut D {
        &mut self.driver
    }

    /// The configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }
}

impl<D: Driver> Strategy for Expandable<D> {
    fn name(&self) -> &'static str {
        "cuvmm"
    }
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        let _ = (size, stream);
        todo!()
    }
    fn free(&mut self, addr: u64) -> Result<(), Error> {
        let _ = addr;
        todo!()
    }
    fn empty_cache(&mut self) -> Result<(), Error> {
        todo!()
    }
    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        let _ = bytes;
        todo!()
    }
    fn stats(&self) -> Stats {
        todo!()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        todo!()
    }
    fn driver_counters(&self) -> DriverCounters {
        self.driver.counters()
    }
}
