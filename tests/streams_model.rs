//! Property test of the expandable allocator with streams whose work progresses at random.
//!
//! Weighted random sequences of alloc / free / record_stream / launch of simulated kernels on live blocks /
//! advance, complete an event, complete a stream / empty_cache / trim, over three streams, with the device's
//! backing store on, cross-stream reuse on or off, and large-pool handles of one page, four, or the default
//! size, with the idle pages of chunks in use lent (mapped a second time elsewhere) or not. The program is a correct one: a kernel launched on a stream other than its
//! buffer's records that use (`record_stream`) before the buffer is freed.
//!
//! Properties checked after every step:
//! - every invariant holds (`check_invariants()`);
//! - **a block is never handed out while work that may use it is pending**: a new allocation on stream S
//!   overlaps no freed block that some other stream u used (its allocation stream or a recorded use) while
//!   u has not yet finished the work it had queued when the block was freed (exactly what an event recorded
//!   on u at the free waits for), **nor any of its physical memory** under another address (a lent page);
//! - **no page is unmapped while work on it is pending**: every operation succeeds or fails only with
//!   out-of-memory (the device refuses such an unmap with `UnmapWhileInUse`, which would surface as an
//!   error), and every byte that pending work touches is still accessible;
//! - **nothing is lost**: every live allocation reads back its own pattern; `allocated_bytes` matches the
//!   model and `active_bytes` is at least that; an out-of-memory happens only when the live blocks' pages
//!   could not fit;
//! - **every block is eventually reusable**: at the end, once every stream has run dry, everything freed and
//!   the cache emptied, nothing is active, reserved, mapped or reserved in VA, and no event is left alive.

mod common;

use common::memory::{Piece, handle_settings, physical, shares_memory};
use cuvmm::driver::VaRange;
use cuvmm::strategy::StreamUses;
use cuvmm::{Config, Error, Strategy as _, StreamId};
use proptest::prelude::*;
use std::collections::{BTreeMap, HashMap};

const PAGE: u64 = 4096;
const PAGES: u64 = 32;
const STREAMS: u64 = 3;
const ROUND: u64 = 512;

#[derive(Debug, Clone)]
enum Action {
    Alloc {
        size: u64,
        stream: u64,
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
        stream: u64,
        from: u64,
        len: u64,
    },
    Advance {
        stream: u64,
        n: usize,
    },
    CompleteEvent {
        stream: u64,
        pick: usize,
    },
    CompleteStream {
        stream: u64,
    },
    EmptyCache,
    Trim {
        pages: u64,
    },
}

fn action() -> impl Strategy<Value = Action> {
    let stream = 0..STREAMS;
    prop_oneof![
        6 => (1u64..6 * PAGE, stream.clone()).prop_map(|(size, stream)| Action::Alloc { size, stream }),
        4 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        1 => (any::<usize>(), stream.clone()).prop_map(|(pick, stream)| Action::RecordStream { pick, stream }),
        5 => (any::<usize>(), stream.clone(), any::<u64>(), any::<u64>())
            .prop_map(|(pick, stream, from, len)| Action::Launch { pick, stream, from, len }),
        3 => (stream.clone(), 1usize..4).prop_map(|(stream, n)| Action::Advance { stream, n }),
        1 => (stream.clone(), any::<usize>()).prop_map(|(stream, pick)| Action::CompleteEvent { stream, pick }),
        1 => stream.prop_map(|stream| Action::CompleteStream { stream }),
        1 => Just(Action::EmptyCache),
        1 => (0u64..6).prop_map(|pages| Action::Trim { pages }),
    ]
}

/// A live allocation in the model.
struct Live {
    size: u64,
    stream: StreamId,
    pattern: u64,
    /// Streams other than its own that work was launched on, or that were recorded.
    uses: Vec<StreamId>,
}

/// A freed block that may still be in use: for each stream that used it, the number of work items that
/// stream had launched when the block was freed.
struct Freed {
    range: VaRange,
    /// The physical memory behind `range` when it was freed.
    physical: Vec<Piece>,
    needs: Vec<(StreamId, u64)>,
}

/// The program's view: live allocations, freed blocks still in flight, and every kernel launched.
#[derive(Default)]
struct Model {
    live: BTreeMap<u64, Live>,
    freed: Vec<Freed>,
    /// Every kernel launched, per stream, in order; the first `launched - pending` have completed.
    work: HashMap<StreamId, Vec<VaRange>>,
    next_pattern: u64,
    /// Pages per large-pool chunk when chunks are used and their idle pages cannot be lent.
    stranding_chunk: Option<u64>,
}

fn stream(s: u64) -> StreamId {
    StreamId(s)
}

fn pick(live: &BTreeMap<u64, Live>, pick: usize) -> Option<u64> {
    (!live.is_empty()).then(|| *live.keys().nth(pick % live.len()).unwrap())
}

type Alloc = cuvmm::expandable::Expandable<cuvmm::driver::sim::SimDriver>;

fn launched(model: &Model, s: StreamId) -> u64 {
    model.work.get(&s).map_or(0, |w| w.len() as u64)
}

fn completed(alloc: &Alloc, model: &Model, s: StreamId) -> u64 {
    launched(model, s) - alloc.driver().pending_work(s) as u64
}

/// Runs `actions` with cross-stream reuse on or off, large-pool handles of `large_handle` bytes, and partial
/// mappings on or off.
fn run(cross_stream_reuse: bool, (large_handle, partial): (u64, bool), actions: Vec<Action>) {
    let config = Config {
        small_size: 1024,
        ..Config::default()
    }
    .with_cross_stream_reuse(cross_stream_reuse);
    let mut alloc = common::memory::chunked(PAGE, PAGES, config, (large_handle, partial));
    // A handle larger than the device is not made: growth then takes what fits, as single pages.
    let chunk = large_handle / PAGE;
    let mut m = Model {
        stranding_chunk: (chunk > 1 && chunk <= PAGES && !partial).then_some(chunk),
        ..Model::default()
    };
    for action in actions {
        step(&mut alloc, &mut m, action);
        check(&alloc, &mut m);
    }
    for s in 0..STREAMS {
        alloc.driver_mut().complete_stream(stream(s));
    }
    for addr in std::mem::take(&mut m.live).into_keys() {
        alloc.free(addr).expect("free at the end");
    }
    alloc.empty_cache().expect("final empty_cache");
    alloc.check_invariants().unwrap();
    let stats = alloc.stats();
    assert_eq!(stats.active_bytes.current, 0, "a block never came back");
    assert_eq!(stats.reserved_bytes.current, 0);
    assert!(alloc.segments().is_empty());
    assert_eq!(alloc.driver().live_events(), 0, "events not destroyed");
    let leaks = alloc.driver().leak_report();
    assert!(leaks.is_empty(), "driver reports leaks: {leaks}");
}

fn step(alloc: &mut Alloc, m: &mut Model, action: Action) {
    match action {
        Action::Alloc { size, stream: s } => {
            let s = stream(s);
            // The pages the live blocks could touch; with chunks that cannot be lent, the chunks.
            let touched = |size: u64| {
                let pages = size.next_multiple_of(ROUND).div_ceil(PAGE) + 2;
                match m.stranding_chunk {
                    Some(chunk) if size > 1024 => (pages.div_ceil(chunk) + 1) * chunk,
                    _ => pages,
                }
            };
            let bound: u64 = m
                .live
                .values()
                .map(|l| l.size)
                .chain([size])
                .map(touched)
                .sum::<u64>()
                * PAGE;
            match alloc.alloc(size, s) {
                Ok(addr) => {
                    let range = VaRange::new(addr, size.next_multiple_of(ROUND));
                    let memory = physical(alloc.driver(), range, PAGE);
                    let reused =
                        |f: &Freed| overlaps(f.range, range) || shares_memory(&f.physical, &memory);
                    for freed in m.freed.iter().filter(|f| reused(f)) {
                        for &(u, need) in &freed.needs {
                            assert!(
                                u == s || completed(alloc, m, u) >= need,
                                "{addr:#x}+{size} handed to {s} while {u} may still use the freed block at {:#x} \
                                 (its addresses or its memory)",
                                freed.range.start
                            );
                        }
                    }
                    m.next_pattern += 1;
                    let bytes = common::pattern(m.next_pattern, size as usize);
                    alloc.driver_mut().write(addr, &bytes).expect("write");
                    m.live.insert(
                        addr,
                        Live {
                            size,
                            stream: s,
                            pattern: m.next_pattern,
                            uses: Vec::new(),
                        },
                    );
                }
                Err(Error::OutOfMemory(oom)) => {
                    assert!(bound > PAGES * PAGE, "OOM though the live pages fit: {oom}");
                }
                Err(err) => panic!("alloc({size}, {s}) failed: {err}"),
            }
        }
        Action::Free { pick: p } => {
            let Some(addr) = pick(&m.live, p) else { return };
            let range = VaRange::new(addr, m.live[&addr].size.next_multiple_of(ROUND));
            let memory = physical(alloc.driver(), range, PAGE);
            alloc.free(addr).expect("free of a live allocation");
            let live = m.live.remove(&addr).unwrap();
            let needs = std::iter::once(live.stream)
                .chain(live.uses)
                .map(|u| (u, launched(m, u)))
                .collect();
            m.freed.push(Freed {
                range,
                physical: memory,
                needs,
            });
        }
        Action::RecordStream { pick: p, stream: s } => {
            let Some(addr) = pick(&m.live, p) else { return };
            record(alloc, m, addr, stream(s));
        }
        Action::Launch {
            pick: p,
            stream: s,
            from,
            len,
        } => {
            let Some(addr) = pick(&m.live, p) else { return };
            let s = stream(s);
            let size = m.live[&addr].size;
            let from = from % size;
            let range = VaRange::new(addr + from, 1 + len % (size - from));
            // A correct program records the use before the buffer can be freed.
            record(alloc, m, addr, s);
            alloc
                .driver_mut()
                .launch(s, &[range])
                .expect("launch on a live block");
            m.work.entry(s).or_default().push(range);
        }
        Action::Advance { stream: s, n } => {
            alloc.driver_mut().advance(stream(s), n);
        }
        Action::CompleteEvent { stream: s, pick } => {
            let events = alloc.driver().pending_event_ids(stream(s));
            if !events.is_empty() {
                let event = events[pick % events.len()];
                alloc.driver_mut().complete_event(event).unwrap();
            }
        }
        Action::CompleteStream { stream: s } => alloc.driver_mut().complete_stream(stream(s)),
        Action::EmptyCache => alloc.empty_cache().expect("empty_cache"),
        Action::Trim { pages } => {
            alloc.trim(pages * PAGE).expect("trim");
        }
    }
}

/// Records that `s` uses the live block at `addr`, in the allocator and the model.
fn record(alloc: &mut Alloc, m: &mut Model, addr: u64, s: StreamId) {
    let live = m.live.get_mut(&addr).unwrap();
    if s != live.stream && !live.uses.contains(&s) {
        alloc
            .record_stream(addr, s)
            .expect("record_stream of a live block");
        live.uses.push(s);
    }
}

fn overlaps(a: VaRange, b: VaRange) -> bool {
    a.start < b.end() && b.start < a.end()
}

fn check(alloc: &Alloc, m: &mut Model) {
    alloc
        .check_invariants()
        .unwrap_or_else(|v| panic!("invariant broken: {v}"));
    let stats = alloc.stats();
    let allocated: u64 = m
        .live
        .values()
        .map(|l| l.size.next_multiple_of(ROUND))
        .sum();
    assert_eq!(stats.allocated_bytes.current, allocated);
    assert!(stats.active_bytes.current >= allocated);
    assert!(stats.reserved_bytes.current <= PAGES * PAGE);
    for (&addr, live) in &m.live {
        let bytes = alloc
            .driver()
            .read(addr, live.size as usize)
            .expect("read of a live allocation");
        assert!(
            bytes == common::pattern(live.pattern, live.size as usize),
            "allocation at {addr:#x} lost bytes"
        );
    }
    // Pending work still reaches mapped, accessible memory.
    for (&s, work) in &m.work {
        let done = completed(alloc, m, s) as usize;
        for range in &work[done..] {
            alloc
                .driver()
                .read(range.start, range.size as usize)
                .unwrap_or_else(|e| panic!("pending work on {s} lost its memory: {e}"));
        }
    }
    // Forget freed blocks no stream can still be using.
    let progress: HashMap<StreamId, u64> = (0..STREAMS)
        .map(|s| (stream(s), completed(alloc, m, stream(s))))
        .collect();
    m.freed
        .retain(|f| f.needs.iter().any(|&(u, need)| progress[&u] < need));
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn streams_with_random_progress(
        reuse in any::<bool>(),
        handle in prop::sample::select(handle_settings(PAGE).to_vec()),
        actions in prop::collection::vec(action(), 1..200),
    ) {
        run(reuse, handle, actions);
    }
}

/// A deterministic scenario for the properties above that needs no luck: every kind of step, both settings.
#[test]
fn a_fixed_sequence_exercises_every_path() {
    use Action::*;
    for (reuse, handle) in [false, true]
        .into_iter()
        .flat_map(|r| handle_settings(PAGE).map(|h| (r, h)))
    {
        run(
            reuse,
            handle,
            vec![
                Alloc {
                    size: 3 * PAGE,
                    stream: 0,
                },
                Alloc {
                    size: 2 * PAGE,
                    stream: 0,
                },
                Launch {
                    pick: 0,
                    stream: 1,
                    from: 0,
                    len: u64::MAX,
                },
                Launch {
                    pick: 1,
                    stream: 0,
                    from: 5,
                    len: 100,
                },
                Free { pick: 0 },
                Free { pick: 0 },
                Alloc {
                    size: 3 * PAGE,
                    stream: 2,
                },
                Alloc {
                    size: 2 * PAGE,
                    stream: 1,
                },
                Advance { stream: 1, n: 1 },
                Alloc {
                    size: 3 * PAGE,
                    stream: 0,
                },
                RecordStream { pick: 0, stream: 2 },
                CompleteEvent { stream: 1, pick: 0 },
                Trim { pages: 3 },
                Alloc {
                    size: 20 * PAGE,
                    stream: 1,
                },
                EmptyCache,
                CompleteStream { stream: 0 },
            ],
        );
    }
}
