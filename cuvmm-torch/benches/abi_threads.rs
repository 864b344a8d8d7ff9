//! The C ABI's hot path (`cuvmm_malloc` / `cuvmm_free`, what PyTorch calls) with 1, 2, 4 and 8 threads,
//! each on its own stream, on simulated devices: cached alloc+free pairs, as `cuvmm bench-threads`
//! measures the facade's other entry points (it cannot reach this crate, which depends on it).
//!
//! Each benchmark's time is that of one pair on every thread at once; criterion's throughput is the pairs
//! of all threads per second, so `thrpt` at N threads over `thrpt` at 1 is the speedup. The configuration is
//! `CUVMM_ALLOC_CONF`'s, else the PyTorch backend's default, whose stream caches wait for contention: one
//! thread then runs the strategy's path (each size on a device of its own, so its one-thread run sees the
//! strategy exactly, as a program that never contends does), and threads that contend run the caches'.
//! `CUVMM_ALLOC_CONF=stream_cache_eager:True` measures the caches from the first pair, as the Rust library's
//! default does.
//!
//! `cargo bench -p cuvmm-torch --bench abi_threads`

use criterion::{BenchmarkId, Criterion, Throughput};
use cuvmm_torch::ffi::{cuvmm_free, cuvmm_malloc};
use cuvmm_torch::registry::Settings;
use std::ffi::c_void;
use std::hint::black_box;
use std::sync::Barrier;
use std::time::{Duration, Instant};

const GIB: u64 = 1 << 30;
const SIZES: [(&str, isize); 3] = [("512B", 512), ("64KiB", 64 << 10), ("20MiB", 20 << 20)];
const THREADS: [usize; 4] = [1, 2, 4, 8];

fn stream(n: usize) -> *mut c_void {
    std::ptr::without_provenance_mut(n)
}

/// One alloc+free pair through the C ABI.
fn pair(size: isize, device: i32, stream: *mut c_void) {
    let ptr = cuvmm_malloc(black_box(size), device, stream);
    assert!(!ptr.is_null(), "{:?}", cuvmm_torch::last_error());
    cuvmm_free(ptr, size, device, stream);
}

/// `iters` pairs on each of `n` threads, thread `t` on stream `t + 1`; the time from all threads starting to
/// the last one finishing.
fn threads(n: usize, iters: u64, size: isize, device: i32) -> Duration {
    let start = Barrier::new(n);
    let times: Vec<Duration> = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..n)
            .map(|t| {
                let start = &start;
                scope.spawn(move || {
                    let s = stream(t + 1);
                    pair(size, device, s);
                    start.wait();
                    let began = Instant::now();
                    for _ in 0..iters {
                        pair(size, device, s);
                    }
                    began.elapsed()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    times.into_iter().max().unwrap_or_default()
}

fn main() {
    let config = cuvmm::Config::from_env().expect("CUVMM_ALLOC_CONF is a valid configuration");
    cuvmm_torch::install(Settings {
        config,
        ..Settings::sim(16 * GIB, SIZES.len())
    });
    let mut c = Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20)
        .configure_from_args();
    let mut group = c.benchmark_group("c_abi");
    for (device, (name, size)) in SIZES.into_iter().enumerate() {
        let device = device as i32;
        for n in THREADS {
            group.throughput(Throughput::Elements(n as u64));
            group.bench_with_input(
                BenchmarkId::new(name, format!("{n}threads")),
                &n,
                |b, &n| b.iter_custom(|iters| threads(n, iters, size, device)),
            );
        }
    }
    group.finish();
    c.final_summary();
}
