//! Every allocator the tools can compare, built by name in one place.

use crate::config::Config;
use crate::driver::sim::{SimConfig, SimDriver};
use crate::error::Error;
use crate::expandable::Expandable;
use crate::strategy::Strategy;

/// Names of the allocators [`build`] knows, in the order reports list them.
pub const ALLOCATORS: &[&str] = &["cuvmm"];

/// An allocator that cannot be built.
#[derive(Debug, thiserror::Error)]
pub enum BuildError {
    /// No allocator has that name.
    #[error("unknown allocator `{name}` (known: {})", ALLOCATORS.join(", "))]
    Unknown {
        /// The name given.
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
/// granularity is `page_size` bytes, with the default configuration.
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
    let device = || {
        SimDriver::new(
            SimConfig::default()
                .with_capacity(capacity)
                .with_granularity(page_size),
        )
    };
    let strategy_error = |source| BuildError::Strategy {
        name: name.to_string(),
        source,
    };
    match name {
        "cuvmm" => Ok(Box::new(
            Expandable::new(device(), config.clone()).map_err(strategy_error)?,
        )),
        _ => Err(BuildError::Unknown {
            name: name.to_string(),
        }),
    }
}
