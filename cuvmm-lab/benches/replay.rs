//! Replay throughput on the simulated device (no GPU needed): `replay/<allocator>/<workload>` replays a
//! built-in workload through one allocator, each iteration on a fresh device. Building the allocator and
//! dropping it are not timed; generating the trace happens once. Criterion reports elements (events) per
//! second. `cuvmm bench` measures the same loop from the command line, on recorded snapshots too.
//!
//! Runtime is kept short: 1 s warm-up, 3 s of measurement, 10 samples per benchmark.

use criterion::{BatchSize, BenchmarkId, Criterion, Throughput};
use cuvmm_lab::replay::allocators;
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::workload;
use std::time::Duration;

const CAPACITY: u64 = 80 << 30;
const PAGE: u64 = 2 << 20;

fn replays(c: &mut Criterion) {
    let mut group = c.benchmark_group("replay");
    for name in ["moe", "llm-serving"] {
        let trace = workload::generate(name, workload::DEFAULT_SEED).expect("a built-in workload");
        group.throughput(Throughput::Elements(trace.events.len() as u64));
        for allocator in ["cuvmm", "classic"] {
            group.bench_function(BenchmarkId::new(allocator, name), |b| {
                b.iter_batched(
                    || allocators::build(allocator, CAPACITY, PAGE).expect("a known allocator"),
                    |mut strategy| {
                        let result = replay(strategy.as_mut(), &trace, &ReplayOptions::default())
                            .expect("the workload replays");
                        assert_eq!(result.ooms, 0);
                        strategy
                    },
                    BatchSize::PerIteration,
                )
            });
        }
    }
    group.finish();
}

fn main() {
    // What `criterion_group!` and `criterion_main!` expand to, without their undocumented `pub fn`.
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(10)
        .configure_from_args();
    replays(&mut c);
    c.final_summary();
}
