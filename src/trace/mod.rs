//! Workloads, traces and the replay engine: the tools layer that drives any allocator.
//!
//! A [`Trace`] is a sequence of allocations and frees ([`event`]); [`workload`] generates the built-in
//! ones; [`replay`](mod@replay) runs a trace through a [`Strategy`](crate::Strategy); [`allocators`] builds every
//! allocator by name; [`compare`] replays workloads through allocators; [`report`] prints the results;
//! [`bench`](mod@bench) measures replay throughput.

pub mod allocators;
pub mod bench;
pub mod builder;
pub mod compare;
pub mod event;
pub mod fidelity;
mod id_table;
pub mod load;
pub mod pytorch;
pub mod replay;
pub mod report;
pub mod rng;
pub mod workload;

pub use builder::TraceBuilder;
pub use event::{Event, Trace, TraceError};
pub use replay::{DriverCalls, ReplayError, ReplayOptions, ReplayResult, replay};
pub use rng::Rng;
