//! Fuzzes `Split<SimDriver>`, the model of PyTorch's allocator (classic and expandable segments), with
//! allocator operations and injected driver faults: the generic ops harness
//! (`tests/harness/strategy_ops.rs`) with this strategy. The properties are listed in
//! `tests/harness/split_ops.rs`; `tests/fuzz_corpus.rs` runs the same code.
#![no_main]

#[path = "../../tests/harness/input.rs"]
mod input;
#[path = "../../tests/harness/ops_common.rs"]
mod ops_common;
#[path = "../../cuvmm-lab/tests/harness/split_input.rs"]
mod split_input;
#[path = "../../cuvmm-lab/tests/harness/split_ops.rs"]
mod split_ops;
#[path = "../../tests/harness/strategy_ops.rs"]
mod strategy_ops;

use cuvmm::driver::sim::SimDriver;
use cuvmm_lab::pytorch_model::Split;

libfuzzer_sys::fuzz_target!(|data: &[u8]| strategy_ops::fuzz::<Split<SimDriver>>(data));
