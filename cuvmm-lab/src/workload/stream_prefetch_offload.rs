//! `stream-prefetch-offload`: layer-offloading inference of a 70B-parameter model in bf16, whose weights
//! live in host memory and stream through the GPU one layer at a time (as accelerate's and FlexGen's
//! offloading do).
//!
//! The model is Llama-2-70B's shape: 80 layers, hidden size 8192, grouped-query attention with 8 KV heads
//! (K and V projections of 8192 x 1024), MLP of 28,672, vocabulary 32,000. Embeddings, the final norm and
//! the LM head stay on the GPU. While the compute stream runs layer `i`, a side (copy) stream prefetches the
//! weights of the next [`PREFETCH_DEPTH`] layers into buffers it allocates itself; the compute stream uses
//! them (`record_stream`) and frees them as soon as the layer has run, so each free waits for the compute
//! stream's event before the side stream may reuse the memory.
//!
//! Requests come in three generations, each a batch of 4, 8 or 16 sequences with a random prompt (at most
//! 16k prompt tokens per batch) and a few generated tokens: one prefill step over all prompt tokens, then
//! one decode step per generated token. Each generation holds a static KV cache (per layer, K and V for 4096
//! positions per sequence) on the compute stream. Each layer of each step allocates and frees activations on
//! the compute stream: norms, fused QKV, attention output (and, in decode steps, fp32 attention scores over
//! the cached positions), MLP gate, up and activation, and the residual stream.

use super::rng::Rng;
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;

/// The workload's name.
pub const NAME: &str = "stream-prefetch-offload";
/// One line saying what it models.
pub const DESCRIPTION: &str = "70B-model layer-offloading inference: a side stream prefetches each layer's weights, the compute stream uses and frees them";

/// Layers whose weights are on the GPU ahead of the one being computed.
pub const PREFETCH_DEPTH: usize = 2;

const COMPUTE: StreamId = StreamId(1);
const PREFETCH: StreamId = StreamId(2);
const LAYERS: usize = 80;
const HIDDEN: u64 = 8192;
const KV_DIM: u64 = 1024;
const FFN: u64 = 28_672;
const VOCAB: u64 = 32_000;
const HEADS: u64 = 64;
const BF16: u64 = 2;
const FP32: u64 = 4;
const MAX_POSITIONS: u64 = 4096;
const GENERATIONS: usize = 3;
const BATCHES: [u64; 3] = [4, 8, 16];
const PREFILL_TOKENS: u64 = 16 * 1024;

/// The weight tensors of one layer, in bytes: norms, q, k, v, o, gate, up, down.
const LAYER_WEIGHTS: [u64; 9] = [
    HIDDEN * BF16,
    HIDDEN * HIDDEN * BF16,
    HIDDEN * KV_DIM * BF16,
    HIDDEN * KV_DIM * BF16,
    HIDDEN * HIDDEN * BF16,
    HIDDEN * BF16,
    HIDDEN * FFN * BF16,
    HIDDEN * FFN * BF16,
    FFN * HIDDEN * BF16,
];

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    let resident = [
        t.alloc(VOCAB * HIDDEN * BF16, COMPUTE),
        t.alloc(HIDDEN * BF16, COMPUTE),
        t.alloc(VOCAB * HIDDEN * BF16, COMPUTE),
    ];
    for _ in 0..GENERATIONS {
        let batch = BATCHES[rng.below(BATCHES.len() as u64) as usize];
        let max_prompt = (PREFILL_TOKENS / batch).min(MAX_POSITIONS - 64);
        let prompt = rng.log_uniform(128, max_prompt);
        let new_tokens = rng.range(2..7);
        // Static KV cache: K and V for every position of every sequence, per layer.
        let kv: Vec<u64> = (0..LAYERS)
            .map(|_| t.alloc(2 * batch * MAX_POSITIONS * KV_DIM * BF16, COMPUTE))
            .collect();
        forward(&mut t, batch, batch * prompt, prompt);
        for step in 1..=new_tokens {
            forward(&mut t, batch, batch, prompt + step);
        }
        t.free_all(kv);
    }
    t.free_all(resident);
    t.finish()
}

/// One forward pass over `tokens` tokens of `batch` sequences whose cached length is `positions`, with
/// the weights of each layer prefetched on the side stream.
fn forward(t: &mut TraceBuilder, batch: u64, tokens: u64, positions: u64) {
    let mut hidden = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    let mut prefetched: std::collections::VecDeque<Vec<u64>> = std::collections::VecDeque::new();
    let mut next = 0;
    for layer in 0..LAYERS {
        while next < LAYERS && next <= layer + PREFETCH_DEPTH {
            prefetched.push_back(
                LAYER_WEIGHTS
                    .iter()
                    .map(|&s| t.alloc(s, PREFETCH))
                    .collect(),
            );
            next += 1;
        }
        let weights = prefetched.pop_front().expect("this layer was prefetched");
        for &w in &weights {
            t.record_stream(w, COMPUTE);
        }
        hidden = layer_activations(t, batch, tokens, positions, hidden);
        t.free_all(weights);
    }
    let logits = t.alloc(batch * VOCAB * FP32, COMPUTE);
    let sampled = t.alloc(batch * 8, COMPUTE);
    t.free_all([logits, hidden, sampled]);
}

/// The activations of one decoder layer; returns the new residual stream (the old one is freed).
fn layer_activations(
    t: &mut TraceBuilder,
    batch: u64,
    tokens: u64,
    positions: u64,
    hidden: u64,
) -> u64 {
    let normed = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    let qkv = t.alloc(tokens * (HIDDEN + 2 * KV_DIM) * BF16, COMPUTE);
    // Prefill runs a fused attention kernel; decode steps materialise fp32 scores over the cache.
    let decode = tokens == batch;
    let scores = decode.then(|| t.alloc(batch * HEADS * positions * FP32, COMPUTE));
    let attn = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    t.free_all(scores.into_iter().chain([qkv, normed]));
    let residual = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    t.free_all([attn, hidden]);
    let normed = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    let gate = t.alloc(tokens * FFN * BF16, COMPUTE);
    let up = t.alloc(tokens * FFN * BF16, COMPUTE);
    t.free(normed);
    let act = t.alloc(tokens * FFN * BF16, COMPUTE);
    t.free_all([gate, up]);
    let out = t.alloc(tokens * HIDDEN * BF16, COMPUTE);
    t.free_all([act, residual]);
    out
}
