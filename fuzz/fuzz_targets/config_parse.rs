//! Fuzzes `Config::from_alloc_conf` with arbitrary text; the properties are listed in
//! `tests/harness/config_parse.rs`, which `tests/fuzz_corpus.rs` also runs.
#![no_main]

#[path = "../../tests/harness/config_parse.rs"]
mod config_parse;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(message) = config_parse::run(data) {
        panic!("{message}");
    }
});
