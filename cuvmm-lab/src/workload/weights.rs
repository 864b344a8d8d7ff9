//! The weights of a 7B Llama-style decoder in bf16, allocated one parameter at a time in the order PyTorch
//! creates them: shared by the inference workloads (`llm-serving`, `batched-inference`).

use crate::trace::builder::TraceBuilder;
use cuvmm::driver::StreamId;

/// Decoder layers.
pub(super) const LAYERS: u64 = 32;
/// Hidden size.
pub(super) const HIDDEN: u64 = 4096;
/// The feed-forward layers' inner size.
pub(super) const FFN: u64 = 11_008;
/// Vocabulary size.
pub(super) const VOCAB: u64 = 32_000;
/// Bytes of a bf16 value.
pub(super) const BF16: u64 = 2;

/// What follows the final norm.
pub(super) enum Head {
    /// The language-model head, a vocabulary-by-hidden matrix.
    LmHead,
    /// A second norm (an encoder's pooling layer).
    Norm,
}

/// Allocates the weights on `stream`: the embedding; per layer a norm, the four attention projections, a
/// norm and the three feed-forward matrices; the final norm; then `head`.
pub(super) fn load(t: &mut TraceBuilder, head: Head, stream: StreamId) {
    t.alloc(VOCAB * HIDDEN * BF16, stream);
    for _ in 0..LAYERS {
        t.alloc(HIDDEN * BF16, stream);
        for _ in 0..4 {
            t.alloc(HIDDEN * HIDDEN * BF16, stream);
        }
        t.alloc(HIDDEN * BF16, stream);
        for _ in 0..3 {
            t.alloc(HIDDEN * FFN * BF16, stream);
        }
    }
    t.alloc(HIDDEN * BF16, stream);
    match head {
        Head::LmHead => t.alloc(VOCAB * HIDDEN * BF16, stream),
        Head::Norm => t.alloc(HIDDEN * BF16, stream),
    };
}
