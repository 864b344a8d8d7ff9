//! Benchmarks of cuvmm's expandable allocator on the simulated device (no GPU needed):
//!
//! - `hot_path/<size>`: an alloc + free pair served from cached, mapped pages after a warm-up, so no
//!   driver call is made (checked after each benchmark, not timed);
//! - `facade/*`: the same through the thread-safe [`Allocator`] with its stream caches waiting for
//!   contention (`stream_cache_eager:False`, the PyTorch backend's default), so each pair takes the
//!   strategy's lock: raw and with the [`DeviceBuffer`] guard, at 512 B, 64 KiB and 20 MiB;
//! - `facade_cached/*`: raw and `DeviceBuffer` pairs with the default configuration, whose stream caches keep
//!   frees from the first, so pairs are served by the thread's cache without the strategy's lock (what
//!   every thread of a Rust service runs);
//! - `cuda/*` (feature `cuda`, skipped without a GPU): cuvmm's raw and `DeviceBuffer` paths on a real
//!   stream against cuMemAllocAsync / cuMemFreeAsync (the device's default pool, release threshold at its
//!   maximum) and cuMemAlloc / cuMemFree, 512 B to 20 MiB, 1 to 8 threads each on its own stream;
//! - `compaction/two_streams`: big allocations alternating between two streams on a device that holds
//!   only one of them, so each one unmaps the idle pages of the other stream's segment and maps them again
//!   (no new physical memory after the warm-up, checked).
//!
//! Times are of the allocator's bookkeeping plus the simulator's; the simulated driver latencies are not
//! slept. Runtime is kept modest: 1 s warm-up, 3 s of measurement, 20 samples per benchmark.

use criterion::{BenchmarkId, Criterion};
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::size::{KIB, MIB};
use cuvmm::{Allocator, Config, Strategy, StreamId};
use std::hint::black_box;
use std::time::Duration;

const S: StreamId = StreamId::DEFAULT;

/// An expandable allocator on a simulated device of `capacity` bytes with 2 MiB pages.
fn expandable(capacity: u64) -> Expandable<SimDriver> {
    let sim = SimDriver::new(SimConfig::default().with_capacity(capacity));
    Expandable::new(sim, Config::default()).expect("valid configuration")
}

fn hot_path(c: &mut Criterion) {
    let mut group = c.benchmark_group("hot_path");
    for (name, size) in [("512B", 512), ("64KiB", 64 * KIB), ("8MiB", 8 * MIB)] {
        let mut alloc = expandable(1 << 30);
        // Warm-up: map the pages once; every later pair is served from the cache.
        let addr = alloc.alloc(size, S).expect("warm-up alloc");
        alloc.free(addr).expect("warm-up free");
        let calls = alloc.driver_counters().total();
        group.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                let addr = alloc.alloc(black_box(size), S).expect("alloc");
                alloc.free(black_box(addr)).expect("free");
            })
        });
        assert_eq!(
            alloc.driver_counters().total(),
            calls,
            "the hot path made a driver call"
        );
    }
    group.finish();
}

const FACADE_SIZES: [(&str, u64); 3] = [("512B", 512), ("64KiB", 64 * KIB), ("20MiB", 20 * MIB)];

/// A facade over a 1 GiB simulated device, with the stream caches eager (the default) or not.
fn facade_allocator(eager: bool) -> Allocator<Expandable<SimDriver>> {
    let config = Config {
        stream_cache_eager: Some(eager),
        ..Config::default()
    };
    Allocator::expandable(
        SimDriver::new(SimConfig::default().with_capacity(1 << 30)),
        config,
    )
    .expect("valid configuration")
}

/// Raw and `DeviceBuffer` pairs on `alloc`, named `<path>/<size>`; no driver call after the warm-up.
fn facade_pairs(
    group: &mut criterion::BenchmarkGroup<'_, criterion::measurement::WallTime>,
    alloc: &Allocator<Expandable<SimDriver>>,
    name: &str,
    size: u64,
) {
    let calls = alloc.with_strategy(|s| s.driver_counters().total());
    group.bench_function(format!("alloc_raw+free_raw/{name}"), |b| {
        b.iter(|| {
            let ptr = alloc.alloc_raw(black_box(size), S).expect("alloc");
            alloc.free_raw(black_box(ptr)).expect("free");
        })
    });
    group.bench_function(format!("device_buffer/{name}"), |b| {
        b.iter(|| drop(black_box(alloc.alloc(black_box(size)).expect("alloc"))))
    });
    assert_eq!(
        alloc.with_strategy(|s| s.driver_counters().total()),
        calls,
        "the facade made a driver call"
    );
    assert!(alloc.take_deferred_errors().is_empty());
}

fn facade(c: &mut Criterion) {
    let mut group = c.benchmark_group("facade");
    for (name, size) in FACADE_SIZES {
        let alloc = facade_allocator(false);
        alloc
            .alloc(size)
            .expect("warm-up alloc")
            .free()
            .expect("warm-up free");
        facade_pairs(&mut group, &alloc, name, size);
    }
    group.finish();
    let mut group = c.benchmark_group("facade_cached");
    for (name, size) in FACADE_SIZES {
        let alloc = facade_allocator(true);
        drop(alloc.alloc(size).expect("warm-up alloc"));
        facade_pairs(&mut group, &alloc, name, size);
        assert!(
            alloc.stream_cached().0 > 0,
            "the pairs did not go through the stream cache"
        );
    }
    group.finish();
}

fn compaction(c: &mut Criterion) {
    let mut group = c.benchmark_group("compaction");
    // 64 MiB device, 48 MiB requests: the second stream's request fits only on the first one's pages.
    let mut alloc = expandable(64 * MIB);
    let size = 48 * MIB;
    let round = |alloc: &mut Expandable<SimDriver>| {
        for stream in [StreamId(1), StreamId(2)] {
            let addr = alloc.alloc(black_box(size), stream).expect("alloc");
            alloc.free(addr).expect("free");
        }
    };
    round(&mut alloc);
    let created = alloc.stats().num_device_alloc;
    group.bench_function("two_streams/48MiB", |b| b.iter(|| round(&mut alloc)));
    let stats = alloc.stats();
    assert_eq!(
        stats.num_device_alloc, created,
        "growth created pages instead of reusing idle ones"
    );
    assert!(stats.handles_reused > 0);
    group.finish();
}

fn config() -> Criterion {
    Criterion::default()
        .warm_up_time(Duration::from_secs(1))
        .measurement_time(Duration::from_secs(3))
        .sample_size(20)
}

fn main() {
    // What `criterion_group!` and `criterion_main!` expand to, without their undocumented `pub fn`.
    let mut c = config().configure_from_args();
    hot_path(&mut c);
    facade(&mut c);
    compaction(&mut c);
    #[cfg(feature = "cuda")]
    cuda::compare(&mut c);
    c.final_summary();
}

/// cuvmm against CUDA's allocators on a GPU (skipped, saying so, without one).
#[cfg(feature = "cuda")]
mod cuda {
    use super::*;
    use criterion::Throughput;
    use cudarc::driver::{CudaContext, CudaStream};
    use cuvmm::Driver;
    use cuvmm::driver::cuda::{AsyncPool, CudaDriver};
    use std::sync::{Arc, Barrier};
    use std::time::Instant;

    const SIZES: [(&str, u64); 4] = [
        ("512B", 512),
        ("64KiB", 64 * KIB),
        ("1MiB", MIB),
        ("20MiB", 20 * MIB),
    ];
    const THREADS: [usize; 4] = [1, 2, 4, 8];

    /// `iters` pairs on each of `n` threads, thread `t` on `streams[t]`, each thread's pair made by `make`
    /// before the clock starts; the time until the last thread is done.
    fn threads<P: FnMut()>(
        n: usize,
        iters: u64,
        streams: &[Arc<CudaStream>],
        make: &(dyn Fn(&Arc<CudaStream>) -> P + Sync),
    ) -> Duration {
        let start = Barrier::new(n);
        std::thread::scope(|scope| {
            let workers: Vec<_> = (0..n)
                .map(|t| {
                    let (start, stream) = (&start, &streams[t]);
                    scope.spawn(move || {
                        let mut pair = make(stream);
                        pair();
                        start.wait();
                        let began = Instant::now();
                        for _ in 0..iters {
                            pair();
                        }
                        began.elapsed()
                    })
                })
                .collect();
            workers
                .into_iter()
                .map(|w| w.join().unwrap())
                .max()
                .unwrap_or_default()
        })
    }

    pub(super) fn compare(c: &mut Criterion) {
        let Ok(driver) = CudaDriver::new(0) else {
            eprintln!("cuda/*: skipped (no CUDA device 0)");
            return;
        };
        drop(driver);
        let ctx = CudaContext::new(0).expect("CUDA device 0");
        let streams: Vec<_> = (0..8).map(|_| ctx.new_stream().expect("stream")).collect();
        let alloc = Allocator::expandable(CudaDriver::new(0).expect("driver"), Config::default())
            .expect("allocator");
        let mut group = c.benchmark_group("cuda");
        group.sample_size(10);
        for (name, size) in SIZES {
            for n in THREADS {
                group.throughput(Throughput::Elements(n as u64));
                let id = |path: &str| BenchmarkId::new(format!("{path}/{name}"), n);
                group.bench_function(id("cuvmm_raw"), |b| {
                    b.iter_custom(|iters| {
                        threads(n, iters, &streams, &|s| {
                            let (alloc, stream) = (&alloc, StreamId::from_cuda(s));
                            move || {
                                let ptr = alloc.alloc_raw(size, stream).expect("alloc");
                                alloc.free_raw(ptr).expect("free");
                            }
                        })
                    })
                });
                group.bench_function(id("cuvmm_device_buffer"), |b| {
                    b.iter_custom(|iters| {
                        threads(n, iters, &streams, &|s| {
                            let (alloc, stream) = (&alloc, StreamId::from_cuda(s));
                            move || drop(alloc.alloc_on(size, stream).expect("alloc"))
                        })
                    })
                });
                group.bench_function(id("cuMemAllocAsync"), |b| {
                    b.iter_custom(|iters| {
                        threads(n, iters, &streams, &|s| {
                            let (mut pool, stream) =
                                (AsyncPool::new(0).expect("pool"), StreamId::from_cuda(s));
                            move || {
                                let ptr = pool.alloc(size, stream).expect("alloc");
                                pool.free(ptr).expect("free");
                            }
                        })
                    })
                });
                group.bench_function(id("cuMemAlloc"), |b| {
                    b.iter_custom(|iters| {
                        threads(n, iters, &streams, &|_| {
                            let mut driver = CudaDriver::new(0).expect("driver");
                            move || {
                                let ptr = driver.malloc(size).expect("alloc");
                                driver.free(ptr).expect("free");
                            }
                        })
                    })
                });
            }
        }
        group.finish();
        ctx.synchronize().expect("synchronize");
    }
}
