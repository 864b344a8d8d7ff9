//! cuvmm: a CUDA device-memory allocator built on the driver's virtual-memory API.
//!
//! It reserves a large contiguous virtual range per (stream, pool) and maps physical pages into it on demand,
//! so free space is never stranded by splitting, and idle physical pages are unmapped and reused wherever the
//! next request needs them. A simulated device ([`driver::sim::SimDriver`]) runs everything without a GPU.
//!
//! Layers, from the bottom: [`driver`] (the seam to the device), `page_map`, the strategy [`expandable`], and
//! the facade ([`Allocator`]). This crate is the allocator alone: its default build compiles cudarc (feature
//! `cuda`), bitvec, parking_lot, tracing, thiserror and serde's derive, nothing else. The laboratory around it
//! (trace formats, workloads, replay, experiments, reports, the models of PyTorch's allocators cuvmm is
//! measured against, and the `cuvmm` command-line tool) is a crate of its own, `cuvmm-lab`, and the PyTorch
//! allocator library is `cuvmm-torch`. See `docs/DESIGN.md`.

// The folders are the layers, lowest first, one group per layer (docs/DESIGN.md's map; tests/layering.rs
// checks it).
mod base;

pub mod driver;

#[cfg(feature = "testing")]
pub mod page_map;
#[cfg(not(feature = "testing"))]
pub(crate) mod page_map;

pub mod strategy;

pub mod expandable;

mod facade;

pub use base::size;
pub use driver::{Driver, DriverError, StreamId};
#[cfg(feature = "cuda")]
pub use facade::cuda_buffer::{CudaBuffer, TypedView, TypedViewMut};
pub use facade::{allocator, allocator::Allocator, device_buffer::DeviceBuffer, summary};
pub use strategy::Strategy;
pub use strategy::config::{Config, ConfigError};
pub use strategy::error::{Error, InvariantViolation, OutOfMemory};
pub use strategy::graph_pool::{GraphPool, PoolBlock, StreamFilter};
pub use strategy::stats::{Stat, Stats};
pub use strategy::{config, error, graph_pool, history, oom, pool, sharing, snapshot, stats, tags};

/// The README's examples, compiled and run as doctests so they stay true.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
struct ReadmeDoctests;
