//! The C structs of `cuvmm_torch.h` that carry more than a number across the boundary (statistics, an
//! out-of-memory diagnosis, a snapshot), as `#[repr(C)]` mirrors, and their construction from cuvmm's
//! values. Safe Rust: `src/ffi.rs` only writes them to the caller's memory or hands a snapshot over.
//!
//! Counts are `i64` as in PyTorch's `DeviceStats` (a count past `i64::MAX` saturates); addresses and
//! sizes are `u64`; a stream is the caller's `cudaStream_t`, its cuvmm [`StreamId`] as a pointer.

use cuvmm::history::TraceEntry;
use cuvmm::oom::OutOfMemory;
use cuvmm::pool::Pool;
use cuvmm::snapshot::{BlockState, MemorySnapshot};
use cuvmm::stats::StatArray;
use cuvmm::{Stat, Stats, StreamId};
use std::ffi::{c_int, c_void};
use std::ptr;

fn count(n: u64) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

fn stream_ptr(stream: StreamId) -> *mut c_void {
    ptr::without_provenance_mut(stream.0 as usize)
}

/// `cuvmm_stat`: PyTorch's `Stat`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CStat {
    /// The value now.
    pub current: i64,
    /// The highest value since the last peak reset.
    pub peak: i64,
    /// Sum of increases since the last reset of accumulated statistics.
    pub allocated: i64,
    /// Sum of decreases since then.
    pub freed: i64,
}

impl From<Stat> for CStat {
    fn from(s: Stat) -> Self {
        Self {
            current: count(s.current),
            peak: count(s.peak),
            allocated: count(s.allocated),
            freed: count(s.freed),
        }
    }
}

/// `cuvmm_stat_array`: PyTorch's `StatArray`, in its order (aggregate, small pool, large pool).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CStatArray {
    /// All pools.
    pub all: CStat,
    /// Requests of at most 1 MiB.
    pub small_pool: CStat,
    /// The others.
    pub large_pool: CStat,
}

impl CStatArray {
    fn new(all: Stat, small_pool: Stat, large_pool: Stat) -> Self {
        Self {
            all: all.into(),
            small_pool: small_pool.into(),
            large_pool: large_pool.into(),
        }
    }
}

impl From<StatArray> for CStatArray {
    fn from(array: StatArray) -> Self {
        Self::new(
            array.all,
            array.pool[Pool::Small.index()],
            array.pool[Pool::Large.index()],
        )
    }
}

/// `cuvmm_private_pool_stat`: one private pool's reserved bytes (an entry of PyTorch's
/// `reserved_bytes_by_private_pools`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CPrivatePoolStat {
    /// The pool's id, first half.
    pub pool_a: u64,
    /// The pool's id, second half.
    pub pool_b: u64,
    /// Its reserved bytes.
    pub reserved_bytes: CStatArray,
}

/// `cuvmm_device_stats`: PyTorch's `DeviceStats`, field for field, then cuvmm's largest free block.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CDeviceStats {
    /// Live allocations.
    pub allocation: CStatArray,
    /// Segments.
    pub segment: CStatArray,
    /// Live and pending allocations.
    pub active: CStatArray,
    /// Free blocks that share a page with an active one.
    pub inactive_split: CStatArray,
    /// Bytes of live allocations.
    pub allocated_bytes: CStatArray,
    /// Bytes held from the driver (the pools' rows leave out pooled handles, which belong to no pool).
    pub reserved_bytes: CStatArray,
    /// Bytes of live and pending allocations.
    pub active_bytes: CStatArray,
    /// Bytes of touched pages no active block uses.
    pub inactive_split_bytes: CStatArray,
    /// Bytes asked for.
    pub requested_bytes: CStatArray,
    /// Allocations served after releasing the cache.
    pub num_alloc_retries: i64,
    /// Allocations that failed with out-of-memory.
    pub num_ooms: i64,
    /// Live allocations of at least `max_split_size`.
    pub oversize_allocations: CStat,
    /// Always 0: cuvmm's segments are virtual reservations.
    pub oversize_segments: CStat,
    /// Stream synchronizations.
    pub num_sync_all_streams: i64,
    /// Physical allocations made.
    pub num_device_alloc: i64,
    /// Physical allocations given back.
    pub num_device_free: i64,
    /// `max_split_size_mb` in bytes; -1 when unset (PyTorch's `SIZE_MAX` as an `int64_t`).
    pub max_split_size: i64,
    /// The largest request served now without a driver call.
    pub largest_free_block: i64,
}

impl CDeviceStats {
    /// The statistics, with the configured `max_split_size` (`None`: unset).
    pub fn new(s: &Stats, max_split_size: Option<u64>) -> Self {
        let (small, large) = (&s.small_pool, &s.large_pool);
        let array = |all, small, large| CStatArray::new(all, small, large);
        Self {
            allocation: array(s.allocation, small.allocation, large.allocation),
            segment: array(s.segment, small.segment, large.segment),
            active: array(s.active, small.active, large.active),
            inactive_split: array(s.inactive_split, small.inactive_split, large.inactive_split),
            allocated_bytes: array(
                s.allocated_bytes,
                small.allocated_bytes,
                large.allocated_bytes,
            ),
            reserved_bytes: array(s.reserved_bytes, small.reserved_bytes, large.reserved_bytes),
            active_bytes: array(s.active_bytes, small.active_bytes, large.active_bytes),
            inactive_split_bytes: array(
                s.inactive_split_bytes,
                small.inactive_split_bytes,
                large.inactive_split_bytes,
            ),
            requested_bytes: array(
                s.requested_bytes,
                small.requested_bytes,
                large.requested_bytes,
            ),
            num_alloc_retries: count(s.num_alloc_retries),
            num_ooms: count(s.num_ooms),
            oversize_allocations: s.oversize_allocations.into(),
            oversize_segments: s.oversize_segments.into(),
            num_sync_all_streams: count(s.num_synchronizations),
            num_device_alloc: count(s.num_device_alloc),
            num_device_free: count(s.num_device_free),
            max_split_size: max_split_size.map_or(-1, count),
            largest_free_block: count(s.largest_free_block),
        }
    }
}

/// `cuvmm_oom_info`: the numbers of an out-of-memory failure, for PyTorch's out-of-memory observers.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct COomInfo {
    /// Bytes asked for.
    pub requested: u64,
    /// Bytes the allocator tried to obtain (the rounded request).
    pub alloc_size: u64,
    /// The device's memory.
    pub device_total: u64,
    /// What the device reported free (for a request larger than the device, which is not asked: the bytes
    /// cuvmm does not hold).
    pub device_free: u64,
    /// The memory limit (`set_per_process_memory_fraction`); 0 when none is set.
    pub allowed: u64,
    /// Bytes of live allocations.
    pub allocated: u64,
    /// Bytes held from the driver.
    pub reserved: u64,
}

impl From<&OutOfMemory> for COomInfo {
    fn from(oom: &OutOfMemory) -> Self {
        Self {
            requested: oom.requested,
            alloc_size: oom.alloc_size,
            device_total: oom.device_total,
            device_free: oom.device_free,
            allowed: oom.allowed.unwrap_or(0),
            allocated: oom.allocated,
            reserved: oom.reserved,
        }
    }
}

/// `cuvmm_block_info.state`: free.
pub const BLOCK_INACTIVE: c_int = 0;
/// `cuvmm_block_info.state`: handed out.
pub const BLOCK_ACTIVE_ALLOCATED: c_int = 1;
/// `cuvmm_block_info.state`: freed, waiting for other streams' work.
pub const BLOCK_ACTIVE_PENDING_FREE: c_int = 2;

/// `cuvmm_segment_info`: one segment of a snapshot; its blocks are `blocks[first_block ..
/// first_block + num_blocks]` of the snapshot.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CSegmentInfo {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub total_size: u64,
    /// Bytes of allocated blocks.
    pub allocated_size: u64,
    /// Bytes of active blocks.
    pub active_size: u64,
    /// Bytes the owners of active blocks asked for.
    pub requested_size: u64,
    /// Its stream.
    pub stream: *mut c_void,
    /// Nonzero for the large pool.
    pub is_large: c_int,
    /// Nonzero for part of an expandable reservation (always, for cuvmm).
    pub is_expandable: c_int,
    /// The private pool (`MempoolId_t`) that owns it; `{0, 0}`: none.
    pub pool_a: u64,
    /// The second half of the pool id.
    pub pool_b: u64,
    /// Index of its first block in the snapshot's blocks.
    pub first_block: usize,
    /// Number of its blocks.
    pub num_blocks: usize,
}

/// `cuvmm_block_info`: one block of a segment.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CBlockInfo {
    /// Start address.
    pub address: u64,
    /// Bytes.
    pub size: u64,
    /// Bytes its owner asked for (0 for a free block).
    pub requested_size: u64,
    /// `BLOCK_*`.
    pub state: c_int,
}

/// `cuvmm_trace_entry`: one recorded event.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CTraceEntry {
    /// PyTorch's `TraceEntry::Action` value (alloc 0, free_requested 1, free_completed 2, segment_alloc 3,
    /// segment_free 4, segment_map 5, segment_unmap 6, snapshot 7, oom 8).
    pub action: c_int,
    /// The address; for `oom`, the bytes the device reported free (as PyTorch).
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// The stream.
    pub stream: *mut c_void,
    /// When it happened: microseconds since the Unix epoch (PyTorch's `time_us`).
    pub time_us: i64,
    /// The private pool of the memory (PyTorch's `mempool_`; for `oom`, the pool asked of), `{0, 0}` for
    /// none.
    pub pool_a: u64,
    /// The pool id's second half.
    pub pool_b: u64,
}

impl From<&TraceEntry> for CTraceEntry {
    fn from(e: &TraceEntry) -> Self {
        Self {
            action: trace_action(e.action),
            addr: e.device_free.unwrap_or(e.addr),
            size: e.size,
            stream: stream_ptr(e.stream),
            time_us: i64::try_from(e.time_us).unwrap_or(i64::MAX),
            pool_a: e.pool.0,
            pool_b: e.pool.1,
        }
    }
}

/// `cuvmm_snapshot`: what a caller reads. Points into the [`OwnedSnapshot`] that holds it.
#[repr(C)]
#[derive(Debug)]
pub struct CSnapshot {
    /// The segments, in address order.
    pub segments: *const CSegmentInfo,
    /// Their number.
    pub num_segments: usize,
    /// Every segment's blocks, one segment after the other.
    pub blocks: *const CBlockInfo,
    /// Their number.
    pub num_blocks: usize,
    /// The recorded events of the device, oldest first (none while recording is off).
    pub traces: *const CTraceEntry,
    /// Their number.
    pub num_traces: usize,
}

/// A snapshot handed to C: the view first (so a pointer to this is a pointer to it), then the arrays it
/// points into, which stay where they are while this lives.
#[repr(C)]
#[derive(Debug)]
pub struct OwnedSnapshot {
    view: CSnapshot,
    segments: Box<[CSegmentInfo]>,
    blocks: Box<[CBlockInfo]>,
    traces: Box<[CTraceEntry]>,
}

impl OwnedSnapshot {
    /// The snapshot of one allocator: its events are the last of `device_traces` (indexed by the driver's
    /// ordinal, which for a simulated device is 0 whatever device number the registry gave it).
    pub fn new(snapshot: &MemorySnapshot) -> Self {
        let mut segments = Vec::with_capacity(snapshot.segments.len());
        let mut blocks = Vec::new();
        for seg in &snapshot.segments {
            segments.push(CSegmentInfo {
                address: seg.address,
                total_size: seg.total_size,
                allocated_size: seg.allocated_size(),
                active_size: seg.active_size(),
                requested_size: seg.requested_size(),
                stream: stream_ptr(seg.stream),
                is_large: c_int::from(seg.pool == cuvmm::pool::Pool::Large),
                is_expandable: c_int::from(seg.is_expandable),
                pool_a: seg.graph_pool.0,
                pool_b: seg.graph_pool.1,
                first_block: blocks.len(),
                num_blocks: seg.blocks.len(),
            });
            blocks.extend(seg.blocks.iter().map(|b| CBlockInfo {
                address: b.address,
                size: b.size,
                requested_size: b.requested_size,
                state: match b.state {
                    BlockState::Inactive => BLOCK_INACTIVE,
                    BlockState::ActiveAllocated => BLOCK_ACTIVE_ALLOCATED,
                    BlockState::ActivePendingFree => BLOCK_ACTIVE_PENDING_FREE,
                },
            }));
        }
        let traces: Box<[CTraceEntry]> = snapshot
            .device_traces
            .last()
            .into_iter()
            .flatten()
            .map(CTraceEntry::from)
            .collect();
        let (segments, blocks) = (segments.into_boxed_slice(), blocks.into_boxed_slice());
        let view = CSnapshot {
            segments: segments.as_ptr(),
            num_segments: segments.len(),
            blocks: blocks.as_ptr(),
            num_blocks: blocks.len(),
            traces: traces.as_ptr(),
            num_traces: traces.len(),
        };
        Self {
            view,
            segments,
            blocks,
            traces,
        }
    }

    /// The segments.
    pub fn segments(&self) -> &[CSegmentInfo] {
        &self.segments
    }

    /// The blocks.
    pub fn blocks(&self) -> &[CBlockInfo] {
        &self.blocks
    }

    /// The recorded events.
    pub fn traces(&self) -> &[CTraceEntry] {
        &self.traces
    }
}

fn trace_action(action: cuvmm::history::TraceAction) -> c_int {
    use cuvmm::history::TraceAction::*;
    match action {
        Alloc => 0,
        FreeRequested => 1,
        FreeCompleted => 2,
        SegmentAlloc => 3,
        SegmentFree => 4,
        SegmentMap => 5,
        SegmentUnmap => 6,
        Oom => 8,
    }
}

/// `cuvmm_pool_block`: a live block of a private pool, as a checkpoint keeps it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CPoolBlock {
    /// Where it starts.
    pub address: u64,
    /// Its size, rounded as cuvmm rounded it.
    pub size: u64,
    /// The size its allocation asked for.
    pub requested_size: u64,
}

impl From<cuvmm::PoolBlock> for CPoolBlock {
    fn from(b: cuvmm::PoolBlock) -> Self {
        Self {
            address: b.addr,
            size: b.size,
            requested_size: b.requested,
        }
    }
}

impl From<CPoolBlock> for cuvmm::PoolBlock {
    fn from(b: CPoolBlock) -> Self {
        Self {
            addr: b.address,
            size: b.size,
            requested: b.requested_size,
        }
    }
}

/// `cuvmm_foreign_segment`: a segment of a pool with an allocator of its own, to give back to it.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CForeignSegment {
    /// The pool's id, first half.
    pub pool_a: u64,
    /// The pool's id, second half.
    pub pool_b: u64,
    /// Where the segment starts.
    pub address: u64,
    /// Its size.
    pub size: u64,
}
