//! Fuzzes `Expandable<SimDriver>`, cuvmm's own allocator, with allocator operations and injected driver
//! faults: the generic ops harness (`tests/harness/strategy_ops.rs`) with this strategy. The properties are listed in
//! `tests/harness/expandable_ops.rs`; `tests/fuzz_corpus.rs` runs the same code.
#![no_main]

#[path = "../../tests/harness/expandable_input.rs"]
mod expandable_input;
#[path = "../../tests/harness/expandable_ops.rs"]
mod expandable_ops;
#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "../../tests/harness/mapped_events.rs"]
mod mapped_events;
#[path = "../../tests/harness/ops_common.rs"]
mod ops_common;
#[path = "../../tests/harness/strategy_ops.rs"]
mod strategy_ops;

use cuvmm::driver::sim::SimDriver;
use cuvmm::expandable::Expandable;

libfuzzer_sys::fuzz_target!(|data: &[u8]| strategy_ops::fuzz::<Expandable<SimDriver>>(data));
