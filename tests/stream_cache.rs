//! The facade's stream caches (`src/stream_cache.rs`, docs/DESIGN.md "Locking"): a program that never
//! contends sees exactly the strategy; once a stream finds the strategy's lock taken, its small freed
//! buffers are kept back and reused on that stream without the lock; every exact view (statistics,
//! snapshots, `empty_cache`, invariants, an out-of-memory retry) gives them back first.
//!
//! "The lock is taken" is made deterministic with `with_strategy`, which holds it while its closure runs.

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Error, Strategy, StreamId};
use std::sync::mpsc;
use std::time::Duration;

const KIB: u64 = 1 << 10;
const PAGE: u64 = 64 * KIB;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

type Alloc = Allocator<Expandable<SimDriver>>;

fn sim(pages: u64) -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(pages * PAGE)
            .with_granularity(PAGE),
    )
}

fn allocator(pages: u64, conf: &str) -> Alloc {
    let config = Config::from_alloc_conf(conf).expect("valid configuration");
    Allocator::expandable(sim(pages), config).expect("allocator")
}

/// Frees `buffer` while the strategy's lock is held, as when another thread is in a driver call.
fn drop_contended(alloc: &Alloc, buffer: cuvmm::DeviceBuffer<Expandable<SimDriver>>) {
    alloc.with_strategy(|_| drop(buffer));
}

#[test]
fn without_contention_nothing_is_cached_and_the_statistics_are_the_strategys() {
    let alloc = allocator(256, "");
    let mut bare = Expandable::new(sim(256), Config::default()).unwrap();
    // The facade asks whether each allocation's stream is capturing a CUDA graph; so does the strategy here.
    bare.detect_captures(true);
    for round in 0..50u64 {
        let size = (1 + round % 7) * 3 * KIB;
        let buffer = alloc.alloc_on(size, StreamId(round % 3)).unwrap();
        let ptr = bare.alloc(size, StreamId(round % 3)).unwrap();
        assert_eq!(buffer.ptr(), ptr);
        drop(buffer);
        bare.free(ptr).unwrap();
        assert_eq!(alloc.stream_cached(), (0, 0));
    }
    assert_eq!(alloc.stats(), bare.stats());
    alloc.check_invariants().unwrap();
}

#[test]
fn a_buffer_freed_under_contention_is_reused_on_its_stream_without_the_lock() {
    let alloc = allocator(256, "");
    let buffer = alloc.alloc_on(64 * KIB, S0).unwrap();
    let ptr = buffer.ptr();
    drop_contended(&alloc, buffer);
    assert_eq!(alloc.stream_cached(), (1, 64 * KIB));

    // Another size, or another stream, is not served from the cache.
    let other_size = alloc.alloc_on(32 * KIB, S0).unwrap();
    let other_stream = alloc.alloc_on(64 * KIB, S1).unwrap();
    assert_ne!(other_size.ptr(), ptr);
    assert_ne!(other_stream.ptr(), ptr);
    assert_eq!(alloc.stream_cached(), (1, 64 * KIB));

    // The same size on the same stream is served while another thread holds the strategy's lock.
    let (tx, rx) = mpsc::channel();
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            let again = alloc.alloc_on(64 * KIB, S0).unwrap();
            tx.send(again.ptr()).unwrap();
            again
        })
    };
    let served = alloc.with_strategy(|_| rx.recv_timeout(Duration::from_secs(30)));
    assert_eq!(served, Ok(ptr), "the cached request waited for the lock");
    let again = worker.join().unwrap();
    assert_eq!(alloc.stream_cached(), (0, 0));
    drop((again, other_size, other_stream));
    alloc.check_invariants().unwrap();
}

#[test]
fn statistics_snapshots_and_empty_cache_give_cached_buffers_back_first() {
    let alloc = allocator(256, "");
    let buffers: Vec<_> = (0..5)
        .map(|_| alloc.alloc_on(8 * KIB, S0).unwrap())
        .collect();
    alloc.with_strategy(|_| drop(buffers));
    assert_eq!(alloc.stream_cached(), (5, 40 * KIB));
    // Active now: later frees are kept back too, without contention.
    drop(alloc.alloc_on(16 * KIB, S0).unwrap());
    assert_eq!(alloc.stream_cached(), (6, 56 * KIB));

    let stats = alloc.stats();
    assert_eq!(alloc.stream_cached(), (0, 0));
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(stats.allocation.current, 0);
    // Drained shards stay active: a later free is kept back again.
    drop(alloc.alloc_on(16 * KIB, S0).unwrap());
    assert_eq!(alloc.stream_cached(), (1, 16 * KIB));

    let snapshot = alloc.snapshot().unwrap();
    assert_eq!(alloc.stream_cached(), (0, 0));
    assert!(snapshot.segments.iter().all(|s| s.allocated_size() == 0));

    drop(alloc.alloc_on(8 * KIB, S0).unwrap());
    assert_eq!(alloc.stream_cached(), (1, 8 * KIB));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.current, 0);
    alloc.with_strategy(|s| assert!(s.driver().leak_report().is_empty()));
}

#[test]
fn a_buffer_used_on_another_stream_is_never_cached() {
    let alloc = allocator(256, "");
    drop_contended(&alloc, alloc.alloc_on(8 * KIB, S0).unwrap());
    assert_eq!(alloc.stream_cached(), (1, 8 * KIB));
    let shared = alloc.alloc_on(8 * KIB, S0).unwrap();
    alloc.with_strategy(|s| {
        s.driver_mut()
            .launch(S1, &[cuvmm::driver::VaRange::new(shared.ptr(), 8 * KIB)])
            .unwrap()
    });
    shared.record_stream(S1).unwrap();
    let raw = alloc.alloc_raw(8 * KIB, S0).unwrap();
    alloc.record_stream(raw, S1).unwrap();
    drop(shared);
    alloc.free_raw(raw).unwrap();
    // Both went to the strategy, which holds them pending until S1's work is done.
    assert_eq!(alloc.stream_cached(), (0, 0));
    assert_eq!(alloc.stats().active_bytes.current, 16 * KIB);
    alloc.with_strategy(|s| s.driver_mut().complete_stream(S1));
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().active_bytes.current, 0);
    alloc.check_invariants().unwrap();
}

#[test]
fn freeing_a_cached_address_again_is_a_double_free() {
    let alloc = allocator(256, "");
    let buffer = alloc.alloc_on(8 * KIB, S0).unwrap();
    let ptr = buffer.ptr();
    drop_contended(&alloc, buffer);
    assert!(matches!(alloc.free_raw(ptr), Err(Error::DoubleFree { addr }) if addr == ptr));
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
}

#[test]
fn memory_held_in_stream_caches_serves_a_request_that_would_run_out() {
    // 64 pages; 60 one-page buffers kept back by the caches leave too little for a 6-page request.
    let alloc = allocator(64, "");
    let buffers: Vec<_> = (0..60)
        .map(|i| alloc.alloc_on(PAGE, StreamId(i % 4)).unwrap())
        .collect();
    alloc.with_strategy(|_| drop(buffers));
    assert_eq!(alloc.stream_cached().0, 60);
    let big = alloc
        .alloc_on(6 * PAGE, S0)
        .expect("served after the caches are given back");
    assert_eq!(alloc.stream_cached(), (0, 0));
    let stats = alloc.stats();
    assert_eq!(stats.num_ooms, 0, "a request served is no out-of-memory");
    assert!(stats.num_alloc_retries >= 1);
    drop(big);
    alloc.check_invariants().unwrap();
}

#[test]
fn stream_cache_mb_0_turns_the_caches_off() {
    let alloc = allocator(256, "stream_cache_mb:0");
    let buffer = alloc.alloc_on(8 * KIB, S0).unwrap();
    let (tx, rx) = mpsc::channel();
    let (go, start) = mpsc::channel::<()>();
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            // Starts once the main thread holds the lock, so the free finds it taken.
            start.recv().unwrap();
            drop(buffer);
            tx.send(alloc.stream_cached()).unwrap();
        })
    };
    // The free waits for the lock instead of being kept back.
    let while_held = alloc.with_strategy(|_| {
        go.send(()).unwrap();
        rx.recv_timeout(Duration::from_millis(300))
    });
    assert!(while_held.is_err(), "the free did not wait: {while_held:?}");
    assert_eq!(rx.recv().unwrap(), (0, 0));
    worker.join().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
}
