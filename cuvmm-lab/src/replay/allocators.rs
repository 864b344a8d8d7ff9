//! Every allocator the tools can compare, built by name in one place.

use crate::pytorch_model::Split;
use cuvmm::driver::Driver;
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::Strategy;
use cuvmm::strategy::config::Config;
use cuvmm::strategy::error::Error;

/// Names of the allocators [`build`] knows, in the order reports list them.
/// "cuvmm" is cuvmm's allocator; "classic" the model of PyTorch's native caching allocator;
/// "pytorch-expandable" the model of PyTorch with `expandable_segments:True`.
pub const ALLOCATORS: &[&str] = &["cuvmm", "classic", "pytorch-expandable"];

/// CUDA's own stream-ordered pool (cuMemAllocAsync on the device's default pool, kept whole): a comparison
/// on a GPU only, never in the default list ([`build_cuda_only`]).
/// (The same as `cuda_async::NAME`, which exists only with the `cuda` feature.)
pub const CUDA_ASYNC: &str = "cuda-async";

/// Allocators that run only on a CUDA device (`--backend cuda`).
pub const CUDA_ONLY: &[&str] = &[CUDA_ASYNC];

/// Why a CUDA-only allocator cannot run on the simulated device, in one line.
pub const NEEDS_GPU: &str =
    "is CUDA's own pool (cuMemAllocAsync) and runs only on a GPU (--backend cuda)";

/// Whether `name` is an allocator the tools know, default or CUDA-only.
pub fn is_known(name: &str) -> bool {
    ALLOCATORS.contains(&name) || CUDA_ONLY.contains(&name)
}

/// An allocator that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// No allocator has that name.
    #[error("unknown allocator `{name}` (known: {}, {})", ALLOCATORS.join(", "), CUDA_ONLY.join(", "))]
    Unknown {
        /// The name given.
        name: String,
    },
    /// A CUDA-only allocator was asked for on the simulated device.
    #[error("allocator `{name}` {NEEDS_GPU}")]
    NeedsGpu {
        /// The allocator.
        name: String,
    },
    /// The allocator rejected the device it was given.
    #[error("cannot build allocator `{name}`: {source}")]
    Strategy {
        /// The allocator.
        name: String,
        /// Its error.
        source: Error,
    },
}

/// The allocator called `name` on a fresh simulated device of `capacity` bytes whose allocation
/// granularity is `page_size` bytes, with the default configuration (PyTorch's defaults for the models of
/// PyTorch; "pytorch-expandable" needs a granularity that divides 2 MiB).
pub fn build(name: &str, capacity: u64, page_size: u64) -> Result<Box<dyn Strategy>, BuildError> {
    build_with(name, capacity, page_size, &Config::default())
}

/// As [`build`], with the allocator configured by `config`.
pub fn build_with(
    name: &str,
    capacity: u64,
    page_size: u64,
    config: &Config,
) -> Result<Box<dyn Strategy>, BuildError> {
    let device = SimDriver::new(
        SimConfig::default()
            .with_capacity(capacity)
            .with_granularity(page_size),
    );
    build_on(name, device, config.clone())
}

/// The allocator called `name` on `device` (any [`Driver`]: a [`SimDriver`], a
/// [`Device`](cuvmm::driver::device::Device), a `&mut` borrow of one, ...), configured by `config`.
pub fn build_on<'d, D: Driver + 'd>(
    name: &str,
    device: D,
    config: Config,
) -> Result<Box<dyn Strategy + 'd>, BuildError> {
    let strategy_error = |source| BuildError::Strategy {
        name: name.to_string(),
        source,
    };
    match name {
        "cuvmm" => Ok(Box::new(
            Expandable::new(device, config).map_err(strategy_error)?,
        )),
        "classic" => Ok(Box::new(
            Split::new(device, config).map_err(strategy_error)?,
        )),
        "pytorch-expandable" => {
            let config = Config {
                expandable_segments: true,
                ..config
            };
            Ok(Box::new(
                Split::new(device, config).map_err(strategy_error)?,
            ))
        }
        _ => Err(BuildError::Unknown {
            name: name.to_string(),
        }),
    }
}

/// The CUDA-only allocator called `name` ([`CUDA_ONLY`]) on `backend`.
///
/// # Errors
/// [`BuildError::NeedsGpu`] on the simulated device (or a build without the `cuda` feature);
/// [`BuildError::Strategy`] if the device cannot be used; [`BuildError::Unknown`] for another name.
pub fn build_cuda_only(name: &str, backend: &DeviceSpec) -> Result<Box<dyn Strategy>, BuildError> {
    if !CUDA_ONLY.contains(&name) {
        return Err(BuildError::Unknown {
            name: name.to_string(),
        });
    }
    match backend {
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda { ordinal } => super::cuda_async::CudaAsync::new(*ordinal)
            .map(|s| Box::new(s) as Box<dyn Strategy>)
            .map_err(|source| BuildError::Strategy {
                name: name.to_string(),
                source,
            }),
        _ => Err(BuildError::NeedsGpu {
            name: name.to_string(),
        }),
    }
}
