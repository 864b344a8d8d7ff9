//! Fuzzes the PyTorch profiler trace reader (`trace::kineto`) with arbitrary bytes, and with the programs
//! they describe; the properties are listed in `tests/harness/kineto_json.rs`, which `tests/fuzz_corpus.rs`
//! also runs.
#![no_main]

#[path = "../../cuvmm-lab/tests/harness/kineto_json.rs"]
mod kineto_json;
#[path = "../../cuvmm-lab/tests/harness/trace_replay.rs"]
mod trace_replay;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(message) = kineto_json::run(data) {
        panic!("{message}");
    }
});
