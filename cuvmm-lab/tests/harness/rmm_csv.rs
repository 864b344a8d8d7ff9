//! The `rmm_csv` harness: the RMM `logging_resource_adaptor` log reader (`trace::rmm::parse`) on arbitrary
//! bytes, as given and after RMM's header line (so that the fuzzer reaches the rows without having to
//! find the header). The fuzz target and `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked:
//! - reading never panics, whatever the bytes;
//! - an error is one line that starts with the file's name and the line (`fuzz.csv:N: `);
//! - a log read gives a valid trace that replays (`trace_replay::check`), with the seeded allocations
//!   first, and that cuvmm's own format writes and reads back unchanged.

use crate::trace_replay;
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::rmm;
use cuvmm_lab::trace::text;
use std::path::Path;

/// The name the log goes by in traces and errors.
pub const FILE: &str = "fuzz.csv";

/// What one input did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Both readings were refused.
    Refused,
    /// One reading gave a trace: its events, allocate failures and seeded allocations.
    Read {
        /// Events.
        events: usize,
        /// `allocate failure` rows.
        failures: usize,
        /// Allocations seeded before the log.
        seeded: usize,
    },
}

/// Reads `data` as an RMM log, as given and after the header, and checks the properties listed in the
/// module docs. The outcome is the last successful reading's.
pub fn run(data: &[u8]) -> Result<Outcome, String> {
    let with_header = [rmm::HEADER.as_bytes(), b"\n", data].concat();
    let mut outcome = Outcome::Refused;
    for bytes in [data, &with_header[..]] {
        match rmm::parse(Path::new(FILE), bytes) {
            Ok(log) => outcome = check_log(&log)?,
            Err(e) => {
                let message = e.to_string();
                let Some(rest) = message.strip_prefix(&format!("{FILE}:")) else {
                    return Err(format!("error not naming the file: {message:?}"));
                };
                let line = rest.split(':').next().unwrap_or_default();
                if line.parse::<usize>().is_err() || message.contains('\n') {
                    return Err(format!("error not one line naming the line: {message:?}"));
                }
            }
        }
    }
    Ok(outcome)
}

fn check_log(log: &rmm::RmmLog) -> Result<Outcome, String> {
    let trace = &log.trace;
    trace_replay::check(trace)?;
    if trace.events.len() < log.seeded
        || !trace.events[..log.seeded]
            .iter()
            .all(|e| matches!(e, Event::Alloc { .. }))
    {
        return Err(format!(
            "the {} seeded allocations do not come first",
            log.seeded
        ));
    }
    let written = text::to_string(trace);
    match text::parse(Path::new("fuzz.trace"), written.as_bytes()) {
        Ok(read) if read == *trace => {}
        Ok(_) => return Err("cuvmm's format changed the trace".to_string()),
        Err(e) => return Err(format!("cuvmm's format refused the trace: {e}")),
    }
    Ok(Outcome::Read {
        events: trace.events.len(),
        failures: log.allocate_failures,
        seeded: log.seeded,
    })
}
