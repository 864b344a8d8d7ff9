//! The built-in workloads: deterministic, seeded generators of traces modelled on what real frameworks do.
//!
//! Each generator lives in its own file, whose documentation says what it models. Every trace has between
//! 10^4 and 10^5 events and a peak of live bytes between roughly 10 and 50 GiB, so it fits an 80 GiB device.

pub mod batched_inference;
pub mod llm_serving;
pub mod moe;
pub mod rng;
pub mod stream_prefetch_offload;
pub mod stream_producer_consumer;
pub mod transformer_train;
mod weights;

pub use rng::Rng;

use crate::trace::event::Trace;

/// The seed used when none is given.
pub const DEFAULT_SEED: u64 = 42;

/// Names of the built-in workloads, in the order reports list them.
pub const BUILTIN: &[&str] = &[
    transformer_train::NAME,
    moe::NAME,
    llm_serving::NAME,
    stream_producer_consumer::NAME,
    stream_prefetch_offload::NAME,
    batched_inference::NAME,
];

/// A built-in workload: its name, what it models, and its generator.
struct Workload {
    name: &'static str,
    description: &'static str,
    generate: fn(u64) -> Trace,
}

const WORKLOADS: [Workload; 6] = [
    Workload {
        name: transformer_train::NAME,
        description: transformer_train::DESCRIPTION,
        generate: transformer_train::generate,
    },
    Workload {
        name: moe::NAME,
        description: moe::DESCRIPTION,
        generate: moe::generate,
    },
    Workload {
        name: llm_serving::NAME,
        description: llm_serving::DESCRIPTION,
        generate: llm_serving::generate,
    },
    Workload {
        name: stream_producer_consumer::NAME,
        description: stream_producer_consumer::DESCRIPTION,
        generate: stream_producer_consumer::generate,
    },
    Workload {
        name: stream_prefetch_offload::NAME,
        description: stream_prefetch_offload::DESCRIPTION,
        generate: stream_prefetch_offload::generate,
    },
    Workload {
        name: batched_inference::NAME,
        description: batched_inference::DESCRIPTION,
        generate: batched_inference::generate,
    },
];

fn find(name: &str) -> Option<&'static Workload> {
    WORKLOADS.iter().find(|w| w.name == name)
}

/// The trace of the built-in workload `name` for `seed`, or `None` if there is no such workload.
pub fn generate(name: &str, seed: u64) -> Option<Trace> {
    find(name).map(|w| (w.generate)(seed))
}

/// One line saying what the built-in workload `name` models, or `None` if there is no such workload.
pub fn description(name: &str) -> Option<&'static str> {
    find(name).map(|w| w.description)
}
