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
//! - the statistics' `asleep_bytes` is the bytes under the asleep allocations' pages, and the device holds
//!   exactly `reserved_bytes`;
//! - what must be refused is refused with its typed error: an allocation under, or a free of, a sleeping
//!   tag (`TagAsleep`), a sleep or wake during a capture (`CaptureUnderway`).

mod common;

use cuvmm::config::Compaction;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::driver::{CaptureMode, Op, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::{
    Allocator, Config, Driver as _, Error, GraphPool, Strategy as _, StreamFilter, StreamId,
};
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

fn write(a: &mut Alloc, addr: u64, id: u64, size: u64) {
    let bytes = common::pattern(id, size as usize);
    a.driver_mut().write(addr, &bytes).expect("writable");
}

fn holds(a: &Alloc, addr: u64, id: u64, size: u64) -> bool {
    a.driver().read(addr, size as usize).expect("readable") == common::pattern(id, size as usize)
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
    write(&mut a, weights, 1, 10 * PAGE);
    write(&mut a, kv, 2, 20 * PAGE + 100);
    write(&mut a, other, 3, 3 * PAGE);
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
    write(&mut a, job, 9, 40 * PAGE);
    a.free(job).unwrap();
    a.empty_cache().unwrap();

    a.wake("kv_cache").unwrap();
    assert!(
        holds(&a, kv, 2, 20 * PAGE + 100),
        "the KV cache's bytes are back"
    );
    assert!(holds(&a, weights, 1, 10 * PAGE));
    assert!(holds(&a, other, 3, 3 * PAGE));
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
    write(&mut a, kv, 5, 8 * PAGE);
    a.sleep("kv", false).unwrap();
    a.wake("kv").unwrap();
    assert!(a.driver().is_accessible(kv));
    assert!(!holds(&a, kv, 5, 8 * PAGE), "the bytes were not kept");
    write(&mut a, kv, 6, 8 * PAGE);
    assert!(holds(&a, kv, 6, 8 * PAGE));
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
        2,
        "the two busy streams, not the idle one"
    );
    assert!(!a.driver().is_accessible(w));
    a.wake("kv").unwrap();
    a.check_invariants().unwrap();
}

/// What a sleeping tag refuses, with typed errors; sleep and wake are idempotent.
#[test]
fn a_sleeping_tag_refuses_allocations_frees_and_captures() {
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
    assert!(matches!(
        a.free(kv),
        Err(Error::TagAsleep {
            operation: "free",
            ..
        })
    ));
    // A capture: neither sleep nor wake.
    let capture = StreamId(3);
    let id = a
        .driver_mut()
        .begin_capture(capture, CaptureMode::ThreadLocal)
        .unwrap();
    a.begin_allocate_to_pool(GraphPool(1, 0), StreamFilter::Capture(id))
        .unwrap();
    assert!(matches!(
        a.wake("kv"),
        Err(Error::CaptureUnderway { operation: "wake" })
    ));
    assert!(matches!(
        a.sleep("other", false),
        Err(Error::CaptureUnderway { operation: "sleep" })
    ));
    a.driver_mut().end_capture(capture).unwrap();
    a.end_allocate_to_pool(GraphPool(1, 0)).unwrap();
    a.wake("kv").unwrap();
    a.wake("kv").unwrap();
    a.wake("never named").unwrap();
    a.free(kv).unwrap();
    a.check_invariants().unwrap();
}

/// A graph captured on tagged memory replays after a wake: its addresses are mapped again, with the bytes
/// it reads.
#[test]
fn a_graph_captured_on_tagged_memory_replays_after_the_wake() {
    let mut a = new_alloc(Config::default());
    let (s, capture) = (StreamId(1), StreamId(3));
    let weights = a.alloc_tagged(6 * PAGE, s, "weights").unwrap();
    write(&mut a, weights, 7, 6 * PAGE);
    let id = a
        .driver_mut()
        .begin_capture(capture, CaptureMode::ThreadLocal)
        .unwrap();
    let pool = GraphPool(1, 0);
    a.begin_allocate_to_pool(pool, StreamFilter::Capture(id))
        .unwrap();
    let out = a.alloc(PAGE, capture).unwrap();
    let ranges = [VaRange::new(weights, 6 * PAGE), VaRange::new(out, PAGE)];
    a.driver_mut().launch(capture, &ranges).unwrap();
    a.driver_mut().end_capture(capture).unwrap();
    a.end_allocate_to_pool(pool).unwrap();

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
    assert!(holds(&a, weights, 7, 6 * PAGE));
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
    write(&mut a, x, 1, 4 * PAGE);
    write(&mut a, y, 2, 4 * PAGE);
    // An unmap that fails is made again (`settle.rs`): the second and third calls fail.
    a.driver_mut().fail_nth(Op::Unmap, 2, FaultKind::Error);
    a.driver_mut().fail_nth(Op::Unmap, 3, FaultKind::Error);
    assert!(a.sleep("kv", true).is_err());
    a.check_invariants().unwrap();
    assert!(matches!(a.free(x), Err(Error::TagAsleep { .. })));
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
    assert!(matches!(a.free(y), Err(Error::TagAsleep { .. })));
    a.free(hog).unwrap();
    a.wake("kv").unwrap();
    assert!(
        holds(&a, x, 1, 4 * PAGE) && holds(&a, y, 2, 4 * PAGE),
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
    assert!(matches!(kv.free(), Err(Error::TagAsleep { .. })));
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
    a.wake("kv_cache").unwrap();
    a.free_raw(ptr).unwrap();
    a.check_invariants().unwrap();
    assert!(a.asleep_tags().is_empty());
}

#[derive(Clone, Debug)]
enum Action {
    Alloc {
        size: u64,
        stream: u64,
        tag: Option<u8>,
    },
    Free {
        pick: usize,
    },
    RecordStream {
        pick: usize,
        stream: u64,
    },
    Launch {
        pick: usize,
    },
    Advance {
        stream: u64,
    },
    Sleep {
        tag: u8,
        keep: bool,
    },
    Wake {
        tag: u8,
    },
    Capture,
    EmptyCache,
}

const TAGS: [&str; 2] = ["weights", "kv_cache"];
/// Streams 1 and 2 allocate; 3 captures.
const CAPTURE: StreamId = StreamId(3);

fn action() -> impl Strategy<Value = Action> {
    prop_oneof![
        8 => (1u64..10 * PAGE, 1u64..3, proptest::option::of(0u8..2))
            .prop_map(|(size, stream, tag)| Action::Alloc { size, stream, tag }),
        4 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        2 => (any::<usize>(), 1u64..3).prop_map(|(pick, stream)| Action::RecordStream { pick, stream }),
        3 => any::<usize>().prop_map(|pick| Action::Launch { pick }),
        1 => (1u64..3).prop_map(|stream| Action::Advance { stream }),
        3 => (0u8..2, any::<bool>()).prop_map(|(tag, keep)| Action::Sleep { tag, keep }),
        3 => (0u8..2).prop_map(|tag| Action::Wake { tag }),
        1 => Just(Action::Capture),
        1 => Just(Action::EmptyCache),
    ]
}

struct Live {
    size: u64,
    id: u64,
    tag: Option<u8>,
    streams: Vec<StreamId>,
}

#[derive(Default)]
struct Model {
    live: BTreeMap<u64, Live>,
    /// Tags asleep, and whether their bytes were kept.
    asleep: BTreeMap<u8, bool>,
    /// Tags whose wake ran out of memory half way: some of their pages may be mapped.
    half: BTreeSet<u8>,
    next_id: u64,
    /// The pool of the capture underway, if any.
    capturing: Option<GraphPool>,
    pools: u64,
}

impl Model {
    fn asleep(&self, live: &Live) -> bool {
        live.tag.is_some_and(|t| self.asleep.contains_key(&t))
    }
}

fn step(a: &mut Alloc, m: &mut Model, action: &Action) {
    let pick = |m: &Model, pick: usize| m.live.keys().nth(pick % m.live.len().max(1)).copied();
    match *action {
        Action::Alloc { size, stream, tag } => {
            let stream = StreamId(stream);
            let result = match tag {
                Some(t) => a.alloc_tagged(size, stream, TAGS[t as usize]),
                None => a.alloc(size, stream),
            };
            match result {
                Ok(addr) => {
                    assert!(tag.is_none_or(|t| !m.asleep.contains_key(&t)));
                    let range = VaRange::new(addr, size);
                    for (&other, l) in &m.live {
                        assert!(
                            other + l.size <= range.start || range.end() <= other,
                            "{addr:#x}+{size} overlaps {other:#x}+{}",
                            l.size
                        );
                    }
                    m.next_id += 1;
                    write(a, addr, m.next_id, size);
                    let streams = vec![stream];
                    m.live.insert(
                        addr,
                        Live {
                            size,
                            id: m.next_id,
                            tag,
                            streams,
                        },
                    );
                }
                Err(Error::TagAsleep { .. }) => {
                    assert!(tag.is_some_and(|t| m.asleep.contains_key(&t)));
                }
                Err(err) => assert!(err.is_out_of_memory(), "{err:?}"),
            }
        }
        Action::Free { pick: p } => {
            let Some(addr) = pick(m, p) else { return };
            let result = a.free(addr);
            if m.asleep(&m.live[&addr]) {
                assert!(matches!(
                    result,
                    Err(Error::TagAsleep {
                        operation: "free",
                        ..
                    })
                ));
            } else {
                result.unwrap();
                m.live.remove(&addr);
            }
        }
        Action::RecordStream { pick: p, stream } => {
            let Some(addr) = pick(m, p) else { return };
            a.record_stream(addr, StreamId(stream)).unwrap();
            m.live
                .get_mut(&addr)
                .unwrap()
                .streams
                .push(StreamId(stream));
        }
        Action::Launch { pick: p } => {
            let Some(addr) = pick(m, p) else { return };
            let live = &m.live[&addr];
            if m.asleep(live) {
                return;
            }
            let stream = *live.streams.last().unwrap();
            a.driver_mut()
                .launch(stream, &[VaRange::new(addr, live.size)])
                .unwrap();
        }
        Action::Advance { stream } => {
            a.driver_mut().advance(StreamId(stream), 1);
        }
        Action::Sleep { tag, keep } => {
            let result = a.sleep(TAGS[tag as usize], keep);
            if m.capturing.is_some() {
                assert!(matches!(result, Err(Error::CaptureUnderway { .. })));
                return;
            }
            result.unwrap();
            m.asleep.entry(tag).or_insert(keep);
            m.half.remove(&tag);
        }
        Action::Wake { tag } => {
            let result = a.wake(TAGS[tag as usize]);
            match (m.asleep.get(&tag).copied(), result) {
                (None, Ok(())) => {}
                (Some(_), Err(Error::CaptureUnderway { .. })) if m.capturing.is_some() => {}
                (Some(_), Err(err)) if err.is_out_of_memory() => {
                    m.half.insert(tag);
                }
                (Some(keep), Ok(())) => {
                    m.asleep.remove(&tag);
                    m.half.remove(&tag);
                    for (&addr, l) in &m.live {
                        if l.tag == Some(tag) {
                            if keep {
                                assert!(holds(a, addr, l.id, l.size), "{addr:#x} lost its bytes");
                            } else {
                                write(a, addr, l.id, l.size);
                            }
                        }
                    }
                }
                (asleep, result) => panic!("wake of {tag} (asleep: {asleep:?}): {result:?}"),
            }
        }
        Action::Capture => match m.capturing.take() {
            None => {
                m.pools += 1;
                let pool = GraphPool(m.pools, 0);
                let id = a
                    .driver_mut()
                    .begin_capture(CAPTURE, CaptureMode::ThreadLocal)
                    .unwrap();
                a.begin_allocate_to_pool(pool, StreamFilter::Capture(id))
                    .unwrap();
                m.capturing = Some(pool);
            }
            Some(pool) => {
                a.driver_mut()
                    .end_capture(CAPTURE)
                    .expect("the capture was not invalidated");
                a.end_allocate_to_pool(pool).unwrap();
                a.release_pool(pool).unwrap();
            }
        },
        Action::EmptyCache => {
            let result = a.empty_cache();
            if m.capturing.is_some() {
                assert!(result.is_err());
            } else {
                result.unwrap();
            }
        }
    }
}

fn check(a: &Alloc, m: &Model) {
    a.check_invariants().unwrap();
    assert_eq!(a.driver().capture_refusals(), 0);
    let mut asleep_pages = BTreeSet::new();
    for (&addr, l) in &m.live {
        if m.asleep(l) {
            if l.tag.is_some_and(|t| m.half.contains(&t)) {
                continue;
            }
            assert!(
                !a.driver().is_accessible(addr),
                "asleep {addr:#x} is mapped"
            );
            for page in addr / PAGE..(addr + l.size).div_ceil(PAGE) {
                asleep_pages.insert(page);
            }
        } else {
            assert!(
                holds(a, addr, l.id, l.size),
                "{addr:#x}+{} lost its bytes",
                l.size
            );
        }
    }
    let stats = a.stats();
    if m.half.is_empty() {
        assert_eq!(stats.asleep_bytes, asleep_pages.len() as u64 * PAGE);
    }
    assert_eq!(stats.reserved_bytes.current, a.driver().used_bytes());
}

fn run(config: Config, actions: Vec<Action>) {
    let mut a = new_alloc(config);
    let mut m = Model::default();
    for action in &actions {
        step(&mut a, &mut m, action);
        check(&a, &m);
    }
    if m.capturing.is_some() {
        step(&mut a, &mut m, &Action::Capture);
    }
    // The awake allocations go first, so the wakes find memory.
    let awake: Vec<u64> = (m.live.iter())
        .filter(|(_, l)| !m.asleep(l))
        .map(|(&addr, _)| addr)
        .collect();
    for addr in awake {
        a.free(addr).unwrap();
        m.live.remove(&addr);
    }
    for (tag, name) in TAGS.iter().enumerate() {
        a.wake(name).unwrap_or_else(|e| panic!("final wake: {e}"));
        if let Some(true) = m.asleep.remove(&(tag as u8)) {
            for (&addr, l) in &m.live {
                assert!(l.tag != Some(tag as u8) || holds(&a, addr, l.id, l.size));
            }
        }
    }
    for addr in std::mem::take(&mut m.live).into_keys() {
        a.free(addr).unwrap();
    }
    for stream in 1..4 {
        a.driver_mut().complete_stream(StreamId(stream));
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Sleep and wake interleaved with allocations, frees, record_stream, kernels, captures and pressure,
    /// with compaction on demand (the default) and eager.
    #[test]
    fn sleep_and_wake_keep_addresses_bytes_and_books(
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
