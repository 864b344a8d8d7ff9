//! How one replay at a capacity C is run: the only thing the backend changes in a capacity search.
//!
//! - [`SimSized`] (`--backend sim`): a fresh simulated device of exactly C bytes.
//! - [`CudaBallast`] (`--backend cuda[:N]`): the CUDA device as it is, with a [ballast](super::ballast)
//!   leaving C bytes free; every allocator, `cuda-async` included, faces that limit.
//! - [`SimBallast`]: the ballast method on a simulated device larger than C, what `--backend cuda` does,
//!   so that it can be checked against [`SimSized`] without a GPU.

use super::ballast::with_ballast;
use super::{CapacityError, CapacityOptions, config};
use crate::replay::allocators::{self, BuildError};
use crate::replay::observe::ReplayObserver;
use crate::replay::{ReplayError, ReplayOptions, ReplayResult, replay_observed};
use crate::trace::event::Trace;
use cuvmm::driver::Driver;
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::strategy::Strategy;
use cuvmm::strategy::config::Config;

/// One replay at one capacity.
#[derive(Clone, Debug)]
pub struct Replayed {
    /// The replay's figures.
    pub result: ReplayResult,
    /// With a ballast, what the device had free once it was placed: the capacity the allocator really had.
    pub free_seen: Option<u64>,
}

/// Where a capacity search replays.
pub trait CapacityDevice {
    /// The largest capacity this device can replay at, a whole number of pages: what a CUDA device has
    /// free now; `None` on the simulator, which has any size asked for.
    ///
    /// # Errors
    /// The device cannot be opened or asked.
    fn ceiling(&mut self) -> Result<Option<u64>, CapacityError>;

    /// Replays `trace` through a fresh `allocator` with `capacity` bytes of device memory.
    ///
    /// # Errors
    /// [`CapacityError::Build`] for an allocator that cannot be built here; [`CapacityError::Replay`] for a
    /// replay that failed other than by OOM; a device or ballast failure.
    fn replay<O: ReplayObserver + ?Sized>(
        &mut self,
        trace: &Trace,
        allocator: &str,
        capacity: u64,
        observer: &mut O,
    ) -> Result<Replayed, CapacityError>;
}

/// The device `options.backend` names.
///
/// # Errors
/// [`CapacityError::Config`] if the allocator configuration does not parse.
pub fn for_options(options: &CapacityOptions) -> Result<Backend, CapacityError> {
    let config = config(options)?;
    Ok(match options.backend {
        DeviceSpec::Sim => Backend::Sim(SimSized {
            page_size: options.page_size,
            config,
        }),
        spec @ DeviceSpec::Cuda { .. } => Backend::Cuda(CudaBallast {
            spec,
            page_size: options.page_size,
            config,
            holder: None,
        }),
    })
}

/// Either backend's device.
#[derive(Debug)]
pub enum Backend {
    /// A simulated device of each capacity.
    Sim(SimSized),
    /// A CUDA device with a ballast.
    Cuda(CudaBallast),
}

impl CapacityDevice for Backend {
    fn ceiling(&mut self) -> Result<Option<u64>, CapacityError> {
        match self {
            Backend::Sim(d) => d.ceiling(),
            Backend::Cuda(d) => d.ceiling(),
        }
    }

    fn replay<O: ReplayObserver + ?Sized>(
        &mut self,
        trace: &Trace,
        allocator: &str,
        capacity: u64,
        observer: &mut O,
    ) -> Result<Replayed, CapacityError> {
        match self {
            Backend::Sim(d) => d.replay(trace, allocator, capacity, observer),
            Backend::Cuda(d) => d.replay(trace, allocator, capacity, observer),
        }
    }
}

/// A fresh simulated device of exactly the capacity, its granularity the page size.
#[derive(Clone, Debug)]
pub struct SimSized {
    /// The simulated device's granularity.
    pub page_size: u64,
    /// The allocators' configuration.
    pub config: Config,
}

impl CapacityDevice for SimSized {
    fn ceiling(&mut self) -> Result<Option<u64>, CapacityError> {
        Ok(None)
    }

    fn replay<O: ReplayObserver + ?Sized>(
        &mut self,
        trace: &Trace,
        allocator: &str,
        capacity: u64,
        observer: &mut O,
    ) -> Result<Replayed, CapacityError> {
        let result = super::replay_at(
            trace,
            allocator,
            capacity,
            self.page_size,
            &self.config,
            observer,
        )?;
        Ok(Replayed {
            result,
            free_seen: None,
        })
    }
}

/// A simulated device of `device_capacity` bytes on which a ballast leaves the capacity free: the method
/// of [`CudaBallast`], through the same [`with_ballast`], with the allocator on the ballast's own driver.
#[derive(Clone, Debug)]
pub struct SimBallast {
    /// The whole simulated device: at least the largest capacity replayed.
    pub device_capacity: u64,
    /// The simulated device's granularity.
    pub page_size: u64,
    /// The allocators' configuration.
    pub config: Config,
}

impl CapacityDevice for SimBallast {
    fn ceiling(&mut self) -> Result<Option<u64>, CapacityError> {
        Ok(Some(self.device_capacity / self.page_size * self.page_size))
    }

    fn replay<O: ReplayObserver + ?Sized>(
        &mut self,
        trace: &Trace,
        allocator: &str,
        capacity: u64,
        observer: &mut O,
    ) -> Result<Replayed, CapacityError> {
        let mut sim = SimDriver::new(
            SimConfig::default()
                .with_capacity(self.device_capacity)
                .with_granularity(self.page_size),
        );
        let config = &self.config;
        with_ballast(&mut sim, capacity, |sim, ballast| {
            if allocators::CUDA_ONLY.contains(&allocator) {
                return Err(needs_gpu(allocator));
            }
            let mut strategy = allocators::build_on(allocator, &mut *sim, config.clone())?;
            let result = replay_one(strategy.as_mut(), trace, allocator, capacity, observer)?;
            Ok(Replayed {
                result,
                free_seen: Some(ballast.free_seen()),
            })
        })
    }
}

/// A CUDA device with a ballast leaving the capacity free. One handle on the device (`holder`) holds the
/// ballast and keeps the device's context alive for the whole search; each allocator is built on its own
/// handle (`cuda-async` on the device's default memory pool), replays, and is dropped, giving its memory
/// back, before the ballast is freed. The default pool is trimmed before each ballast is placed, so that
/// what `cuda-async` kept from one replay is neither free memory missing from the next ballast nor a head
/// start for the next `cuda-async`.
#[derive(Debug)]
pub struct CudaBallast {
    spec: DeviceSpec,
    page_size: u64,
    config: Config,
    /// Boxed: a device is large (it may hold a simulator), and a search opens one.
    holder: Option<Box<cuvmm::driver::device::Device>>,
}

impl CudaBallast {
    /// The handle holding the ballast, opened on first use; the default pool trimmed.
    fn settled_holder(&mut self) -> Result<&mut cuvmm::driver::device::Device, CapacityError> {
        trim_default_pool(self.spec)?;
        let holder = match self.holder.take() {
            Some(holder) => holder,
            None => Box::new(self.spec.open_for_replay(SimConfig::default())?),
        };
        Ok(self.holder.insert(holder).as_mut())
    }
}

impl CapacityDevice for CudaBallast {
    fn ceiling(&mut self) -> Result<Option<u64>, CapacityError> {
        let free = (self.settled_holder()?)
            .mem_info()
            .map_err(|e| CapacityError::Ballast(e.into()))?
            .free;
        Ok(Some(free / self.page_size * self.page_size))
    }

    fn replay<O: ReplayObserver + ?Sized>(
        &mut self,
        trace: &Trace,
        allocator: &str,
        capacity: u64,
        observer: &mut O,
    ) -> Result<Replayed, CapacityError> {
        let (spec, config) = (self.spec, self.config.clone());
        let holder = self.settled_holder()?;
        with_ballast(holder, capacity, |_, ballast| {
            let mut strategy: Box<dyn Strategy> = if allocators::CUDA_ONLY.contains(&allocator) {
                allocators::build_cuda_only(allocator, &spec)?
            } else {
                let device = spec.open_for_replay(SimConfig::default())?;
                allocators::build_on(allocator, device, config)?
            };
            let result = replay_one(strategy.as_mut(), trace, allocator, capacity, observer);
            // The allocator's memory goes back before the ballast does.
            drop(strategy);
            Ok(Replayed {
                result: result?,
                free_seen: Some(ballast.free_seen()),
            })
        })
    }
}

/// Gives back what the device's default memory pool (`cuda-async`'s) keeps and no allocation uses.
#[cfg(feature = "cuda")]
fn trim_default_pool(spec: DeviceSpec) -> Result<(), CapacityError> {
    if let DeviceSpec::Cuda { ordinal } = spec {
        let mut pool = cuvmm::driver::cuda::AsyncPool::new(ordinal)
            .map_err(cuvmm::driver::device::DeviceError::from)?;
        pool.trim_to(0)
            .map_err(|e| CapacityError::Ballast(e.into()))?;
    }
    Ok(())
}

/// Without CUDA there is no pool (and opening the device fails first).
#[cfg(not(feature = "cuda"))]
fn trim_default_pool(_spec: DeviceSpec) -> Result<(), CapacityError> {
    Ok(())
}

/// A CUDA-only allocator asked for on the simulator.
fn needs_gpu(allocator: &str) -> CapacityError {
    BuildError::NeedsGpu {
        name: allocator.to_string(),
    }
    .into()
}

/// Replays `trace` through `strategy`, naming the trace, allocator and capacity in an error.
fn replay_one<O: ReplayObserver + ?Sized>(
    strategy: &mut dyn Strategy,
    trace: &Trace,
    allocator: &str,
    capacity: u64,
    observer: &mut O,
) -> Result<ReplayResult, CapacityError> {
    replay_observed(strategy, trace, &ReplayOptions::default(), observer).map_err(
        |source: ReplayError| CapacityError::Replay {
            trace: trace.name.clone(),
            allocator: allocator.to_string(),
            capacity,
            source: Box::new(source),
        },
    )
}
