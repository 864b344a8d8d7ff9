//! `transformer-train`: mixed-precision training of a ~1B-parameter GPT-style decoder with Adam.
//!
//! Modelled on what PyTorch does under `torch.autocast(bfloat16)`: fp32 weights, gradients and both Adam
//! moments are allocated up front, one tensor per parameter (q/k/v/o and MLP matrices of 8-32 MiB, biases and
//! layernorm vectors of a few KiB, a 400 MiB embedding). Each step draws its own sequence length, as packing
//! variable-length documents does, so every activation size changes from step to step: this is what
//! fragments a block-splitting allocator. Forward casts weights to bf16 and saves per-layer activations
//! (`batch*seq*hidden`, the attention probabilities `batch*heads*seq*seq`, the MLP's `batch*seq*4*hidden`);
//! the loss upcasts logits to fp32 (over 1 GiB at the longest sequences). Backward frees the saved tensors
//! layer by layer in reverse while allocating gradient temporaries; the optimizer step allocates per-layer
//! norm scalars and foreach temporaries.

use super::rng::Rng;
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;

/// The workload's name.
pub const NAME: &str = "transformer-train";
/// One line saying what it models.
pub const DESCRIPTION: &str = "GPT-style ~1B-parameter training with Adam, bf16 autocast and a variable sequence length per step";

const LAYERS: usize = 20;
const HIDDEN: u64 = 2048;
const HEADS: u64 = 16;
const FFN: u64 = 4 * HIDDEN;
const VOCAB: u64 = 50_304;
const MAX_SEQ: u64 = 2048;
const BATCH: u64 = 4;
const STEPS: usize = 32;
const FP32: u64 = 4;
const BF16: u64 = 2;
const S: StreamId = StreamId::DEFAULT;

/// Element counts of one layer's parameters: ln1 (w, b), q, k, v, o (w, b each), ln2 (w, b), fc1 (w, b),
/// fc2 (w, b).
fn layer_params() -> Vec<u64> {
    let mut p = vec![HIDDEN, HIDDEN];
    for _ in 0..4 {
        p.extend([HIDDEN * HIDDEN, HIDDEN]);
    }
    p.extend([HIDDEN, HIDDEN, HIDDEN * FFN, FFN, FFN * HIDDEN, HIDDEN]);
    p
}

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    // Parameters: embeddings, layers, final layernorm; then grads and the two Adam moments, all fp32.
    let mut params = vec![VOCAB * HIDDEN, MAX_SEQ * HIDDEN];
    for _ in 0..LAYERS {
        params.extend(layer_params());
    }
    params.extend([HIDDEN, HIDDEN]);
    for _copy in 0..4 {
        for &numel in &params {
            t.alloc(numel * FP32, S);
        }
    }
    for _ in 0..STEPS {
        let seq = 64 * rng.range(4..MAX_SEQ / 64 + 1);
        step(&mut t, &mut rng, seq);
    }
    t.finish()
}

/// What forward saved for one layer's backward.
struct Saved {
    ids: Vec<u64>,
}

fn step(t: &mut TraceBuilder, rng: &mut Rng, seq: u64) {
    let tokens = BATCH * seq;
    let act = tokens * HIDDEN * BF16;
    let scores = BATCH * HEADS * seq * seq * BF16;
    let ids = t.alloc(tokens * 8, S);
    let labels = t.alloc(tokens * 8, S);
    let mut x = t.alloc(act, S);
    let mut saved = Vec::with_capacity(LAYERS);
    for _ in 0..LAYERS {
        let (layer, out) = forward_layer(t, rng, tokens, act, scores, x);
        saved.push(layer);
        x = out;
    }
    // Final layernorm, logits in bf16, upcast to fp32 for the cross-entropy, a scalar loss.
    let ln = t.alloc(act, S);
    let stats = [t.alloc(tokens * FP32, S), t.alloc(tokens * FP32, S)];
    let logits = t.alloc(tokens * VOCAB * BF16, S);
    let logits32 = t.alloc(tokens * VOCAB * FP32, S);
    let loss = t.alloc(FP32, S);
    // Backward of the loss: gradient of the logits, then of the final layernorm.
    let grad_logits32 = t.alloc(tokens * VOCAB * FP32, S);
    t.free_all([logits32, loss]);
    let grad_logits = t.alloc(tokens * VOCAB * BF16, S);
    t.free_all([grad_logits32, logits]);
    let mut grad = t.alloc(act, S);
    t.free_all([grad_logits, ln, stats[0], stats[1], x]);
    for layer in saved.into_iter().rev() {
        grad = backward_layer(t, tokens, act, scores, layer, grad);
    }
    // Embedding backward: a sparse-ish gradient accumulated into the fp32 grad through a bf16 temporary.
    let emb_grad = t.alloc(VOCAB * HIDDEN * BF16, S);
    t.free_all([grad, emb_grad, ids, labels]);
    optimizer_step(t, rng);
}

/// Forward of one block; `x` is the input (saved), returns the saved tensors and the output.
fn forward_layer(
    t: &mut TraceBuilder,
    rng: &mut Rng,
    tokens: u64,
    act: u64,
    scores: u64,
    x: u64,
) -> (Saved, u64) {
    let mut ids = vec![x];
    // Layernorm 1 and its per-token mean and rstd (a few KiB to 32 KiB).
    ids.extend([
        t.alloc(act, S),
        t.alloc(tokens * FP32, S),
        t.alloc(tokens * FP32, S),
    ]);
    // Autocast casts of the weights (kept for backward) and the q, k, v projections.
    for _ in 0..4 {
        ids.push(t.alloc(HIDDEN * HIDDEN * BF16, S));
    }
    ids.extend([t.alloc(act, S), t.alloc(act, S), t.alloc(act, S)]);
    // Attention: raw scores (temporary), softmax probabilities (saved), an occasional per-head scale.
    let raw = t.alloc(scores, S);
    let scale = rng.chance(0.5).then(|| t.alloc(HEADS * FP32, S));
    ids.push(t.alloc(scores, S));
    t.free(raw);
    t.free_all(scale);
    ids.push(t.alloc(act, S));
    let proj = t.alloc(act, S);
    let mid = t.alloc(act, S);
    t.free(proj);
    ids.push(mid);
    // Layernorm 2 and the MLP.
    ids.extend([
        t.alloc(act, S),
        t.alloc(tokens * FP32, S),
        t.alloc(tokens * FP32, S),
        t.alloc(HIDDEN * FFN * BF16, S),
        t.alloc(HIDDEN * FFN * BF16, S),
        t.alloc(tokens * FFN * BF16, S),
        t.alloc(tokens * FFN * BF16, S),
    ]);
    let fc2 = t.alloc(act, S);
    let out = t.alloc(act, S);
    t.free(fc2);
    (Saved { ids }, out)
}

/// Backward of one block: gradient temporaries, weight-gradient casts accumulated into the fp32 grads, and
/// the saved tensors freed in reverse. Returns the gradient of the block's input.
fn backward_layer(
    t: &mut TraceBuilder,
    tokens: u64,
    act: u64,
    scores: u64,
    layer: Saved,
    grad: u64,
) -> u64 {
    // MLP backward.
    let d_gelu = t.alloc(tokens * FFN * BF16, S);
    let d_fc1 = t.alloc(tokens * FFN * BF16, S);
    t.free(d_gelu);
    for _ in 0..2 {
        let w_grad = t.alloc(HIDDEN * FFN * BF16, S);
        let b_grad = t.alloc(FFN * BF16, S);
        t.free_all([w_grad, b_grad]);
    }
    let d_mid = t.alloc(act, S);
    t.free_all([d_fc1, grad]);
    // Attention backward: gradients of probabilities and scores, q, k, v.
    let d_probs = t.alloc(scores, S);
    let d_scores = t.alloc(scores, S);
    t.free(d_probs);
    let d_qkv = [t.alloc(act, S), t.alloc(act, S), t.alloc(act, S)];
    t.free(d_scores);
    for _ in 0..4 {
        let w_grad = t.alloc(HIDDEN * HIDDEN * BF16, S);
        t.free(w_grad);
    }
    let d_x = t.alloc(act, S);
    t.free_all(d_qkv);
    t.free(d_mid);
    t.free_all(layer.ids.into_iter().rev());
    d_x
}

/// Gradient clipping (a norm scalar per layer, then the total) and a foreach Adam step whose temporaries
/// are as large as each layer's largest parameter.
fn optimizer_step(t: &mut TraceBuilder, rng: &mut Rng) {
    let norms: Vec<u64> = (0..LAYERS + 2).map(|_| t.alloc(FP32, S)).collect();
    let total = t.alloc(FP32, S);
    let clip = t.alloc(FP32, S);
    t.free_all(norms);
    t.free_all([total, clip]);
    for _ in 0..LAYERS {
        let chunk = if rng.chance(0.5) { 2 } else { 1 };
        let temps = [
            t.alloc(chunk * HIDDEN * FFN * FP32, S),
            t.alloc(chunk * HIDDEN * FFN * FP32, S),
        ];
        t.free_all(temps);
    }
}
