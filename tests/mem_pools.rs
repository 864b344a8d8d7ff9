//! What PyTorch's `MemPool` and cudagraph trees ask of a private pool beyond a capture, on the simulated
//! device: use counts, nested pools (the inner one wins), checkpoints and putting a pool back to one, a
//! pool's free memory serving an allocation that ran out (`use_on_oom`), a pool that splits no page
//! (`no_split`), one pool's cache given back (`emptyCache(pool)`), and a pool begun with no capture once
//! captures are marked (PyTorch 2.13's `markCaptureBegin`/`End`). Every test walks the invariants.

mod common;

use cuvmm::driver::VaRange;
use cuvmm::driver::sim::SimDriver;
use cuvmm::expandable::Expandable;
use cuvmm::strategy::{Controls, GraphPools, Snapshots, StreamUses};
use cuvmm::{
    Allocator, Config, Error, GraphPool, PoolBlock, Strategy as _, StreamFilter, StreamId,
};

const PAGE: u64 = 4096;
const PAGES: u64 = 32;

type Alloc = Expandable<SimDriver>;

fn new_alloc() -> Alloc {
    common::expandable_with(
        PAGE,
        PAGES,
        Config {
            small_size: 1024,
            large_handle: PAGE,
            ..Config::default()
        },
        true,
    )
}

/// `stream`'s allocations go to `pool` (as `torch.cuda.use_mem_pool` begins it for the current thread).
fn begin(a: &mut Alloc, pool: GraphPool, stream: StreamId) {
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![stream]))
        .unwrap();
}

/// Ends `pool`'s allocations and drops the use its begin made (the end of `use_mem_pool`).
fn end(a: &mut Alloc, pool: GraphPool) {
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
}

/// A live `pool` of `stream` being allocated to, with a block `x` of two pages, and its checkpoint then.
fn pool_with_a_checkpoint(
    a: &mut Alloc,
    pool: GraphPool,
    stream: StreamId,
) -> (u64, Vec<PoolBlock>) {
    a.incref_pool(pool).unwrap();
    begin(a, pool, stream);
    let x = a.alloc(2 * PAGE, stream).unwrap();
    (x, a.pool_blocks(pool))
}

/// The addresses of `pool`'s live blocks, in order.
fn live_in(a: &Alloc, pool: GraphPool) -> Vec<u64> {
    let mut live: Vec<u64> = a.pool_blocks(pool).iter().map(|b| b.addr).collect();
    live.sort_unstable();
    live
}

/// Asserts that an operation was refused as a capture would refuse it.
#[track_caller]
fn assert_refused<T: std::fmt::Debug>(result: Result<T, Error>) {
    assert!(
        matches!(result, Err(Error::CaptureUnderway { .. })),
        "{result:?}"
    );
}

fn pool_of(a: &Alloc, addr: u64) -> GraphPool {
    let snapshot = a.snapshot().unwrap();
    let seg = (snapshot.segments.iter())
        .find(|s| s.address <= addr && addr < s.address + s.total_size)
        .expect("a segment holds it");
    seg.graph_pool
}

#[test]
fn a_pools_use_count_follows_increfs_begins_and_releases() {
    let mut a = new_alloc();
    let pool = GraphPool(0, 1);
    assert_eq!(a.pool_use_count(pool), 0);
    a.incref_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), 1, "a MemPool made");
    begin(&mut a, pool, StreamId(1));
    assert_eq!(a.pool_use_count(pool), 2, "inside use_mem_pool");
    end(&mut a, pool);
    assert_eq!(a.pool_use_count(pool), 1);
    a.release_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), 0, "the MemPool deleted");
    a.check_invariants().unwrap();
}

/// A pool released as often as it was begun while it is still being allocated to (a MemPool deleted inside
/// its own `use_mem_pool`, a graph dropped during its capture) keeps serving its stream until its end, then
/// goes as any released pool; one release more is refused.
#[test]
fn a_pool_released_while_allocated_to_goes_at_its_end() {
    let mut a = new_alloc();
    let (pool, stream) = (GraphPool(0, 1), StreamId(1));
    begin(&mut a, pool, stream);
    let x = a.alloc(2 * PAGE, stream).unwrap();
    a.release_pool(pool).unwrap();
    assert_eq!(a.pool_use_count(pool), 0);
    a.check_invariants().unwrap();
    let y = a.alloc(PAGE, stream).unwrap();
    assert_eq!(
        (pool_of(&a, x), pool_of(&a, y)),
        (pool, pool),
        "still the pool's"
    );
    assert!(matches!(a.release_pool(pool), Err(Error::GraphPool { .. })));
    a.end_allocate_to_pool(pool).unwrap();
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.free(y).unwrap();
    let z = a.alloc(PAGE, stream).unwrap();
    assert_eq!(
        pool_of(&a, z),
        GraphPool::NONE,
        "released at its end: common memory"
    );
    a.free(z).unwrap();
    a.check_invariants().unwrap();
}

/// `use_mem_pool(p2)` inside `use_mem_pool(p1)` on one thread: both accept the stream, and the pool begun
/// last gets the allocation, as in PyTorch; once it ends, the outer one does again.
#[test]
fn nested_pools_allocate_to_the_inner_one() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let (outer, inner) = (GraphPool(0, 1), GraphPool(0, 2));
    begin(&mut a, outer, s);
    let x = a.alloc(2 * PAGE, s).unwrap();
    begin(&mut a, inner, s);
    let y = a.alloc(2 * PAGE, s).unwrap();
    end(&mut a, inner);
    let z = a.alloc(2 * PAGE, s).unwrap();
    end(&mut a, outer);
    assert_eq!(
        [pool_of(&a, x), pool_of(&a, y), pool_of(&a, z)],
        [outer, inner, outer]
    );
    a.check_invariants().unwrap();
}

/// `use_mem_pool` with no capture, once captures are marked (PyTorch 2.13 on): a request in the pool that
/// runs out releases the cache and is served, and `empty_cache` gives memory back, as outside a pool. Before
/// captures are marked, a pool begun may be a capture: the request fails rather than unmap, and
/// `empty_cache` is refused. A marked capture has every rule of a capture until its end is marked.
#[test]
fn once_captures_are_marked_a_pool_begun_alone_is_no_capture() {
    for marked in [false, true] {
        let mut a = new_alloc();
        if marked {
            a.mark_captures();
        }
        let s = StreamId(1);
        let cached = a.alloc(24 * PAGE, s).unwrap();
        a.free(cached).unwrap();
        let pool = GraphPool(0, 1);
        begin(&mut a, pool, s);
        let request = a.alloc(16 * PAGE, s);
        let emptied = a.empty_cache();
        if marked {
            let x = request.unwrap();
            assert_eq!(pool_of(&a, x), pool);
            emptied.unwrap();
            a.mark_capture(true);
            assert_refused(a.empty_cache());
            let y = a.alloc(PAGE, s).unwrap();
            a.free(y).unwrap();
            a.mark_capture(false);
            a.empty_cache().unwrap();
            a.free(x).unwrap();
        } else {
            assert!(request.unwrap_err().is_out_of_memory(), "marked: {marked}");
            assert_refused(emptied);
        }
        a.check_invariants().unwrap();
        end(&mut a, pool);
        a.empty_cache().unwrap();
        assert_eq!(a.stats().reserved_bytes.current, 0, "marked: {marked}");
        a.check_invariants().unwrap();
    }
}

/// A capture abandoned before its end (PyTorch's `CUDAGraph::reset` ends its pool without
/// `markCaptureEnd`) leaves no mark once its pool ends: a `use_mem_pool` after it is no capture, and a late
/// end is ignored.
#[test]
fn the_mark_of_an_abandoned_capture_goes_with_its_pool() {
    let mut a = new_alloc();
    a.mark_captures();
    let graph = GraphPool(2, 0);
    begin(&mut a, graph, StreamId(3));
    a.mark_capture(true);
    assert_refused(a.empty_cache());
    a.end_allocate_to_pool(graph).unwrap();
    a.empty_cache().unwrap();
    let pool = GraphPool(0, 7);
    begin(&mut a, pool, StreamId(1));
    a.empty_cache().unwrap();
    a.mark_capture(false);
    a.empty_cache().unwrap();
    a.mark_capture(true);
    assert_refused(a.empty_cache());
    a.mark_capture(false);
    end(&mut a, pool);
    a.release_pool(graph).unwrap();
    a.check_invariants().unwrap();
}

/// Marked or not: a pool begun for a capture's id is a capture; and a sleep or a wake, whose copies run
/// without the allocator's lock, waits until no pool is being allocated to, since a capture may begin while
/// they copy.
#[test]
fn a_captures_pool_and_a_sleep_keep_their_rules_when_captures_are_marked() {
    let mut a = new_alloc();
    a.mark_captures();
    let graph = GraphPool(2, 0);
    a.begin_allocate_to_pool(graph, StreamFilter::Capture(9))
        .unwrap();
    assert_refused(a.empty_cache());
    end(&mut a, graph);
    let weights = a.alloc_tagged(2 * PAGE, StreamId(1), "weights").unwrap();
    let pool = GraphPool(0, 1);
    begin(&mut a, pool, StreamId(1));
    a.empty_cache().unwrap();
    assert_refused(a.sleep("weights", true));
    end(&mut a, pool);
    assert_eq!(a.sleep("weights", true).unwrap(), 2 * PAGE);
    a.wake("weights").unwrap();
    a.free(weights).unwrap();
    a.check_invariants().unwrap();
}

/// cudagraph trees: a checkpoint after recording, then blocks freed and allocated in the pool; putting
/// the pool back frees those allocated since and makes the checkpoint's blocks live again at the same
/// addresses, with the statistics of that state.
#[test]
fn a_pool_put_back_to_a_checkpoint_has_its_blocks_at_their_addresses() {
    let mut a = new_alloc();
    let s = StreamId(3);
    let pool = GraphPool(4, 0);
    a.incref_pool(pool).unwrap();
    begin(&mut a, pool, s);
    let x = a.alloc(3 * PAGE, s).unwrap();
    let y = a.alloc(PAGE + 512, s).unwrap();
    let checkpoint = a.pool_blocks(pool);
    assert_eq!(
        checkpoint,
        vec![
            PoolBlock {
                addr: x,
                size: 3 * PAGE,
                requested: 3 * PAGE
            },
            PoolBlock {
                addr: y,
                size: PAGE + 512,
                requested: PAGE + 512
            },
        ]
    );
    let stats = a.stats();
    // Replayed and diverged: x died, z took part of its memory, w came after.
    a.free(x).unwrap();
    let z = a.alloc(PAGE, s).unwrap();
    let w = a.alloc(5 * PAGE, s).unwrap();
    assert!(z >= x && z < x + 3 * PAGE, "z reuses x's memory");
    let reserved = a.stats().reserved_bytes.current;
    let freed = a.restore_pool(pool, &checkpoint).unwrap();
    let mut freed_sorted = freed.clone();
    freed_sorted.sort_unstable();
    let mut expected = vec![y, z, w];
    expected.sort_unstable();
    assert_eq!(freed_sorted, expected, "every block live when called");
    assert_eq!(a.pool_blocks(pool), checkpoint);
    let now = a.stats();
    assert_eq!(now.allocated_bytes.current, stats.allocated_bytes.current);
    assert_eq!(now.allocation.current, stats.allocation.current);
    assert_eq!(
        now.reserved_bytes.current, reserved,
        "nothing mapped or unmapped"
    );
    assert!(
        matches!(a.free(w), Err(Error::DoubleFree { .. })),
        "w was freed by the checkpoint"
    );
    a.check_invariants().unwrap();
    // The pool goes on: its blocks free and are reused as any.
    a.free(x).unwrap();
    a.free(y).unwrap();
    end(&mut a, pool);
    a.release_pool(pool).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_checkpoint_that_cannot_be_put_back_is_refused_with_the_pool_unchanged() {
    let mut a = new_alloc();
    let (s, side) = (StreamId(3), StreamId(4));
    let pool = GraphPool(4, 0);
    begin(&mut a, pool, s);
    let x = a.alloc(2 * PAGE, s).unwrap();
    let checkpoint = a.pool_blocks(pool);
    let outside = a.alloc(PAGE, StreamId(9)).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    let foreign = [PoolBlock {
        addr: outside,
        size: PAGE,
        requested: PAGE,
    }];
    let refused = a.restore_pool(pool, &foreign).unwrap_err();
    assert!(
        refused.to_string().contains("outside the pool"),
        "{refused}"
    );
    // A block live since and used on another stream cannot be freed by the checkpoint.
    begin(&mut a, GraphPool(0, 99), StreamId(99));
    a.end_allocate_to_pool(GraphPool(0, 99)).unwrap();
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![s]))
        .unwrap();
    let y = a.alloc(PAGE, s).unwrap();
    a.end_allocate_to_pool(pool).unwrap();
    a.record_stream(y, side).unwrap();
    let refused = a.restore_pool(pool, &checkpoint).unwrap_err();
    assert!(refused.to_string().contains("another stream"), "{refused}");
    assert_eq!(a.pool_blocks(pool).len(), 2, "nothing freed");
    assert!(matches!(
        a.restore_pool(GraphPool(0, 77), &[]),
        Err(Error::GraphPool { .. })
    ));
    a.check_invariants().unwrap();
    for addr in [x, y, outside] {
        a.free(addr).unwrap();
    }
}

/// A block of the checkpoint over memory freed since but still waited for (`record_stream` on a side
/// stream whose kernel still reads it) is refused before any block is freed: PyTorch still holds the
/// blocks live then, and frees them itself.
#[test]
fn a_checkpoint_over_memory_still_waited_for_is_refused_before_anything_is_freed() {
    let mut a = new_alloc();
    let (s, side) = (StreamId(3), StreamId(4));
    let pool = GraphPool(4, 0);
    let (x, checkpoint) = pool_with_a_checkpoint(&mut a, pool, s);
    a.driver_mut()
        .launch(side, &[VaRange::new(x, 2 * PAGE)])
        .unwrap();
    a.record_stream(x, side).unwrap();
    a.free(x).unwrap();
    let y = a.alloc(PAGE, s).unwrap();
    assert!(
        !(x..x + 2 * PAGE).contains(&y),
        "x's memory waits for the side stream"
    );
    let refused = a.restore_pool(pool, &checkpoint).unwrap_err();
    assert!(
        refused.to_string().contains("overlaps memory in use since"),
        "{refused}"
    );
    assert_eq!(
        live_in(&a, pool),
        vec![y],
        "y, live since the checkpoint, is still live"
    );
    a.check_invariants().unwrap();
    a.free(y).unwrap();
    a.driver_mut().complete_stream(side);
    end(&mut a, pool);
    a.release_pool(pool).unwrap();
    a.check_invariants().unwrap();
}

/// A pool whose memory is partly under a sleeping tag (a graph captured in a tagged region) refuses a
/// restore before freeing anything: the awake blocks live since stay live.
#[test]
fn a_checkpoint_of_a_pool_with_a_sleeping_tag_is_refused_before_anything_is_freed() {
    let mut a = new_alloc();
    let s = StreamId(3);
    let pool = GraphPool(4, 0);
    let (x, checkpoint) = pool_with_a_checkpoint(&mut a, pool, s);
    let z = a.alloc(PAGE, s).unwrap();
    let kv = a.alloc_tagged(PAGE, s, "kv").unwrap();
    assert_eq!(pool_of(&a, kv), pool);
    end(&mut a, pool);
    a.sleep("kv", true).unwrap();
    let refused = a.restore_pool(pool, &checkpoint).unwrap_err();
    assert!(refused.to_string().contains("asleep"), "{refused}");
    a.wake("kv").unwrap();
    let mut expected = vec![x, z, kv];
    expected.sort_unstable();
    assert_eq!(live_in(&a, pool), expected, "nothing freed");
    a.check_invariants().unwrap();
    for addr in [x, z, kv] {
        a.free(addr).unwrap();
    }
    a.release_pool(pool).unwrap();
    a.check_invariants().unwrap();
}

/// A pool made with `use_on_oom`: an allocation outside every pool that would run out of memory takes the
/// pool's free memory instead (no OOM counted), and gives it back to the pool when freed. Without the flag,
/// the same request fails.
#[test]
fn a_use_on_oom_pools_free_memory_serves_a_request_that_ran_out() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let pool = GraphPool(0, 5);
    a.incref_pool(pool).unwrap();
    begin(&mut a, pool, s);
    let temp = a.alloc(24 * PAGE, s).unwrap();
    a.free(temp).unwrap();
    end(&mut a, pool);
    let _held = a.alloc(6 * PAGE, s).unwrap();
    let err = a.alloc(10 * PAGE, s).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    let ooms = a.stats().num_ooms;
    a.set_pool_use_on_oom(pool, true);
    let x = a.alloc(10 * PAGE, s).unwrap();
    assert!(x >= temp && x < temp + 24 * PAGE, "in the pool's memory");
    assert_eq!(pool_of(&a, x), pool);
    assert_eq!(a.stats().num_ooms, ooms, "no out-of-memory counted");
    // Another stream's request finds none of the pool's memory on its stream.
    assert!(
        a.alloc(10 * PAGE, StreamId(2))
            .unwrap_err()
            .is_out_of_memory()
    );
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    assert!(
        a.pool_blocks(pool).is_empty(),
        "freed, it is the pool's free memory"
    );
    a.set_pool_use_on_oom(pool, false);
    assert!(a.alloc(10 * PAGE, s).unwrap_err().is_out_of_memory());
    a.check_invariants().unwrap();
}

/// A `no_split` pool: each allocation takes whole pages, so no two share one; the request is still counted
/// as asked.
#[test]
fn a_no_split_pools_allocations_share_no_page() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let pool = GraphPool(0, 6);
    a.incref_pool(pool).unwrap();
    a.set_pool_no_split(pool);
    begin(&mut a, pool, s);
    let x = a.alloc(700, s).unwrap();
    let y = a.alloc(PAGE + 1, s).unwrap();
    end(&mut a, pool);
    let sizes: Vec<u64> = a.pool_blocks(pool).iter().map(|b| b.size).collect();
    assert_eq!(sizes, vec![PAGE, 2 * PAGE]);
    assert_eq!(x % PAGE, 0);
    assert_eq!(y % PAGE, 0);
    assert!(y >= x + PAGE, "no shared page");
    let stats = a.stats();
    assert_eq!(stats.requested_bytes.current, 700 + PAGE + 1);
    // Outside the pool, requests still share pages.
    let u = a.alloc(700, s).unwrap();
    let v = a.alloc(700, s).unwrap();
    assert_eq!(u / PAGE, v / PAGE);
    a.check_invariants().unwrap();
    for addr in [x, y, u, v] {
        a.free(addr).unwrap();
    }
    a.check_invariants().unwrap();
    // Deleted (its last user released), the pool's setting goes with it: a pool of that id made again
    // splits pages (a process making a MemPool per step keeps no setting per pool).
    a.release_pool(pool).unwrap();
    a.incref_pool(pool).unwrap();
    begin(&mut a, pool, s);
    let (x, y) = (a.alloc(700, s).unwrap(), a.alloc(700, s).unwrap());
    assert_eq!(x / PAGE, y / PAGE);
    a.free(x).unwrap();
    a.free(y).unwrap();
    end(&mut a, pool);
    a.check_invariants().unwrap();
}

/// `emptyCache(pool)` (what `del pool` does after releasing it): a live pool keeps its memory; a released
/// one gives back its idle pages and segments, and nothing of the common cache.
#[test]
fn one_pools_cache_goes_back_once_it_is_released_and_nothing_else() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let pool = GraphPool(0, 8);
    a.incref_pool(pool).unwrap();
    begin(&mut a, pool, s);
    let p = a.alloc(6 * PAGE, s).unwrap();
    end(&mut a, pool);
    let c = a.alloc(4 * PAGE, s).unwrap();
    a.free(c).unwrap();
    a.free(p).unwrap();
    let reserved = a.stats().reserved_bytes.current;
    assert_eq!(reserved, 10 * PAGE);
    assert_eq!(a.empty_pool_cache(pool).unwrap(), 0, "the pool is live");
    a.release_pool(pool).unwrap();
    assert_eq!(a.empty_pool_cache(pool).unwrap(), 6 * PAGE);
    assert_eq!(
        a.stats().reserved_bytes.current,
        4 * PAGE,
        "the common cache stays"
    );
    assert!(
        a.snapshot()
            .unwrap()
            .segments
            .iter()
            .all(|seg| seg.graph_pool != pool)
    );
    assert_eq!(a.empty_pool_cache(pool).unwrap(), 0, "nothing left");
    a.check_invariants().unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

/// While a pool is being allocated to, `emptyCache(pool)` is refused only where there is memory of that pool
/// to give back: `~MemPool` calls it on every device, and a pool deleted while another device (or another
/// pool) captures must not warn where it holds nothing.
#[test]
fn a_pool_with_nothing_here_is_emptied_during_a_capture_and_one_with_memory_refused() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let (released, capturing, never) = (GraphPool(0, 3), GraphPool(0, 4), GraphPool(0, 5));
    a.incref_pool(released).unwrap();
    begin(&mut a, released, s);
    let x = a.alloc(2 * PAGE, s).unwrap();
    end(&mut a, released);
    a.free(x).unwrap();
    a.release_pool(released).unwrap();
    a.incref_pool(capturing).unwrap();
    begin(&mut a, capturing, s);
    assert_eq!(a.empty_pool_cache(never).unwrap(), 0, "nothing of it here");
    assert_eq!(
        a.empty_pool_cache(capturing).unwrap(),
        0,
        "the pool is live"
    );
    assert_refused(a.empty_pool_cache(released));
    a.check_invariants().unwrap();
    end(&mut a, capturing);
    assert_eq!(a.empty_pool_cache(released).unwrap(), 2 * PAGE);
    a.check_invariants().unwrap();
}

/// PyTorch's `reserved_bytes_by_private_pools`: each pool's mapped pages, separate from the common memory;
/// at 0 once the pool's memory is given back, its peak and totals kept, and no longer listed once both
/// resets have cleared them.
#[test]
fn each_private_pools_reserved_bytes_are_counted_apart_until_both_resets_forget_it() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let (one, two) = (GraphPool(0, 1), GraphPool(0, 2));
    let common = a.alloc(3 * PAGE, s).unwrap();
    let mut pool_blocks = Vec::new();
    for (pool, pages) in [(one, 6), (two, 2)] {
        a.incref_pool(pool).unwrap();
        begin(&mut a, pool, s);
        pool_blocks.push(a.alloc(pages * PAGE, s).unwrap());
        end(&mut a, pool);
        a.check_invariants().unwrap();
    }
    let reserved = |a: &Alloc, pool: GraphPool| {
        let found = a
            .reserved_by_private_pool()
            .into_iter()
            .find(|(p, _)| *p == pool);
        found.map(|(_, array)| array.all)
    };
    let (six, two_pages) = (reserved(&a, one).unwrap(), reserved(&a, two).unwrap());
    assert_eq!(
        (six.current, six.peak, six.allocated),
        (6 * PAGE, 6 * PAGE, 6 * PAGE)
    );
    assert_eq!(two_pages.current, 2 * PAGE);
    assert_eq!(
        a.reserved_by_private_pool().len(),
        2,
        "the common memory is no pool's"
    );
    assert_eq!(a.stats().reserved_bytes.current, 11 * PAGE);

    a.free(pool_blocks[0]).unwrap();
    a.release_pool(one).unwrap();
    a.empty_pool_cache(one).unwrap();
    a.check_invariants().unwrap();
    let gone = reserved(&a, one).unwrap();
    assert_eq!(
        (gone.current, gone.peak, gone.freed),
        (0, 6 * PAGE, 6 * PAGE)
    );
    a.reset_peak_stats().unwrap();
    assert_eq!(
        reserved(&a, one).unwrap().peak,
        0,
        "listed until its totals are reset too"
    );
    a.reset_accumulated_stats().unwrap();
    assert_eq!(reserved(&a, one), None);
    let kept = reserved(&a, two).unwrap();
    assert_eq!(
        (kept.current, kept.peak, kept.allocated),
        (2 * PAGE, 2 * PAGE, 0)
    );
    a.check_invariants().unwrap();
    a.free(pool_blocks[1]).unwrap();
    a.free(common).unwrap();
}

/// Every event of a pool's memory names the pool, as PyTorch's trace entries do (`mempool_`): NCCL's
/// registration hook (`ProcessGroupNCCL::registerMemPool`) matches a segment event's pool against the
/// pools registered. Memory of no pool names none, and an out-of-memory names the pool it asked of.
#[test]
fn every_event_of_a_pools_memory_names_the_pool() {
    use cuvmm::history::{TraceAction, TraceEntry};
    use std::sync::{Arc, Mutex};
    let mut a = new_alloc();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    a.attach_trace_tracker(Arc::new(move |e: &TraceEntry| {
        sink.lock().unwrap().push(*e)
    }))
    .unwrap();
    let s = StreamId(1);
    let pool = GraphPool(0, 5);
    let common = a.alloc(2 * PAGE, s).unwrap();
    a.incref_pool(pool).unwrap();
    begin(&mut a, pool, s);
    let p = a.alloc(3 * PAGE, s).unwrap();
    assert!(matches!(
        a.alloc(4 * PAGES * PAGE, s),
        Err(Error::OutOfMemory(_) | Error::TooLarge { .. })
    ));
    a.free(p).unwrap();
    end(&mut a, pool);
    a.release_pool(pool).unwrap();
    assert!(a.empty_pool_cache(pool).unwrap() > 0);
    a.free(common).unwrap();
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();

    let seen = seen.lock().unwrap().clone();
    let pool_of_event = |action: TraceAction, addr: u64| {
        let found = seen
            .iter()
            .find(|e| e.action == action && e.addr <= addr && addr < e.addr + e.size);
        found
            .unwrap_or_else(|| panic!("no {action:?} of {addr:#x} in {seen:#x?}"))
            .pool
    };
    use TraceAction::*;
    for action in [
        Alloc,
        FreeRequested,
        FreeCompleted,
        SegmentMap,
        SegmentUnmap,
    ] {
        assert_eq!(
            pool_of_event(action, p),
            pool,
            "{action:?} of the pool's block"
        );
        assert_eq!(
            pool_of_event(action, common),
            GraphPool::NONE,
            "{action:?} of a common block"
        );
    }
    let ooms: Vec<GraphPool> = (seen.iter().filter(|e| e.action == Oom))
        .map(|e| e.pool)
        .collect();
    assert_eq!(ooms, [pool], "the out-of-memory asked of the pool");
}

/// The same operations through the thread-safe facade.
#[test]
fn the_facade_reaches_every_pool_operation() {
    let a = Allocator::new(new_alloc());
    let s = StreamId(1);
    let pool = GraphPool(0, 3);
    a.incref_pool(pool).unwrap();
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![s]))
        .unwrap();
    let x = a.alloc_raw(2 * PAGE, s).unwrap();
    let checkpoint = a.pool_blocks(pool);
    a.free_raw(x).unwrap();
    let y = a.alloc_raw(3 * PAGE, s).unwrap();
    assert_eq!(a.pool_use_count(pool), 2);
    assert_eq!(a.restore_pool(pool, &checkpoint).unwrap(), vec![y]);
    assert_eq!(a.pool_blocks(pool), checkpoint);
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
    a.set_pool_use_on_oom(pool, true);
    a.set_pool_no_split(pool);
    a.mark_captures();
    a.mark_capture_begin();
    assert_refused(a.empty_cache());
    a.mark_capture_end();
    a.free_raw(x).unwrap();
    a.release_pool(pool).unwrap();
    assert!(a.empty_pool_cache(pool).unwrap() > 0);
    a.check_invariants().unwrap();
}

/// PyTorch 2.15's `allocateWithAddress`: a block at an address of a segment's free memory, and nowhere
/// else.
#[test]
fn a_block_is_allocated_at_a_free_address_and_nowhere_else() {
    let mut a = new_alloc();
    let s = StreamId(1);
    let x = a.alloc(2 * PAGE, s).unwrap();
    a.free(x).unwrap();
    let y = a.alloc_at(x + PAGE, 1000).unwrap();
    assert_eq!(y, x + PAGE);
    assert_eq!(a.stats().allocated_bytes.current, 1024);
    for (addr, size) in [(y, 512), (y + 512, 512), (x + 100, 512), (1 << 50, 512)] {
        assert!(
            matches!(a.alloc_at(addr, size), Err(Error::UnknownAddress { .. })),
            "{addr:#x}"
        );
    }
    assert!(matches!(a.alloc_at(x, 0), Err(Error::ZeroSize)));
    a.check_invariants().unwrap();
    a.free(y).unwrap();
    a.check_invariants().unwrap();
}
