//! From a snapshot to a replayable device trace: the requests, the ground-truth segment events, and the
//! allocator's state when recording began.
//!
//! The state at the start is the final state with the recorded events undone: segments freed during the
//! trace existed before it, segments allocated during it did not. Blocks live at the start are those freed
//! without an earlier alloc (their rounded requested size), and those still live at the end whose address
//! no alloc names (their recorded size). Everything else in a starting segment was cached, and cached
//! neighbours always merge, so each gap between live blocks was one free block.

use super::releases::{self, Context};
use super::snapshot::{Entry, RawEntry, RawSegment, RawSnapshot, SnapshotError};
use super::{InitialSegment, PytorchTrace};
use crate::pytorch_model::rules::{self, SMALL_BUFFER};
use crate::pytorch_model::{SeedBlock, SegmentAction, SegmentEvent};
use cuvmm::driver::StreamId;
use cuvmm::strategy::config::Config;
use cuvmm::strategy::pool::Pool;
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

/// The entries of `device` with their fields checked ([`RawEntry::check`]).
fn checked_entries(
    path: &Path,
    raw: &RawSnapshot,
    device: usize,
) -> Result<Vec<Entry>, SnapshotError> {
    entries(raw, device)
        .iter()
        .enumerate()
        .map(|(index, e)| {
            e.check().map_err(|(field, problem)| SnapshotError::Field {
                path: path.to_path_buf(),
                device,
                index,
                action: match &e.action {
                    Some(serde_pickle::Value::String(a)) => crate::trace::excerpt(a),
                    _ => "?".to_string(),
                },
                field,
                problem,
            })
        })
        .collect()
}

/// The replayable trace of `device`.
pub fn build(
    path: &Path,
    raw: &RawSnapshot,
    device: usize,
    config: Config,
) -> Result<PytorchTrace, SnapshotError> {
    let entries = &checked_entries(path, raw, device)?[..];
    if entries.is_empty() {
        return Err(SnapshotError::NoHistory {
            path: path.to_path_buf(),
            device,
        });
    }
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

    let live = live_at_start(entries, &segments, &config, &inconsistent)?;
    let (ops, oom_releases) = releases::requests(
        entries,
        Context {
            config: &config,
            expandable,
            live_at_start: live.keys().copied().collect(),
            segments_at_start: start.iter().map(|(&a, &(size, ..))| (a, size)).collect(),
            initial_reserved,
            peak_reserved,
            free_action: free_action(entries),
        },
    );
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
fn free_action(entries: &[Entry]) -> &'static str {
    ["free_completed", "free_requested", "free"]
        .into_iter()
        .find(|a| entries.iter().any(|e| e.action == *a))
        .unwrap_or("free_completed")
}

/// Blocks live when recording began, by address: (size, requested) with the offset left at 0, and
/// whether the size was inferred from the requested size (rather than recorded).
fn live_at_start(
    entries: &[Entry],
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
