//! Traces and their formats.
//!
//! A [`Trace`] is a sequence of allocations and frees ([`event`]), written by naming allocations as they
//! are made ([`builder`]); [`load`] reads trace files whatever their format: [`pytorch`] memory snapshots,
//! [`rmm`] logs, cuvmm's own [`text`] format, [`kineto`] profiler traces,
//! each plain or [`gzip`]ped.

pub mod builder;
pub mod event;
pub mod gzip;
pub mod kineto;
pub mod load;
pub mod pytorch;
pub mod rmm;
pub mod text;

pub use builder::TraceBuilder;
pub use event::{Event, Trace, TraceError};

/// At most 40 characters of `text` (a field of a user's file), so an error message stays one short line.
fn excerpt(text: &str) -> String {
    const MAX: usize = 40;
    match text.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{}...", &text[..cut]),
        None => text.to_string(),
    }
}
