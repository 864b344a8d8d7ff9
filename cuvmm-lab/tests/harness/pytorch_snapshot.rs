//! The `pytorch_snapshot` harness: the PyTorch memory snapshot reader (`trace::pytorch::parse_devices`,
//! then `PytorchTrace::to_trace`) on arbitrary bytes. The fuzz target and `tests/fuzz_corpus.rs` both run
//! [`run`].
//!
//! Properties checked:
//! - reading never panics, and never exhausts memory or the stack (libFuzzer reports both), whatever the
//!   bytes;
//! - reading is deterministic: the same bytes give the same result twice;
//! - an error is one line that starts with the file's name;
//! - each device's trace is valid and replays (`trace_replay::check`).

use crate::trace_replay;
pub use crate::trace_replay::Outcome;
use cuvmm_lab::trace::pytorch::{self, PytorchTrace};
use std::path::Path;

/// The name the snapshot goes by in traces and errors.
pub const FILE: &str = "fuzz.pickle";

/// Reads `data` as a snapshot, every device and then device 1 alone, and checks the properties listed in
/// the module docs.
pub fn run(data: &[u8]) -> Result<Outcome, String> {
    let path = Path::new(FILE);
    let mut outcome = Outcome::Refused;
    for device in [None, Some(1)] {
        let first = pytorch::parse_devices(path, data, device);
        let again = pytorch::parse_devices(path, data, device);
        if format!("{first:?}") != format!("{again:?}") {
            return Err(format!("device {device:?}: read twice, two results"));
        }
        match first {
            Ok(traces) => {
                let events = check_traces(&traces)?;
                if device.is_none() {
                    outcome = Outcome::Read {
                        traces: traces.len(),
                        events,
                    };
                }
            }
            Err(e) => {
                trace_replay::check_refusal(&e.to_string(), FILE)?;
            }
        }
    }
    Ok(outcome)
}

fn check_traces(traces: &[PytorchTrace]) -> Result<usize, String> {
    let mut events = 0;
    for t in traces {
        let trace = t.to_trace(format!("{FILE}:{}", t.device));
        trace_replay::check(&trace)?;
        events += trace.events.len();
    }
    Ok(events)
}
