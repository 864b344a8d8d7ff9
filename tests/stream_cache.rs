//! The facade's stream caches (`src/facade/stream_cache.rs`, docs/library.md "Locking"). With caches that wait
//! for contention (`stream_cache_eager:False`, the PyTorch backend's default, what most tests here use), a
//! program that never contends sees exactly the strategy; once a thread finds the strategy's lock taken,
//! freed buffers are kept back in the freeing thread's shard and reused on their stream without the lock.
//! Eager caches (the Rust library's default) do so from the first free. Every exact view (statistics,
//! snapshots, `empty_cache`, invariants, an out-of-memory retry) gives them back first.
//!
//! Raw allocations (`alloc_raw` / `free_raw`, the C ABI's and PyTorch's path) take the same way while the
//! caches are on: the facade notes each one's size and stream at the allocation. A property test checks,
//! against a model of the program's streams and with both kinds of caches, that a raw free served through
//! the caches is reused only on its own stream, and never while another stream recorded on it
//! (`record_stream`) may still use it.
//!
//! "The lock is taken" is made deterministic with `with_strategy`, which holds it while its closure runs.

use cuvmm::driver::Op;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Error, Strategy as _, StreamId};
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

/// An allocator whose stream caches wait for contention (the PyTorch backend's default), configured further
/// by `conf`.
fn allocator(pages: u64, conf: &str) -> Alloc {
    let mut config = Config::from_alloc_conf(conf).expect("valid configuration");
    config.stream_cache_eager.get_or_insert(false);
    Allocator::expandable(sim(pages), config).expect("allocator")
}

/// An allocator with the Rust library's defaults: stream caches that keep frees from the first one.
fn eager(pages: u64) -> Alloc {
    Allocator::expandable(sim(pages), Config::default()).expect("allocator")
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

/// Whether every `again` of [`served_while_locked`] was served without waiting and returned the same (the
/// same cached buffer each time).
fn all_served_alike<T: PartialEq, E: PartialEq>(served: &[Result<T, E>]) -> bool {
    served.iter().all(Result::is_ok) && served.windows(2).all(|w| w[0] == w[1])
}

/// Runs `warm` on a new thread, then `again` three times on it while this thread holds the strategy's lock;
/// returns what each `again` returned, or an error if one waited for the lock (30 s).
fn served_while_locked<T: Send + 'static>(
    alloc: &Alloc,
    warm: impl FnOnce(&Alloc) + Send + 'static,
    again: impl Fn(&Alloc) -> T + Send + 'static,
) -> Vec<Result<T, mpsc::RecvTimeoutError>> {
    let (ready_tx, ready_rx) = mpsc::channel();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let (tx, rx) = mpsc::channel();
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            warm(&alloc);
            ready_tx.send(()).unwrap();
            go_rx.recv().unwrap();
            for _ in 0..3 {
                tx.send(again(&alloc)).unwrap();
            }
        })
    };
    ready_rx.recv().unwrap();
    let served = alloc.with_strategy(|_| {
        go_tx.send(()).unwrap();
        (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(30)))
            .collect()
    });
    worker.join().unwrap();
    served
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
    let again = alloc.alloc_on(64 * KIB, S0).unwrap();
    assert_eq!(again.ptr(), ptr);
    assert_eq!(alloc.stream_cached(), (0, 0));
    drop((again, other_size, other_stream));

    // A thread's own frees are served again while another thread holds the strategy's lock.
    let served = served_while_locked(
        &alloc,
        |alloc| drop(alloc.alloc_on(16 * KIB, S1).unwrap()),
        |alloc| alloc.alloc_on(16 * KIB, S1).unwrap().ptr(),
    );
    assert!(
        all_served_alike(&served),
        "a cached request waited for the lock: {served:?}"
    );
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
fn while_the_history_records_every_alloc_and_free_reaches_it() {
    use cuvmm::history::TraceAction::{self, FreeCompleted, FreeRequested};
    const ALLOC: TraceAction = TraceAction::Alloc;
    let alloc = eager(256);
    let actions = |alloc: &Alloc| -> Vec<(TraceAction, u64)> {
        let traces = alloc.snapshot().unwrap().device_traces.concat();
        (traces.iter())
            .filter(|t| matches!(t.action, ALLOC | FreeRequested | FreeCompleted))
            .map(|t| (t.action, t.addr))
            .collect()
    };
    // Held back before recording: given back then, and not recorded (it was freed before).
    drop(alloc.alloc_on(8 * KIB, S0).unwrap());
    let raw = alloc.alloc_raw(16 * KIB, S1).unwrap();
    alloc.free_raw(raw).unwrap();
    assert_eq!(alloc.stream_cached(), (2, 24 * KIB));
    alloc.record_history(Some(100)).unwrap();
    assert_eq!(alloc.stream_cached(), (0, 0));
    assert_eq!(actions(&alloc), []);

    // Recording: a free of either kind goes to the strategy, and the next request of its size with it.
    let mut expected = Vec::new();
    for _ in 0..3 {
        let buffer = alloc.alloc_on(8 * KIB, S0).unwrap();
        let ptr = buffer.ptr();
        drop(buffer);
        let raw = alloc.alloc_raw(16 * KIB, S1).unwrap();
        alloc.free_raw(raw).unwrap();
        assert_eq!(alloc.stream_cached(), (0, 0));
        for addr in [ptr, raw] {
            expected.extend([(ALLOC, addr), (FreeRequested, addr), (FreeCompleted, addr)]);
        }
    }
    assert_eq!(actions(&alloc), expected);
    alloc.check_invariants().unwrap();

    // Stopped: frees are kept back again.
    alloc.record_history(None).unwrap();
    drop(alloc.alloc_on(8 * KIB, S0).unwrap());
    assert_eq!(alloc.stream_cached(), (1, 8 * KIB));
    alloc.check_invariants().unwrap();
}

#[test]
fn recording_that_starts_while_threads_free_leaves_no_buffer_in_a_cache() {
    let alloc = eager(1024);
    // Recording starts once every thread's cache has been used, while they go on.
    let started = std::sync::Barrier::new(5);
    std::thread::scope(|scope| {
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let (alloc, started) = (alloc.clone(), &started);
                scope.spawn(move || {
                    for round in 0..2000u64 {
                        let buffer = alloc
                            .alloc_on((1 + round % 3) * 4 * KIB, StreamId(t))
                            .unwrap();
                        drop(buffer);
                        if round == 100 {
                            started.wait();
                        }
                    }
                })
            })
            .collect();
        started.wait();
        alloc.record_history(Some(10)).unwrap();
        for worker in workers {
            worker.join().unwrap();
        }
    });
    // Whatever a thread freed once recording had started went to the strategy.
    assert_eq!(alloc.stream_cached(), (0, 0));
    alloc.check_invariants().unwrap();
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
    // One retry, in which the strategy took the caches back; a request served is no out-of-memory.
    assert_eq!(
        (stats.num_alloc_retries, stats.num_ooms),
        (1, 0),
        "{stats:?}"
    );
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

/// Makes the cache shards of `streams` active, as their first contention for the lock would, and leaves
/// them empty.
fn activate(alloc: &Alloc, streams: impl IntoIterator<Item = StreamId>) {
    for stream in streams {
        drop_contended(alloc, alloc.alloc_on(KIB, stream).unwrap());
    }
    let _ = alloc.stats();
    assert_eq!(alloc.stream_cached(), (0, 0));
}

#[test]
fn a_raw_free_under_contention_is_reused_on_its_stream_without_the_lock() {
    let alloc = allocator(256, "");
    activate(&alloc, [S0]);
    let ptr = alloc.alloc_raw(64 * KIB, S0).unwrap();
    alloc.free_raw(ptr).unwrap();
    assert_eq!(
        alloc.stream_cached(),
        (1, 64 * KIB),
        "the raw free went to the strategy"
    );
    // Another stream does not get it.
    let other_stream = alloc.alloc_raw(64 * KIB, S1).unwrap();
    assert_ne!(other_stream, ptr);

    // Served and freed again while another thread holds the strategy's lock, as often as asked.
    let served = served_while_locked(
        &alloc,
        |alloc| {
            alloc
                .free_raw(alloc.alloc_raw(64 * KIB, S0).unwrap())
                .unwrap()
        },
        |alloc| {
            let again = alloc.alloc_raw(64 * KIB, S0).unwrap();
            alloc.free_raw(again).unwrap();
            again
        },
    );
    assert!(
        all_served_alike(&served),
        "a cached raw request or free waited for the lock: {served:?}"
    );
    // A second free of the cached address is a double free; the statistics see it freed.
    assert!(matches!(alloc.free_raw(ptr), Err(Error::DoubleFree { .. })));
    alloc.free_raw(other_stream).unwrap();
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
}

#[test]
fn raw_blocks_of_a_stream_that_never_contended_go_to_the_strategy() {
    let alloc = allocator(256, "");
    let ptr = alloc.alloc_raw(64 * KIB, S0).unwrap();
    // Its stream turns active after the allocation: the block was not noted, so its free is the strategy's.
    activate(&alloc, [S0]);
    alloc.free_raw(ptr).unwrap();
    assert_eq!(alloc.stream_cached(), (0, 0));
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
}

#[test]
fn a_raw_block_allocated_during_a_capture_is_never_cached() {
    let alloc = allocator(256, "");
    activate(&alloc, [S0]);
    let pool = cuvmm::GraphPool(1, 0);
    alloc
        .begin_allocate_to_pool(pool, cuvmm::StreamFilter::Streams(vec![S0]))
        .unwrap();
    let in_pool = alloc.alloc_raw(8 * KIB, S0).unwrap();
    alloc.end_allocate_to_pool(pool).unwrap();
    alloc.free_raw(in_pool).unwrap();
    assert_eq!(
        alloc.stream_cached(),
        (0, 0),
        "a graph pool's block was cached"
    );
    alloc.release_pool(pool).unwrap();
    alloc.check_invariants().unwrap();
}

#[path = "stream_cache/raw_model.rs"]
mod raw_model;

#[test]
fn once_threads_contend_every_stream_that_reaches_the_strategy_keeps_its_frees() {
    let alloc = allocator(256, "");
    activate(&alloc, [S0]);
    // Stream 1 never found the lock taken (the thread holding it, say): its block is noted and kept back.
    let ptr = alloc.alloc_raw(8 * KIB, S1).unwrap();
    alloc.free_raw(ptr).unwrap();
    assert_eq!(alloc.stream_cached(), (1, 8 * KIB));
    assert_eq!(alloc.alloc_raw(8 * KIB, S1).unwrap(), ptr);
    alloc.free_raw(ptr).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn a_capture_nobody_announced_is_not_served_from_a_stream_cache() {
    let alloc = allocator(256, "");
    let s = StreamId(5);
    activate(&alloc, [s]);
    let cached = alloc.alloc_on(64 * KIB, s).unwrap();
    let ptr = cached.ptr();
    drop_contended(&alloc, cached);
    assert_eq!(alloc.stream_cached(), (1, 64 * KIB));
    // The program captures `s` without telling the allocator (cudarc's `begin_capture`).
    let mode = cuvmm::driver::CaptureMode::ThreadLocal;
    alloc
        .with_strategy(|st| st.driver_mut().begin_capture(s, mode))
        .unwrap();
    let in_graph = alloc.alloc_on(64 * KIB, s).unwrap();
    assert_ne!(
        in_graph.ptr(),
        ptr,
        "the graph was given a cached buffer of the common pool"
    );
    assert_eq!(
        alloc.stats().graph_pools,
        1,
        "the capture got a pool of its own"
    );
    drop(in_graph);
    alloc
        .with_strategy(|st| st.driver_mut().end_capture(s))
        .unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn capture_detection_false_asks_the_driver_nothing_about_captures() {
    let capture_queries = |conf: &str| {
        let alloc = allocator(256, conf);
        let s = StreamId(5);
        drop(alloc.alloc_on(64 * KIB, s).unwrap());
        activate(&alloc, [s]);
        let cached = alloc.alloc_on(64 * KIB, s).unwrap();
        drop_contended(&alloc, cached);
        drop(alloc.alloc_on(64 * KIB, s).unwrap());
        let counters = alloc.with_strategy(|st| cuvmm::driver::Driver::counters(st.driver()));
        counters.get(cuvmm::driver::Op::CaptureInfo)
    };
    assert!(capture_queries("") > 0, "detection is on by default");
    assert_eq!(capture_queries("capture_detection:False"), 0);
}

#[test]
fn eager_caches_serve_one_threads_repeated_requests_without_the_lock_at_every_size() {
    // The Rust library's default: no contention needed, 20 MiB (PyTorch's large handle) included.
    let alloc = eager(1024);
    for size in [512, 64 * KIB, 20 << 20] {
        let served = served_while_locked(
            &alloc,
            move |alloc| drop(alloc.alloc_on(size, S0).unwrap()),
            move |alloc| alloc.alloc_on(size, S0).unwrap().ptr(),
        );
        assert!(
            all_served_alike(&served),
            "{size} B: a buffer pair waited for the lock: {served:?}"
        );
        let served = served_while_locked(
            &alloc,
            move |alloc| alloc.free_raw(alloc.alloc_raw(size, S1).unwrap()).unwrap(),
            move |alloc| {
                let ptr = alloc.alloc_raw(size, S1).unwrap();
                alloc.free_raw(ptr).unwrap();
                ptr
            },
        );
        assert!(
            all_served_alike(&served),
            "{size} B: a raw pair waited for the lock: {served:?}"
        );
    }
    // The statistics give the cached buffers back: nothing is allocated.
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    assert_eq!(alloc.stream_cached(), (0, 0));
    alloc.check_invariants().unwrap();
}

#[test]
fn eager_caches_are_given_back_when_memory_runs_out() {
    // 64 pages: eight 4-page buffers cached on one stream leave too little for a 40-page request elsewhere
    // until the out-of-memory retry gives them back.
    let alloc = eager(64);
    let buffers: Vec<_> = (0..8)
        .map(|_| alloc.alloc_on(4 * PAGE, S0).unwrap())
        .collect();
    drop(buffers);
    assert_eq!(alloc.stream_cached(), (8, 32 * PAGE));
    let big = alloc
        .alloc_on(40 * PAGE, S1)
        .expect("served after the caches were drained");
    assert_eq!(alloc.stream_cached(), (0, 0));
    let stats = alloc.stats();
    // One retry (the strategy's, which took the caches back), not an out-of-memory.
    assert_eq!(
        (stats.num_alloc_retries, stats.num_ooms),
        (1, 0),
        "{stats:?}"
    );
    drop(big);
    alloc.check_invariants().unwrap();
}

#[test]
fn a_request_that_stays_out_of_memory_takes_the_caches_back_in_its_one_retry() {
    // 64 pages: 24 live, 32 kept back by the caches; a 48-page request fails even with them given back.
    let alloc = eager(64);
    let cached: Vec<_> = (0..8)
        .map(|_| alloc.alloc_on(4 * PAGE, S0).unwrap())
        .collect();
    let live: Vec<_> = (0..6)
        .map(|_| alloc.alloc_on(4 * PAGE, S0).unwrap())
        .collect();
    drop(cached);
    assert_eq!(alloc.stream_cached(), (8, 32 * PAGE));
    let before = alloc.with_strategy(|s| s.driver_counters());
    let err = alloc.alloc_on(48 * PAGE, S1).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let after = alloc.with_strategy(|s| s.driver_counters());
    assert_eq!(alloc.stream_cached(), (0, 0));
    // One request, one retry: the cache released once (nothing idle), the cached buffers given back, the
    // request tried once more. What it gathered (the 8 pages the device had left, created once, and the 32
    // cached ones) is released once, at the end. Before, the facade asked the strategy a second time, which
    // released and retried again: 8 pages created and released twice, two retries, two out-of-memories.
    assert_eq!(after.get(Op::Release) - before.get(Op::Release), 40);
    let stats = alloc.stats();
    assert_eq!(
        (stats.num_alloc_retries, stats.num_ooms),
        (1, 1),
        "{stats:?}"
    );
    assert_eq!(stats.reserved_bytes.current, 24 * PAGE);
    drop(live);
    alloc.check_invariants().unwrap();
}
