//! Observability: snapshots (tiling, history, the pickle read back by cuvmm's reader, by Python, and made of
//! MemoryViz.js's opcodes only), the state at a replay's peak, and out-of-memory diagnoses.

use cuvmm::driver::StreamId;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::error::{Error, OutOfMemory, ReclaimStep, Suggestion};
use cuvmm::history::{TraceAction, TraceEntry, TraceTracker};
use cuvmm::size::{GIB, MIB};
use cuvmm::snapshot::{BlockState, MemorySnapshot};
use cuvmm::strategy::{Snapshots, Strategy};
use cuvmm::{Allocator, Config};
use cuvmm_lab::replay::allocators::{self, ALLOCATORS};
use cuvmm_lab::replay::peak::{find_peak, replay_capturing};
use cuvmm_lab::replay::{ReplayOptions, replay};
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::pytorch::writer::{self, op};
use cuvmm_lab::workload;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};

const S: StreamId = StreamId(0);

fn moe() -> Trace {
    workload::generate("moe", workload::DEFAULT_SEED).unwrap()
}

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuvmm-observability-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(name)
}

/// The opcodes of a pickle, walked by their argument lengths; `Err` at the first one outside `allowed`.
fn opcodes(bytes: &[u8], allowed: &[u8]) -> Result<Vec<u8>, String> {
    let mut seen = Vec::new();
    let mut i = 0;
    while i < bytes.len() {
        let code = bytes[i];
        if !allowed.contains(&code) {
            return Err(format!("opcode {code:#04x} at {i}"));
        }
        seen.push(code);
        i += 1;
        i += match code {
            op::PROTO | op::BININT1 => 1,
            op::BININT2 => 2,
            op::BININT => 4,
            op::BINFLOAT => 8,
            op::LONG1 => 1 + bytes[i] as usize,
            op::BINUNICODE => 4 + u32::from_le_bytes(bytes[i..i + 4].try_into().unwrap()) as usize,
            op::STOP => {
                return if i == bytes.len() {
                    Ok(seen)
                } else {
                    Err(format!("bytes after STOP at {i}"))
                };
            }
            _ => 0,
        };
    }
    Err("no STOP".into())
}

/// Replays `moe` through `name`, keeping its last `max_entries` events (none with `None`) and calling
/// `tracker` with each, if given.
fn replayed(
    name: &str,
    max_entries: Option<usize>,
    tracker: Option<TraceTracker>,
) -> (Box<dyn Strategy>, MemorySnapshot) {
    let mut strategy = allocators::build(name, 80 * GIB, 2 * MIB).unwrap();
    let snapshots = (strategy.snapshots()).expect("every built-in allocator has snapshots");
    snapshots.record_history(max_entries).unwrap();
    if let Some(tracker) = tracker {
        snapshots.attach_trace_tracker(tracker).unwrap();
    }
    let result = replay(strategy.as_mut(), &moe(), &ReplayOptions::default()).unwrap();
    assert_eq!(result.ooms, 0);
    strategy.check_invariants().unwrap();
    let snapshot = strategy.snapshots().unwrap().snapshot().unwrap();
    (strategy, snapshot)
}

fn replayed_with_history(name: &str, max_entries: usize) -> (Box<dyn Strategy>, MemorySnapshot) {
    replayed(name, Some(max_entries), None)
}

#[test]
fn snapshots_tile_their_segments_and_agree_with_the_statistics() {
    for &name in ALLOCATORS {
        let (strategy, snap) = replayed_with_history(name, usize::MAX);
        snap.check_tiling()
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        let stats = strategy.stats();
        assert_eq!(snap.allocated(), stats.allocated_bytes.current, "{name}");
        // Segments are mapped or cudaMalloc'd memory: all of it, less cuvmm's unmapped pooled handles.
        assert_eq!(
            snap.reserved(),
            stats.reserved_bytes.current - stats.idle_handle_bytes,
            "{name}"
        );
        let live = snap
            .segments
            .iter()
            .flat_map(|s| &s.blocks)
            .filter(|b| b.state == BlockState::ActiveAllocated)
            .count() as u64;
        assert_eq!(live, stats.allocation.current, "{name}");
        // Every alloc and free of the trace is in the history, with the segment events of the allocator.
        let trace = moe();
        let mut actions: HashMap<TraceAction, usize> = HashMap::new();
        for e in &snap.device_traces[0] {
            *actions.entry(e.action).or_default() += 1;
        }
        assert_eq!(actions[&TraceAction::Alloc], trace.alloc_count(), "{name}");
        assert_eq!(
            actions[&TraceAction::FreeRequested],
            actions[&TraceAction::FreeCompleted],
            "{name}"
        );
        let growth = match name {
            "classic" => TraceAction::SegmentAlloc,
            _ => TraceAction::SegmentMap,
        };
        assert!(
            actions.get(&growth).copied().unwrap_or(0) > 0,
            "{name}: {actions:?}"
        );
    }
}

#[test]
fn the_history_is_a_ring_buffer_and_off_by_default() {
    let (_, all) = replayed_with_history("cuvmm", usize::MAX);
    let (_, last) = replayed_with_history("cuvmm", 1000);
    // The two replays ran at different times: the events compare without theirs.
    let timeless = |events: &[TraceEntry]| -> Vec<TraceEntry> {
        (events.iter())
            .map(|e| TraceEntry { time_us: 0, ..*e })
            .collect()
    };
    let all = &all.device_traces[0];
    assert_eq!(last.device_traces[0].len(), 1000);
    assert_eq!(
        timeless(&last.device_traces[0]),
        timeless(&all[all.len() - 1000..])
    );

    let mut strategy = allocators::build("classic", 80 * GIB, 2 * MIB).unwrap();
    replay(strategy.as_mut(), &moe(), &ReplayOptions::default()).unwrap();
    let snap = strategy.snapshots().unwrap().snapshot().unwrap();
    assert!(snap.device_traces.iter().all(Vec::is_empty));
    assert!(!snap.segments.is_empty());
}

/// Replays `moe` through `name` with a trace tracker attached (and the history kept, with `keep`); the
/// tracker's events and the snapshot.
fn replayed_with_tracker(name: &str, keep: bool) -> (Vec<TraceEntry>, MemorySnapshot) {
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    let tracker = Arc::new(move |e: &TraceEntry| sink.lock().unwrap().push(*e));
    let (_, snapshot) = replayed(name, keep.then_some(usize::MAX), Some(tracker));
    let seen = seen.lock().unwrap().clone();
    (seen, snapshot)
}

#[test]
fn trace_trackers_see_each_event_the_history_keeps_recording_or_not() {
    for &name in ALLOCATORS {
        let (tracked, snap) = replayed_with_tracker(name, true);
        assert!(!tracked.is_empty(), "{name}");
        assert_eq!(
            tracked, snap.device_traces[0],
            "{name}: the same events, in order, with their times"
        );

        // A registration hook's view (NCCL's): the segment events add up to the memory mapped now.
        let net: i128 = (tracked.iter())
            .map(|e| match e.action {
                TraceAction::SegmentMap | TraceAction::SegmentAlloc => e.size as i128,
                TraceAction::SegmentUnmap | TraceAction::SegmentFree => -(e.size as i128),
                _ => 0,
            })
            .sum();
        assert_eq!(net, snap.reserved() as i128, "{name}");

        let (tracked_alone, snap) = replayed_with_tracker(name, false);
        assert!(
            snap.device_traces.iter().all(Vec::is_empty),
            "{name}: nothing kept"
        );
        let actions = |events: &[TraceEntry]| {
            events
                .iter()
                .map(|e| (e.action, e.addr, e.size))
                .collect::<Vec<_>>()
        };
        assert_eq!(
            actions(&tracked_alone),
            actions(&tracked),
            "{name}: recording or not"
        );
    }
}

#[test]
fn the_pickle_uses_only_memoryviz_opcodes_and_reads_back() {
    for &name in ALLOCATORS {
        let (_, snap) = replayed_with_history(name, usize::MAX);
        let bytes = writer::to_pickle(&snap);
        let seen = opcodes(&bytes, &op::ALL).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(seen[0], op::PROTO);
        let path = scratch(&format!("{name}.pickle"));
        writer::write_file(&path, &snap).unwrap();

        // cuvmm's own reader reads it back, blocks tiling their segments.
        let raw = cuvmm_lab::trace::pytorch::snapshot::read(&path).unwrap();
        assert_eq!(raw.segments.len(), snap.segments.len(), "{name}");
        for (seg, ours) in raw.segments.iter().zip(&snap.segments) {
            assert_eq!(
                (seg.address, seg.total_size),
                (ours.address, ours.total_size)
            );
            let mut addr = seg.address;
            for block in &seg.blocks {
                assert_eq!(block.address, Some(addr), "{name}");
                addr += block.size;
            }
            assert_eq!(addr, seg.address + seg.total_size, "{name}");
        }
        let entries = raw.device_traces[0].as_ref().unwrap();
        assert_eq!(entries.len(), snap.device_traces[0].len(), "{name}");
        for (raw, ours) in entries.iter().zip(&snap.device_traces[0]) {
            let raw = raw.check().expect("every field as its action needs");
            assert_eq!(raw.action, ours.action.as_str());
            assert_eq!((raw.addr, raw.size), (ours.addr, ours.size));
        }
        python_checks(&path, name);
    }
}

/// With python3 present: `pickle.load` reads the file, the blocks tile their segments, and
/// `pickletools.genops` finds only MemoryViz.js's opcodes.
fn python_checks(path: &std::path::Path, name: &str) {
    let script = r#"
import pickle, pickletools, sys
data = open(sys.argv[1], 'rb').read()
snap = pickle.loads(data)
allowed = {'PROTO', 'EMPTY_DICT', 'EMPTY_LIST', 'EMPTY_TUPLE', 'TUPLE2', 'MARK', 'SETITEMS', 'APPENDS',
           'BININT1', 'BININT2', 'BININT', 'LONG1', 'BINUNICODE', 'NONE', 'NEWTRUE', 'NEWFALSE',
           'BINFLOAT', 'STOP'}
used = {opcode.name for opcode, _, _ in pickletools.genops(data)}
assert used <= allowed, used - allowed
for seg in snap['segments']:
    addr = seg['address']
    for block in seg['blocks']:
        assert block['address'] == addr, (seg['address'], block['address'], addr)
        addr += block['size']
    assert addr == seg['address'] + seg['total_size'], seg['address']
print(len(snap['segments']), len(snap['device_traces'][0]))
"#;
    let output = match std::process::Command::new("python3")
        .arg("-c")
        .arg(script)
        .arg(path)
        .output()
    {
        Ok(output) => output,
        Err(e) => {
            println!("skipped the Python check: python3 cannot be run ({e})");
            return;
        }
    };
    assert!(
        output.status.success(),
        "{name}: python3 failed: {}",
        String::from_utf8_lossy(&output.stderr)
    );
}

#[test]
fn the_peak_state_is_captured_where_reserved_memory_peaked() {
    for &name in ALLOCATORS {
        let trace = moe();
        let options = ReplayOptions::default();
        let mut first = allocators::build(name, 80 * GIB, 2 * MIB).unwrap();
        let (result, peak) = find_peak(first.as_mut(), &trace, &options).unwrap();
        assert_eq!(peak.reserved, result.peak_reserved_bytes, "{name}");
        let mut captured = None;
        let mut second = allocators::build(name, 80 * GIB, 2 * MIB).unwrap();
        let again = replay_capturing(
            second.as_mut(),
            &trace,
            &options,
            peak.operation,
            &mut |s| {
                s.check_invariants().unwrap();
                captured = Some(s.stats());
            },
        )
        .unwrap();
        let at_peak = captured.expect("the peak operation was replayed");
        assert_eq!(at_peak.reserved_bytes.current, peak.reserved, "{name}");
        assert_eq!(at_peak.reserved_bytes.peak, peak.reserved, "{name}");
        assert_eq!(again.peak_reserved_bytes, peak.reserved, "{name}");
        // The first time: one operation earlier, reserved memory was below the peak.
        let mut before = None;
        let mut third = allocators::build(name, 80 * GIB, 2 * MIB).unwrap();
        replay_capturing(
            third.as_mut(),
            &trace,
            &options,
            peak.operation - 1,
            &mut |s| {
                before = Some(s.stats().reserved_bytes.peak);
            },
        )
        .unwrap();
        assert!(before.unwrap() < peak.reserved, "{name}");
    }
}

#[test]
fn the_memory_summary_has_pools_that_add_up() {
    let allocator = Allocator::new(
        cuvmm_lab::pytorch_model::Split::new(
            SimDriver::new(SimConfig::default().with_capacity(GIB)),
            Config::default(),
        )
        .unwrap(),
    );
    let small = allocator.alloc(4096).unwrap();
    let large = allocator.alloc(30 * MIB).unwrap();
    allocator.check_invariants().unwrap();
    let stats = allocator.stats();
    assert_eq!(stats.small_pool.allocated_bytes.current, 4096);
    assert_eq!(stats.large_pool.allocated_bytes.current, 30 * MIB);
    assert_eq!(stats.small_pool.segment.current, 1);
    assert_eq!(stats.large_pool.reserved_bytes.current, 30 * MIB);
    assert_eq!(stats.small_pool.reserved_bytes.current, 2 * MIB);
    let text = allocator.memory_summary();
    let row = |label: &str| {
        text.lines()
            .find(|l| l.starts_with(label))
            .unwrap()
            .to_string()
    };
    assert!(
        row("| GPU reserved segments").contains("|       2    |"),
        "{text}"
    );
    assert!(row("| Allocator").contains("classic"), "{text}");
    drop((small, large));
    allocator.check_invariants().unwrap();
    assert_eq!(allocator.stats().large_pool.allocation.peak, 1);
}

#[test]
fn a_full_device_says_how_many_bytes_are_missing() {
    let page = 2 * MIB;
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(8 * page)
            .with_granularity(page),
    );
    let mut cuvmm = cuvmm::expandable::Expandable::new(sim, Config::default()).unwrap();
    let _kept = cuvmm.alloc(7 * page, S).unwrap();
    let err = cuvmm.alloc(3 * page, S).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("{err}")
    };
    cuvmm.check_invariants().unwrap();
    assert_eq!(
        (oom.allocated, oom.device_free, oom.alloc_size),
        (7 * page, page, 3 * page)
    );
    assert_eq!(oom.suggestion(), Suggestion::ReduceUsage { need: 2 * page });
    assert!(
        oom.reclaim.contains(&ReclaimStep::Retry),
        "{:?}",
        oom.reclaim
    );
    let text = err.to_string();
    assert!(
        text.starts_with(
            "CUDA out of memory. Tried to allocate 6.00 MiB. GPU 0 has a total capacity of 16.00 MiB of \
             which 2.00 MiB is free. Of the allocated memory 14.00 MiB is allocated by cuvmm"
        ),
        "{text}"
    );
    assert!(text.contains("free at least 4.00 MiB more"), "{text}");
    // The failed request moved no statistic: PyTorch counts a block only when it hands it out.
    let stats = cuvmm.stats();
    assert_eq!(stats.allocated_bytes.peak, 7 * page);
    assert_eq!(stats.allocation.allocated, 1);
    assert_eq!(stats.large_pool.active_bytes.peak, 7 * page);
    assert_eq!(stats.num_ooms, 1);
}

#[test]
fn classic_fragmentation_suggests_expandable_segments() {
    let sim = SimDriver::new(SimConfig::default().with_capacity(40 * MIB));
    let mut classic = cuvmm_lab::pytorch_model::Split::new(sim, Config::default()).unwrap();
    classic.record_history(Some(100)).unwrap();
    // Two 20 MiB segments split into 6 + 6 + 8 MiB blocks; the free ones cannot be given back.
    let a1 = classic.alloc(6 * MIB, S).unwrap();
    let _b1 = classic.alloc(6 * MIB, S).unwrap();
    let _c1 = classic.alloc(8 * MIB, S).unwrap();
    let a2 = classic.alloc(6 * MIB, S).unwrap();
    let _b2 = classic.alloc(6 * MIB, S).unwrap();
    classic.free(a1).unwrap();
    classic.free(a2).unwrap();
    let err = classic.alloc(16 * MIB, S).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("{err}")
    };
    classic.check_invariants().unwrap();
    let OutOfMemory {
        allocated,
        reserved,
        ..
    } = **oom;
    assert_eq!((allocated, reserved), (20 * MIB, 40 * MIB));
    match oom.suggestion() {
        Suggestion::Fragmentation {
            unallocated,
            remedy,
        } => {
            assert_eq!(unallocated, 20 * MIB);
            assert!(remedy.contains("expandable_segments:True"), "{remedy}");
        }
        other => panic!("{other:?}\n{err}"),
    }
    // The failure is in the history, with the device's free memory, as PyTorch records it.
    let snap = classic.snapshot().unwrap();
    let last = snap.device_traces[0].last().unwrap();
    assert_eq!(last.action, TraceAction::Oom);
    assert_eq!((last.size, last.device_free), (16 * MIB, Some(0)));
}
