//! The `kineto_json` harness: the PyTorch profiler trace reader (`trace::kineto::parse`) on arbitrary bytes.
//! Bytes that start like JSON (`{`) or gzip are read as given; any others describe the `[memory]` events of
//! a program (allocations, frees, frees of memory allocated before profiling, unrecorded frees), which are
//! written as today's profiler writes them, so that the fuzzer reaches the pairing without having to write
//! JSON. The fuzz target and `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked:
//! - reading never panics, whatever the bytes;
//! - an error is one line that starts with the file's name;
//! - each device's trace is valid and replays (`trace_replay::check`);
//! - for the events of a program, the trace's peak of live bytes is the peak of the program's allocated
//!   bytes (`Total Allocated`, and what was allocated when profiling began): frees are paired by address,
//!   even where one was not recorded, and the memory never freed while profiling is seen.

use crate::trace_replay;
pub use crate::trace_replay::Outcome;
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::kineto;
use std::path::Path;

/// The name the trace goes by in traces and errors.
pub const FILE: &str = "fuzz.json";

/// Reads `data` as a profiler trace, or as the program it describes, and checks the properties listed in
/// the module docs.
pub fn run(data: &[u8]) -> Result<Outcome, String> {
    if data.first() == Some(&b'{') || data.starts_with(&[0x1f, 0x8b]) {
        return read(data);
    }
    let program = Program::from_bytes(data);
    let outcome = read(program.json.as_bytes())?;
    if program.events > 0 {
        let traces = kineto::parse(Path::new(FILE), program.json.as_bytes(), None, FILE)
            .map_err(|e| format!("a program's events were refused: {e}"))?;
        let peak = traces.iter().map(Trace::peak_live_bytes).max();
        if peak != Some(program.peak_allocated) {
            return Err(format!(
                "peak live bytes {peak:?}, where the program's allocated bytes peaked at {}:\n{}",
                program.peak_allocated, program.json
            ));
        }
    }
    Ok(outcome)
}

fn read(bytes: &[u8]) -> Result<Outcome, String> {
    match kineto::parse(Path::new(FILE), bytes, None, FILE) {
        Ok(traces) => {
            let mut events = 0;
            for trace in &traces {
                trace_replay::check(trace)?;
                events += trace.events.len();
            }
            Ok(Outcome::Read {
                traces: traces.len(),
                events,
            })
        }
        Err(e) => {
            trace_replay::check_refusal(&e.to_string(), FILE)?;
            Ok(Outcome::Refused)
        }
    }
}

/// A program's memory events, as a profiler trace of today's format.
struct Program {
    json: String,
    /// Memory events written.
    events: usize,
    /// The most bytes allocated at once from the start of profiling on.
    peak_allocated: u64,
}

impl Program {
    /// The first byte is the number of blocks of 512 bytes allocated before profiling and never freed; then
    /// each pair of bytes `(op, arg)` is one step: `op % 4` 0 or 1 allocates `(arg + 1) * 512` bytes (at the
    /// newest freed address of that size, else a new one), 2 frees the live allocation `arg` picks (left
    /// unrecorded when `op` is 2 mod 8 and the address is reused at once), 3 frees a block of `(arg + 1) *
    /// 512` bytes allocated before profiling began.
    fn from_bytes(data: &[u8]) -> Self {
        const UNIT: u64 = 512;
        let never_freed = u64::from(data.first().copied().unwrap_or(0)) * UNIT;
        let steps: Vec<(u8, u8)> = data
            .get(1..)
            .unwrap_or_default()
            .chunks_exact(2)
            .map(|pair| (pair[0], pair[1]))
            .collect();
        // Allocated when profiling began: what is never freed, and each block a step frees from before.
        let freed_from_before: u64 = steps
            .iter()
            .filter(|(op, _)| op % 4 == 3)
            .map(|&(_, arg)| (u64::from(arg) + 1) * UNIT)
            .sum();
        let mut allocated = never_freed + freed_from_before;
        let mut peak_allocated = allocated;
        let mut live: Vec<(u64, u64)> = Vec::new();
        let mut free_addresses: Vec<(u64, u64)> = Vec::new();
        let (mut next_address, mut next_before) = (1u64 << 40, 1u64 << 44);
        let mut events = Vec::new();
        let mut event = |addr: u64, bytes: i64, allocated: u64| {
            events.push(format!(
                r#"{{"ph": "i", "name": "[memory]", "ts": {}, "args": {{"Device Type": 1, "Device Id": 0, "Addr": {addr}, "Bytes": {bytes}, "Total Allocated": {allocated}}}}}"#,
                events.len()
            ));
        };
        for (op, arg) in steps {
            match op % 4 {
                0 | 1 => {
                    let size = (u64::from(arg) + 1) * UNIT;
                    let addr = match free_addresses.iter().rposition(|&(s, _)| s == size) {
                        Some(i) => free_addresses.remove(i).1,
                        None => {
                            next_address += size;
                            next_address - size
                        }
                    };
                    live.push((addr, size));
                    allocated += size;
                    event(addr, size as i64, allocated);
                }
                2 if !live.is_empty() => {
                    let (addr, size) = live.remove(usize::from(arg) % live.len());
                    allocated -= size;
                    if op % 8 == 2 {
                        // Unrecorded (as by a profiler that does not follow the freeing thread), and the
                        // address taken again at once by a block of the same size.
                        live.push((addr, size));
                        allocated += size;
                        event(addr, size as i64, allocated);
                    } else {
                        free_addresses.push((size, addr));
                        event(addr, -(size as i64), allocated);
                    }
                }
                3 => {
                    let size = (u64::from(arg) + 1) * UNIT;
                    next_before += size;
                    allocated -= size;
                    event(next_before - size, -(size as i64), allocated);
                }
                _ => {}
            }
            peak_allocated = peak_allocated.max(allocated);
        }
        Self {
            json: format!(r#"{{"traceEvents": [{}]}}"#, events.join(", ")),
            events: events.len(),
            peak_allocated,
        }
    }
}
