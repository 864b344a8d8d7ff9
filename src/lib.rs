//! cuvmm: a CUDA device-memory allocator built on the driver's virtual-memory API.
//!
//! It reserves a large contiguous virtual range per (stream, pool) and maps physical pages into it on demand,
//! so free space is never stranded by splitting, and idle physical pages are unmapped and reused wherever the
//! next request needs them. A simulated device ([`driver::sim::SimDriver`]) runs everything without a GPU.
//!
//! Layers, from the bottom: [`driver`] (the seam to the device), [`page_map`], the strategy [`expandable`], and
//! the facade ([`Allocator`]). The laboratory around them is behind the `lab` feature (on by default, and
//! needed by the `cli` feature): `split`, the model of PyTorch's caching allocator cuvmm is measured against,
//! and the tools, `trace` (formats, replay, comparison, workloads) and `driver_bench`. A program that only
//! allocates turns default features off and compiles the allocator's own dependencies alone. See
//! `docs/DESIGN.md`.

pub mod allocator;
mod bit_words;
mod bits;
pub mod config;
#[cfg(feature = "cuda")]
pub mod cuda_buffer;
mod divisor;
pub mod driver;
#[cfg(feature = "lab")]
pub mod driver_bench;
pub mod error;
pub mod expandable;
pub mod graph_pool;
pub mod history;
pub mod oom;
pub mod page_map;
pub mod pool;
mod raw_book;
pub mod size;
pub mod snapshot;
#[cfg(feature = "lab")]
pub mod split;
pub mod stats;
pub mod strategy;
mod stream_cache;
pub mod summary;
mod sync;
#[cfg(feature = "lab")]
pub mod trace;

pub use allocator::{Allocator, DeviceBuffer};
pub use config::{Config, ConfigError};
#[cfg(feature = "cuda")]
pub use cuda_buffer::{CudaBuffer, TypedView, TypedViewMut};
pub use driver::{Driver, DriverError, StreamId};
pub use error::{Error, InvariantViolation, OutOfMemory};
pub use graph_pool::{GraphPool, StreamFilter};
pub use stats::{Stat, Stats};
pub use strategy::Strategy;

/// The README's examples, compiled and run as doctests so they stay true (some use the laboratory).
#[cfg(all(doctest, feature = "lab"))]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
