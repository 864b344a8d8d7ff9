//! `moe`: training a mixture-of-experts decoder (dropless, top-2 routing) in bf16.
//!
//! Modelled on dropless MoE stacks (MegaBlocks, Megatron's grouped GEMM): each layer's router sends each token
//! to two of 16 experts, and the split is uneven and different every step (popular experts get ten times
//! the average, some get none), so the per-expert buffers (`tokens_e * hidden`, `tokens_e * ffn`) take a
//! new size at every layer of every step. Persistent: bf16 weights and gradients, one tensor per expert
//! matrix, per attention projection, per norm and per router. Per layer forward: attention activations at
//! a fixed `batch*seq*hidden`, router logits and probabilities, top-k indices and per-expert counts (a few
//! hundred bytes), the permuted token buffer, then per expert its gathered input and saved MLP activations.
//! Backward frees them in reverse with per-expert gradient temporaries.

use super::rng::Rng;
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;

/// The workload's name.
pub const NAME: &str = "moe";
/// One line saying what it models.
pub const DESCRIPTION: &str =
    "mixture-of-experts training: 16 experts, top-2 routing with skewed token counts per step";

const LAYERS: usize = 12;
const EXPERTS: usize = 16;
const TOP_K: u64 = 2;
const HIDDEN: u64 = 2048;
const FFN: u64 = 4096;
const VOCAB: u64 = 32_000;
/// Per-token log-sum-exp values saved by flash attention, one per head.
const HEADS_LSE: u64 = 16;
const TOKENS: u64 = 8 * 2048;
const STEPS: usize = 14;
const BF16: u64 = 2;
const FP32: u64 = 4;
const S: StreamId = StreamId::DEFAULT;

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    // Weights, then gradients: embedding, per layer 2 norms, 4 attention projections, router, experts.
    let mut params = vec![VOCAB * HIDDEN];
    for _ in 0..LAYERS {
        params.extend([HIDDEN, HIDDEN]);
        params.extend([HIDDEN * HIDDEN; 4]);
        params.push(HIDDEN * EXPERTS as u64);
        params.extend([HIDDEN * FFN; 2 * EXPERTS]);
    }
    params.extend([HIDDEN, VOCAB * HIDDEN]);
    for _copy in 0..2 {
        for &numel in &params {
            t.alloc(numel * BF16, S);
        }
    }
    for _ in 0..STEPS {
        step(&mut t, &mut rng);
    }
    t.finish()
}

/// Tokens routed to each expert: `TOKENS * TOP_K` assignments split by heavy-tailed random popularity.
fn route(rng: &mut Rng) -> Vec<u64> {
    let popularity: Vec<f64> = (0..EXPERTS).map(|_| rng.exponential(1.0).powi(2)).collect();
    let total: f64 = popularity.iter().sum();
    popularity
        .iter()
        .map(|p| ((TOKENS * TOP_K) as f64 * p / total).round() as u64)
        .collect()
}

fn step(t: &mut TraceBuilder, rng: &mut Rng) {
    let act = TOKENS * HIDDEN * BF16;
    let mut x = t.alloc(act, S);
    let mut saved = Vec::with_capacity(LAYERS);
    for _ in 0..LAYERS {
        let counts = route(rng);
        let mut ids = vec![x];
        // Attention block (flash attention: no seq*seq buffer), norm statistics.
        ids.extend([t.alloc(act, S), t.alloc(TOKENS * FP32, S)]);
        ids.extend([t.alloc(act, S), t.alloc(act, S), t.alloc(act, S)]);
        ids.extend([t.alloc(act, S), t.alloc(TOKENS * HEADS_LSE * FP32, S)]);
        let mid = t.alloc(act, S);
        ids.extend([mid, t.alloc(act, S)]);
        // Router: logits, probabilities, top-k indices and weights, per-expert counts and offsets.
        let logits = t.alloc(TOKENS * EXPERTS as u64 * FP32, S);
        ids.push(t.alloc(TOKENS * EXPERTS as u64 * FP32, S));
        t.free(logits);
        ids.extend([
            t.alloc(TOKENS * TOP_K * 8, S),
            t.alloc(TOKENS * TOP_K * FP32, S),
            t.alloc(EXPERTS as u64 * 8, S),
            t.alloc(EXPERTS as u64 * 8, S),
        ]);
        ids.push(t.alloc(TOKENS * TOP_K * HIDDEN * BF16, S));
        // Experts: gathered input, fc1 output and activation saved; fc2 output scattered back.
        let mut outputs = Vec::new();
        for &n in counts.iter().filter(|&&n| n > 0) {
            ids.extend([
                t.alloc(n * HIDDEN * BF16, S),
                t.alloc(n * FFN * BF16, S),
                t.alloc(n * FFN * BF16, S),
            ]);
            outputs.push(t.alloc(n * HIDDEN * BF16, S));
        }
        let combined = t.alloc(TOKENS * TOP_K * HIDDEN * BF16, S);
        t.free_all(outputs);
        x = t.alloc(act, S);
        t.free(combined);
        saved.push((ids, counts));
    }
    let loss_logits = t.alloc(TOKENS * VOCAB * BF16, S);
    let loss = t.alloc(FP32, S);
    let mut grad = t.alloc(act, S);
    t.free_all([loss_logits, loss, x]);
    for (ids, counts) in saved.into_iter().rev() {
        grad = backward_layer(t, act, ids, &counts, grad);
    }
    t.free(grad);
    let norms: Vec<u64> = (0..LAYERS).map(|_| t.alloc(FP32, S)).collect();
    t.free_all(norms);
}

fn backward_layer(t: &mut TraceBuilder, act: u64, ids: Vec<u64>, counts: &[u64], grad: u64) -> u64 {
    let d_combined = t.alloc(TOKENS * TOP_K * HIDDEN * BF16, S);
    let mut d_inputs = Vec::new();
    for &n in counts.iter().filter(|&&n| n > 0) {
        let d_act = t.alloc(n * FFN * BF16, S);
        let d_fc1 = t.alloc(n * FFN * BF16, S);
        t.free(d_act);
        d_inputs.push(t.alloc(n * HIDDEN * BF16, S));
        t.free(d_fc1);
    }
    let d_permuted = t.alloc(TOKENS * TOP_K * HIDDEN * BF16, S);
    t.free_all(d_inputs);
    t.free(d_combined);
    let d_router = t.alloc(TOKENS * EXPERTS as u64 * FP32, S);
    let d_mid = t.alloc(act, S);
    t.free_all([d_permuted, d_router, grad]);
    let d_qkv = [t.alloc(act, S), t.alloc(act, S), t.alloc(act, S)];
    let d_x = t.alloc(act, S);
    t.free_all(d_qkv);
    t.free(d_mid);
    t.free_all(ids.into_iter().rev());
    d_x
}
