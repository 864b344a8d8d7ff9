//! The facade's stream caches (`src/facade/stream_cache.rs`, docs/DESIGN.md "Locking"): a program that never
//! contends sees exactly the strategy; once a stream finds the strategy's lock taken, its small freed
//! buffers are kept back and reused on that stream without the lock; every exact view (statistics,
//! snapshots, `empty_cache`, invariants, an out-of-memory retry) gives them back first.
//!
//! Raw allocations (`alloc_raw` / `free_raw`, the C ABI's and PyTorch's path) take the same way once their
//! stream has contended: the facade notes each one's size and stream at the allocation. A property test
//! checks, against a model of the program's streams, that a raw free served through the caches is reused
//! only on its own stream, and never while another stream recorded on it (`record_stream`) may still use it.
//!
//! "The lock is taken" is made deterministic with `with_strategy`, which holds it while its closure runs.

use cuvmm::driver::VaRange;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Error, Strategy as _, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;
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
    let (tx, rx) = mpsc::channel();
    let worker = {
        let alloc = alloc.clone();
        std::thread::spawn(move || {
            for _ in 0..3 {
                let again = alloc.alloc_raw(64 * KIB, S0).unwrap();
                alloc.free_raw(again).unwrap();
                tx.send(again).unwrap();
            }
        })
    };
    let served: Vec<_> = alloc.with_strategy(|_| {
        (0..3)
            .map(|_| rx.recv_timeout(Duration::from_secs(30)))
            .collect()
    });
    assert_eq!(
        served,
        vec![Ok(ptr); 3],
        "a cached raw request or free waited for the lock"
    );
    worker.join().unwrap();
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

const STREAMS: u64 = 3;
/// The streams the model's indices name: 0 and 13 share a cache shard (their ids hash alike), 5 has its
/// own, so entries of two streams sit side by side in one shard.
const STREAM_IDS: [u64; STREAMS as usize] = [0, 13, 5];

fn sid(index: u64) -> StreamId {
    StreamId(STREAM_IDS[index as usize])
}
/// A few sizes, so that requests often find a cached block of their size.
const SIZES: [u64; 3] = [4 * KIB, 8 * KIB, 12 * KIB];

#[derive(Debug, Clone)]
enum Action {
    Alloc {
        size: usize,
        stream: u64,
    },
    Free {
        pick: usize,
    },
    /// Work on `stream` over a live block; a stream other than the block's is recorded first.
    Launch {
        pick: usize,
        stream: u64,
    },
    CompleteStream {
        stream: u64,
    },
    /// Statistics: the caches go back to the strategy.
    Drain,
}

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0..SIZES.len(), 0..STREAMS).prop_map(|(size, stream)| Action::Alloc { size, stream }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        3 => (any::<usize>(), 0..STREAMS).prop_map(|(pick, stream)| Action::Launch { pick, stream }),
        1 => (0..STREAMS).prop_map(|stream| Action::CompleteStream { stream }),
        1 => Just(Action::Drain),
    ]
}

/// A live raw allocation of the model, and the streams that used it.
struct Live {
    size: u64,
    uses: Vec<StreamId>,
}

/// A freed block another stream may still be using: its range, and for each of its streams the work that
/// stream had queued at the free.
struct Freed {
    range: VaRange,
    needs: Vec<(StreamId, usize)>,
}

#[derive(Default)]
struct Model {
    live: BTreeMap<u64, Live>,
    freed: Vec<Freed>,
    /// Work items launched per stream so far.
    launched: BTreeMap<StreamId, usize>,
    /// Requests served by a block the caches held.
    cache_hits: usize,
}

fn completed(alloc: &Alloc, m: &Model, s: StreamId) -> usize {
    let pending = alloc.with_strategy(|st| st.driver().pending_work(s));
    m.launched.get(&s).copied().unwrap_or(0) - pending
}

/// Runs `actions` on raw allocations of three active streams; returns the model at the end.
fn run_raw(actions: Vec<Action>) -> Model {
    let alloc = allocator(256, "");
    activate(&alloc, (0..STREAMS).map(sid));
    let mut m = Model::default();
    for action in actions {
        match action {
            Action::Alloc { size, stream } => {
                let (size, s) = (SIZES[size], sid(stream));
                let held = alloc.stream_cached().0;
                let ptr = alloc.alloc_raw(size, s).expect("room");
                if alloc.stream_cached().0 < held {
                    m.cache_hits += 1;
                }
                let range = VaRange::new(ptr, size);
                for freed in m.freed.iter().filter(|f| overlaps(f.range, range)) {
                    for &(u, need) in &freed.needs {
                        assert!(
                            u == s || completed(&alloc, &m, u) >= need,
                            "{ptr:#x} handed to {s} while {u} may still use the block freed there"
                        );
                    }
                }
                m.live.insert(
                    ptr,
                    Live {
                        size,
                        uses: vec![s],
                    },
                );
            }
            Action::Free { pick } => {
                let Some(&ptr) = m.live.keys().nth(pick % m.live.len().max(1)) else {
                    continue;
                };
                let live = m.live.remove(&ptr).unwrap();
                alloc.free_raw(ptr).expect("free of a live block");
                let needs = (live.uses.iter())
                    .map(|&u| (u, m.launched.get(&u).copied().unwrap_or(0)))
                    .collect();
                m.freed.push(Freed {
                    range: VaRange::new(ptr, live.size),
                    needs,
                });
            }
            Action::Launch { pick, stream } => {
                let n = m.live.len().max(1);
                let Some((&ptr, live)) = m.live.iter_mut().nth(pick % n) else {
                    continue;
                };
                let s = sid(stream);
                if !live.uses.contains(&s) {
                    alloc
                        .record_stream(ptr, s)
                        .expect("record_stream of a live block");
                    live.uses.push(s);
                }
                let range = VaRange::new(ptr, live.size);
                alloc.with_strategy(|st| st.driver_mut().launch(s, &[range]).expect("launch"));
                *m.launched.entry(s).or_default() += 1;
            }
            Action::CompleteStream { stream } => {
                alloc.with_strategy(|st| st.driver_mut().complete_stream(sid(stream)));
            }
            Action::Drain => {
                let _ = alloc.stats();
            }
        }
    }
    alloc.check_invariants().unwrap();
    for s in 0..STREAMS {
        alloc.with_strategy(|st| st.driver_mut().complete_stream(sid(s)));
    }
    for &ptr in m.live.keys() {
        alloc.free_raw(ptr).expect("free at the end");
    }
    alloc.empty_cache().unwrap();
    let stats = alloc.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.reserved_bytes.current),
        (0, 0)
    );
    alloc.with_strategy(|st| assert!(st.driver().leak_report().is_empty()));
    m
}

fn overlaps(a: VaRange, b: VaRange) -> bool {
    a.start < b.end() && b.start < a.end()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// A raw block freed through the stream caches is reused only on its stream, and never while a stream
    /// recorded on it may still use it; nothing is lost at the end.
    #[test]
    fn raw_frees_through_the_caches_are_stream_safe(actions in prop::collection::vec(action(), 1..120)) {
        run_raw(actions);
    }
}

/// The scenario of the property without luck: a raw block used on another stream, freed, then asked for
/// on both streams; and a plain one reused from its stream's cache.
#[test]
fn a_fixed_raw_sequence_reuses_through_the_cache_and_never_across_streams() {
    use Action::*;
    let m = run_raw(vec![
        Alloc { size: 0, stream: 0 },
        Free { pick: 0 },
        // Served by stream 0's cache.
        Alloc { size: 0, stream: 0 },
        Launch { pick: 0, stream: 2 },
        Free { pick: 0 },
        // Stream 2's work may still use the block: neither stream 0 nor stream 1 may get it.
        Alloc { size: 0, stream: 0 },
        Alloc { size: 0, stream: 1 },
        CompleteStream { stream: 2 },
        Drain,
        Alloc { size: 0, stream: 2 },
    ]);
    assert!(
        m.cache_hits >= 1,
        "no request was served from a stream cache"
    );
}

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
