//! `batched-inference`: an evaluation or scoring service that runs a 7B-parameter encoder over batches of
//! variable-length sequences and calls `torch.cuda.empty_cache()` after each batch.
//!
//! Persistent bf16 weights (per-layer q/k/v/o and gate/up/down matrices, norm vectors, embeddings). Each
//! batch has a random number of sequences (1 to 32) padded to a random length (log-uniform, 64 to 4,096
//! tokens), trimmed to a token budget; its inputs (token ids, attention mask, position ids) are copied in,
//! then each layer allocates and frees its temporaries (normed hidden states, fused qkv, attention scores,
//! quadratic in the length, attention output, MLP gate/up/down), the final hidden states are pooled, and
//! the per-sequence scores come back. Everything but the weights is freed, then the cache is emptied, as
//! evaluation loops and servers do between batches so that the next, differently shaped batch does not
//! fragment what the last one cached.

use super::rng::Rng;
use super::weights::{self, BF16, FFN, HIDDEN, Head, LAYERS};
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;

/// The workload's name.
pub const NAME: &str = "batched-inference";
/// One line saying what it models.
pub const DESCRIPTION: &str =
    "7B-encoder scoring service: variable-length batches, empty_cache() after each";

const HEADS: u64 = 32;
const FP32: u64 = 4;
const I64: u64 = 8;
const MAX_SEQS: u64 = 32;
const TOKEN_BUDGET: u64 = 16 * 1024;
const BATCHES: usize = 60;
const S: StreamId = StreamId::DEFAULT;

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    weights::load(&mut t, Head::Norm, S);
    for _ in 0..BATCHES {
        let len = rng.log_uniform(64, 4096);
        let seqs = rng.range(1..MAX_SEQS + 1).min((TOKEN_BUDGET / len).max(1));
        batch(&mut t, seqs, len);
        t.empty_cache();
    }
    t.finish()
}

/// One batch of `seqs` sequences padded to `len` tokens.
fn batch(t: &mut TraceBuilder, seqs: u64, len: u64) {
    let tokens = seqs * len;
    let ids = t.alloc(tokens * I64, S);
    let mask = t.alloc(tokens, S);
    let positions = t.alloc(len * I64, S);
    let mut hidden = t.alloc(tokens * HIDDEN * BF16, S);
    for _ in 0..LAYERS {
        let normed = t.alloc(tokens * HIDDEN * BF16, S);
        let qkv = t.alloc(tokens * 3 * HIDDEN * BF16, S);
        t.free(normed);
        let scores = t.alloc(seqs * HEADS * len * len * BF16, S);
        let attn = t.alloc(tokens * HIDDEN * BF16, S);
        t.free_all([scores, qkv]);
        let residual = t.alloc(tokens * HIDDEN * BF16, S);
        t.free_all([attn, hidden]);
        let gate = t.alloc(tokens * FFN * BF16, S);
        let up = t.alloc(tokens * FFN * BF16, S);
        let down = t.alloc(tokens * HIDDEN * BF16, S);
        t.free_all([gate, up, residual]);
        hidden = down;
    }
    let pooled = t.alloc(seqs * HIDDEN * FP32, S);
    let scores = t.alloc(seqs * FP32, S);
    t.free_all([hidden, pooled, ids, mask, positions, scores]);
}
