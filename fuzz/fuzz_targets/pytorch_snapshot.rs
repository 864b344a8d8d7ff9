//! Fuzzes the PyTorch memory snapshot reader (`trace::pytorch`) with arbitrary bytes; the properties are listed
//! in `tests/harness/pytorch_snapshot.rs`, which `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../cuvmm-lab/tests/harness/pytorch_snapshot.rs"]
mod pytorch_snapshot;
#[path = "../../cuvmm-lab/tests/harness/trace_replay.rs"]
mod trace_replay;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(message) = pytorch_snapshot::run(data) {
        panic!("{message}");
    }
});
