//! The property test: sleep and wake interleaved with allocations, frees, record_stream, kernels,
//! captures and memory pressure, against a model of every allocation's bytes and tag.

use super::*;
use crate::mapped_events::MappedEvents;
use cuvmm::strategy::Snapshots as _;
use cuvmm::strategy::snapshot::BlockState;
use cuvmm::strategy::{GraphPools, StreamUses};

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
    /// `release_host_buffers` of one tag, or of all.
    ReleaseHost {
        tag: Option<u8>,
    },
    /// `prepare_sleep`: the tag's next sleep pins nothing.
    Prepare {
        tag: u8,
    },
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
        1 => proptest::option::of(0u8..2).prop_map(|tag| Action::ReleaseHost { tag }),
        1 => (0u8..2).prop_map(|tag| Action::Prepare { tag }),
    ]
}

struct Live {
    size: u64,
    id: u64,
    tag: Option<u8>,
    streams: Vec<StreamId>,
    /// Freed while its tag slept: no longer allocated, but its memory held until the wake, which frees it.
    freed: bool,
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
    /// Tags prepared since their last allocation, sleep or release of host memory: their next sleep pins
    /// nothing.
    prepared: BTreeSet<u8>,
    /// Tags prepared since their last wake or release of host memory: they may hold buffers whatever
    /// `keep_host_buffers` says.
    buffered: BTreeSet<u8>,
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
                    if let Some(t) = tag {
                        m.prepared.remove(&t);
                    }
                    let range = VaRange::new(addr, size);
                    for (&other, l) in &m.live {
                        assert!(
                            other + l.size <= range.start || range.end() <= other,
                            "{addr:#x}+{size} overlaps {other:#x}+{}",
                            l.size
                        );
                    }
                    m.next_id += 1;
                    write_pattern(a, addr, m.next_id, size);
                    let streams = vec![stream];
                    m.live.insert(
                        addr,
                        Live {
                            size,
                            id: m.next_id,
                            tag,
                            streams,
                            freed: false,
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
            let live = m.live.get_mut(&addr).unwrap();
            if live.freed {
                assert!(
                    matches!(result, Err(Error::DoubleFree { .. })),
                    "{result:?}"
                );
            } else if live.tag.is_some_and(|t| m.asleep.contains_key(&t)) {
                result.unwrap();
                live.freed = true;
            } else {
                result.unwrap();
                m.live.remove(&addr);
            }
        }
        Action::RecordStream { pick: p, stream } => {
            let Some(addr) = pick(m, p) else { return };
            if m.live[&addr].freed {
                return;
            }
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
            if m.asleep(live) || live.freed {
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
            let pinned = a.driver().counters().get(Op::HostAlloc);
            let result = a.sleep(TAGS[tag as usize], keep);
            if m.capturing.is_some() {
                assert!(matches!(result, Err(Error::CaptureUnderway { .. })));
                return;
            }
            result.unwrap();
            if m.prepared.remove(&tag) {
                let pinned = a.driver().counters().get(Op::HostAlloc) - pinned;
                assert_eq!(pinned, 0, "a prepared sleep of {tag} pins nothing");
            }
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
                    m.buffered.remove(&tag);
                    m.half.remove(&tag);
                    m.live.retain(|_, l| !(l.freed && l.tag == Some(tag)));
                    for (&addr, l) in &m.live {
                        if l.tag == Some(tag) {
                            if keep {
                                assert!(
                                    holds_pattern(a, addr, l.id, l.size),
                                    "{addr:#x} lost its bytes"
                                );
                            } else {
                                write_pattern(a, addr, l.id, l.size);
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
                begin_capture(a, CAPTURE, pool, CaptureMode::ThreadLocal);
                m.capturing = Some(pool);
            }
            Some(pool) => {
                end_capture(a, CAPTURE, pool);
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
        Action::ReleaseHost { tag } => {
            let released = a.release_host_buffers(tag.map(|t| TAGS[t as usize]));
            if m.capturing.is_some() {
                assert!(
                    matches!(released, Err(Error::CaptureUnderway { .. })),
                    "{released:?}"
                );
                return;
            }
            released.unwrap();
            match tag {
                Some(t) => {
                    m.prepared.remove(&t);
                    m.buffered.remove(&t);
                }
                None => {
                    m.prepared.clear();
                    m.buffered.clear();
                }
            }
            if tag.is_none() && !m.asleep.values().any(|&keep| keep) {
                assert_eq!(a.stats().host_kept_bytes, 0, "only kept bytes stay");
            }
        }
        Action::Prepare { tag } => {
            let pinned = a.driver().counters().get(Op::HostAlloc);
            let result = a.prepare_sleep(TAGS[tag as usize]);
            if m.capturing.is_some() {
                assert!(
                    matches!(result, Err(Error::CaptureUnderway { .. })),
                    "{result:?}"
                );
                return;
            }
            let bytes = result.unwrap();
            let pinned = a.driver().counters().get(Op::HostAlloc) - pinned;
            assert_eq!(bytes > 0, pinned > 0, "{bytes} bytes in {pinned} pieces");
            if m.asleep.contains_key(&tag) {
                assert_eq!(bytes, 0, "a tag asleep has its host memory");
                return;
            }
            m.prepared.insert(tag);
            m.buffered.insert(tag);
            let info = (a.tag_infos().into_iter()).find(|t| t.name == TAGS[tag as usize]);
            if let Some(info) = info {
                assert!(info.host_kept_bytes >= info.live_bytes, "{info:?}");
            }
        }
    }
}

fn check(a: &Alloc, m: &Model, mapped: &MappedEvents) {
    a.check_invariants().unwrap();
    mapped.check(a).unwrap();
    assert_eq!(a.driver().capture_refusals(), 0);
    let mut asleep_pages = BTreeSet::new();
    for (&addr, l) in &m.live {
        // What `read_kept` finds: the block's bytes where its tag sleeps with them kept, `NotKept` where
        // it sleeps without, the device's (`None`) elsewhere.
        let mut out = vec![0u8; l.size as usize];
        match l.tag.map(|t| (t, m.asleep.get(&t))) {
            Some((t, Some(true))) => {
                let tag = a.read_kept(addr, &mut out).unwrap();
                assert_eq!(tag.as_deref(), Some(TAGS[t as usize]));
                assert_eq!(out, pattern(l.id, l.size as usize), "{addr:#x} kept");
            }
            Some((_, Some(false))) => assert!(matches!(
                a.read_kept(addr, &mut out),
                Err(Error::NotKept { .. })
            )),
            Some((_, None)) | None => assert_eq!(a.read_kept(addr, &mut out).unwrap(), None),
        }
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
                holds_pattern(a, addr, l.id, l.size),
                "{addr:#x}+{} lost its bytes",
                l.size
            );
        }
    }
    let stats = a.stats();
    if m.half.is_empty() {
        assert_eq!(stats.asleep_bytes, asleep_pages.len() as u64 * PAGE);
    }
    let buffers = m.asleep.values().any(|&keep| keep) || !m.buffered.is_empty();
    if !a.config().keep_host_buffers && !buffers {
        assert_eq!(stats.host_kept_bytes, 0, "no buffer kept past a wake");
    }
    for tag in a.tag_infos() {
        let name = TAGS.iter().position(|&n| n == tag.name).unwrap() as u8;
        let kept = m.asleep.get(&name).copied().unwrap_or(false);
        let of_tag = || m.live.values().filter(|l| l.tag == Some(name));
        let slept_with = of_tag().next().is_some();
        assert_eq!(tag.bytes_kept, kept && slept_with, "{tag:?}");
        let live: u64 = (of_tag().filter(|l| !l.freed))
            .map(|l| l.size.next_multiple_of(512))
            .sum();
        assert_eq!(tag.live_bytes, live, "{tag:?}");
    }
    // A block freed while its tag sleeps is freed at once, as PyTorch counts a free (its memory waits for
    // the wake).
    let allocated: u64 = (m.live.values().filter(|l| !l.freed))
        .map(|l| l.size.next_multiple_of(512))
        .sum();
    assert_eq!(stats.allocated_bytes.current, allocated);
    // The snapshot shows the blocks held, asleep or not, and the requested bytes of those whose memory
    // waits.
    let snapshot = a.snapshot().unwrap();
    let shown: BTreeMap<u64, u64> = (snapshot.segments.iter().flat_map(|s| &s.blocks))
        .filter(|b| b.state == BlockState::ActiveAllocated)
        .map(|b| (b.address, b.requested_size))
        .collect();
    let held: BTreeMap<u64, u64> = (m.live.iter().filter(|(_, l)| !l.freed))
        .map(|(&addr, l)| (addr, l.size))
        .collect();
    assert_eq!(shown, held, "the snapshot's allocated blocks");
    assert_eq!(
        stats.requested_bytes.current,
        held.values().sum::<u64>() + snapshot.pending_requested_bytes()
    );
    assert_eq!(stats.reserved_bytes.current, a.driver().used_bytes());
}

fn run(config: Config, actions: Vec<Action>) {
    let mut a = new_alloc(config);
    let mapped = MappedEvents::attach(&mut a, PAGE);
    let mut m = Model::default();
    for action in &actions {
        step(&mut a, &mut m, action);
        check(&a, &m, &mapped);
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
    // One tag at a time, its allocations freed before the next wakes: the two need not have been live
    // together (one may have grown into the memory the other gave back by sleeping), but each was once
    // live with everything else freed now, so each wake alone must find memory.
    for (tag, name) in TAGS.iter().enumerate() {
        a.wake(name).unwrap_or_else(|e| panic!("final wake: {e}"));
        m.live.retain(|_, l| !(l.freed && l.tag == Some(tag as u8))); // the wake freed them
        if let Some(true) = m.asleep.remove(&(tag as u8)) {
            for (&addr, l) in &m.live {
                assert!(l.tag != Some(tag as u8) || holds_pattern(&a, addr, l.id, l.size));
            }
        }
        let mine: Vec<u64> = (m.live.iter())
            .filter(|(_, l)| l.tag == Some(tag as u8))
            .map(|(&addr, _)| addr)
            .collect();
        for addr in mine {
            a.free(addr).unwrap();
            m.live.remove(&addr);
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
    mapped.check(&a).unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    /// Sleep and wake interleaved with allocations, frees, record_stream, kernels, captures and pressure,
    /// with compaction on demand (the default) and eager, host memory in pieces of one page, three pages or
    /// the default, kept after a wake or not.
    #[test]
    fn sleep_and_wake_keep_addresses_bytes_and_books(
        actions in proptest::collection::vec(action(), 1..80),
        eager in any::<bool>(),
        cross_stream_reuse in any::<bool>(),
        piece in prop_oneof![Just(PAGE), Just(3 * PAGE), Just(cuvmm::config::DEFAULT_SLEEP_COPY)],
        keep_host_buffers in any::<bool>(),
    ) {
        let compaction = if eager { Compaction::Eager } else { Compaction::Pressure };
        let config = Config::default()
            .with_compaction(compaction)
            .with_cross_stream_reuse(cross_stream_reuse)
            .with_sleep_copy(piece)
            .with_keep_host_buffers(keep_host_buffers);
        run(config, actions);
    }
}
