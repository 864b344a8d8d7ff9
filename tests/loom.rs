//! A deterministic model check of the facade's synchronization with loom: every interleaving of the threads
//! below with at most three preemptions each (`PREEMPTIONS`), at every lock acquisition, atomic access and
//! `Arc` reference count change, is run.
//!
//! The facade (`src/facade/allocator.rs`, `src/facade/stream_cache.rs`): an `Arc` shared by every handle and buffer; one
//! `Mutex` around the strategy; stream cache shards (two in loom builds, one per thread number modulo two),
//! each a `Mutex` around its kept-back buffers plus a relaxed length read without the lock, and one relaxed
//! flag for whether the caches are on (a stale value only sends a request or a free the slow way); the
//! per-thread handles buffers hold (two slots, each a `Mutex`) and the count of the program's own handles,
//! whose last drop lets go of them; a `Mutex` and an atomic length for the addresses
//! used on other streams; the book of raw allocations' sizes and streams (two shards, each a `Mutex`, and a
//! relaxed flag); and a `Mutex` around the errors that `DeviceBuffer::drop` could not return. No path
//! holds two of these locks at once, except `with_strategy`, whose closure may free buffers into a shard
//! while the strategy's lock is held, and `record_history`, which empties the shards under it; nothing waits for the strategy's lock while holding another (draining
//! takes each shard's entries, releases it, then frees under the strategy's lock), so no cycle can form. What
//! could go wrong is what these models check in every interleaving: a deadlock (loom reports one), a free
//! lost or applied twice, a cached buffer handed out twice or lost by a drain, a deferred error lost, the
//! strategy dropped while a handle lives or never dropped (loom reports a leaked `Arc`), invariants broken or
//! statistics seen half-updated, a raw free served through a stream cache reused on another stream or after
//! a `record_stream` while the other stream's work is pending. One model runs with a bug planted in the stream cache
//! (`Allocator::seed_stream_cache_bug`) and must fail.
//!
//! Runs only under `RUSTFLAGS="--cfg loom"`, where `src/base/sync.rs` swaps in loom's `Mutex`, `Arc` and atomics:
//! `RUSTFLAGS="--cfg loom" cargo test --release -p cuvmm --test loom --target-dir target/loom`
//! (what `.ci/run` runs; without the `cli` feature the binary and clap are not built).
//! Each model prints how many interleavings it explored.
#![cfg(loom)]

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Error, StreamId};
use loom::thread;
use std::sync::atomic::{AtomicUsize, Ordering};

const PAGE: u64 = 64 << 10;

type Alloc = Allocator<Expandable<SimDriver>>;

/// A small cuvmm allocator on a simulated device.
fn allocator() -> Alloc {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(64 * PAGE)
            .with_granularity(PAGE),
    );
    Allocator::expandable(sim, Config::default()).expect("valid configuration")
}

/// At most this many preemptions per execution (loom's `preemption_bound`, as its documentation suggests
/// for CI: bugs of practical interest need two or three). Unbounded, the models that drop buffers through
/// the stream caches' atomics run for many minutes.
const PREEMPTIONS: usize = 3;

/// A loom model checker with [`PREEMPTIONS`].
fn checker() -> loom::model::Builder {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(PREEMPTIONS);
    builder
}

/// Explores every interleaving of `model` with at most [`PREEMPTIONS`] preemptions, counting them; prints
/// and returns the count.
fn explore(name: &str, model: impl Fn() + Sync + Send + 'static) -> usize {
    // A count of this model's own (tests run in parallel: a static would count theirs too).
    let count = std::sync::Arc::new(AtomicUsize::new(0));
    let counted = std::sync::Arc::clone(&count);
    checker().check(move || {
        counted.fetch_add(1, Ordering::SeqCst);
        model();
    });
    let runs = count.load(Ordering::SeqCst);
    eprintln!("loom {name}: {runs} interleavings explored");
    runs
}

/// After the threads: nothing live, invariants hold, and emptying the cache leaves the device empty. A block
/// freed after it was borrowed by another stream stays active (pending) until its events are seen complete,
/// which `empty_cache` waits for: only then must nothing be active.
fn assert_drained(alloc: &Alloc) {
    alloc.check_invariants().expect("invariants hold");
    assert_eq!(alloc.stats().allocation.current, 0);
    alloc.empty_cache().expect("empty_cache");
    let stats = alloc.stats();
    assert_eq!(stats.active_bytes.current, 0);
    assert_eq!(stats.reserved_bytes.current, 0);
    alloc.with_strategy(|s| {
        let leaks = s.driver().leak_report();
        assert!(leaks.is_empty(), "{leaks}");
    });
}

#[test]
fn buffers_allocated_and_dropped_on_two_threads_while_a_third_reads_stats() {
    let runs = explore("alloc/drop x2 + stats", || {
        let alloc = allocator();
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let alloc = alloc.clone();
                thread::spawn(move || {
                    let buffer = alloc.alloc_on((t + 1) * PAGE, StreamId(t)).expect("room");
                    alloc.check_invariants().expect("invariants hold");
                    drop(buffer);
                })
            })
            .collect();
        // Each statistic comes from one locked snapshot: never a half-done allocation.
        let stats = alloc.stats();
        assert!(stats.allocation.current <= 2);
        assert!(stats.allocated_bytes.current <= stats.reserved_bytes.current);
        assert!(
            [0, PAGE, 2 * PAGE, 3 * PAGE].contains(&stats.allocated_bytes.current),
            "{stats:?}"
        );
        for worker in workers {
            worker.join().expect("worker");
        }
        assert_drained(&alloc);
        assert!(alloc.take_deferred_errors().is_empty());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn a_drop_racing_an_explicit_free_of_the_same_buffer_fails_exactly_once() {
    let runs = explore("drop vs free_raw", || {
        let alloc = allocator();
        let buffer = alloc.alloc(PAGE).expect("room");
        let ptr = buffer.ptr();
        let dropper = thread::spawn(move || drop(buffer));
        let freed = alloc.free_raw(ptr);
        dropper.join().expect("dropper");
        // A drop that found the lock taken by `free_raw` kept the buffer in its stream's cache; reading the
        // statistics gives it back to the strategy, which then reports the double free.
        let _ = alloc.stats();
        let deferred = alloc.take_deferred_errors();
        // One of the two frees the block; the other fails, returned or deferred, never lost or doubled.
        match (&freed, deferred.as_slice()) {
            (Ok(()), [Error::DoubleFree { .. }]) => {}
            (Err(Error::DoubleFree { .. }), []) => {}
            other => panic!("free_raw and drop gave {other:?}"),
        }
        assert_drained(&alloc);
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn deferred_errors_taken_while_a_drop_records_one_are_never_lost() {
    let runs = explore("deferred errors vs take", || {
        let alloc = allocator();
        let buffer = alloc.alloc(PAGE).expect("room");
        // Freed behind the buffer's back: its drop keeps the address in this thread's stream cache, and the
        // drain that reading the statistics makes fails to free it and defers a DoubleFree.
        alloc.free_raw(buffer.ptr()).expect("free");
        let taker = {
            let alloc = alloc.clone();
            thread::spawn(move || alloc.take_deferred_errors().len())
        };
        drop(buffer);
        let _ = alloc.stats();
        let taken = taker.join().expect("taker") + alloc.take_deferred_errors().len();
        assert_eq!(taken, 1, "the drop's error was lost or duplicated");
        assert_drained(&alloc);
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn the_allocator_outlives_every_handle_and_buffer_and_is_dropped_once() {
    let runs = explore("last handle on another thread", || {
        let alloc = allocator();
        let buffer = alloc.alloc_on(2 * PAGE, StreamId(1)).expect("room");
        let other = alloc.clone();
        let worker = thread::spawn(move || {
            buffer.record_stream(StreamId(2)).expect("record_stream");
            drop(buffer);
            other.trim(u64::MAX).expect("trim");
            // The last handle may be this one: the strategy (and its device) is dropped here then.
            drop(other);
        });
        let stats = alloc.stats();
        assert!(stats.allocation.current <= 1);
        alloc.check_invariants().expect("invariants hold");
        drop(alloc);
        worker.join().expect("worker");
        // loom fails the model if the shared state (an Arc) was not dropped by now.
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

/// Two cached buffers of stream 0, kept back in this thread's cache shard; this thread and another ask for
/// that size on that stream while a third empties the cache. In loom builds a thread's shard is its number
/// in the model modulo two: the takers are threads 0 (this one) and 2, which share a shard, and the drainer
/// is thread 1, so both takers race for the same entries while the drain takes them.
fn two_takers_and_a_drain(alloc: &Alloc) {
    let kept: Vec<_> = (0..2)
        .map(|_| alloc.alloc_on(PAGE, StreamId(0)).expect("room"))
        .collect();
    alloc.with_strategy(|_| drop(kept));
    let drainer = {
        let alloc = alloc.clone();
        thread::spawn(move || alloc.empty_cache().expect("empty_cache"))
    };
    let taker = {
        let alloc = alloc.clone();
        thread::spawn(move || alloc.alloc_on(PAGE, StreamId(0)).expect("room"))
    };
    let mine = alloc.alloc_on(PAGE, StreamId(0)).expect("room");
    drainer.join().expect("drainer");
    let theirs = taker.join().expect("taker");
    assert_ne!(mine.ptr(), theirs.ptr(), "one buffer handed out twice");
    alloc.check_invariants().expect("invariants hold");
    drop((mine, theirs));
    assert_drained(alloc);
    assert!(alloc.take_deferred_errors().is_empty());
}

#[test]
fn a_cached_buffer_is_handed_out_once_even_while_the_caches_are_drained() {
    let runs = explore("stream cache: two takers + drain", || {
        two_takers_and_a_drain(&allocator());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn the_model_catches_a_seeded_stream_cache_bug() {
    // The same model with `take` splitting its lookup and its removal across two lock acquisitions.
    let caught = std::panic::catch_unwind(|| {
        checker().check(|| {
            let alloc = allocator();
            alloc.seed_stream_cache_bug();
            two_takers_and_a_drain(&alloc);
        })
    });
    assert!(caught.is_err(), "loom did not catch the seeded bug");
}

#[test]
fn frees_on_two_streams_under_contention_are_kept_back_and_given_back_whole() {
    let runs = explore("stream cache: alloc/free x2 on two streams", || {
        let alloc = allocator();
        let workers: Vec<_> = (0..2u64)
            .map(|t| {
                let alloc = alloc.clone();
                thread::spawn(move || {
                    for _ in 0..2 {
                        drop(alloc.alloc_on(PAGE, StreamId(t)).expect("room"));
                    }
                })
            })
            .collect();
        for worker in workers {
            worker.join().expect("worker");
        }
        let (kept, _) = alloc.stream_cached();
        assert!(
            kept <= 2,
            "{kept} buffers kept back for two streams of one size"
        );
        assert_drained(&alloc);
        assert_eq!(alloc.stream_cached(), (0, 0));
        assert!(alloc.take_deferred_errors().is_empty());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn recording_that_starts_while_a_thread_frees_leaves_nothing_in_the_caches() {
    let runs = explore("record_history vs frees", || {
        let alloc = allocator();
        let worker = {
            let alloc = alloc.clone();
            thread::spawn(move || {
                for _ in 0..2 {
                    drop(alloc.alloc_on(PAGE, StreamId(0)).expect("room"));
                }
            })
        };
        alloc.record_history(Some(8)).expect("recording");
        worker.join().expect("worker");
        // A free before the recording started was given back by it; one after went to the strategy.
        assert_eq!(alloc.stream_cached(), (0, 0));
        assert_drained(&alloc);
        assert!(alloc.take_deferred_errors().is_empty());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn raw_frees_through_the_caches_are_reused_only_on_their_stream_and_never_after_a_record_stream() {
    let runs = explore("raw path: free + alloc on two streams", || {
        // The workers are threads 1 and 2, whose shards are told apart from this thread's only by stream.
        let (s0, s1) = (StreamId(0), StreamId(13));
        let alloc = allocator();
        // Each stream has had a free kept back (the caches are on from the start by default; the held lock
        // turns them on otherwise), so raw blocks are noted at alloc.
        for stream in [s0, s1] {
            let buffer = alloc.alloc_on(PAGE, stream).expect("room");
            alloc.with_strategy(|_| drop(buffer));
        }
        let _ = alloc.stats();
        let a = alloc.alloc_raw(PAGE, s0).expect("room");
        let b = alloc.alloc_raw(PAGE, s1).expect("room");
        // Work on stream 0 that never completes in this model uses both; `b` is recorded as used there.
        let ranges = [a, b].map(|ptr| cuvmm::driver::VaRange::new(ptr, PAGE));
        alloc.with_strategy(|s| s.driver_mut().launch(s0, &ranges).expect("launch"));
        alloc.record_stream(b, s0).expect("record_stream");
        let workers: Vec<_> = [a, b]
            .into_iter()
            .map(|ptr| {
                let alloc = alloc.clone();
                thread::spawn(move || {
                    alloc.free_raw(ptr).expect("free");
                    alloc.alloc_raw(PAGE, s1).expect("room")
                })
            })
            .collect();
        let got: Vec<u64> = workers
            .into_iter()
            .map(|w| w.join().expect("worker"))
            .collect();
        // Stream 13 gets neither `a` (stream 0's, used by its pending work) nor `b` (used by stream 0).
        for ptr in &got {
            assert!(
                ![a, b].contains(ptr),
                "{ptr:#x} reused on stream 13 while stream 0 uses it"
            );
        }
        assert_ne!(got[0], got[1], "one block handed out twice");
        for ptr in got {
            alloc.free_raw(ptr).expect("free");
        }
        alloc.with_strategy(|s| s.driver_mut().complete_stream(s0));
        assert_drained(&alloc);
        assert!(alloc.take_deferred_errors().is_empty());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

/// A sleep keeping its tag's bytes copies them without the strategy's lock, in phases (`facade/tags.rs`),
/// then a wake copies them back: another thread allocating untagged and under the tag meanwhile never
/// deadlocks, is refused under the tag exactly while it sleeps or is copied (`TagAsleep`), and never gets
/// memory the tag's copies read; the tag's bytes come back whole.
/// `check_invariants` while another thread frees a raw block into its stream's cache and allocates it back:
/// the block moves between the raw book and the cache one lock at a time, and the check must never see it
/// in both (it once read the book, then each cache, and reported a block freed in between).
#[test]
fn an_invariant_check_racing_a_raw_free_and_allocation_sees_each_block_in_one_place() {
    let runs = explore("raw path: free + alloc racing check_invariants", || {
        let s0 = StreamId(0);
        let alloc = allocator();
        // A free kept back on the stream, so that raw blocks are noted at alloc (see the model above).
        let buffer = alloc.alloc_on(PAGE, s0).expect("room");
        alloc.with_strategy(|_| drop(buffer));
        let a = alloc.alloc_raw(PAGE, s0).expect("room");
        let worker = {
            let alloc = alloc.clone();
            thread::spawn(move || {
                alloc.free_raw(a).expect("free");
                let b = alloc.alloc_raw(PAGE, s0).expect("room");
                alloc.free_raw(b).expect("free");
            })
        };
        alloc
            .check_invariants()
            .expect("each block live or cached, never both");
        worker.join().expect("worker");
        assert_drained(&alloc);
        assert!(alloc.take_deferred_errors().is_empty());
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}

#[test]
fn a_sleep_that_copies_without_the_lock_races_an_allocating_thread() {
    let runs = explore("sleep/wake vs alloc", || {
        let sim = SimDriver::new(
            SimConfig::default()
                .with_capacity(64 * PAGE)
                .with_granularity(PAGE)
                .with_backing_store(true),
        );
        let alloc = Allocator::expandable(sim, Config::default()).expect("valid configuration");
        let kv = alloc
            .alloc_tagged_raw(PAGE, StreamId(1), "kv")
            .expect("room");
        alloc
            .with_strategy(|s| s.driver_mut().write(kv, &[7; 64]))
            .expect("writable");
        let other = alloc.clone();
        let worker = thread::spawn(move || {
            let plain = other.alloc_raw(PAGE, StreamId(2)).expect("room");
            other.free_raw(plain).expect("free");
            match other.alloc_tagged_raw(PAGE, StreamId(1), "kv") {
                Ok(p) => Some(p),
                Err(Error::TagAsleep { .. }) => None,
                Err(err) => panic!("{err}"),
            }
        });
        alloc.sleep("kv", true).expect("sleep");
        alloc.wake("kv").expect("wake");
        let tagged = worker.join().expect("worker");
        let bytes = alloc.with_strategy(|s| s.driver().read(kv, 64));
        assert_eq!(bytes.expect("readable"), vec![7; 64]);
        alloc.check_invariants().expect("invariants hold");
        if let Some(p) = tagged {
            alloc.free_raw(p).expect("free");
        }
        alloc.free_raw(kv).expect("free");
        alloc.release_host_buffers(None).expect("release");
        assert_drained(&alloc);
    });
    assert!(runs > 1, "loom explored only {runs} interleaving");
}
