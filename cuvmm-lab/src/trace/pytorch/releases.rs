//! Which of PyTorch's releases of memory were the program's `torch.cuda.empty_cache()`.
//!
//! A snapshot has no entry for `empty_cache`: it shows only as a burst of `segment_free` entries
//! (`segment_unmap` with expandable segments). PyTorch's allocator frees segments on its own too, always
//! inside `malloc`, when a request finds no cached block: `garbage_collect_cached_blocks` (with
//! `garbage_collection_threshold` set), then, after a `cudaMalloc` that failed, `release_available_cached_blocks`
//! and `release_cached_blocks`, followed by the retried `cudaMalloc` (a `segment_alloc` or `segment_map`,
//! then the request's `alloc`) or by an `oom` entry. So a burst (consecutive `segment_free`/`segment_unmap`
//! entries) is one `empty_cache`, unless:
//!
//! - a freed range holds a block that is live at that moment (PyTorch frees only whole free segments and
//!   unmaps only free pages, so the snapshot is not what it seems: the burst is left unexplained);
//! - without expandable segments, it leaves a segment that holds no live block (`empty_cache` frees every
//!   such segment): garbage collection if `garbage_collection_threshold` is set, else, with
//!   `max_split_size` set and a new segment right after it, `release_available_cached_blocks` before a
//!   retried `cudaMalloc` (out of memory); otherwise unexplained;
//! - an `oom` entry follows it: an out-of-memory release;
//! - it has the shape of `malloc`'s growth path, a new segment right after it whose size is the one the
//!   next request needs (its `get_allocation_size`; any size with expandable segments), and that request
//!   could not have been served by the memory the burst released (a freed segment of the request's stream
//!   and pool at least as large as the rounded request, within the oversize rules: then `malloc` would have
//!   taken it and never reached `cudaMalloc`), and either
//!   - `garbage_collection_threshold` is set and every freed segment is a large-pool one (what garbage
//!     collection frees), or
//!   - the reserved bytes before the burst plus the new segment exceed the most PyTorch ever held
//!     (`peak_reserved`), which the device evidently had room for: the `cudaMalloc` before the burst could
//!     have failed (an out-of-memory release). Otherwise it would have succeeded, and the burst was
//!     `empty_cache`.
//!
//! Frames naming `emptyCache` decide when they can be read (serde-pickle turns the strings the pickle memo
//! shares, frame names among them, into `None`, so they rarely can).

use super::TraceOp;
use super::snapshot::Entry;
use crate::pytorch_model::rules::{self, SMALL_BUFFER};
use cuvmm::driver::StreamId;
use cuvmm::strategy::config::Config;
use cuvmm::strategy::pool::Pool;
use std::collections::{BTreeMap, BTreeSet, HashSet};

/// What a burst of releases was.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Release {
    /// The program called `torch.cuda.empty_cache()`.
    EmptyCache,
    /// PyTorch released cached blocks because a device allocation failed.
    OutOfMemory,
    /// PyTorch's garbage collection (`garbage_collection_threshold`).
    GarbageCollection,
    /// No rule of PyTorch's explains it: a freed range held a live block, or (without garbage collection
    /// or `max_split_size`) the burst left a free segment cached.
    Unexplained,
}

/// What [`requests`] needs to know of the snapshot besides its entries.
pub struct Context<'a> {
    /// The configuration PyTorch ran with.
    pub config: &'a Config,
    /// Whether PyTorch ran with expandable segments.
    pub expandable: bool,
    /// Addresses of the blocks live when recording began.
    pub live_at_start: BTreeSet<u64>,
    /// The segments held when recording began: address to bytes.
    pub segments_at_start: BTreeMap<u64, u64>,
    /// Bytes reserved when recording began.
    pub initial_reserved: u64,
    /// The most bytes reserved at once during the trace.
    pub peak_reserved: u64,
    /// The action that returns a block to the cache (`free_completed`, or in older versions another).
    pub free_action: &'a str,
}

/// The requests in order, with one [`TraceOp::EmptyCache`] for each burst of releases that was
/// `empty_cache`, and whether any release came from out-of-memory (a burst classified so, or an `oom`
/// entry).
pub fn requests(entries: &[Entry], cx: Context<'_>) -> (Vec<TraceOp>, bool) {
    let mut ops = Vec::new();
    let mut oom_releases = false;
    let mut live = cx.live_at_start.clone();
    let mut segments = cx.segments_at_start.clone();
    let mut reserved = cx.initial_reserved;
    let mut i = 0;
    while i < entries.len() {
        let e = &entries[i];
        match e.action.as_str() {
            "alloc" => {
                live.insert(e.addr);
                // PyTorch records no 0-byte allocation (it hands out null without one); a file that has one
                // is read as asking for a byte, as every replay of it can serve.
                ops.push(TraceOp::Alloc {
                    addr: e.addr,
                    size: e.size.max(1),
                    stream: StreamId(e.stream),
                });
            }
            a if a == cx.free_action => {
                live.remove(&e.addr);
                ops.push(TraceOp::Free { addr: e.addr });
            }
            "segment_alloc" | "segment_map" => {
                reserved = reserved.saturating_add(e.size);
                if e.action == "segment_alloc" {
                    segments.insert(e.addr, e.size);
                }
            }
            "segment_free" | "segment_unmap" => {
                let end = entries[i..]
                    .iter()
                    .position(|x| !is_release(x))
                    .map_or(entries.len(), |n| i + n);
                let state = State {
                    live: &live,
                    segments: &segments,
                    reserved,
                };
                match classify(entries, i, end, &state, &cx) {
                    Release::EmptyCache => ops.push(TraceOp::EmptyCache),
                    Release::OutOfMemory => oom_releases = true,
                    Release::GarbageCollection | Release::Unexplained => {}
                }
                reserved =
                    reserved.saturating_sub(entries[i..end].iter().map(|x| x.size).sum::<u64>());
                for x in entries[i..end]
                    .iter()
                    .filter(|x| x.action == "segment_free")
                {
                    segments.remove(&x.addr);
                }
                i = end;
                continue;
            }
            "oom" => oom_releases = true,
            _ => {}
        }
        i += 1;
    }
    (ops, oom_releases)
}

fn is_release(e: &Entry) -> bool {
    e.action == "segment_free" || e.action == "segment_unmap"
}

/// PyTorch's state just before a burst.
pub struct State<'a> {
    /// Addresses of the live blocks.
    pub live: &'a BTreeSet<u64>,
    /// The segments (without expandable segments): address to bytes.
    pub segments: &'a BTreeMap<u64, u64>,
    /// Bytes reserved.
    pub reserved: u64,
}

impl State<'_> {
    fn holds_live(&self, addr: u64, size: u64) -> bool {
        self.live
            .range(addr..addr.saturating_add(size))
            .next()
            .is_some()
    }
}

/// What the burst `entries[start..end]` was, from PyTorch's state just before it.
pub fn classify(
    entries: &[Entry],
    start: usize,
    end: usize,
    state: &State<'_>,
    cx: &Context<'_>,
) -> Release {
    let burst = &entries[start..end];
    if burst.iter().any(|e| state.holds_live(e.addr, e.size)) {
        return Release::Unexplained;
    }
    let next = entries.get(end);
    let grows = |x: &Entry| x.action == "segment_alloc" || x.action == "segment_map";
    if !cx.expandable {
        let freed: HashSet<u64> = burst.iter().map(|e| e.addr).collect();
        let leaves_free = state
            .segments
            .iter()
            .any(|(&a, &size)| !freed.contains(&a) && !state.holds_live(a, size));
        if leaves_free {
            return if cx.config.garbage_collection_threshold.is_some() {
                Release::GarbageCollection
            } else if cx.config.max_split_size.is_some() && next.is_some_and(grows) {
                Release::OutOfMemory
            } else {
                Release::Unexplained
            };
        }
    }
    if let Some(by_frames) = burst.iter().find_map(|e| e.from_empty_cache) {
        return if by_frames {
            Release::EmptyCache
        } else if entries.get(end).is_some_and(|x| x.action == "oom") {
            Release::OutOfMemory
        } else if cx.config.garbage_collection_threshold.is_some() {
            Release::GarbageCollection
        } else {
            Release::OutOfMemory
        };
    }
    let Some(next) = next else {
        return Release::EmptyCache;
    };
    if next.action == "oom" {
        return Release::OutOfMemory;
    }
    if !grows(next) {
        // Every release of PyTorch's own is followed by the retried device allocation or an `oom`.
        return Release::EmptyCache;
    }
    // The request the new segment was made for: the first `alloc` after the growth.
    let Some(request) = entries[end..]
        .iter()
        .find(|x| !grows(x))
        .filter(|x| x.action == "alloc")
    else {
        return Release::EmptyCache;
    };
    let Some(rounded) = rules::round_size(request.size, &cx.config.roundup_power2_divisions) else {
        return Release::EmptyCache;
    };
    let pool = rules::pool_for(rounded);
    if !cx.expandable && rules::allocation_size(rounded) != Some(next.size) {
        return Release::EmptyCache;
    }
    let max_split = cx.config.max_split_size.unwrap_or(u64::MAX);
    let servable = burst.iter().any(|e| {
        e.stream == request.stream
            && pool_of(e.size) == pool
            && e.size >= rounded
            && rules::oversize_allows(rounded, e.size, max_split, cx.config.max_non_split_rounding)
    });
    if servable {
        return Release::EmptyCache;
    }
    if cx.config.garbage_collection_threshold.is_some()
        && !cx.expandable
        && burst.iter().all(|e| pool_of(e.size) == Pool::Large)
    {
        return Release::GarbageCollection;
    }
    if state.reserved.saturating_add(next.size) > cx.peak_reserved {
        Release::OutOfMemory
    } else {
        Release::EmptyCache
    }
}

/// The pool of a freed segment: the small pool's segments are 2 MiB, and no large-pool one is.
fn pool_of(size: u64) -> Pool {
    if size == SMALL_BUFFER {
        Pool::Small
    } else {
        Pool::Large
    }
}
