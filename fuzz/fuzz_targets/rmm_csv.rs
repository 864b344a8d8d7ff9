//! Fuzzes the RMM log reader (`trace::rmm`) with arbitrary bytes; the properties are listed
//! in `tests/harness/rmm_csv.rs`, which `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../cuvmm-lab/tests/harness/rmm_csv.rs"]
mod rmm_csv;
// Only its `check`: the outcome and the refusal check are the other readers'.
#[allow(dead_code)]
#[path = "../../cuvmm-lab/tests/harness/trace_replay.rs"]
mod trace_replay;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(message) = rmm_csv::run(data) {
        panic!("{message}");
    }
});
