//! From a snapshot to a replayable device trace: the requests, the ground-truth segment events, and the
//! allocator's state when recording began.
//!
//! The state at the start is the final state with the recorded events undone: segments freed during the
//! trace existed before it, segments allocated during it did not. Blocks live at the start are those freed
//! without an earlier alloc (their rounded requested size), and those still live at the end whose address
//! no alloc names (their recorded size). Everything else in a starting segment was cached, and cached
//! neighbours always merge, so each gap between live blocks was one free block.

use super::snapshot::{RawEntry, RawSegment, RawSnapshot, SnapshotError};
use super::{InitialSegment, PytorchTrace, TraceOp};
use crate::config::Config;
use crate::driver::StreamId;
use crate::expandable::Pool;
use crate::split::rules::{self, SMALL_BUFFER};
use crate::split::{SeedBlock, SegmentAction, SegmentEvent};
use std::collections::{BTreeMap, HashSet};
use std::path::Path;

/// No device address reaches 2^60 ...
const MAX_ADDRESS: u64 = 1 << 60;
/// ... and no size 2^50 bytes (1 PiB), so an address plus a size fits in 64 bits (sums saturate).
const MAX_SIZE: u64 = 1 << 50;

/// The device a replay uses: `device` if given (it must exist), else the one with the most trace
/// entries.
pub fn pick_device(
    path: &Path,
    raw: &RawSnapshot,
    device: Option<usize>,
) -> Result<usize, SnapshotError> {
    let devices = raw.device_traces.len().max(
        raw.segments
            .iter()
            .map(|s| s.device as usize + 1)
            .max()
            .unwrap_or(0),
    );
    match device {
        Some(d) if d < devices.max(1) => Ok(d),
        Some(d) => Err(SnapshotError::NoSuchDevice {
            path: path.to_path_buf(),
            device: d,
            devices,
        }),
        None => Ok((0..raw.device_traces.len())
            .max_by_key(|&d| (entries(raw, d).len(), std::cmp::Reverse(d)))
            .unwrap_or(0)),
    }
}

fn entries(raw: &RawSnapshot, device: usize) -> &[RawEntry] {
    raw.device_traces
        .get(device)
        .and_then(Option::as_deref)
        .unwrap_or(&[])
}

/// The replayable trace of `device`.
pub fn build(
    path: &Path,
    raw: &RawSnapshot,
    device: usize,
    config: Config,
) -> Result<PytorchTrace, SnapshotError> {
    let entries = entries(raw, device);
    let inconsistent = |what, addr| SnapshotError::Inconsistent {
        path: path.to_path_buf(),
        what,
        addr,
    };
    let segments: Vec<&RawSegment> = raw
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
        .collect();
    // Bound every number so the arithmetic below cannot overflow on a corrupt file.
    let sizes = entries
        .iter()
        .map(|e| (e.addr, e.size))
        .chain(segments.iter().flat_map(|s| {
            std::iter::once((s.address, s.total_size))
                .chain(s.blocks.iter().map(|b| (b.address.unwrap_or(0), b.size)))
        }));
    for (addr, size) in sizes {
        if addr >= MAX_ADDRESS || size >= MAX_SIZE {
            return Err(inconsistent("an address or size beyond any device", addr));
        }
    }
    let expandable = config.expandable_segments
        || segments.iter().any(|s| s.is_expandable == Some(true))
        || entries
            .iter()
            .any(|e| e.action == "segment_map" || e.action == "segment_unmap");
    let segment_events: Vec<SegmentEvent> = entries
        .iter()
        .filter_map(|e| {
            let action = match e.action.as_str() {
                "segment_alloc" => SegmentAction::SegmentAlloc,
                "segment_free" => SegmentAction::SegmentFree,
                "segment_map" => SegmentAction::SegmentMap,
                "segment_unmap" => SegmentAction::SegmentUnmap,
                _ => return None,
            };
            Some(SegmentEvent {
                action,
                addr: e.addr,
                size: e.size,
                stream: StreamId(e.stream),
            })
        })
        .collect();

    // Segments at the start: the final ones with the segment events undone, newest first.
    let mut start: BTreeMap<u64, (u64, StreamId, Pool)> = segments
        .iter()
        .map(|s| (s.address, (s.total_size, StreamId(s.stream), pool_of(s))))
        .collect();
    let final_reserved = segments
        .iter()
        .fold(0u64, |sum, s| sum.saturating_add(s.total_size));
    let mut initial_reserved = final_reserved;
    for e in segment_events.iter().rev() {
        if e.action.grows() {
            initial_reserved = initial_reserved
                .checked_sub(e.size)
                .ok_or_else(|| inconsistent("more memory taken than the snapshot holds", e.addr))?;
            if e.action == SegmentAction::SegmentAlloc && start.remove(&e.addr).is_none() {
                return Err(inconsistent(
                    "segment_alloc of a segment missing at the end",
                    e.addr,
                ));
            }
        } else {
            initial_reserved = initial_reserved.saturating_add(e.size);
            if e.action == SegmentAction::SegmentFree {
                let pool = if e.size == SMALL_BUFFER {
                    Pool::Small
                } else {
                    Pool::Large
                };
                start.insert(e.addr, (e.size, e.stream, pool));
            }
        }
    }
    let mut reserved = initial_reserved;
    let mut peak_reserved = reserved;
    for e in &segment_events {
        if e.action.grows() {
            reserved = reserved.saturating_add(e.size);
            peak_reserved = peak_reserved.max(reserved);
        } else {
            reserved = reserved.saturating_sub(e.size);
        }
    }

    let (ops, oom_releases) = requests(entries, initial_reserved, peak_reserved);
    let live = live_at_start(entries, &segments, &config, &inconsistent)?;
    let mut initial: BTreeMap<u64, InitialSegment> = start
        .iter()
        .map(|(&addr, &(size, stream, pool))| {
            let seg = InitialSegment {
                addr,
                size,
                stream,
                pool,
                live: Vec::new(),
            };
            (addr, seg)
        })
        .collect();
    let mut inferred: HashSet<(u64, u64)> = HashSet::new();
    for (addr, (block, is_inferred)) in live {
        let (_, seg) = initial
            .range_mut(..=addr)
            .next_back()
            .filter(|(_, s)| addr < s.addr + s.size)
            .ok_or_else(|| inconsistent("a block live at the start lies in no segment", addr))?;
        if is_inferred {
            inferred.insert((seg.addr, addr - seg.addr));
        }
        seg.live.push(SeedBlock {
            offset: addr - seg.addr,
            ..block
        });
    }
    for seg in initial.values_mut() {
        absorb_slivers(seg, &inferred);
    }
    Ok(PytorchTrace {
        device,
        expandable,
        config,
        ops,
        initial: initial.into_values().collect(),
        segment_events,
        initial_reserved,
        peak_reserved,
        oom_releases,
    })
}

/// Gives back to each block whose size was inferred from its request the sliver after it: in the large
/// pool every block, free or live, is larger than 1 MiB (PyTorch splits off only remainders above 1 MiB),
/// so a gap of at most 1 MiB after a block was never a block of its own but the unsplit remainder of the
/// block before it.
fn absorb_slivers(seg: &mut InitialSegment, inferred: &HashSet<(u64, u64)>) {
    if seg.pool != Pool::Large {
        return;
    }
    let ends: Vec<u64> = seg
        .live
        .iter()
        .skip(1)
        .map(|b| b.offset)
        .chain([seg.size])
        .collect();
    for (block, next) in seg.live.iter_mut().zip(ends) {
        let gap = next.saturating_sub(block.offset + block.size);
        if gap > 0 && gap <= rules::SMALL_SIZE && inferred.contains(&(seg.addr, block.offset)) {
            block.size += gap;
        }
    }
}

fn pool_of(s: &RawSegment) -> Pool {
    match s.segment_type.as_deref() {
        Some("small") => Pool::Small,
        Some(_) => Pool::Large,
        None if s.total_size == SMALL_BUFFER => Pool::Small,
        None => Pool::Large,
    }
}

/// The action that marks a block's return to the cache: `free_completed`, or in versions without it
/// `free_requested` or `free`.
fn free_action(entries: &[RawEntry]) -> &'static str {
    ["free_completed", "free_requested", "free"]
        .into_iter()
        .find(|a| entries.iter().any(|e| e.action == *a))
        .unwrap_or("free_completed")
}

/// The requests in order: allocs, frees, and one `empty_cache` for each run of `segment_free` (or
/// `segment_unmap`) entries that `torch.cuda.empty_cache()` made rather than an out-of-memory retry. Also
/// says whether any release came from out-of-memory (a run not made by `empty_cache`, or an `oom` entry).
///
/// A run's frames tell when they name `emptyCache`. They rarely can: serde-pickle's
/// `replace_recursive_structures` turns every string the pickle memo shares into `None`, and frame names
/// are shared. Otherwise the run is an out-of-memory retry only if it is followed by a new segment that
/// the device could not have held: the reserved bytes before the run plus that segment's size exceed the
/// most PyTorch held at any point of the trace (`peak_reserved`), which the device evidently had room for.
fn requests(
    entries: &[RawEntry],
    initial_reserved: u64,
    peak_reserved: u64,
) -> (Vec<TraceOp>, bool) {
    let free = free_action(entries);
    let mut ops = Vec::new();
    let mut oom_releases = false;
    let mut reserved = initial_reserved;
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        match e.action.as_str() {
            "alloc" => ops.push(TraceOp::Alloc {
                addr: e.addr,
                size: e.size,
                stream: StreamId(e.stream),
            }),
            a if a == free => ops.push(TraceOp::Free { addr: e.addr }),
            "segment_alloc" | "segment_map" => reserved = reserved.saturating_add(e.size),
            "segment_free" | "segment_unmap" => {
                let run_end = entries[i..]
                    .iter()
                    .position(|x| x.action != e.action)
                    .map_or(entries.len(), |n| i + n);
                let by_frames = entries[i..run_end]
                    .iter()
                    .find_map(RawEntry::from_empty_cache);
                let impossible_growth = entries.get(run_end).is_some_and(|x| {
                    (x.action == "segment_alloc" || x.action == "segment_map")
                        && reserved.saturating_add(x.size) > peak_reserved
                });
                reserved =
                    reserved.saturating_sub(entries[i..run_end].iter().map(|x| x.size).sum());
                if by_frames.unwrap_or(!impossible_growth) {
                    ops.push(TraceOp::EmptyCache);
                } else {
                    oom_releases = true;
                }
                i = run_end;
                continue;
            }
            "oom" => oom_releases = true,
            _ => {}
        }
        i += 1;
    }
    (ops, oom_releases)
}

/// Blocks live when recording began, by address: (size, requested) with the offset left at 0, and
/// whether the size was inferred from the requested size (rather than recorded).
fn live_at_start(
    entries: &[RawEntry],
    segments: &[&RawSegment],
    config: &Config,
    inconsistent: &dyn Fn(&'static str, u64) -> SnapshotError,
) -> Result<BTreeMap<u64, (SeedBlock, bool)>, SnapshotError> {
    let free = free_action(entries);
    let mut live: BTreeMap<u64, (SeedBlock, bool)> = BTreeMap::new();
    let mut in_trace: HashSet<u64> = HashSet::new();
    let mut allocated_ever: HashSet<u64> = HashSet::new();
    for e in entries {
        if e.action == "alloc" {
            in_trace.insert(e.addr);
            allocated_ever.insert(e.addr);
        } else if e.action == free && !in_trace.remove(&e.addr) {
            let size = rules::round_size(e.size, &config.roundup_power2_divisions)
                .ok_or_else(|| inconsistent("a free of an impossible size", e.addr))?;
            let block = SeedBlock {
                offset: 0,
                size,
                requested: e.size,
            };
            live.insert(e.addr, (block, true));
        }
    }
    for seg in segments {
        let mut addr = seg.address;
        for b in &seg.blocks {
            let at = b.address.unwrap_or(addr);
            addr = at + b.size;
            if b.state != "inactive" && !allocated_ever.contains(&at) {
                let block = SeedBlock {
                    offset: 0,
                    size: b.size,
                    requested: b.requested_size,
                };
                live.entry(at).or_insert((block, false));
            }
        }
    }
    Ok(live)
}
