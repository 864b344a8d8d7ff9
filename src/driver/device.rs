//! Which device to run on: the simulated one or a CUDA device (`cuvmm --backend sim|cuda[:N]`).
//!
//! [`DeviceSpec`] is what the user asked for; [`DeviceSpec::open`] turns it into a [`Device`], one type that
//! is either backend and implements [`Driver`] by forwarding, so the strategies, the replay engine and
//! `driver-bench` are built once for both. Without the `cuda` feature, asking for `cuda` is
//! [`DeviceError::NoCudaSupport`]; with it, a machine without libcuda or without a device gives
//! [`DriverError::NoDriver`], never a panic.

use super::sim::{SimConfig, SimDriver};
use super::{
    CaptureStatus, Driver, DriverCounters, DriverError, EventId, MemInfo, PhysHandle, PhysPage,
    StreamId, VaRange,
};
use std::fmt;

/// A device named on the command line.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DeviceSpec {
    /// The simulated device ([`SimDriver`]), the default.
    #[default]
    Sim,
    /// CUDA device number `ordinal` (`cuda` alone is device 0).
    Cuda {
        /// The device's ordinal, as `cuDeviceGet` numbers them.
        ordinal: usize,
    },
}

/// Why a device could not be opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DeviceError {
    /// A CUDA device was asked for, but this build has no CUDA backend.
    #[error(
        "no CUDA driver found: cuvmm was built without CUDA support; rebuild with --features cuda"
    )]
    NoCudaSupport,
    /// The CUDA driver could not be used: no libcuda, no such device ([`DriverError::NoDriver`]), or a
    /// failed setup call.
    #[error(transparent)]
    Driver(#[from] DriverError),
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DeviceSpec::Sim => f.write_str("sim"),
            DeviceSpec::Cuda { ordinal } => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl DeviceSpec {
    /// Whether this build can open the device at all (`cuda` needs the `cuda` feature).
    pub fn check_supported(&self) -> Result<(), DeviceError> {
        match self {
            DeviceSpec::Sim => Ok(()),
            DeviceSpec::Cuda { .. } if cfg!(feature = "cuda") => Ok(()),
            DeviceSpec::Cuda { .. } => Err(DeviceError::NoCudaSupport),
        }
    }

    /// Opens the device for a program: a fresh [`SimDriver`] built from `sim` (ignored for CUDA), or the
    /// CUDA device on the caller's streams: a [`StreamId`] is the program's own `CUstream`, on which events
    /// are recorded and which is synchronized, so memory is reused only once the program's work on it is
    /// done.
    pub fn open(&self, sim: SimConfig) -> Result<Device, DeviceError> {
        self.open_with(sim, Streams::Caller)
    }

    /// Opens the device to replay a recorded trace: on CUDA each stream number names a stream the driver
    /// creates ([`CudaDriver::with_stand_in_streams`](super::cuda::CudaDriver::with_stand_in_streams)),
    /// since a trace's stream numbers are names from another process. Only the laboratory's replays use it;
    /// a program that did would have every wait for its work wait on an empty stream instead
    /// (`tests/layering.rs` checks that no program-facing code calls it).
    pub fn open_for_replay(&self, sim: SimConfig) -> Result<Device, DeviceError> {
        self.open_with(sim, Streams::StandIn)
    }

    fn open_with(&self, sim: SimConfig, streams: Streams) -> Result<Device, DeviceError> {
        match *self {
            DeviceSpec::Sim => Ok(Device::Sim(SimDriver::new(sim))),
            DeviceSpec::Cuda { ordinal } => open_cuda(ordinal, streams),
        }
    }
}

/// Whose streams a CUDA device's [`StreamId`]s name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Streams {
    /// The program's own `CUstream`s.
    Caller,
    /// Streams the driver creates, one per stream number of a replayed trace.
    StandIn,
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize, streams: Streams) -> Result<Device, DeviceError> {
    let driver = super::cuda::CudaDriver::new(ordinal)?;
    Ok(Device::Cuda(match streams {
        Streams::Caller => driver,
        Streams::StandIn => driver.with_stand_in_streams(),
    }))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(_ordinal: usize, _streams: Streams) -> Result<Device, DeviceError> {
    Err(DeviceError::NoCudaSupport)
}

/// An open device of either kind. Implements [`Driver`] by forwarding every call.
// One `Device` exists per allocator and is never moved on a hot path, so the simulator's size is no cost.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Device {
    /// The simulated device.
    Sim(SimDriver),
    /// A real CUDA device.
    #[cfg(feature = "cuda")]
    Cuda(super::cuda::CudaDriver),
}

impl Device {
    /// The simulated device, if this is one (tests reach its controls through it).
    pub fn as_sim(&self) -> Option<&SimDriver> {
        match self {
            Device::Sim(sim) => Some(sim),
            #[cfg(feature = "cuda")]
            Device::Cuda(_) => None,
        }
    }

    /// Whether driver time is measured (a real device) rather than estimated from a latency model.
    pub fn is_measured(&self) -> bool {
        !matches!(self, Device::Sim(_))
    }
}

/// Forwards one call to whichever driver `self` holds.
macro_rules! forward {
    ($self:ident, $d:ident => $call:expr) => {
        match $self {
            Device::Sim($d) => $call,
            #[cfg(feature = "cuda")]
            Device::Cuda($d) => $call,
        }
    };
}

impl Driver for Device {
    fn granularity(&self) -> u64 {
        forward!(self, d => d.granularity())
    }
    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        forward!(self, d => d.reserve(size))
    }
    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        forward!(self, d => d.free_reservation(range))
    }
    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        forward!(self, d => d.create(size))
    }
    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        forward!(self, d => d.release(handle))
    }
    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        forward!(self, d => d.map(va, size, handle))
    }
    fn map_from(
        &mut self,
        va: u64,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> Result<(), DriverError> {
        forward!(self, d => d.map_from(va, size, handle, offset))
    }
    fn create_each(
        &mut self,
        size: u64,
        count: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        forward!(self, d => d.create_each(size, count, out))
    }
    fn map_each(
        &mut self,
        va: u64,
        size: u64,
        pages: &[PhysPage],
    ) -> Result<(), (usize, DriverError)> {
        forward!(self, d => d.map_each(va, size, pages))
    }
    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        forward!(self, d => d.set_access(va, size))
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        forward!(self, d => d.unmap(va, size))
    }
    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        forward!(self, d => d.mem_info())
    }
    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        forward!(self, d => d.malloc(size))
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        forward!(self, d => d.free(ptr))
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        forward!(self, d => d.record_event(stream))
    }
    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        forward!(self, d => d.event_complete(event))
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        forward!(self, d => d.destroy_event(event))
    }
    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        forward!(self, d => d.synchronize(stream))
    }
    fn counters(&self) -> DriverCounters {
        forward!(self, d => d.counters())
    }
    fn ordinal(&self) -> usize {
        forward!(self, d => d.ordinal())
    }
    fn maps_parts_of_handles(&self) -> bool {
        forward!(self, d => d.maps_parts_of_handles())
    }
    fn capture_status(&mut self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
        forward!(self, d => d.capture_status(stream))
    }
    fn add_peer(&mut self, peer: usize) -> Result<(), DriverError> {
        forward!(self, d => d.add_peer(peer))
    }
    fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
        forward!(self, d => d.memset_d8(va, size, value))
    }
    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        forward!(self, d => d.copy_to_host(va, out))
    }
    fn copy_from_host(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        forward!(self, d => d.copy_from_host(va, data))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sim_always_opens_and_cuda_needs_the_feature() {
        let device = DeviceSpec::Sim.open(SimConfig::default()).unwrap();
        assert!(device.as_sim().is_some());
        assert!(!device.is_measured());
        let cuda = DeviceSpec::Cuda { ordinal: 0 };
        if cfg!(feature = "cuda") {
            assert_eq!(cuda.check_supported(), Ok(()));
        } else {
            assert_eq!(cuda.check_supported(), Err(DeviceError::NoCudaSupport));
            assert!(matches!(
                cuda.open(SimConfig::default()),
                Err(DeviceError::NoCudaSupport)
            ));
        }
    }
}
