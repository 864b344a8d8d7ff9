//! Replaying a small trace that a reader produced, for the reader harnesses (`pytorch_snapshot`, `rmm_csv`,
//! `kineto_json`): what a reader hands over must replay without any error but running out of memory, and
//! what it refuses must be said in one line naming the file.

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::size::{GIB, MIB};
use cuvmm::{Config, Error};
use cuvmm_lab::replay::ReplayError;
use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::replay::replay;
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::event::MAX_SIZE;

/// Traces longer than this are checked but not replayed, so every input runs in milliseconds.
pub const MAX_REPLAYED_EVENTS: usize = 200;

/// Checks `trace`: it passes `Trace::validate`, every allocation asks for 1 to 2^50 bytes, and, when it
/// has at most [`MAX_REPLAYED_EVENTS`] events, it replays through cuvmm's allocator on a 1 GiB simulated
/// device with 2 MiB pages, invariants checked after every event, with no error but out-of-memory (or a
/// request larger than the device); afterwards everything is freed and no handle leaks.
pub fn check(trace: &Trace) -> Result<(), String> {
    trace
        .validate()
        .map_err(|e| format!("{}: invalid trace: {e}", trace.name))?;
    for event in &trace.events {
        if let cuvmm_lab::trace::Event::Alloc { size, .. } = event {
            if !(1..=MAX_SIZE).contains(size) {
                return Err(format!("{}: allocation of {size} bytes", trace.name));
            }
        }
    }
    if trace.events.len() > MAX_REPLAYED_EVENTS {
        return Ok(());
    }
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(GIB)
            .with_granularity(2 * MIB),
    );
    let mut alloc = Expandable::new(sim, Config::default()).map_err(|e| e.to_string())?;
    let options = ReplayOptions {
        check_invariants_every: Some(1),
        ..ReplayOptions::default()
    };
    match replay(&mut alloc, trace, &options) {
        Ok(_)
        | Err(ReplayError::Alloc {
            source: Error::TooLarge { .. },
            ..
        }) => Ok(()),
        Err(e) => Err(format!("{}: replay failed: {e}", trace.name)),
    }
}

/// What one input did to a reader that returns a trace per device.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The file was read: its devices' traces and their events in all.
    Read {
        /// Traces (devices).
        traces: usize,
        /// Events of all of them.
        events: usize,
    },
    /// The bytes were refused with a typed error.
    Refused,
}

/// Checks a reader's error: one line that starts with the file's name.
pub fn check_refusal(message: &str, file: &str) -> Result<(), String> {
    if !message.starts_with(file) || message.contains('\n') {
        return Err(format!("error not one line naming the file: {message:?}"));
    }
    Ok(())
}
