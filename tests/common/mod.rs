//! Helpers shared by the integration tests.
#![allow(dead_code)]

pub mod memory;
pub mod sim_device;
pub mod source;

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, StreamId};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::GraphPools;
use cuvmm::{Config, GraphPool, StreamFilter};

/// An expandable allocator on a simulated device of `pages` pages of `granularity` bytes. Requests above
/// `small_size` go to the large pool.
pub fn expandable(
    granularity: u64,
    pages: u64,
    small_size: u64,
    backing_store: bool,
) -> Expandable<SimDriver> {
    let config = Config {
        small_size,
        ..Config::default()
    };
    expandable_with(granularity, pages, config, backing_store)
}

/// An expandable allocator configured by `config` on a simulated device of `pages` pages of `granularity`
/// bytes.
pub fn expandable_with(
    granularity: u64,
    pages: u64,
    config: Config,
    backing_store: bool,
) -> Expandable<SimDriver> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(granularity * pages)
            .with_granularity(granularity)
            .with_backing_store(backing_store),
    );
    Expandable::new(sim, config).expect("valid configuration")
}

/// A byte pattern that differs between allocations and along each allocation.
pub fn pattern(id: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (id.wrapping_mul(131).wrapping_add(i as u64 * 7) % 251) as u8)
        .collect()
}

/// Writes [`pattern`]`(id, size)` at `addr` of the allocator's simulated device.
pub fn write_pattern(a: &mut Expandable<SimDriver>, addr: u64, id: u64, size: u64) {
    let bytes = pattern(id, size as usize);
    a.driver_mut().write(addr, &bytes).expect("writable");
}

/// Whether `addr` of the allocator's simulated device holds [`pattern`]`(id, size)`.
pub fn holds_pattern(a: &Expandable<SimDriver>, addr: u64, id: u64, size: u64) -> bool {
    a.driver().read(addr, size as usize).expect("readable") == pattern(id, size as usize)
}

/// Begins a capture of `stream` and the pool it allocates to, as PyTorch's `CUDAGraph.capture_begin` does;
/// returns the capture's id.
pub fn begin_capture(
    a: &mut Expandable<SimDriver>,
    stream: StreamId,
    pool: GraphPool,
    mode: CaptureMode,
) -> u64 {
    let id = a
        .driver_mut()
        .begin_capture(stream, mode)
        .expect("begin capture");
    a.begin_allocate_to_pool(pool, StreamFilter::Capture(id))
        .expect("begin pool");
    id
}

/// Ends the capture of `stream` (it must not have been invalidated) and stops allocating to `pool`.
pub fn end_capture(a: &mut Expandable<SimDriver>, stream: StreamId, pool: GraphPool) {
    a.driver_mut()
        .end_capture(stream)
        .expect("the capture was invalidated");
    a.end_allocate_to_pool(pool).expect("end pool");
}
