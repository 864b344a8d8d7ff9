//! Fuzzes `PageMap` against a model; the properties are listed in `tests/harness/page_map.rs`, which
//! `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "../../tests/harness/page_map.rs"]
mod page_map;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(message) = page_map::run(data) {
        panic!("{message}");
    }
});
