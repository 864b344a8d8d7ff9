//! Sleep and wake of tagged memory on the simulated device, with its bytes checked through the backing
//! store. The simulator refuses an unmap of memory that pending work still uses (the illegal address a GPU
//! would give), so a sleep that does not wait for the right streams fails here.
//!
//! The scenarios are what RL and serving frameworks do (vLLM's sleep mode, SGLang's memory saver): tag
//! weights and a KV cache, sleep, let another job use the memory, wake at the same addresses. The property
//! test interleaves sleep and wake with allocations, frees, record_stream, kernels, captures and memory
//! pressure, and checks after every step:
//! - `check_invariants()` (a sleeping tag's pages unmapped, no block placed or freed in its segments);
//! - no two live allocations overlap, tagged or not, asleep or awake;
//! - every awake allocation holds its bytes; an asleep one is not accessible; after a wake its bytes are
//!   back if the sleep kept them;
//! - the segment events a trace tracker sees add up to the driver's mappings (`harness/mapped_events.rs`);
//! - the statistics' `asleep_bytes` is the bytes under the asleep allocations' pages, and the device holds
//!   exactly `reserved_bytes`;
//! - what must be refused is refused with its typed error: an allocation under a sleeping tag
//!   (`TagAsleep`), a sleep, a wake or a release of host memory during a capture (`CaptureUnderway`); a free
//!   of a sleeping tag's block succeeds, the block stays live until the wake, and a second free of it is
//!   `DoubleFree`.

mod common;

use common::{begin_capture, end_capture, holds_pattern, pattern, write_pattern};
use cuvmm::strategy::StreamUses;
#[path = "harness/mapped_events.rs"]
mod mapped_events;
#[path = "sleep_wake/model.rs"]
mod model;

use cuvmm::config::Compaction;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, DriverError, Op, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Driver as _, Error, GraphPool, Strategy as _, StreamId};
use proptest::prelude::*;
use std::collections::{BTreeMap, BTreeSet};

const PAGE: u64 = 4096;
const PAGES: u64 = 64;

type Alloc = Expandable<SimDriver>;

fn new_alloc(config: Config) -> Alloc {
    common::expandable_with(
        PAGE,
        PAGES,
        Config {
            small_size: 1024,
            ..config
        },
        true,
    )
}

/// Weights and a KV cache sleep with their bytes kept: the device gets their pages back, another job
/// allocates and frees that memory, and the wake puts the bytes back at the same addresses.
#[test]
fn a_sleep_gives_the_pages_back_and_the_wake_restores_the_bytes_in_place() {
    let mut a = new_alloc(Config::default());
    let s = StreamId(1);
    let weights = a.alloc_tagged(10 * PAGE, s, "weights").unwrap();
    let kv = a.alloc_tagged(20 * PAGE + 100, s, "kv_cache").unwrap();
    let other = a.alloc(3 * PAGE, s).unwrap();
    write_pattern(&mut a, weights, 1, 10 * PAGE);
    write_pattern(&mut a, kv, 2, 20 * PAGE + 100);
    write_pattern(&mut a, other, 3, 3 * PAGE);
    let used = a.driver().used_bytes();

    let given = a.sleep("kv_cache", true).unwrap();
    assert_eq!(
        given,
        21 * PAGE,
        "every page of the KV cache's segment is given back"
    );
    assert_eq!(a.driver().used_bytes(), used - 21 * PAGE);
    assert!(!a.driver().is_accessible(kv));
    assert_eq!(a.stats().asleep_bytes, 21 * PAGE);
    assert_eq!(a.asleep_tags(), vec![("kv_cache".to_string(), 21 * PAGE)]);
    a.check_invariants().unwrap();

    // Another job takes the memory and gives it back.
    let job = a.alloc(40 * PAGE, StreamId(2)).unwrap();
    write_pattern(&mut a, job, 9, 40 * PAGE);
    a.free(job).unwrap();
    a.empty_cache().unwrap();

    a.wake("kv_cache").unwrap();
    assert!(
        holds_pattern(&a, kv, 2, 20 * PAGE + 100),
        "the KV cache's bytes are back"
    );
    assert!(holds_pattern(&a, weights, 1, 10 * PAGE));
    assert!(holds_pattern(&a, other, 3, 3 * PAGE));
    assert_eq!(a.stats().asleep_bytes, 0);
    a.check_invariants().unwrap();
    a.free(kv).unwrap();
    a.free(weights).unwrap();
    a.free(other).unwrap();
}

/// Without `keep`, the wake maps fresh memory: the addresses are the same, the bytes are not.
#[test]
fn a_sleep_without_keep_loses_the_bytes() {
    let mut a = new_alloc(Config::default());
    let kv = a.alloc_tagged(8 * PAGE, StreamId(1), "kv").unwrap();
    write_pattern(&mut a, kv, 5, 8 * PAGE);
    a.sleep("kv", false).unwrap();
    a.wake("kv").unwrap();
    assert!(a.driver().is_accessible(kv));
    assert!(
        !holds_pattern(&a, kv, 5, 8 * PAGE),
        "the bytes were not kept"
    );
    write_pattern(&mut a, kv, 6, 8 * PAGE);
    assert!(holds_pattern(&a, kv, 6, 8 * PAGE));
    a.check_invariants().unwrap();
}

/// A kernel still running on the tag's stream, and one on a stream recorded with `record_stream`: the
/// sleep waits for both (the simulator refuses to unmap memory pending work uses), synchronizing only the
/// busy ones.
#[test]
fn a_sleep_waits_for_the_streams_that_used_the_tag() {
    let mut a = new_alloc(Config::default());
    let (own, side, idle) = (StreamId(1), StreamId(2), StreamId(3));
    let kv = a.alloc_tagged(4 * PAGE, own, "kv").unwrap();
    let w = a.alloc_tagged(4 * PAGE, idle, "kv").unwrap();
    a.record_stream(kv, side).unwrap();
    let range = VaRange::new(kv, 4 * PAGE);
    a.driver_mut().launch(own, &[range]).unwrap();
    a.driver_mut().launch(side, &[range]).unwrap();
    let syncs = a.driver().counters().get(Op::Synchronize);
    a.sleep("kv", true).unwrap();
    assert_eq!(a.driver().pending_work(own), 0);
    assert_eq!(a.driver().pending_work(side), 0);
    assert_eq!(
        a.driver().counters().get(Op::Synchronize) - syncs,
        3,
        "the two busy streams, not the idle one, and the wait for the copies"
    );
    assert!(!a.driver().is_accessible(w));
    a.wake("kv").unwrap();
    a.check_invariants().unwrap();
}

/// What a sleeping tag refuses, with typed errors; sleep and wake are idempotent.
#[test]
fn a_sleeping_tag_refuses_allocations_and_captures() {
    let mut a = new_alloc(Config::default());
    let s = StreamId(1);
    let kv = a.alloc_tagged(2 * PAGE, s, "kv").unwrap();
    assert_eq!(a.sleep("kv", true).unwrap(), 2 * PAGE);
    assert_eq!(a.sleep("kv", true).unwrap(), 0, "already asleep");
    assert!(matches!(
        a.alloc_tagged(PAGE, s, "kv"),
        Err(Error::TagAsleep {
            operation: "alloc",
            ..
        })
    ));
    // A capture: neither sleep, nor wake, nor a release of host memory.
    let capture = StreamId(3);
    begin_capture(&mut a, capture, GraphPool(1, 0), CaptureMode::ThreadLocal);
    assert!(matches!(
        a.wake("kv"),
        Err(Error::CaptureUnderway { operation: "wake" })
    ));
    assert!(matches!(
        a.sleep("other", false),
        Err(Error::CaptureUnderway { operation: "sleep" })
    ));
    // Freeing page-locked memory would invalidate the capture.
    assert!(matches!(
        a.release_host_buffers(None),
        Err(Error::CaptureUnderway {
            operation: "release_host_buffers"
        })
    ));
    end_capture(&mut a, capture, GraphPool(1, 0));
    a.wake("kv").unwrap();
    a.wake("kv").unwrap();
    a.wake("never named").unwrap();
    a.free(kv).unwrap();
    a.check_invariants().unwrap();
}

/// A block freed while its tag sleeps (a tensor dropped then) is not lost: the free succeeds, the block
/// stays live, its bytes laid out with the others', until the wake, which puts back the others' bytes and
/// frees it; a second free is `DoubleFree`. So too for a free while a sleep copies (no lock held: the
/// tag is busy), and a wake of a tag that kept no bytes.
#[test]
fn a_block_freed_while_its_tag_sleeps_is_freed_at_the_wake() {
    for keep in [true, false] {
        let mut a = new_alloc(Config::default());
        let s = StreamId(1);
        let x = a.alloc_tagged(3 * PAGE, s, "kv").unwrap();
        let y = a.alloc_tagged(2 * PAGE + 100, s, "kv").unwrap();
        let z = a.alloc_tagged(PAGE, s, "kv").unwrap();
        for (addr, id, size) in [(x, 1, 3 * PAGE), (y, 2, 2 * PAGE + 100), (z, 3, PAGE)] {
            write_pattern(&mut a, addr, id, size);
        }
        let live = a.stats().allocated_bytes.current;
        // y is freed while the sleep copies (the facade runs the copies without its lock), x once asleep.
        let copy = match a.begin_sleep("kv", keep).unwrap() {
            cuvmm::strategy::tags::Begun::Copy(mut copy) => {
                a.free(y).unwrap();
                a.check_invariants().unwrap();
                copy.run();
                Some(a.finish_sleep(*copy).unwrap())
            }
            cuvmm::strategy::tags::Begun::Done(_) => {
                a.free(y).unwrap();
                None
            }
        };
        assert_eq!(copy.is_some(), keep);
        a.free(x).unwrap();
        a.check_invariants().unwrap();
        assert!(matches!(a.free(x), Err(Error::DoubleFree { .. })));
        assert!(matches!(a.free(y), Err(Error::DoubleFree { .. })));
        // Freed at once (no longer allocated), their memory pending until the wake.
        let stats = a.stats();
        assert_eq!(
            (stats.allocated_bytes.current, stats.active_bytes.current),
            (PAGE, live)
        );
        assert_eq!(a.tag_infos()[0].live_bytes, PAGE);
        a.wake("kv").unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().allocated_bytes.current, PAGE, "z alone");
        if keep {
            assert!(holds_pattern(&a, z, 3, PAGE), "z's bytes are back");
        }
        assert!(matches!(a.free(x), Err(Error::DoubleFree { .. })));
        // The memory the two freed serves the next allocation under the tag.
        let w = a.alloc_tagged(5 * PAGE, s, "kv").unwrap();
        a.free(w).unwrap();
        a.free(z).unwrap();
        a.check_invariants().unwrap();
        assert_eq!(a.stats().allocated_bytes.current, 0);
    }
}

/// A graph captured on tagged memory replays after a wake: its addresses are mapped again, with the bytes
/// it reads.
#[test]
fn a_graph_captured_on_tagged_memory_replays_after_the_wake() {
    let mut a = new_alloc(Config::default());
    let (s, capture) = (StreamId(1), StreamId(3));
    let weights = a.alloc_tagged(6 * PAGE, s, "weights").unwrap();
    write_pattern(&mut a, weights, 7, 6 * PAGE);
    let pool = GraphPool(1, 0);
    begin_capture(&mut a, capture, pool, CaptureMode::ThreadLocal);
    let out = a.alloc(PAGE, capture).unwrap();
    let ranges = [VaRange::new(weights, 6 * PAGE), VaRange::new(out, PAGE)];
    a.driver_mut().launch(capture, &ranges).unwrap();
    end_capture(&mut a, capture, pool);

    a.sleep("weights", true).unwrap();
    assert!(
        a.driver_mut().launch(s, &ranges).is_err(),
        "a replay now would fault"
    );
    let job = a.alloc(30 * PAGE, StreamId(2)).unwrap();
    a.free(job).unwrap();
    a.wake("weights").unwrap();
    a.driver_mut()
        .launch(s, &ranges)
        .expect("the replay finds its memory");
    assert!(holds_pattern(&a, weights, 7, 6 * PAGE));
    a.check_invariants().unwrap();
}

/// Captures `blocks` (tagged "t", each `4 * PAGE`) into graph pool 1 on stream 3 as `torch.cuda.graph`
/// does, with a kernel using them and `weights`, and frees the last of them in the capture (a temporary the
/// graph keeps using); returns the graph and the ranges its replay touches.
fn capture_in_tag(a: &mut Alloc, weights: Option<u64>, blocks: usize) -> (u64, Vec<VaRange>) {
    let capture = StreamId(3);
    let pool = GraphPool(1, 0);
    let id = begin_capture(a, capture, pool, CaptureMode::ThreadLocal);
    let made: Vec<u64> = (0..blocks)
        .map(|_| a.alloc_tagged(4 * PAGE, capture, "t").unwrap())
        .collect();
    let mut ranges: Vec<VaRange> = made.iter().map(|&b| VaRange::new(b, 4 * PAGE)).collect();
    ranges.extend(weights.map(|w| VaRange::new(w, 6 * PAGE)));
    a.driver_mut().launch(capture, &ranges).unwrap();
    a.free(*made.last().unwrap()).unwrap();
    end_capture(a, capture, pool);
    (id, ranges)
}

/// vLLM empties the cache right after a sleep: the segments of a sleeping tag that hold only a graph's
/// freed temporaries (no live block, no page mapped once asleep) keep their addresses, which the graph
/// baked in, and the wake maps them again there, with the tag's weights.
#[test]
fn empty_cache_keeps_a_sleeping_tags_graph_memory_and_the_wake_maps_it_in_place() {
    let mut a = new_alloc(Config::default());
    let s = StreamId(1);
    let weights = a.alloc_tagged(6 * PAGE, s, "t").unwrap();
    write_pattern(&mut a, weights, 7, 6 * PAGE);
    let (_, ranges) = capture_in_tag(&mut a, Some(weights), 1);
    a.sleep("t", true).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    // Another job takes memory; none of it at the graph's addresses.
    let other = a.alloc(8 * PAGE, StreamId(5)).unwrap();
    assert!(
        (ranges.iter()).all(|r| other + 8 * PAGE <= r.start || r.start + r.size <= other),
        "the graph's addresses went to another allocation"
    );
    a.wake("t").unwrap();
    a.driver_mut()
        .launch(s, &ranges)
        .expect("the replay finds its memory");
    assert!(holds_pattern(&a, weights, 7, 6 * PAGE));
    a.free(other).unwrap();
    a.check_invariants().unwrap();
}

/// `torch.cuda.graph` captures on a side stream and replays on the current one: the allocator never sees
/// the replay's stream, so a sleep of the graph's tag waits for the whole device before it copies and
/// unmaps (the simulator refuses an unmap under running work, as a GPU faults).
#[test]
fn a_sleep_waits_for_a_graph_replayed_on_another_stream_than_its_capture() {
    let mut a = new_alloc(Config::default());
    let (graph, _) = capture_in_tag(&mut a, None, 2);
    a.driver_mut()
        .replay_graph(graph, StreamId(1))
        .expect("replay queued");
    a.sleep("t", true).unwrap();
    a.wake("t").unwrap();
    a.check_invariants().unwrap();
}

/// A sleep whose second unmap fails leaves the tag asleep half way: the allocation and free stay refused,
/// a second sleep finishes, and the wake restores everything. A wake that runs out of memory leaves the
/// tag asleep; once memory is free a second wake finishes.
#[test]
fn a_sleep_or_wake_that_fails_half_way_is_finished_by_the_next() {
    let mut a = new_alloc(Config::default().with_cross_stream_reuse(false));
    let (s1, s2) = (StreamId(1), StreamId(2));
    let x = a.alloc_tagged(4 * PAGE, s1, "kv").unwrap();
    let y = a.alloc_tagged(4 * PAGE, s2, "kv").unwrap();
    write_pattern(&mut a, x, 1, 4 * PAGE);
    write_pattern(&mut a, y, 2, 4 * PAGE);
    // An unmap that fails is made again (`settle.rs`): the second and third calls fail.
    a.driver_mut().fail_nth(Op::Unmap, 2, FaultKind::Error);
    a.driver_mut().fail_nth(Op::Unmap, 3, FaultKind::Error);
    assert!(a.sleep("kv", true).is_err());
    a.check_invariants().unwrap();
    a.driver_mut().clear_faults();
    assert_eq!(
        a.sleep("kv", false).unwrap(),
        4 * PAGE,
        "the rest is unmapped"
    );
    a.check_invariants().unwrap();

    // Fill the device so the wake runs out of memory.
    let hog = a.alloc((PAGES - 2) * PAGE, StreamId(3)).unwrap();
    assert!(a.wake("kv").unwrap_err().is_out_of_memory());
    a.check_invariants().unwrap();
    a.free(hog).unwrap();
    a.wake("kv").unwrap();
    assert!(
        holds_pattern(&a, x, 1, 4 * PAGE) && holds_pattern(&a, y, 2, 4 * PAGE),
        "the first sleep's bytes"
    );
    a.check_invariants().unwrap();
}

/// Through the facade: tagged buffers never enter a stream cache, the statistics and the summary show
/// what sleeps, and an out-of-memory message says so.
#[test]
fn the_facade_reports_what_sleeps() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(PAGE * PAGES)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let a = Allocator::expandable(sim, Config::default()).unwrap();
    let kv = a.alloc_tagged(10 * PAGE, StreamId(1), "kv_cache").unwrap();
    let ptr = kv.ptr();
    assert_eq!(a.sleep("kv_cache", true).unwrap(), 10 * PAGE);
    kv.free().unwrap(); // dropped while asleep: freed now, its memory given back at the wake
    assert_eq!(a.stream_cached(), (0, 0));
    let stats = a.stats();
    assert_eq!(stats.asleep_bytes, 10 * PAGE);
    assert_eq!(stats.to_pytorch_keys()["cuvmm.asleep_bytes"], 10 * PAGE);
    let summary = a.memory_summary();
    assert!(
        summary.contains("Asleep (tags)") && summary.contains("tag kv_cache"),
        "{summary}"
    );
    let hog = a.alloc_on(60 * PAGE, StreamId(1)).unwrap();
    let err = a.alloc_on(10 * PAGE, StreamId(1)).unwrap_err();
    assert!(err.to_string().contains("tag \"kv_cache\""), "{err}");
    hog.free().unwrap();
    let stats = a.stats();
    assert_eq!(
        (stats.allocated_bytes.current, stats.active_bytes.current),
        (0, 10 * PAGE),
        "freed, pending until the wake"
    );
    a.wake("kv_cache").unwrap();
    assert_eq!(a.stats().active_bytes.current, 0, "freed at the wake");
    assert!(matches!(a.free_raw(ptr), Err(Error::DoubleFree { .. })));
    a.check_invariants().unwrap();
    assert!(a.asleep_tags().is_empty());
}

/// The host has no memory to spare for a sleep's copies (pinning its pieces fails).
#[test]
fn a_sleep_whose_bytes_the_host_cannot_hold_fails_and_changes_nothing() {
    let mut a = new_alloc(Config::default());
    let weights = a.alloc_tagged(4 * PAGE, StreamId(1), "weights").unwrap();
    let bytes = vec![7u8; (4 * PAGE) as usize];
    a.driver_mut().write(weights, &bytes).unwrap();
    a.driver_mut()
        .fail_nth(Op::HostAlloc, 1, FaultKind::OutOfMemory);
    let reserved = a.stats().reserved_bytes.current;
    let refused = a.sleep("weights", true);
    assert!(
        matches!(
            refused,
            Err(Error::Driver(DriverError::HostOutOfMemory { .. }))
        ),
        "{refused:?}"
    );
    assert_eq!(a.stats().asleep_bytes, 0);
    assert_eq!(a.stats().reserved_bytes.current, reserved);
    assert_eq!(
        a.driver().read(weights, bytes.len()).unwrap(),
        bytes,
        "the tag stays awake with its bytes"
    );
    a.check_invariants().unwrap();
    // Without its bytes a sleep needs no host memory.
    assert!(a.sleep("weights", false).unwrap() > 0);
    a.wake("weights").unwrap();
    a.free(weights).unwrap();
    a.check_invariants().unwrap();
}
