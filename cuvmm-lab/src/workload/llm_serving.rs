//! `llm-serving`: a naive LLM inference server for a 7B-parameter model in bf16.
//!
//! Persistent bf16 weights (per-layer q/k/v/o and gate/up/down matrices, norm vectors, embeddings). Requests
//! arrive at random (exponential inter-arrival times) with log-uniform prompt and output lengths; a
//! scheduler admits them while the worst-case KV tokens fit a budget, so tens to a couple of hundred run
//! at once. Each request holds one KV-cache buffer for all layers (512 KiB per token) that a naive stack
//! grows by reallocation: every 32 tokens it allocates a bigger buffer, copies, and frees the old one. The
//! buffer and the request's output-id buffer are freed when it finishes. Each step allocates and frees
//! activation temporaries sized by the batch (prefill steps by the prompt tokens), including logits.

use super::rng::Rng;
use super::weights::{self, BF16, FFN, HIDDEN, Head, LAYERS, VOCAB};
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;
use std::collections::VecDeque;

/// The workload's name.
pub const NAME: &str = "llm-serving";
/// One line saying what it models.
pub const DESCRIPTION: &str =
    "7B-model inference serving: requests come and go, each KV cache regrown every 32 tokens";

const FP32: u64 = 4;
const KV_PER_TOKEN: u64 = 2 * LAYERS * HIDDEN * BF16;
const CHUNK: u64 = 32;
const TOKEN_BUDGET: u64 = 48 * 1024;
const MAX_BATCH: usize = 256;
const STEPS: usize = 2_500;
const MEAN_ARRIVAL_STEPS: f64 = 2.0;
const S: StreamId = StreamId::DEFAULT;

struct Request {
    prompt: u64,
    output: u64,
}

struct Active {
    kv: u64,
    out_ids: u64,
    len: u64,
    cap: u64,
    remaining: u64,
    budget: u64,
}

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    weights::load(&mut t, Head::LmHead, S);
    let mut queue: VecDeque<Request> = VecDeque::new();
    let mut active: Vec<Active> = Vec::new();
    let mut reserved = 0u64;
    let mut next_arrival = 0.0;
    for step in 0..STEPS {
        while next_arrival <= step as f64 {
            queue.push_back(Request {
                prompt: rng.log_uniform(16, 2048),
                output: rng.log_uniform(8, 1024),
            });
            next_arrival += rng.exponential(MEAN_ARRIVAL_STEPS);
        }
        // Admission and prefill of the newly admitted requests.
        let mut prefill_tokens = 0;
        while let Some(req) = queue.front() {
            let budget = req.prompt + req.output;
            if active.len() >= MAX_BATCH || reserved + budget > TOKEN_BUDGET {
                break;
            }
            reserved += budget;
            prefill_tokens += req.prompt;
            let cap = (req.prompt + 1).next_multiple_of(CHUNK);
            active.push(Active {
                kv: t.alloc(cap * KV_PER_TOKEN, S),
                out_ids: t.alloc(req.output * 8, S),
                len: req.prompt,
                cap,
                remaining: req.output,
                budget,
            });
            queue.pop_front();
        }
        if prefill_tokens > 0 {
            forward_temporaries(&mut t, prefill_tokens);
        }
        if active.is_empty() {
            continue;
        }
        forward_temporaries(&mut t, active.len() as u64);
        let sampled = t.alloc(active.len() as u64 * 8, S);
        t.free(sampled);
        // One token per request: grow the KV buffers that are full, retire finished requests.
        active.retain_mut(|req| {
            req.len += 1;
            req.remaining -= 1;
            if req.remaining == 0 {
                t.free_all([req.kv, req.out_ids]);
                reserved -= req.budget;
                return false;
            }
            if req.len == req.cap {
                req.cap += CHUNK;
                let bigger = t.alloc(req.cap * KV_PER_TOKEN, S);
                t.free(req.kv);
                req.kv = bigger;
            }
            true
        });
    }
    t.finish()
}

/// A forward pass over `tokens` tokens: hidden states, fused qkv, MLP intermediates, last-token logits.
fn forward_temporaries(t: &mut TraceBuilder, tokens: u64) {
    let hidden = t.alloc(tokens * HIDDEN * BF16, S);
    let qkv = t.alloc(tokens * 3 * HIDDEN * BF16, S);
    let attn = t.alloc(tokens * HIDDEN * BF16, S);
    t.free(qkv);
    let gate = t.alloc(tokens * FFN * BF16, S);
    let up = t.alloc(tokens * FFN * BF16, S);
    t.free_all([gate, up, attn]);
    let logits = t.alloc(tokens.min(MAX_BATCH as u64) * VOCAB * FP32, S);
    t.free_all([logits, hidden]);
}
