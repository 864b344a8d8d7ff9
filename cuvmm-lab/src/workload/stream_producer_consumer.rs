//! `stream-producer-consumer`: a multi-stream pipeline, as in a data-loading or pre-processing service.
//!
//! A producer stream fills batches of input buffers of varied sizes (256 KiB to 1 GiB) and keeps the last
//! few batches in flight; two consumer streams, each with its own persistent model weights, take batches
//! in turn and allocate work buffers (4 KiB to 256 MiB, freed within the batch) and output buffers kept in
//! a small ring; a side stream allocates small staging and metrics buffers (hundreds of bytes to 64 KiB)
//! that live a few batches. A consumer reads the batch the producer made two iterations before, so it
//! records its use of those input buffers (`record_stream`); the producer frees them when they leave its
//! in-flight window, and their memory returns to the producer only after the consumer's work on them.

use super::rng::Rng;
use crate::trace::builder::TraceBuilder;
use crate::trace::event::Trace;
use cuvmm::driver::StreamId;
use cuvmm::size::{GIB, KIB, MIB};
use std::collections::VecDeque;

/// The workload's name.
pub const NAME: &str = "stream-producer-consumer";
/// One line saying what it models.
pub const DESCRIPTION: &str = "a producer stream feeding two consumer streams (record_stream on its inputs) and a side stream";

const PRODUCER: StreamId = StreamId(1);
const CONSUMERS: [StreamId; 2] = [StreamId(2), StreamId(3)];
const SIDE: StreamId = StreamId(4);
const BATCHES: usize = 1_100;
const IN_FLIGHT: usize = 8;
const OUTPUT_RING: usize = 4;
const SIDE_LIFETIME: usize = 3;

/// Generates the trace for `seed`.
pub fn generate(seed: u64) -> Trace {
    let mut rng = Rng::new(seed);
    let mut t = TraceBuilder::new(NAME);
    for stream in CONSUMERS {
        for _ in 0..rng.range(40..120) {
            t.alloc(rng.log_uniform(4 * KIB, 256 * MIB), stream);
        }
    }
    let mut batches: VecDeque<Vec<u64>> = VecDeque::new();
    let mut outputs: [VecDeque<u64>; 2] = Default::default();
    let mut side: VecDeque<Vec<u64>> = VecDeque::new();
    for batch in 0..BATCHES {
        // Producer: a new batch; the oldest one in flight is done.
        let count = rng.range(4..13);
        batches.push_back(
            (0..count)
                .map(|_| t.alloc(rng.log_uniform(256 * KIB, GIB), PRODUCER))
                .collect(),
        );
        // The consumer whose turn it is works on the batch produced two iterations ago.
        let consumer = batch % CONSUMERS.len();
        if let Some(inputs) = batches.len().checked_sub(3).map(|i| &batches[i]) {
            for &input in inputs {
                t.record_stream(input, CONSUMERS[consumer]);
            }
        }
        consume(
            &mut t,
            &mut rng,
            CONSUMERS[consumer],
            &mut outputs[consumer],
        );
        if batches.len() > IN_FLIGHT {
            t.free_all(batches.pop_front().into_iter().flatten());
        }
        // Side stream: staging and metrics buffers.
        side.push_back(
            (0..rng.range(1..5))
                .map(|_| t.alloc(rng.log_uniform(256, 64 * KIB), SIDE))
                .collect(),
        );
        if side.len() > SIDE_LIFETIME {
            t.free_all(side.pop_front().into_iter().flatten());
        }
    }
    t.finish()
}

/// One consumer's work on a batch: temporaries freed in a random order, one output kept in a ring.
fn consume(t: &mut TraceBuilder, rng: &mut Rng, stream: StreamId, outputs: &mut VecDeque<u64>) {
    let mut work: Vec<u64> = (0..rng.range(3..11))
        .map(|_| t.alloc(rng.log_uniform(4 * KIB, 256 * MIB), stream))
        .collect();
    outputs.push_back(t.alloc(rng.log_uniform(MIB, 128 * MIB), stream));
    while !work.is_empty() {
        let i = rng.below(work.len() as u64) as usize;
        t.free(work.swap_remove(i));
    }
    if outputs.len() > OUTPUT_RING {
        t.free_all(outputs.pop_front());
    }
}
