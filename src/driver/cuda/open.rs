//! Opening a CUDA device: loading libcuda, checking the device (its virtual-memory support, its
//! granularities, whether its handles can be exported) and the peers that may reach its memory.
//!
//! # Environment
//! - `CUVMM_IPC_HANDLES=0` (or `false`, `off`, `no`): create handles that cannot be exported as file
//!   descriptors even where the device supports it ([`IPC_HANDLES_VAR`]), for a container whose driver
//!   misbehaves with them. Any other value, or none, leaves them on where the device supports them.

use super::errors;
use super::result::{self, Granularity};
use crate::driver::DriverError;
use cudarc::driver::CudaContext;
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys::{CUdevice, CUdevice_attribute};
use std::sync::Arc;

/// The environment variable that turns exportable handles off (see the module documentation).
pub(super) const IPC_HANDLES_VAR: &str = "CUVMM_IPC_HANDLES";

/// What opening a device found: its primary context and what the driver keeps of it.
pub(super) struct OpenDevice {
    /// The device's primary context, current on the calling thread.
    pub ctx: Arc<CudaContext>,
    /// The device's name (`cuDeviceGetName`).
    pub name: String,
    /// The minimum allocation granularity.
    pub granularity: u64,
    /// The recommended allocation granularity.
    pub recommended_granularity: u64,
    /// The peers that may reach the device's memory, the device itself and repeats left out.
    pub peers: Vec<usize>,
    /// The devices every `set_access` grants: the device itself, then the peers.
    pub access: Vec<CUdevice>,
    /// Whether to create handles that can be exported as POSIX file descriptors: the device supports
    /// them and [`IPC_HANDLES_VAR`] does not turn them off.
    pub exportable: bool,
}

/// Opens device `ordinal` with `peers` (ordinals); leaves its context current.
pub(super) fn open_device(ordinal: usize, peers: &[usize]) -> Result<OpenDevice, DriverError> {
    let count =
        cudarc::driver::result::device::get_count().map_err(|e| setup("cuDeviceGetCount", &e))?;
    let count = usize::try_from(count).unwrap_or(0);
    for &wanted in std::iter::once(&ordinal).chain(peers) {
        if wanted >= count {
            return Err(DriverError::NoDriver {
                reason: format!("there is no CUDA device {wanted}: {count} device(s) found"),
            });
        }
    }
    let ctx = CudaContext::new(ordinal).map_err(|e| setup("cuDevicePrimaryCtxRetain", &e))?;
    let name = ctx.name().map_err(|e| setup("cuDeviceGetName", &e))?;
    // Attribute 102: CUDA calls it VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; cudarc keeps its older alias.
    let vmm = ctx
        .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
        .map_err(|e| setup("cuDeviceGetAttribute", &e))?;
    if vmm == 0 {
        return Err(DriverError::NoDriver {
            reason: format!(
                "CUDA device {ordinal} ({name}) does not support the virtual memory management API"
            ),
        });
    }
    let exportable = ipc_handles_wanted(std::env::var(IPC_HANDLES_VAR).ok().as_deref())
        && ctx
            .attribute(
                CUdevice_attribute::CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED,
            )
            .map_err(|e| setup("cuDeviceGetAttribute", &e))?
            != 0;
    let device = ctx.cu_device();
    let minimum = result::granularity(device, Granularity::Minimum)
        .map_err(|e| setup("cuMemGetAllocationGranularity", &e))?;
    let recommended = result::granularity(device, Granularity::Recommended)
        .map_err(|e| setup("cuMemGetAllocationGranularity", &e))?;
    let mut access = vec![device];
    let mut peer_list = Vec::new();
    for &peer in peers.iter().filter(|&&p| p != ordinal) {
        let peer_device = peer_device(ordinal, device, peer)?;
        if !access.contains(&peer_device) {
            access.push(peer_device);
            peer_list.push(peer);
        }
    }
    Ok(OpenDevice {
        ctx,
        name,
        granularity: minimum as u64,
        recommended_granularity: recommended as u64,
        peers: peer_list,
        access,
        exportable,
    })
}

/// Whether [`IPC_HANDLES_VAR`], of value `value` (`None`: not set), leaves exportable handles on.
pub(super) fn ipc_handles_wanted(value: Option<&str>) -> bool {
    let off = ["0", "false", "off", "no"];
    !value.is_some_and(|v| off.iter().any(|o| v.trim().eq_ignore_ascii_case(o)))
}

/// Opens libcuda and checks that it exports every entry point cuvmm uses, then initialises the driver.
/// Until this succeeds no `sys` call may be made: cudarc panics on a library or symbol it cannot load.
pub(super) fn load_driver() -> Result<(), DriverError> {
    if !result::culib_present() {
        return Err(DriverError::NoDriver {
            reason:
                "libcuda could not be loaded (is the NVIDIA driver installed, and libcuda.so.1 on \
                     the library path?)"
                    .to_string(),
        });
    }
    let missing = result::missing_symbols();
    if !missing.is_empty() {
        return Err(DriverError::NoDriver {
            reason: format!(
                "libcuda is too old: it lacks {} (a driver for CUDA 12.2 or later is needed)",
                missing.join(", ")
            ),
        });
    }
    cudarc::driver::result::init().map_err(|e| {
        let (code, name) = errors::code_and_name(&e);
        let what = if errors::is_no_device(&e) {
            "no CUDA-capable device is present"
        } else {
            "the driver could not be initialised"
        };
        DriverError::NoDriver {
            reason: format!("cuInit failed: {what} (CUDA error {code}, {name})"),
        }
    })
}

/// Device `peer` (an ordinal below the device count), checked to reach the memory of `device`, device
/// `ordinal`: [`DriverError::PeerAccess`] if it cannot.
pub(super) fn peer_device(
    ordinal: usize,
    device: CUdevice,
    peer: usize,
) -> Result<CUdevice, DriverError> {
    let peer_i32 = i32::try_from(peer).map_err(|_| DriverError::PeerAccess {
        device: ordinal,
        peer,
    })?;
    let peer_device =
        cudarc::driver::result::device::get(peer_i32).map_err(|e| setup("cuDeviceGet", &e))?;
    let can = result::can_access_peer(peer_device, device)
        .map_err(|e| setup("cuDeviceCanAccessPeer", &e))?;
    if !can {
        return Err(DriverError::PeerAccess {
            device: ordinal,
            peer,
        });
    }
    Ok(peer_device)
}

/// A failed setup call.
pub(super) fn setup(call: &'static str, err: &CuError) -> DriverError {
    let (code, name) = errors::code_and_name(err);
    DriverError::CudaSetup { call, code, name }
}
