//! cuvmm's laboratory: everything cuvmm uses to measure allocators, and nothing a program that only
//! allocates needs. A crate of its own beside the library (`cuvmm`), so that a service embedding the
//! allocator never compiles it; the `cuvmm` command-line tool (`src/bin/cuvmm/`) is its front end.
//!
//! - [`trace`]: the trace model (allocations, frees, cross-stream uses) and its file formats: cuvmm's own
//!   text, PyTorch memory snapshots, RMM logs and Kineto profiler traces.
//! - [`workload`]: the built-in workloads, seeded generators of traces.
//! - [`replay`](mod@replay): the replay engine, which drives any [`Strategy`](cuvmm::Strategy) through a
//!   trace, and the allocators it can drive, built by name.
//! - [`experiments`]: what the tool's subcommands answer: compare, capacity, frontier, fidelity, bench and
//!   driver-bench.
//! - [`reports`]: tables, JSON and plots of their results.
//! - [`pytorch_model`]: the models of PyTorch's own allocators (its classic caching allocator and its
//!   `expandable_segments:True` mode) that cuvmm is measured against; not to be mistaken for cuvmm's own
//!   allocator, [`cuvmm::expandable`].
//!
//! Data flows down the list, models aside: formats and workloads make traces, replay runs them through
//! allocators, experiments replay, reports print.

pub mod experiments;
pub mod pytorch_model;
pub mod replay;
pub mod reports;
pub mod trace;
pub mod workload;
