//! Which device to run on: the simulated one or a CUDA device (`cuvmm --backend sim|cuda[:N]`).
//!
//! [`DeviceSpec`] is what the user asked for; [`DeviceSpec::open`] turns it into a [`Device`], one type that
//! is either backend and implements [`Driver`] by forwarding, so the strategies, the replay engine and
//! `driver-bench` are built once for both. Without the `cuda` feature, asking for `cuda` is
//! [`DeviceError::NoCudaSupport`]; with it, a machine without libcuda or without a device gives
//! [`DriverError::NoDriver`], never a panic.

use super::Forward;
use super::sim::{SimConfig, SimDriver};
use super::{Driver, DriverError};
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
    /// CUDA device on the caller's streams: a [`StreamId`](super::StreamId) is the program's own `CUstream`, on which events
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

    /// The simulated device, if this is one, to change (tests write its memory through it).
    pub fn as_sim_mut(&mut self) -> Option<&mut SimDriver> {
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

/// Every call goes to whichever driver the device holds.
impl Forward for Device {
    type Inner = dyn Driver;
    fn inner(&self) -> &Self::Inner {
        match self {
            Device::Sim(sim) => sim,
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => cuda,
        }
    }
    fn inner_mut(&mut self) -> &mut Self::Inner {
        match self {
            Device::Sim(sim) => sim,
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => cuda,
        }
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
