//! Fuzzes `Expandable<SimDriver>` with allocator operations and injected driver faults; the properties
//! are listed in `tests/harness/expandable_ops.rs`, which `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../tests/harness/expandable_input.rs"]
mod expandable_input;
#[path = "../../tests/harness/expandable_ops.rs"]
mod expandable_ops;
#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "../../tests/harness/ops_common.rs"]
mod ops_common;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(failure) = expandable_ops::run(data) {
        panic!("{failure}");
    }
});
