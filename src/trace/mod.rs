//! Workloads, traces and the replay engine: the tools layer that drives any allocator.
//!
//! A [`Trace`] is a sequence of allocations and frees ([`event`]); [`workload`] generates the built-in
//! ones; [`load`] reads trace files ([`pytorch`] snapshots, [`rmm`] logs, cuvmm's own [`text`] format,
//! [`kineto`] profiler traces); [`replay`](mod@replay) runs a trace through a [`Strategy`](crate::Strategy);
//! [`allocators`] builds every allocator by name; [`compare`] replays workloads through allocators; [`report`]
//! prints the results; [`capacity`] finds the smallest device each allocator fits on; [`sample`] and [`plot`]
//! draw replays; [`bench`](mod@bench) measures replay throughput.

pub mod allocators;
pub mod bench;
pub mod builder;
pub mod capacity;
pub mod compare;
#[cfg(feature = "cuda")]
pub mod cuda_async;
pub mod event;
pub mod fidelity;
pub mod frontier;
mod id_table;
pub mod kineto;
pub mod load;
pub mod observe;
pub mod peak;
pub mod plot;
pub mod pytorch;
pub mod replay;
pub mod report;
pub mod rmm;
pub mod rng;
pub mod sample;
pub mod text;
pub mod workload;

pub use builder::TraceBuilder;
pub use event::{Event, Trace, TraceError};
pub use replay::{DriverCalls, ReplayError, ReplayOptions, ReplayResult, replay, replay_observed};
pub use rng::Rng;

/// At most 40 characters of `text` (a field of a user's file), so an error message stays one short line.
fn excerpt(text: &str) -> String {
    const MAX: usize = 40;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}
