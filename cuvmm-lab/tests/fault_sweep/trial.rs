//! One trial: a sequence run on a fresh allocator with at most one fault planned, every live allocation's
//! bytes checked after each step, and the cleanup that must leave the device holding nothing.

use super::*;

/// A live allocation: its size and id.
type Live = BTreeMap<u64, (u64, u64)>;

/// The tags of the sequences.
const TAGS: [&str; 2] = ["weights", "kv_cache"];

/// What the model knows of tags: each tagged allocation's tag, and the tags asleep (or half way) with
/// whether their sleep kept the bytes.
#[derive(Debug, Default)]
struct Tagged {
    of: BTreeMap<u64, usize>,
    asleep: BTreeMap<usize, bool>,
}

impl Tagged {
    fn asleep(&self, addr: u64) -> bool {
        self.of
            .get(&addr)
            .is_some_and(|t| self.asleep.contains_key(t))
    }

    /// Learns which tags sleep from the allocator (a failed sleep or wake may have changed that), noting
    /// `keep` for a tag that fell asleep now.
    fn sync(&mut self, subject: &mut Subject, keep: bool) {
        let Subject::Cuvmm(a) = subject else { return };
        let now: Vec<String> = a.asleep_tags().into_iter().map(|(t, _)| t).collect();
        for (tag, name) in TAGS.iter().enumerate() {
            match now.iter().any(|n| n == name) {
                true => {
                    self.asleep.entry(tag).or_insert(keep);
                }
                false => {
                    self.asleep.remove(&tag);
                }
            }
        }
    }
}

/// Runs `steps` on a fresh allocator with `fault` planned and checks everything the module docs list.
pub(super) fn run(
    kind: Kind,
    seed: u64,
    steps: &[Step],
    fault: Option<Fault>,
) -> Result<Outcome, String> {
    let mut subject = Subject::new(kind, seed);
    if let Some(f) = fault {
        subject.plan(f);
    }
    let start = subject.sim().counters();
    let target = fault.map(|f| start.get(f.op) + f.n);
    let fired = |s: &Subject| {
        fault
            .zip(target)
            .is_some_and(|(f, t)| s.sim().counters().get(f.op) >= t)
    };
    let mut live: Live = BTreeMap::new();
    let mut tagged = Tagged::default();
    let mut outcome = Outcome::default();
    let mut next_id = 0;
    for (i, &step) in steps.iter().enumerate() {
        let was_fired = fired(&subject);
        let retries = subject.strategy().stats().num_alloc_retries;
        let maps_before = subject.sim().counters().get(Op::Map) - start.get(Op::Map);
        let result = apply(
            &mut subject,
            &mut live,
            &mut tagged,
            &mut next_id,
            kind,
            step,
        );
        let maps_after = subject.sim().counters().get(Op::Map) - start.get(Op::Map);
        outcome.maps.push((maps_before + 1, maps_after));
        let fired_now = !was_fired && fired(&subject);
        if fired_now {
            outcome.fired_in = Some((i, result.is_err()));
        }
        match result {
            Err(err) if !fired_now => return Err(format!("step {i} {step:?} failed: {err:?}")),
            Err(err) if !(matches!(err, Error::Driver(_)) || err.is_out_of_memory()) => {
                return Err(format!("step {i} {step:?}: untyped failure {err:?}"));
            }
            Ok(())
                if fired_now && matches!(step, Step::Alloc { .. } | Step::AllocTagged { .. }) =>
            {
                let f = fault.expect("a fault fired");
                let retried = subject.strategy().stats().num_alloc_retries > retries;
                if f.kind == Failure::Before(FaultKind::OutOfMemory) && !retried {
                    return Err(format!(
                        "step {i} {step:?}: {} ran out of memory and the allocation succeeded \
                         without a retry",
                        f.op
                    ));
                }
            }
            _ => {}
        }
        check(&mut subject, &live, &tagged, kind)
            .map_err(|e| format!("after step {i} {step:?}: {e}"))?;
    }
    for op in FAULT_OPS {
        let calls = subject.sim().counters().get(op) - start.get(op);
        outcome.calls.insert(op, calls);
    }
    if fault.is_some() && outcome.fired_in.is_none() {
        return Err("the planned fault never fired".into());
    }
    finish(&mut subject, &mut live, &mut tagged, &mut next_id, kind)
        .map_err(|e| format!("cleanup: {e}"))?;
    Ok(outcome)
}

/// Applies one step; a failed allocation or free leaves the model as it was.
fn apply(
    subject: &mut Subject,
    live: &mut Live,
    tagged: &mut Tagged,
    next_id: &mut u64,
    kind: Kind,
    step: Step,
) -> Result<(), Error> {
    // Frees and record_stream pick among the allocations of tags awake (and untagged ones).
    let nth = |live: &Live, pick: usize| {
        let awake: Vec<u64> = live
            .keys()
            .copied()
            .filter(|&a| !tagged.asleep(a))
            .collect();
        awake.get(pick % awake.len().max(1)).copied()
    };
    match step {
        Step::AllocTagged { size, stream, tag } => {
            let Subject::Cuvmm(a) = subject else {
                unreachable!("tags are cuvmm's")
            };
            let result = a.alloc_tagged(size, StreamId(stream), TAGS[tag]);
            if tagged.asleep.contains_key(&tag) {
                return match result {
                    Err(Error::TagAsleep { .. }) => Ok(()),
                    other => panic!("an allocation under a sleeping tag: {other:?}"),
                };
            }
            let addr = result?;
            *next_id += 1;
            stamp(subject, addr, size, *next_id, kind);
            live.insert(addr, (size, *next_id));
            tagged.of.insert(addr, tag);
        }
        Step::Sleep { tag, keep } => {
            let Subject::Cuvmm(a) = subject else {
                unreachable!("tags are cuvmm's")
            };
            let result = a.sleep(TAGS[tag], keep);
            tagged.sync(subject, keep);
            result?;
        }
        Step::Wake { tag } => {
            let Subject::Cuvmm(a) = subject else {
                unreachable!("tags are cuvmm's")
            };
            let result = a.wake(TAGS[tag]);
            let kept = tagged.asleep.get(&tag).copied();
            tagged.sync(subject, false);
            result?;
            if kept == Some(false) {
                // The bytes were not kept: the allocations get new markers.
                let ids: Vec<(u64, u64, u64)> = (live.iter())
                    .filter(|(addr, _)| tagged.of.get(addr) == Some(&tag))
                    .map(|(&addr, &(size, id))| (addr, size, id))
                    .collect();
                for (addr, size, id) in ids {
                    stamp(subject, addr, size, id, kind);
                }
            }
        }
        Step::Alloc { size, stream } => {
            let addr = subject.strategy().alloc(size, StreamId(stream))?;
            *next_id += 1;
            stamp(subject, addr, size, *next_id, kind);
            live.insert(addr, (size, *next_id));
        }
        Step::Free { pick } => {
            if let Some(addr) = nth(live, pick) {
                subject.strategy().free(addr)?;
                live.remove(&addr);
                tagged.of.remove(&addr);
            }
        }
        Step::RecordStream { pick, stream } => {
            if let Some(addr) = nth(live, pick) {
                if let Some(uses) = subject.strategy().stream_uses() {
                    uses.record_stream(addr, StreamId(stream))?;
                }
            }
        }
        Step::Trim { bytes } => {
            subject.strategy().trim(bytes)?;
        }
        Step::EmptyCache => subject.strategy().empty_cache()?,
    }
    Ok(())
}

/// Where the markers of an allocation of `size` bytes go: every `stride` bytes, and its last bytes.
fn marker_offsets(size: u64, stride: u64) -> Vec<u64> {
    let mut offsets: Vec<u64> = (0..size).step_by(stride as usize).collect();
    if let Some(&last) = offsets.last()
        && size >= last + 2 * MARKER
    {
        offsets.push(size - MARKER);
    }
    offsets
}

/// The marker of allocation `id` at `offset` (shorter at the end of a small allocation).
fn marker(id: u64, offset: u64, size: u64) -> Vec<u8> {
    let mut bytes = [0u8; MARKER as usize];
    bytes[..8].copy_from_slice(&id.to_le_bytes());
    bytes[8..].copy_from_slice(&(offset.wrapping_mul(0x9E37) ^ id).to_le_bytes());
    bytes[..(size - offset).min(MARKER) as usize].to_vec()
}

/// Writes the markers of a new allocation through the device's backing store.
fn stamp(subject: &mut Subject, addr: u64, size: u64, id: u64, kind: Kind) {
    for offset in marker_offsets(size, kind.stride()) {
        let bytes = marker(id, offset, size);
        if let Err(e) = subject.sim_mut().write(addr + offset, &bytes) {
            panic!("allocation {addr:#x}+{size} is not writable at {offset}: {e}");
        }
    }
}

/// The properties that hold after every operation.
fn check(subject: &mut Subject, live: &Live, tagged: &Tagged, kind: Kind) -> Result<(), String> {
    let strategy = subject.strategy();
    strategy
        .check_invariants()
        .map_err(|v| format!("invariant broken: {v}"))?;
    let stats = strategy.stats();
    let mut requested: u64 = live.values().map(|&(size, _)| size).sum();
    if stats.active_bytes.current != stats.allocated_bytes.current {
        // Blocks freed and waiting for other streams' events: their requested bytes count until then, as
        // PyTorch's.
        let snapshots =
            (strategy.snapshots()).ok_or("no snapshot to find the pending blocks in")?;
        let snapshot = (snapshots.snapshot()).map_err(|e| format!("snapshot: {e}"))?;
        requested += snapshot.pending_requested_bytes();
    }
    if (stats.requested_bytes.current, stats.allocation.current) != (requested, live.len() as u64) {
        return Err(format!(
            "stats say {} B in {} allocations, the model {requested} B in {}",
            stats.requested_bytes.current,
            stats.allocation.current,
            live.len()
        ));
    }
    let used = subject.sim().used_bytes();
    if stats.reserved_bytes.current != used {
        return Err(format!(
            "reserved_bytes is {}, the device holds {used}",
            stats.reserved_bytes.current
        ));
    }
    for (&addr, &(size, id)) in live {
        if tagged.asleep(addr) {
            continue;
        }
        for offset in marker_offsets(size, kind.stride()) {
            let want = marker(id, offset, size);
            let got = subject
                .sim()
                .read(addr + offset, want.len())
                .map_err(|e| format!("allocation {addr:#x}+{size} unreadable at {offset}: {e}"))?;
            if got != want {
                return Err(format!(
                    "allocation {addr:#x}+{size} lost its bytes at {offset}"
                ));
            }
        }
    }
    Ok(())
}

/// With faults cleared: new requests are served and hold their bytes; then everything is freed, the cache
/// emptied, and the device holds nothing.
fn finish(
    subject: &mut Subject,
    live: &mut Live,
    tagged: &mut Tagged,
    next_id: &mut u64,
    kind: Kind,
) -> Result<(), String> {
    subject.clear_faults();
    for tag in (0..TAGS.len()).filter(|_| kind == Kind::Cuvmm) {
        apply(subject, live, tagged, next_id, kind, Step::Wake { tag })
            .map_err(|e| format!("wake {}: {e:?}", TAGS[tag]))?;
    }
    check(subject, live, tagged, kind)?;
    let page = kind.granularity();
    for (size, stream) in [(100, 0), (3 * page + 512, 1), (page, 2)] {
        apply(
            subject,
            live,
            tagged,
            next_id,
            kind,
            Step::Alloc { size, stream },
        )
        .map_err(|e| format!("a new request of {size} B failed: {e:?}"))?;
    }
    check(subject, live, tagged, kind)?;
    for addr in std::mem::take(live).into_keys() {
        subject
            .strategy()
            .free(addr)
            .map_err(|e| format!("free({addr:#x}): {e:?}"))?;
    }
    subject
        .strategy()
        .empty_cache()
        .map_err(|e| format!("empty_cache: {e:?}"))?;
    check(subject, live, tagged, kind)?;
    let reserved = subject.strategy().stats().reserved_bytes.current;
    if reserved != 0 {
        return Err(format!("{reserved} B still reserved after empty_cache"));
    }
    if subject.sim().live_events() != 0 {
        return Err(format!(
            "{} events left undestroyed",
            subject.sim().live_events()
        ));
    }
    let leaks = subject.sim().leak_report();
    if !leaks.is_empty() {
        return Err(format!("the device reports leaks: {leaks}"));
    }
    Ok(())
}
