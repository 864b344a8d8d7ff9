//! One allocator per device, built on first use, and the settings that choose the backend.
//!
//! The process has one [`Registry`], built from the environment the first time any exported function runs
//! ([`global`]), or installed before that by [`install`] (the Rust tests do). Each device's allocator is
//! built the first time that device is named, from [`Settings::config`]; a failure to build it is kept and
//! returned to every later call, since neither a bad configuration nor a missing driver fixes itself.

use crate::error::{AbiError, InitError};
use cuvmm::driver::device::{Device, DeviceSpec};
use cuvmm::driver::sim::SimConfig;
use cuvmm::expandable::Expandable;
use cuvmm::size::{GIB, parse_size};
use cuvmm::{Allocator, Config};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};

/// The allocator each device gets.
pub type TorchAllocator = Allocator<Expandable<Device>>;

/// Chooses the backend: `sim` or `cuda` (the default).
pub const BACKEND_VAR: &str = "CUVMM_BACKEND";
/// Memory of each simulated device, a size such as `80GiB` (the default).
pub const SIM_CAPACITY_VAR: &str = "CUVMM_SIM_CAPACITY";
/// Number of simulated devices (default 1).
pub const SIM_DEVICES_VAR: &str = "CUVMM_SIM_DEVICES";
/// A tracing filter (`warn`, `cuvmm=debug`, ...): when set, cuvmm logs to stderr.
pub const LOG_VAR: &str = "CUVMM_LOG";

/// Devices a process may name on the CUDA backend (PyTorch's own limit is lower).
pub const MAX_CUDA_DEVICES: usize = 64;
/// The most simulated devices [`SIM_DEVICES_VAR`] may ask for.
pub const MAX_SIM_DEVICES: usize = 64;

/// Where allocations come from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// Simulated devices: no GPU needed, addresses are never dereferenced, a stream is an identity.
    Sim {
        /// Memory of each device, in bytes.
        capacity: u64,
        /// Number of devices.
        devices: usize,
    },
    /// The CUDA devices of this machine, through the driver API; a stream is the caller's `CUstream`.
    Cuda,
}

/// What the library runs with.
#[derive(Clone, Debug, PartialEq)]
pub struct Settings {
    /// The backend.
    pub backend: Backend,
    /// Every device's allocator configuration.
    pub config: Config,
}

impl Settings {
    /// Simulated devices with the default configuration.
    pub fn sim(capacity: u64, devices: usize) -> Self {
        Self {
            backend: Backend::Sim { capacity, devices },
            config: Config::default(),
        }
    }

    /// Reads `CUVMM_BACKEND`, `CUVMM_SIM_CAPACITY`, `CUVMM_SIM_DEVICES` and `CUVMM_ALLOC_CONF`.
    ///
    /// # Errors
    /// [`InitError::BadEnv`] for a variable with a value it does not accept, [`InitError::Config`] for a
    /// `CUVMM_ALLOC_CONF` that does not parse.
    pub fn from_env() -> Result<Self, InitError> {
        let var = |name| std::env::var(name).ok();
        let backend = match var(BACKEND_VAR).as_deref() {
            None | Some("cuda") => Backend::Cuda,
            Some("sim") => Backend::Sim {
                capacity: sim_capacity(var(SIM_CAPACITY_VAR))?,
                devices: sim_devices(var(SIM_DEVICES_VAR))?,
            },
            Some(other) => {
                return Err(InitError::BadEnv {
                    var: BACKEND_VAR,
                    value: other.to_string(),
                    expected: "sim or cuda",
                });
            }
        };
        Ok(Self {
            backend,
            config: Config::from_env()?,
        })
    }

    /// Number of devices that may be named.
    pub fn device_count(&self) -> usize {
        match self.backend {
            Backend::Sim { devices, .. } => devices,
            Backend::Cuda => MAX_CUDA_DEVICES,
        }
    }
}

fn sim_capacity(value: Option<String>) -> Result<u64, InitError> {
    let Some(text) = value else {
        return Ok(80 * GIB);
    };
    match parse_size(&text) {
        Ok(bytes) if bytes > 0 => Ok(bytes),
        _ => Err(InitError::BadEnv {
            var: SIM_CAPACITY_VAR,
            value: text,
            expected: "a size above 0, such as 80GiB",
        }),
    }
}

fn sim_devices(value: Option<String>) -> Result<usize, InitError> {
    let Some(text) = value else {
        return Ok(1);
    };
    match text.trim().parse::<usize>() {
        Ok(n) if (1..=MAX_SIM_DEVICES).contains(&n) => Ok(n),
        _ => Err(InitError::BadEnv {
            var: SIM_DEVICES_VAR,
            value: text,
            expected: "a number of devices from 1 to 64",
        }),
    }
}

/// The allocators of one process, one per device.
#[derive(Debug)]
pub struct Registry {
    /// This registry's number in the process (the exports of shared memory say whose they are).
    id: u64,
    settings: Settings,
    slots: Box<[Slot]>,
    /// Bytes of each device that a request's growth leaves free (`set_device_margin`), for the devices
    /// built from now on too; `None`: the configuration's.
    margin: Mutex<Option<u64>>,
}

/// A device's allocator, once its first naming has built it (or failed to).
type Slot = OnceLock<Result<TorchAllocator, InitError>>;

impl Registry {
    /// A registry whose allocators are built from `settings` as devices are first named.
    pub fn new(settings: Settings) -> Self {
        let slots = (0..settings.device_count())
            .map(|_| OnceLock::new())
            .collect();
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let id = NEXT.fetch_add(1, Ordering::Relaxed);
        Self {
            id,
            settings,
            slots,
            margin: Mutex::new(None),
        }
    }

    /// Sets the bytes of every device that a request's growth leaves free, counting other processes' use
    /// ([`Allocator::set_device_margin`]), on the devices built so far and those built later, as
    /// torch_memory_saver's process-wide `memory_margin_bytes`.
    pub fn set_device_margin(&self, bytes: u64) {
        // Held while the built allocators are set, and by the first naming of a device once it is built
        // (`allocator`), so that a device built meanwhile gets the new margin either way.
        let mut margin = self.margin.lock().unwrap_or_else(PoisonError::into_inner);
        *margin = Some(bytes);
        for (_, allocator) in self.built() {
            allocator.set_device_margin(bytes);
        }
    }

    /// The number of devices: device numbers are `0..device_count()`.
    pub fn device_count(&self) -> usize {
        self.slots.len()
    }

    /// This registry's number among the process's registries.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// The settings.
    pub fn settings(&self) -> &Settings {
        &self.settings
    }

    /// The allocator of `device`, built now if this is the first time it is named.
    ///
    /// # Errors
    /// [`AbiError::DeviceOutOfRange`] for a negative device or one past the last; [`AbiError::Init`] if the
    /// allocator could not be built (now or at the first try).
    pub fn allocator(&self, device: i32) -> Result<&TorchAllocator, AbiError> {
        let (ordinal, slot) = self.slot(device)?;
        let mut fresh = false;
        let built = slot.get_or_init(|| {
            fresh = true;
            self.build(ordinal)
        });
        let allocator = built.as_ref().map_err(|e| AbiError::Init(e.clone()))?;
        if fresh {
            // After it is in its slot: a margin set before this reads it here, one set after finds the
            // allocator among those built.
            let margin = self.margin.lock().unwrap_or_else(PoisonError::into_inner);
            if let Some(bytes) = *margin {
                allocator.set_device_margin(bytes);
            }
        }
        Ok(allocator)
    }

    /// The allocator of `device` if it has been built; `None` if the device was never named, and then
    /// nothing is built. For what reads or resets statistics: PyTorch's are zeros on a device its allocator
    /// never served, and asking must not open the device (on CUDA that makes a context there, hundreds of
    /// MiB on a GPU the program never uses).
    ///
    /// # Errors
    /// As [`allocator`](Self::allocator), for a device out of range or one whose allocator failed to build.
    pub fn existing(&self, device: i32) -> Result<Option<&TorchAllocator>, AbiError> {
        let (_, slot) = self.slot(device)?;
        (slot.get())
            .map(|built| built.as_ref().map_err(|e| AbiError::Init(e.clone())))
            .transpose()
    }

    fn slot(&self, device: i32) -> Result<(usize, &Slot), AbiError> {
        usize::try_from(device)
            .ok()
            .and_then(|ordinal| Some((ordinal, self.slots.get(ordinal)?)))
            .ok_or(AbiError::DeviceOutOfRange {
                device,
                count: self.slots.len(),
            })
    }

    /// The allocators built so far with their devices, in device order (those that failed to build are left
    /// out).
    pub fn built(&self) -> impl Iterator<Item = (i32, &TorchAllocator)> {
        (self.slots.iter().enumerate()).filter_map(|(device, slot)| {
            let built = slot.get()?.as_ref().ok()?;
            Some((device as i32, built))
        })
    }

    fn build(&self, ordinal: usize) -> Result<TorchAllocator, InitError> {
        let device = match self.settings.backend {
            Backend::Sim { capacity, .. } => {
                // The byte store on, so that a sleep keeps bytes (kept as ranges: costs nothing unwritten).
                let sim = SimConfig::default().with_capacity(capacity);
                DeviceSpec::Sim.open(sim.with_backing_store(true))?
            }
            Backend::Cuda => DeviceSpec::Cuda { ordinal }.open(SimConfig::default())?,
        };
        let mut config = self.settings.config.clone();
        // PyTorch's statistics and reserved memory are matched to the byte only while a program that never
        // contends sees exactly the strategy: the stream caches wait for contention unless told otherwise.
        config.stream_cache_eager.get_or_insert(false);
        let allocator =
            Allocator::expandable(device, config).map_err(|e| InitError::Allocator(Arc::new(e)))?;
        tracing::info!(ordinal, backend = ?self.settings.backend, "cuvmm-torch: allocator ready");
        Ok(allocator)
    }
}

static GLOBAL: OnceLock<Result<Registry, InitError>> = OnceLock::new();

/// The process's registry, built from the environment ([`Settings::from_env`]) on first use.
///
/// # Errors
/// [`AbiError::Init`] if the environment holds a bad value (kept for every later call).
pub fn global() -> Result<&'static Registry, AbiError> {
    GLOBAL
        .get_or_init(|| {
            init_logging();
            Settings::from_env().map(Registry::new)
        })
        .as_ref()
        .map_err(|e| AbiError::Init(e.clone()))
}

/// Installs the process's registry with `settings` instead of reading the environment. Returns whether it
/// was installed: false if the registry already exists (with the settings it was first given).
pub fn install(settings: Settings) -> bool {
    let mut installed = false;
    GLOBAL.get_or_init(|| {
        installed = true;
        Ok(Registry::new(settings))
    });
    installed
}

/// Logs to stderr with the filter in `CUVMM_LOG`, unless the host already installed a tracing subscriber.
fn init_logging() {
    let Ok(filter) = std::env::var(LOG_VAR) else {
        return;
    };
    let filter = tracing_subscriber::EnvFilter::try_new(&filter)
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    // Err only if a subscriber is already set: the host's wins.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn simulated_capacity_and_device_count_parse_or_name_the_variable() {
        assert_eq!(sim_capacity(None).unwrap(), 80 * GIB);
        assert_eq!(sim_capacity(Some("2GiB".into())).unwrap(), 2 * GIB);
        for bad in ["", "0", "-1GiB", "lots"] {
            let err = sim_capacity(Some(bad.into())).unwrap_err();
            assert!(err.to_string().contains(SIM_CAPACITY_VAR), "{err}");
        }
        assert_eq!(sim_devices(None).unwrap(), 1);
        assert_eq!(sim_devices(Some("4".into())).unwrap(), 4);
        for bad in ["0", "65", "-1", "two"] {
            let err = sim_devices(Some(bad.into())).unwrap_err();
            assert!(err.to_string().contains(SIM_DEVICES_VAR), "{err}");
        }
    }

    #[test]
    fn each_device_gets_its_own_allocator_and_out_of_range_is_refused() {
        let registry = Registry::new(Settings::sim(GIB, 2));
        let a = registry
            .allocator(0)
            .unwrap()
            .alloc_raw(4096, cuvmm::StreamId(0))
            .unwrap();
        assert_eq!(registry.allocator(0).unwrap().stats().allocation.current, 1);
        assert_eq!(registry.allocator(1).unwrap().stats().allocation.current, 0);
        registry.allocator(0).unwrap().free_raw(a).unwrap();
        for device in [-1, 2, i32::MIN] {
            let err = registry.allocator(device).unwrap_err();
            assert!(
                matches!(err, AbiError::DeviceOutOfRange { count: 2, .. }),
                "{err:?}"
            );
            assert!(registry.existing(device).is_err());
        }
    }

    #[test]
    fn asking_for_an_existing_allocator_builds_none() {
        let registry = Registry::new(Settings::sim(GIB, 2));
        assert!(registry.existing(1).unwrap().is_none());
        assert_eq!(registry.built().count(), 0, "nothing built by asking");
        registry.allocator(1).unwrap();
        assert!(registry.existing(1).unwrap().is_some());
        assert!(registry.existing(0).unwrap().is_none());
    }
}
