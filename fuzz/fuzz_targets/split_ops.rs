//! Fuzzes `Split<SimDriver>`, the model of PyTorch's allocator (classic and expandable segments), with
//! allocator operations and injected driver faults; the properties are listed in
//! `tests/harness/split_ops.rs`, which `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "../../tests/harness/ops_common.rs"]
mod ops_common;
#[path = "../../tests/harness/split_input.rs"]
mod split_input;
#[path = "../../tests/harness/split_ops.rs"]
mod split_ops;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(failure) = split_ops::run(data) {
        panic!("{failure}");
    }
});
