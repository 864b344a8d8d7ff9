//! CUDA graph capture and private pools on the simulated device, which refuses what CUDA refuses during a
//! capture (an event query or synchronization of a capturing stream; in global mode such calls, and unmaps
//! and releases, from any thread) and counts every refusal.
//!
//! The scenarios are the failures seen with PyTorch on an H100 (issue 29), as the allocator sees them; the
//! property test interleaves captures with allocations, frees, `record_stream`, kernels and memory pressure
//! and checks after every step that no call was refused, no capture invalidated, and no memory of a live
//! pool handed outside it.

mod common;

use cuvmm::config::Compaction;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Error, GraphPool, Strategy as _, StreamFilter, StreamId};
use proptest::prelude::*;
use std::collections::BTreeMap;

const PAGE: u64 = 4096;
const PAGES: u64 = 32;
const ROUND: u64 = 512;

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

/// Begins a capture of `stream` and the pool it allocates to, as PyTorch's `CUDAGraph.capture_begin` does.
fn begin(a: &mut Alloc, stream: StreamId, pool: GraphPool, mode: CaptureMode) -> u64 {
    let id = a
        .driver_mut()
        .begin_capture(stream, mode)
        .expect("begin capture");
    a.begin_allocate_to_pool(pool, StreamFilter::Capture(id))
        .expect("begin pool");
    id
}

/// Ends the capture (it must not have been invalidated) and stops allocating to the pool.
fn end(a: &mut Alloc, stream: StreamId, pool: GraphPool) {
    a.driver_mut()
        .end_capture(stream)
        .expect("the capture was invalidated");
    a.end_allocate_to_pool(pool).expect("end pool");
}

fn assert_capture_safe(a: &Alloc) {
    let d = a.driver();
    assert_eq!(
        d.capture_refusals(),
        0,
        "the allocator made a call CUDA refuses during capture"
    );
    assert_eq!(d.invalidated_captures(), 0, "a capture was invalidated");
}

fn overlaps(a: VaRange, b: VaRange) -> bool {
    a.start < b.start + b.size && b.start < a.start + a.size
}

/// record_stream during a capture: a block read on a side stream, freed while the default stream captures.
/// Its free waits for no event during the capture (none may be queried) and its memory is not reused until
/// the side stream's work is done.
#[test]
fn a_free_of_a_block_used_on_another_stream_waits_until_the_capture_ends() {
    let mut a = new_alloc(Config::default());
    let (main, side, capture) = (StreamId(1), StreamId(2), StreamId(3));
    let x = a.alloc(8 * PAGE, main).unwrap();
    a.record_stream(x, side).unwrap();
    a.driver_mut()
        .launch(side, &[VaRange::new(x, 8 * PAGE)])
        .unwrap();
    let pool = GraphPool(1, 0);
    begin(&mut a, capture, pool, CaptureMode::Global);
    a.free(x).unwrap();
    // Deferred: still counted, and not handed out again on its own stream.
    assert_eq!(a.stats().allocated_bytes.current, 8 * PAGE);
    let y = a.alloc(8 * PAGE, main).unwrap();
    assert!(!overlaps(
        VaRange::new(x, 8 * PAGE),
        VaRange::new(y, 8 * PAGE)
    ));
    assert!(
        matches!(a.free(x), Err(Error::DoubleFree { .. })),
        "a deferred free is a free"
    );
    a.check_invariants().unwrap();
    end(&mut a, capture, pool);
    // Freed twice, or used again, before the deferred free ran: typed errors, and nothing breaks later.
    assert!(matches!(a.free(x), Err(Error::DoubleFree { .. })));
    assert!(matches!(
        a.record_stream(x, side),
        Err(Error::UnknownAddress { .. })
    ));
    a.check_invariants().unwrap();
    // After the capture the next allocation records the event; the side stream is still busy.
    let z = a.alloc(8 * PAGE, main).unwrap();
    assert!(!overlaps(
        VaRange::new(x, 8 * PAGE),
        VaRange::new(z, 8 * PAGE)
    ));
    assert_eq!(a.stats().active_bytes.current, 24 * PAGE, "x is pending");
    a.driver_mut().complete_stream(side);
    a.free(z).unwrap();
    let w = a.alloc(8 * PAGE, main).unwrap();
    assert_eq!(
        a.stats().active_bytes.current,
        16 * PAGE,
        "x's free completed"
    );
    a.check_invariants().unwrap();
    assert_capture_safe(&a);
    for addr in [y, w] {
        a.free(addr).unwrap();
    }
}

/// Two graphs captured back to back on one capture stream, each with its own pool: a temporary freed in the
/// first capture is not given to the second, and neither pool's memory goes anywhere else while it lives.
#[test]
fn graphs_captured_back_to_back_keep_their_memory_apart() {
    let mut a = new_alloc(Config::default());
    let capture = StreamId(5);
    let (g1, g2) = (GraphPool(1, 0), GraphPool(2, 0));
    begin(&mut a, capture, g1, CaptureMode::Global);
    let t1 = a.alloc(3 * PAGE, capture).unwrap();
    let out1 = a.alloc(PAGE, capture).unwrap();
    a.free(t1).unwrap();
    end(&mut a, capture, g1);
    begin(&mut a, capture, g2, CaptureMode::Global);
    let t2 = a.alloc(3 * PAGE, capture).unwrap();
    a.free(t2).unwrap();
    end(&mut a, capture, g2);
    assert!(!overlaps(
        VaRange::new(t1, 3 * PAGE),
        VaRange::new(t2, 3 * PAGE)
    ));
    // Eager work on the same stream gets neither pool's memory.
    let eager = a.alloc(3 * PAGE, capture).unwrap();
    for (addr, size) in [(t1, 3 * PAGE), (t2, 3 * PAGE), (out1, PAGE)] {
        assert!(!overlaps(
            VaRange::new(eager, 3 * PAGE),
            VaRange::new(addr, size)
        ));
    }
    // Pool memory shows: in the statistics, the snapshot, the summary.
    let stats = a.stats();
    assert_eq!(stats.graph_pools, 2);
    assert!(stats.graph_pool_bytes >= 4 * PAGE, "{stats:?}");
    let snapshot = a.snapshot().unwrap();
    assert!(snapshot.segments.iter().any(|s| s.graph_pool == g1));
    assert!(snapshot.segments.iter().any(|s| s.graph_pool == g2));
    a.check_invariants().unwrap();
    assert_capture_safe(&a);
}

/// Nothing of a live pool is unmapped, lent or compacted, even when memory runs short: a request that
/// could only be served by taking the pool's idle pages fails instead, and succeeds once the pool is
/// released.
#[test]
fn pressure_never_takes_a_live_pools_pages_and_a_released_pool_gives_them_back() {
    let mut a = new_alloc(Config::default());
    let capture = StreamId(7);
    let pool = GraphPool(0, 9);
    begin(&mut a, capture, pool, CaptureMode::Global);
    let temp = a.alloc(20 * PAGE, capture).unwrap();
    a.driver_mut()
        .write(temp, &common::pattern(1, (20 * PAGE) as usize))
        .unwrap();
    a.free(temp).unwrap();
    end(&mut a, capture, pool);
    // 20 of 32 pages are the pool's, idle: 16 pages elsewhere cannot be had without them.
    let err = a.alloc(16 * PAGE, StreamId(1)).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(
        err.to_string().contains("CUDA graphs' private pools"),
        "{err}"
    );
    let pages: Vec<u64> = (0..20).map(|p| temp + p * PAGE).collect();
    assert!(
        pages.iter().all(|&va| a.driver().is_accessible(va)),
        "a pool page was unmapped"
    );
    let kept = a.driver().read(temp, (20 * PAGE) as usize).unwrap();
    assert_eq!(
        kept,
        common::pattern(1, (20 * PAGE) as usize),
        "the graph's bytes moved"
    );
    a.empty_cache().unwrap();
    assert!(
        pages.iter().all(|&va| a.driver().is_accessible(va)),
        "empty_cache unmapped a pool page"
    );
    a.release_pool(pool).unwrap();
    let x = a.alloc(16 * PAGE, StreamId(1)).unwrap();
    a.check_invariants().unwrap();
    a.free(x).unwrap();
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
    assert!(
        a.segments().is_empty(),
        "the released pool's segment was not freed"
    );
    assert_capture_safe(&a);
}

/// During a capture: no compaction, no release and retry (they wait and unmap), so an allocation that
/// needs them fails with out-of-memory rather than break the capture; empty_cache and trim are refused.
#[test]
fn during_a_capture_out_of_memory_is_reported_and_the_cache_is_left_alone() {
    let mut a = new_alloc(Config::default());
    let busy = StreamId(1);
    let x = a.alloc(24 * PAGE, busy).unwrap();
    a.free(x).unwrap();
    let capture = StreamId(2);
    let pool = GraphPool(3, 0);
    begin(&mut a, capture, pool, CaptureMode::Global);
    let err = a.alloc(16 * PAGE, capture).unwrap_err();
    assert!(err.is_out_of_memory(), "{err}");
    assert!(err.to_string().contains("being captured"), "{err}");
    assert!(matches!(
        a.empty_cache(),
        Err(Error::CaptureUnderway { .. })
    ));
    assert!(matches!(a.trim(PAGE), Err(Error::CaptureUnderway { .. })));
    let small = a.alloc(4 * PAGE, capture).unwrap();
    a.check_invariants().unwrap();
    end(&mut a, capture, pool);
    assert_capture_safe(&a);
    // After the capture the idle pages can be taken again.
    let y = a.alloc(16 * PAGE, busy).unwrap();
    a.free(y).unwrap();
    a.free(small).unwrap();
}

/// The pool operations refuse what makes no sense, with typed errors.
#[test]
fn pool_misuse_is_a_typed_error() {
    let mut a = new_alloc(Config::default());
    let pool = GraphPool(4, 0);
    let refused = |r: Result<(), Error>| matches!(r, Err(Error::GraphPool { .. }));
    assert!(refused(a.begin_allocate_to_pool(
        GraphPool::NONE,
        StreamFilter::Streams(vec![])
    )));
    assert!(refused(a.end_allocate_to_pool(pool)));
    assert!(refused(a.release_pool(pool)));
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![StreamId(1)]))
        .unwrap();
    assert!(refused(
        a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![]))
    ));
    a.end_allocate_to_pool(pool).unwrap();
    a.release_pool(pool).unwrap();
    assert!(refused(a.release_pool(pool)));
    a.check_invariants().unwrap();
}

/// A capture the allocator was not told of: with detection on (the facade's default), its allocations go
/// to a pool of their own, and nothing the capture forbids is called. Also through the facade's stream
/// caches: a buffer cached before the capture is not handed to it.
#[test]
fn a_capture_nobody_announced_gets_a_pool_of_its_own() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_granularity(PAGE)
            .with_capacity(PAGES * PAGE),
    );
    let config = Config {
        small_size: 1024,
        page_size: Some(PAGE),
        ..Config::default()
    };
    let alloc = Allocator::expandable(sim, config).unwrap();
    let s = StreamId(3);
    let before = alloc.alloc_on(512, s).unwrap();
    let old = before.ptr();
    drop(before);
    alloc.with_strategy(|a| {
        a.driver_mut()
            .begin_capture(s, CaptureMode::Global)
            .unwrap()
    });
    let inside = alloc.alloc_on(512, s).unwrap();
    assert_ne!(
        inside.ptr(),
        old,
        "a block of the common pool was baked into the graph"
    );
    let stats = alloc.stats();
    assert_eq!(stats.graph_pools, 1);
    alloc.with_strategy(|a| a.driver_mut().end_capture(s).unwrap());
    let inside_ptr = inside.ptr();
    drop(inside);
    let after = alloc.alloc_on(512, s).unwrap();
    assert_ne!(
        after.ptr(),
        inside_ptr,
        "the implicit pool's memory left it"
    );
    alloc.check_invariants().unwrap();
    alloc.with_strategy(|a| assert_capture_safe(a));
}

/// add_peer: every mapped range and every later one is accessible to the peer.
#[test]
fn a_peer_reaches_every_mapping_now_and_later() {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_granularity(PAGE)
            .with_capacity(PAGES * PAGE)
            .with_devices(2),
    );
    let mut a = Expandable::new(
        sim,
        Config {
            page_size: Some(PAGE),
            ..Config::default()
        },
    )
    .unwrap();
    let x = a.alloc(3 * PAGE, StreamId(1)).unwrap();
    assert!(!a.driver().peer_access(x, 1));
    a.add_peer(1).unwrap();
    assert!((0..3).all(|p| a.driver().peer_access(x + p * PAGE, 1)));
    let y = a.alloc(5 * PAGE, StreamId(2)).unwrap();
    assert!((0..5).all(|p| a.driver().peer_access(y + p * PAGE, 1)));
    assert!(a.add_peer(5).is_err(), "a device the machine does not have");
    a.check_invariants().unwrap();
}

// ---- The property test ----

#[derive(Debug, Clone)]
enum Action {
    Alloc {
        size: u64,
        stream: u64,
    },
    Free {
        pick: usize,
    },
    /// A kernel on `stream` reading a live block (recorded first if it is another stream's).
    Launch {
        pick: usize,
        stream: u64,
    },
    Advance {
        stream: u64,
        n: usize,
    },
    CompleteStream {
        stream: u64,
    },
    /// Begin capturing `stream` (3 or 4) into a new pool, or into the last pool (shared by graphs).
    BeginCapture {
        stream: u64,
        mode: u8,
        share: bool,
    },
    EndCapture {
        stream: u64,
    },
    ReleasePool {
        pick: usize,
    },
    EmptyCache,
}

/// Streams 0..5 (0 and 1 are CUDA's legacy default stream, which cannot capture); 3 and 4 may capture.
const STREAMS: u64 = 5;

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (1u64..8 * PAGE, 0..STREAMS).prop_map(|(size, stream)| Action::Alloc { size, stream }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        3 => (any::<usize>(), 0..STREAMS).prop_map(|(pick, stream)| Action::Launch { pick, stream }),
        2 => (0..STREAMS, 1usize..3).prop_map(|(stream, n)| Action::Advance { stream, n }),
        1 => (0..STREAMS).prop_map(|stream| Action::CompleteStream { stream }),
        2 => (3u64..5, 0u8..3, any::<bool>())
            .prop_map(|(stream, mode, share)| Action::BeginCapture { stream, mode, share }),
        2 => (3u64..5).prop_map(|stream| Action::EndCapture { stream }),
        1 => any::<usize>().prop_map(|pick| Action::ReleasePool { pick }),
        1 => Just(Action::EmptyCache),
    ]
}

struct Live {
    size: u64,
    stream: StreamId,
    /// The pool it was allocated to, if any.
    pool: Option<GraphPool>,
    /// Other streams that ran work on it.
    uses: Vec<StreamId>,
}

/// A freed block that work may still read: per stream, the work that stream had launched at the free.
struct Freed {
    range: VaRange,
    needs: Vec<(StreamId, u64)>,
}

#[derive(Default)]
struct Model {
    live: BTreeMap<u64, Live>,
    freed: Vec<Freed>,
    launched: BTreeMap<StreamId, u64>,
    /// Captures underway: stream -> pool.
    capturing: BTreeMap<StreamId, GraphPool>,
    /// Live pools (begun, not yet released as often) with their begin count, and every range allocated to
    /// each while it was being captured: the addresses its graphs baked in.
    pools: BTreeMap<GraphPool, (usize, Vec<VaRange>)>,
    next_pool: u64,
    last_pool: Option<GraphPool>,
}

fn mode(m: u8) -> CaptureMode {
    [
        CaptureMode::Global,
        CaptureMode::ThreadLocal,
        CaptureMode::Relaxed,
    ][m as usize % 3]
}

fn completed(a: &Alloc, m: &Model, s: StreamId) -> u64 {
    m.launched.get(&s).copied().unwrap_or(0) - a.driver().pending_work(s) as u64
}

fn step(a: &mut Alloc, m: &mut Model, action: Action) {
    match action {
        Action::Alloc { size, stream } => {
            let s = StreamId(stream);
            let pool = m.capturing.get(&s).copied();
            match a.alloc(size, s) {
                Ok(addr) => {
                    let range = VaRange::new(addr, size.next_multiple_of(ROUND));
                    // Never a live pool's baked-in memory, unless this is that pool.
                    for (&p, (_, baked)) in &m.pools {
                        if Some(p) != pool {
                            assert!(
                                !baked.iter().any(|&b| overlaps(b, range)),
                                "{addr:#x}+{size} on {s} (pool {pool:?}) overlaps memory of live {p}"
                            );
                        }
                    }
                    // Never a block that other streams' work may still read.
                    for freed in m.freed.iter().filter(|f| overlaps(f.range, range)) {
                        for &(u, need) in &freed.needs {
                            assert!(
                                u == s || completed(a, m, u) >= need,
                                "{addr:#x} handed to {s} while {u} may still read it"
                            );
                        }
                    }
                    if let Some(p) = pool {
                        m.pools
                            .get_mut(&p)
                            .expect("a pool underway is live")
                            .1
                            .push(range);
                    }
                    m.live.insert(
                        addr,
                        Live {
                            size,
                            stream: s,
                            pool,
                            uses: Vec::new(),
                        },
                    );
                }
                Err(err) => assert!(err.is_out_of_memory(), "alloc failed: {err}"),
            }
        }
        Action::Free { pick } => {
            let Some(&addr) = m.live.keys().nth(pick % m.live.len().max(1)) else {
                return;
            };
            let live = m.live.remove(&addr).unwrap();
            a.free(addr).unwrap();
            let needs = live
                .uses
                .iter()
                .map(|&u| (u, m.launched.get(&u).copied().unwrap_or(0)))
                .collect();
            let _ = (live.stream, live.pool);
            m.freed.push(Freed {
                range: VaRange::new(addr, live.size.next_multiple_of(ROUND)),
                needs,
            });
        }
        Action::Launch { pick, stream } => {
            let s = StreamId(stream);
            // Work queued on a capturing stream is recorded into the graph, not run: not modelled.
            if m.capturing.contains_key(&s) {
                return;
            }
            let n = m.live.len().max(1);
            let Some((&addr, live)) = m.live.iter_mut().nth(pick % n) else {
                return;
            };
            if s != live.stream {
                a.record_stream(addr, s).unwrap();
                if !live.uses.contains(&s) {
                    live.uses.push(s);
                }
            }
            a.driver_mut()
                .launch(s, &[VaRange::new(addr, live.size)])
                .unwrap();
            *m.launched.entry(s).or_default() += 1;
        }
        Action::Advance { stream, n } => {
            a.driver_mut().advance(StreamId(stream), n);
        }
        Action::CompleteStream { stream } => a.driver_mut().complete_stream(StreamId(stream)),
        Action::BeginCapture {
            stream,
            mode: md,
            share,
        } => {
            let s = StreamId(stream);
            if m.capturing.contains_key(&s) {
                return;
            }
            let pool = match m.last_pool.filter(|p| share && m.pools.contains_key(p)) {
                // A pool shared by graphs (PyTorch's `pool=` argument), not being captured into now.
                Some(p) if !m.capturing.values().any(|&q| q == p) => p,
                _ => {
                    m.next_pool += 1;
                    GraphPool(m.next_pool, 0)
                }
            };
            let id = a.driver_mut().begin_capture(s, mode(md)).unwrap();
            a.begin_allocate_to_pool(pool, StreamFilter::Capture(id))
                .unwrap();
            m.pools.entry(pool).or_default().0 += 1;
            m.capturing.insert(s, pool);
            m.last_pool = Some(pool);
        }
        Action::EndCapture { stream } => {
            let s = StreamId(stream);
            let Some(pool) = m.capturing.remove(&s) else {
                return;
            };
            a.driver_mut()
                .end_capture(s)
                .expect("the capture was invalidated");
            a.end_allocate_to_pool(pool).unwrap();
        }
        Action::ReleasePool { pick } => {
            let ended: Vec<GraphPool> = (m.pools.keys().copied())
                .filter(|p| !m.capturing.values().any(|q| q == p))
                .collect();
            let Some(&pool) = ended.get(pick % ended.len().max(1)) else {
                return;
            };
            a.release_pool(pool).unwrap();
            let entry = m.pools.get_mut(&pool).unwrap();
            entry.0 -= 1;
            if entry.0 == 0 {
                m.pools.remove(&pool);
            }
        }
        Action::EmptyCache => {
            let result = a.empty_cache();
            if m.capturing.is_empty() {
                result.unwrap();
            } else {
                assert!(
                    matches!(result, Err(Error::CaptureUnderway { .. })),
                    "{result:?}"
                );
            }
        }
    }
}

fn check(a: &Alloc, m: &Model) {
    a.check_invariants().unwrap();
    assert_capture_safe(a);
    // The memory a live pool's graphs baked in stays mapped where they use it.
    for (pool, (_, baked)) in &m.pools {
        for range in baked {
            let mut va = range.start - range.start % PAGE;
            while va < range.start + range.size {
                assert!(a.driver().is_accessible(va), "{pool}: {va:#x} was unmapped");
                va += PAGE;
            }
        }
    }
}

fn run(config: Config, actions: Vec<Action>) {
    let mut a = new_alloc(config);
    let mut m = Model::default();
    for action in actions {
        step(&mut a, &mut m, action);
        check(&a, &m);
    }
    // The end: every capture ended, every pool released, every stream done, everything freed.
    for (s, pool) in std::mem::take(&mut m.capturing) {
        end(&mut a, s, pool);
    }
    for (pool, (uses, _)) in std::mem::take(&mut m.pools) {
        for _ in 0..uses {
            a.release_pool(pool).unwrap();
        }
    }
    for s in 0..STREAMS {
        a.driver_mut().complete_stream(StreamId(s));
    }
    for addr in std::mem::take(&mut m.live).into_keys() {
        a.free(addr).unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_capture_safe(&a);
    let stats = a.stats();
    assert_eq!(stats.active_bytes.current, 0, "a block never came back");
    assert_eq!(
        stats.reserved_bytes.current, 0,
        "memory kept after every pool was released"
    );
    assert!(a.segments().is_empty());
    assert_eq!(a.driver().live_events(), 0);
    let leaks = a.driver().leak_report();
    assert!(leaks.is_empty(), "{leaks}");
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Captures interleaved with allocations, frees, record_stream, kernels and pressure, with
    /// compaction on demand (the default) and eager.
    #[test]
    fn captures_break_nothing_and_pools_keep_their_memory(
        actions in proptest::collection::vec(action(), 1..80),
        eager in any::<bool>(),
        cross_stream_reuse in any::<bool>(),
    ) {
        let compaction = if eager { Compaction::Eager } else { Compaction::Pressure };
        let config = Config::default()
            .with_compaction(compaction)
            .with_cross_stream_reuse(cross_stream_reuse);
        run(config, actions);
    }
}
