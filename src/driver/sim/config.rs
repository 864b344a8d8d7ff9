//! How a simulated device is built.

use super::LatencyModel;
use crate::base::size::{GIB, MIB};

/// How a simulated device is built.
#[derive(Debug, Clone, PartialEq)]
pub struct SimConfig {
    /// Physical memory in bytes, shared by `create` and `malloc`.
    pub capacity: u64,
    /// Allocation granularity in bytes. A granularity of 0 is taken as 1 by
    /// [`SimDriver::new`](super::SimDriver::new).
    pub granularity: u64,
    /// Latency model for estimated driver time.
    pub latency: LatencyModel,
    /// Whether bytes written through mapped addresses are stored (for integrity tests). Without it,
    /// [`SimDriver::write`](super::SimDriver::write) and [`SimDriver::read`](super::SimDriver::read) fail
    /// with [`DriverError::NoBackingStore`](crate::driver::DriverError::NoBackingStore).
    pub backing_store: bool,
    /// Whether each call sleeps the calling thread for its modelled latency, so that measurements of
    /// waiting (`cuvmm bench-threads`) see driver calls take time. Off by default and in replays.
    pub sleep_latency: bool,
    /// Whether [`Driver::map_from`](crate::driver::Driver::map_from) may map part of a handle (a nonzero
    /// offset, or fewer bytes than the handle has). Off by default, as on CUDA: its documentation says the
    /// offset "must be zero", and on an H100 (driver 580) `cuMemMap` with an offset fails with
    /// `CUDA_ERROR_NOT_SUPPORTED` (docs/gpu-results.md). On, the simulator models what CUDA 12's
    /// documentation once suggested, for lending chunk pages (`lend_chunk_pages`) on a driver that allows it.
    pub partial_mappings: bool,
    /// Devices in the simulated machine (this one is device 0): [`Driver::add_peer`](crate::driver::Driver::add_peer)
    /// accepts peers `1 .. devices`. From 1 to [`SimConfig::MAX_DEVICES`]; 8 by default, as on a DGX.
    pub devices: usize,
    /// Whether handles can be exported as file descriptors and imported
    /// ([`Driver::export_handle`](crate::driver::Driver::export_handle),
    /// [`Driver::import_handle`](crate::driver::Driver::import_handle)). On by default, as on a GPU whose
    /// driver supports POSIX file descriptor handles; off models one that does not (or a container that
    /// refuses them): both calls fail with [`DriverError::Unsupported`](crate::driver::DriverError::Unsupported).
    pub exportable_handles: bool,
}

impl Default for SimConfig {
    /// An 80 GiB device with 2 MiB granularity, A100 latencies, and no backing store.
    fn default() -> Self {
        Self {
            capacity: 80 * GIB,
            granularity: 2 * MIB,
            latency: LatencyModel::a100(),
            backing_store: false,
            sleep_latency: false,
            partial_mappings: false,
            devices: 8,
            exportable_handles: true,
        }
    }
}

impl SimConfig {
    /// The most devices a simulated machine has (peers are kept as a 32-bit set).
    pub const MAX_DEVICES: usize = 32;

    /// Sets the number of devices in the simulated machine (see [`SimConfig::devices`]).
    pub fn with_devices(mut self, devices: usize) -> Self {
        self.devices = devices;
        self
    }
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
    /// Makes every call sleep its modelled latency, or not.
    pub fn with_sleep_latency(mut self, on: bool) -> Self {
        self.sleep_latency = on;
        self
    }
    /// Turns the byte backing store on or off.
    pub fn with_backing_store(mut self, on: bool) -> Self {
        self.backing_store = on;
        self
    }
    /// Lets `map_from` map part of a handle, or not (see [`SimConfig::partial_mappings`]).
    pub fn with_partial_mappings(mut self, on: bool) -> Self {
        self.partial_mappings = on;
        self
    }
    /// Lets handles be exported and imported, or not (see [`SimConfig::exportable_handles`]).
    pub fn with_exportable_handles(mut self, on: bool) -> Self {
        self.exportable_handles = on;
        self
    }
    /// Sets the latency model.
    pub fn with_latency(mut self, latency: LatencyModel) -> Self {
        self.latency = latency;
        self
    }
}
