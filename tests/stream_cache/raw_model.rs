//! The property of raw frees through the stream caches (a module of `tests/stream_cache.rs`): against a model
//! of the program's streams, a raw free served through the caches is reused only on its own stream, and never
//! while another stream recorded on it (`record_stream`) may still use it; with caches that wait for
//! contention and with eager ones.

use super::{Alloc, activate, allocator, eager};
use cuvmm::StreamId;
use cuvmm::driver::VaRange;
use proptest::prelude::*;
use std::collections::BTreeMap;

const KIB: u64 = 1 << 10;

const STREAMS: u64 = 3;
/// The streams the model's indices name. The model runs on one thread, whose cache shard holds the entries of
/// every stream side by side.
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

/// Runs `actions` on raw allocations of three streams, with the stream caches on from the start (`eager`) or
/// turned on by contention first; returns the model at the end.
fn run_raw(actions: Vec<Action>, eager_caches: bool) -> Model {
    let alloc = if eager_caches {
        eager(256)
    } else {
        let alloc = allocator(256, "");
        activate(&alloc, (0..STREAMS).map(sid));
        alloc
    };
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
    fn raw_frees_through_the_caches_are_stream_safe(
        actions in prop::collection::vec(action(), 1..120),
        eager_caches: bool,
    ) {
        run_raw(actions, eager_caches);
    }
}

/// The scenario of the property without luck: a raw block used on another stream, freed, then asked for
/// on both streams; and a plain one reused from its stream's cache.
#[test]
fn a_fixed_raw_sequence_reuses_through_the_cache_and_never_across_streams() {
    use Action::*;
    let actions = vec![
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
    ];
    for eager_caches in [false, true] {
        let m = run_raw(actions.clone(), eager_caches);
        assert!(
            m.cache_hits >= 1,
            "no request was served from a stream cache (eager: {eager_caches})"
        );
    }
}
