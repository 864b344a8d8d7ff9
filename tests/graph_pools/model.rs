//! The property test: captures interleaved with allocations, frees, `record_stream`, kernels and memory
//! pressure, against a model of what each pool and stream holds, with large-pool handles of one page, four or
//! the default size, their idle pages lent or not. Memory is checked by address and by what backs it (a lent
//! page is mapped a second time elsewhere). Streams 1 and 2 allocate to pools of their own now and then,
//! with no capture (PyTorch's `use_mem_pool`). Captures are made as PyTorch 2.11 makes them (a pool for the
//! capture's id, not marked) or, with `marked`, as PyTorch 2.13 does (a pool for the capturing stream, the
//! capture marked), when `empty_cache` must give back memory while a pool is routed to outside captures.

use super::*;
use crate::mapped_events::MappedEvents;
use common::memory::{Piece, handle_settings, physical, shares_memory};
use cuvmm::strategy::{GraphPools, StreamUses};

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
    /// `stream` (1 or 2) starts allocating to a new pool of its own, with no capture, or stops.
    UseMemPool {
        stream: u64,
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
        1 => (1u64..3).prop_map(|stream| Action::UseMemPool { stream }),
        1 => Just(Action::EmptyCache),
    ]
}

struct Live {
    size: u64,
    stream: StreamId,
    /// Other streams that ran work on it.
    uses: Vec<StreamId>,
}

/// A freed block that work may still read: per stream, the work that stream had launched at the free.
struct Freed {
    range: VaRange,
    /// The memory behind `range` at the free.
    memory: Vec<Piece>,
    needs: Vec<(StreamId, u64)>,
}

/// A range allocated to a pool during its capture, and the memory behind it.
type Baked = (VaRange, Vec<Piece>);

#[derive(Default)]
struct Model {
    live: BTreeMap<u64, Live>,
    freed: Vec<Freed>,
    launched: BTreeMap<StreamId, u64>,
    /// Whether captures are marked (PyTorch 2.13's `markCaptureBegin`/`End`).
    marked: bool,
    /// Captures underway: stream -> pool.
    capturing: BTreeMap<StreamId, GraphPool>,
    /// Pools allocated to with no capture: stream -> pool.
    routed: BTreeMap<StreamId, GraphPool>,
    /// Live pools (begun, not yet released as often) with their begin count, and every range allocated to
    /// each while it was being captured, with its memory: the addresses its graphs baked in.
    pools: BTreeMap<GraphPool, (usize, Vec<Baked>)>,
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
            let pool = (m.capturing.get(&s).or(m.routed.get(&s))).copied();
            match a.alloc(size, s) {
                Ok(addr) => {
                    let range = VaRange::new(addr, size.next_multiple_of(ROUND));
                    let memory = physical(a.driver(), range, PAGE);
                    let shares = |other: VaRange, pieces: &[Piece]| {
                        overlaps(other, range) || shares_memory(pieces, &memory)
                    };
                    // Never a live pool's baked-in memory, unless this is that pool.
                    for (&p, (_, baked)) in &m.pools {
                        if Some(p) != pool {
                            assert!(
                                !baked.iter().any(|(b, pieces)| shares(*b, pieces)),
                                "{addr:#x}+{size} on {s} (pool {pool:?}) shares memory of live {p}"
                            );
                        }
                    }
                    // Never a block that other streams' work may still read.
                    for freed in m.freed.iter().filter(|f| shares(f.range, &f.memory)) {
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
                            .push((range, memory));
                    }
                    m.live.insert(
                        addr,
                        Live {
                            size,
                            stream: s,
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
            let range = VaRange::new(addr, live.size.next_multiple_of(ROUND));
            let memory = physical(a.driver(), range, PAGE);
            a.free(addr).unwrap();
            let needs = std::iter::once(live.stream)
                .chain(live.uses)
                .map(|u| (u, m.launched.get(&u).copied().unwrap_or(0)))
                .collect();
            m.freed.push(Freed {
                range,
                memory,
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
            if m.marked {
                // As PyTorch 2.13: the pool begun for the stream, the capture begun, then marked.
                a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![s]))
                    .unwrap();
                a.driver_mut().begin_capture(s, mode(md)).unwrap();
                a.mark_capture(true);
            } else {
                begin_capture(a, s, pool, mode(md));
            }
            m.pools.entry(pool).or_default().0 += 1;
            m.capturing.insert(s, pool);
            m.last_pool = Some(pool);
        }
        Action::EndCapture { stream } => {
            let s = StreamId(stream);
            let Some(pool) = m.capturing.remove(&s) else {
                return;
            };
            end_capture_of(a, m.marked, s, pool);
        }
        Action::UseMemPool { stream } => {
            let s = StreamId(stream);
            if let Some(pool) = m.routed.remove(&s) {
                a.end_allocate_to_pool(pool).unwrap();
                a.release_pool(pool).unwrap();
                m.pools.remove(&pool);
                return;
            }
            m.next_pool += 1;
            let pool = GraphPool(0, m.next_pool);
            a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![s]))
                .unwrap();
            m.pools.entry(pool).or_default().0 += 1;
            m.routed.insert(s, pool);
        }
        Action::ReleasePool { pick } => {
            let ended: Vec<GraphPool> = (m.pools.keys().copied())
                .filter(|p| {
                    !m.capturing
                        .values()
                        .chain(m.routed.values())
                        .any(|q| q == p)
                })
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
            // Once captures are marked, a pool routed to outside a capture is no capture.
            if m.capturing.is_empty() && (m.marked || m.routed.is_empty()) {
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

fn check(a: &Alloc, m: &Model, mapped: &MappedEvents) {
    a.check_invariants().unwrap();
    assert_capture_safe(a);
    mapped.check(a).unwrap();
    // The memory a live pool's graphs baked in stays mapped where they use it.
    for (pool, (_, baked)) in &m.pools {
        for (range, _) in baked {
            let mut va = range.start - range.start % PAGE;
            while va < range.start + range.size {
                assert!(a.driver().is_accessible(va), "{pool}: {va:#x} was unmapped");
                va += PAGE;
            }
        }
    }
}

/// Ends the capture of `s` (it must not have been invalidated) and stops allocating to `pool`, marking the
/// end if captures are `marked`.
fn end_capture_of(a: &mut Alloc, marked: bool, s: StreamId, pool: GraphPool) {
    if marked {
        a.driver_mut()
            .end_capture(s)
            .expect("the capture was invalidated");
        a.mark_capture(false);
        a.end_allocate_to_pool(pool).unwrap();
    } else {
        end_capture(a, s, pool);
    }
}

/// Runs `actions` with `config` and large-pool handles of `handle.0` bytes, partial mappings as `handle.1`,
/// captures marked or not.
fn run(config: Config, handle: (u64, bool), marked: bool, actions: Vec<Action>) {
    let config = Config {
        small_size: 1024,
        ..config
    };
    let mut a = common::memory::chunked(PAGE, PAGES, config, handle);
    if marked {
        a.mark_captures();
    }
    let mapped = MappedEvents::attach(&mut a, PAGE);
    let mut m = Model {
        marked,
        ..Model::default()
    };
    for action in actions {
        step(&mut a, &mut m, action);
        check(&a, &m, &mapped);
    }
    // The end: every capture ended, every pool released, every stream done, everything freed.
    for (s, pool) in std::mem::take(&mut m.capturing) {
        end_capture_of(&mut a, marked, s, pool);
    }
    for pool in std::mem::take(&mut m.routed).into_values() {
        a.end_allocate_to_pool(pool).unwrap();
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
    mapped.check(&a).unwrap();
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
    /// compaction on demand (the default) and eager, and every handle setting.
    #[test]
    fn captures_break_nothing_and_pools_keep_their_memory(
        actions in proptest::collection::vec(action(), 1..80),
        eager in any::<bool>(),
        cross_stream_reuse in any::<bool>(),
        handle in prop::sample::select(handle_settings(PAGE).to_vec()),
        marked in any::<bool>(),
    ) {
        let compaction = if eager { Compaction::Eager } else { Compaction::Pressure };
        let config = Config::default()
            .with_compaction(compaction)
            .with_cross_stream_reuse(cross_stream_reuse);
        run(config, handle, marked, actions);
    }
}
