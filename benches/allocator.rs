//! Benchmarks of cuvmm's expandable allocator on the simulated device (no GPU needed):
//!
//! - `hot_path/<size>`: an alloc + free pair served from cached, mapped pages after a warm-up, so no
//!   driver call is made (checked after each benchmark, not timed);
//! - `facade/*`: the same through the thread-safe [`Allocator`] (lock included), raw and with the
//!   [`DeviceBuffer`] guard;
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

fn facade(c: &mut Criterion) {
    let mut group = c.benchmark_group("facade");
    let alloc = Allocator::expandable(
        SimDriver::new(SimConfig::default().with_capacity(1 << 30)),
        Config::default(),
    )
    .expect("valid configuration");
    let size = 64 * KIB;
    alloc
        .alloc(size)
        .expect("warm-up alloc")
        .free()
        .expect("warm-up free");
    let calls = alloc.stats().driver.total();
    group.bench_function("alloc_raw+free_raw/64KiB", |b| {
        b.iter(|| {
            let ptr = alloc.alloc_raw(black_box(size), S).expect("alloc");
            alloc.free_raw(black_box(ptr)).expect("free");
        })
    });
    group.bench_function("device_buffer/64KiB", |b| {
        b.iter(|| drop(black_box(alloc.alloc(black_box(size)).expect("alloc"))))
    });
    assert_eq!(
        alloc.stats().driver.total(),
        calls,
        "the facade made a driver call"
    );
    assert!(alloc.take_deferred_errors().is_empty());
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
    c.final_summary();
}
