//! Errors at the API boundary, and the typed report of a broken invariant.

use crate::driver::DriverError;
use crate::strategy::config::ConfigError;

pub use crate::strategy::oom::{OutOfMemory, ReclaimStep, StrandedRemedy, Suggestion};

/// What an allocator operation can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The device has no memory left for the request, even after reclaiming the cache and retrying once.
    /// Retryable once the program frees memory.
    #[error(transparent)]
    OutOfMemory(Box<OutOfMemory>),
    /// A request for zero bytes. cuvmm follows `cuMemAlloc`, which rejects size 0, rather than handing out
    /// a pointer that must not be used.
    #[error("cannot allocate 0 bytes")]
    ZeroSize,
    /// A request larger than the device, or so large that rounding it overflows. Never retryable.
    #[error("a request of {requested} bytes can never fit: the device has {capacity} bytes in all")]
    TooLarge {
        /// Bytes asked for.
        requested: u64,
        /// Total bytes of the device.
        capacity: u64,
    },
    /// `free` of an address this allocator did not hand out.
    #[error("free of {addr:#x}, which is not an address this allocator handed out")]
    UnknownAddress {
        /// The address given.
        addr: u64,
    },
    /// `free` of an address inside a block that is already free.
    #[error("double free of {addr:#x}")]
    DoubleFree {
        /// The address given.
        addr: u64,
    },
    /// The allocator does not offer this operation (a [`Strategy`](crate::Strategy) method it does not
    /// implement). Never retryable.
    #[error("{allocator} does not support {what}")]
    Unsupported {
        /// The operation.
        what: &'static str,
        /// The allocator's name.
        allocator: &'static str,
    },
    /// A stream of one device was given to an allocator of another (`Allocator::alloc_on_stream`).
    #[error(
        "a stream of CUDA device {stream_device} was given to the allocator of device {device}"
    )]
    WrongDevice {
        /// The stream's device.
        stream_device: usize,
        /// The allocator's device.
        device: usize,
    },
    /// A private-pool operation named `{0, 0}`, a pool begun twice, or a pool not begun or not live.
    #[error("{operation}: {problem} ({pool})")]
    GraphPool {
        /// The operation (`begin_allocate_to_pool`, `end_allocate_to_pool`, `release_pool`).
        operation: &'static str,
        /// The pool named.
        pool: crate::strategy::graph_pool::GraphPool,
        /// What is wrong with it.
        problem: &'static str,
    },
    /// An operation that must wait for streams or unmap memory (`empty_cache`, `trim`) was asked for while
    /// a CUDA graph is being captured into a private pool: CUDA refuses those calls during a capture, and
    /// making them would invalidate it. Retry once the capture has ended. A sleep or a wake, whose copies
    /// run without the allocator's lock, is refused while any pool is being allocated to, captured or not
    /// (a capture may begin while they copy).
    #[error(
        "{operation} is not possible while a CUDA graph is being captured or a pool is being allocated to \
         (end the capture, or leave the pool, first)"
    )]
    CaptureUnderway {
        /// The operation refused.
        operation: &'static str,
    },
    /// An allocation under a tag that is asleep: its memory has no pages until
    /// [`wake`](crate::Allocator::wake). Retry after waking the tag. (A free of a sleeping tag's memory
    /// succeeds; its memory is free again at the wake.)
    #[error("{operation}: tag {tag:?} is asleep (wake it first)")]
    TagAsleep {
        /// The operation refused (`alloc`).
        operation: &'static str,
        /// The tag.
        tag: String,
    },
    /// A sleep or a wake of a tag whose bytes another thread's sleep or wake is copying now (without the
    /// allocator's lock). Nothing changed; retry once that call has returned.
    #[error("{operation}: tag {tag:?} is being copied by another sleep or wake")]
    TagBusy {
        /// The operation refused (`sleep`, `wake`, `release_host_buffers`).
        operation: &'static str,
        /// The tag.
        tag: String,
    },
    /// [`read_kept`](crate::Allocator::read_kept) of memory of a sleeping tag whose bytes its sleep did not
    /// keep: it fell asleep without them (`keep` false), or the range is not inside the blocks live when it
    /// fell asleep. The memory has no bytes until the wake; a tag that keeps them is put to sleep with
    /// `keep`.
    #[error(
        "read_kept: {len} bytes at {addr:#x} are memory of tag {tag:?}, asleep without those bytes kept"
    )]
    NotKept {
        /// The tag.
        tag: String,
        /// The address asked for.
        addr: u64,
        /// The bytes asked for.
        len: u64,
    },
    /// A sleep refused because pages of the tag's memory are lent, mapped a second time elsewhere under
    /// memory pressure: unmapping them would take memory from live allocations of others. Retry once
    /// those allocations are freed (or with `lend_chunk_pages` off).
    #[error(
        "sleep: {pages} pages of tag {tag:?} are mapped elsewhere too (lent under memory pressure)"
    )]
    TagPagesLent {
        /// The tag.
        tag: String,
        /// Pages lent.
        pages: usize,
    },
    /// Memory that cannot be shared with another process, or shared memory given wrong
    /// ([`crate::strategy::sharing`]).
    #[error(transparent)]
    Sharing(#[from] crate::strategy::sharing::SharingError),
    /// A driver call failed for a reason other than running out of memory.
    #[error("driver call failed: {0}")]
    Driver(#[from] DriverError),
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
}

impl Error {
    /// Whether this is an out-of-memory error (retryable after freeing memory): the allocator's own, or the
    /// driver's before the allocator turned it into one.
    pub fn is_out_of_memory(&self) -> bool {
        match self {
            Error::OutOfMemory(_) => true,
            Error::Driver(err) => err.is_out_of_memory(),
            _ => false,
        }
    }
}

/// A broken invariant found by `check_invariants()`. Each names what it found, so a failing test or fuzz
/// run says what went wrong without a debugger.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InvariantViolation {
    /// Two blocks overlap, or a block does not start where the previous one ended.
    #[error("segment {segment:#x}: expected a block at {expected:#x}, found one at {found:#x}")]
    Tiling {
        /// Start of the segment.
        segment: u64,
        /// Where the next block should start.
        expected: u64,
        /// Where it starts.
        found: u64,
    },
    /// A block is not aligned to the allocator's rounding (to a page in a segment of whole-page requests).
    #[error("block at {addr:#x} is not {align}-byte aligned")]
    Misaligned {
        /// Address of the block.
        addr: u64,
        /// The alignment required.
        align: u64,
    },
    /// Two free blocks are neighbours (they should have merged).
    #[error("free blocks at {first:#x} and {second:#x} are adjacent")]
    AdjacentFree {
        /// The lower block.
        first: u64,
        /// The upper block.
        second: u64,
    },
    /// The free index and the block list disagree.
    #[error("free index disagrees with the block list at {addr:#x}")]
    FreeIndex {
        /// Address of the block.
        addr: u64,
    },
    /// A page touched by a live block is not mapped with access set.
    #[error(
        "page at {page_addr:#x}, touched by the live block at {block:#x}, is not mapped and accessible"
    )]
    LivePageUnmapped {
        /// Address of the page.
        page_addr: u64,
        /// Address of the block.
        block: u64,
    },
    /// A page's count of live blocks touching it is wrong.
    #[error("page at {page_addr:#x}: {counted} live blocks counted, {actual} touch it")]
    PageUsers {
        /// Address of the page.
        page_addr: u64,
        /// What the page map says.
        counted: u32,
        /// What the block list says.
        actual: u32,
    },
    /// A handle is mapped more than once, or both mapped and pooled.
    #[error("{handle} is held twice")]
    HandleHeldTwice {
        /// The handle.
        handle: u64,
    },
    /// The descriptor of an exported handle is kept after the handle was released.
    #[error("an export descriptor is kept for handle#{handle}, which is not held")]
    ExportOutlivesHandle {
        /// The handle.
        handle: u64,
    },
    /// Handles held do not add up: mapped + pooled must equal created - released.
    #[error(
        "{mapped} mapped + {pooled} pooled handles, but {created} created - {released} released"
    )]
    HandleCount {
        /// Handles mapped.
        mapped: u64,
        /// Handles held unmapped.
        pooled: u64,
        /// Handles created.
        created: u64,
        /// Handles released.
        released: u64,
    },
    /// A statistic disagrees with what the block list says.
    #[error("stat {stat}: counter says {counted}, block list says {actual}")]
    Stat {
        /// Name of the statistic.
        stat: &'static str,
        /// The counter's value.
        counted: u64,
        /// The value recomputed from the blocks.
        actual: u64,
    },
    /// More memory is reserved than the memory limit allows (`per_process_memory_fraction`).
    #[error("{reserved} bytes reserved, over the memory limit of {limit}")]
    OverLimit {
        /// Bytes reserved.
        reserved: u64,
        /// The limit.
        limit: u64,
    },
    /// The pending-free list and the block list disagree: a pending block with no outstanding event, or an
    /// event held for a block that is not pending.
    #[error("pending free at {addr:#x}: the pending list and the block list disagree")]
    PendingFree {
        /// Address of the block.
        addr: u64,
    },
    /// A lent page and the lending tables disagree: a lent block not at a page of a chunk's home group, a
    /// second mapping whose chunk does not lend that page, or counts that do not match.
    #[error("lent page at {addr:#x}: the lent blocks, second mappings and lenders disagree")]
    LentPage {
        /// Address of the lent block, second mapping or chunk group.
        addr: u64,
    },
    /// Streams are recorded as users of an address that is not the start of a live block, or the list
    /// names the block's own segment stream or a stream twice.
    #[error("stream uses recorded for {addr:#x} are not those of a live block")]
    StreamUse {
        /// Address recorded.
        addr: u64,
    },
    /// The graph pools and the blocks disagree: a segment of a pool neither live nor released, a pool
    /// being allocated to that is not live, or a deferred free that is not of a live block with streams.
    #[error(
        "graph pool state at {addr:#x}: the pools, their segments and the deferred frees disagree"
    )]
    GraphPool {
        /// Address of the segment or block (0 for a pool with no address).
        addr: u64,
    },
    /// A sleeping tag and its segments disagree: a page mapped once it is asleep, a block placed or freed
    /// while it sleeps, kept bytes that do not match its blocks, or a segment of a tag never named.
    #[error("sleeping tag at {addr:#x}: its segments, blocks and kept bytes disagree")]
    Asleep {
        /// Address of the segment or block (0 for the tag as a whole).
        addr: u64,
    },
    /// A live allocation is indexed but its block is missing or free.
    #[error("live allocation at {addr:#x} has no live block")]
    LostAllocation {
        /// Address of the allocation.
        addr: u64,
    },
    /// A stream cache holds an address twice, in the shard of another stream, or while it is a live raw
    /// allocation.
    #[error("stream cache entry {addr:#x} is held twice, in the wrong shard, or while live")]
    StreamCache {
        /// The cached address.
        addr: u64,
    },
}

impl InvariantViolation {
    /// The first statistic whose counter disagrees with the value recomputed from the blocks:
    /// `(name, counter, recomputed)` triples, checked in order.
    pub fn check_stats(stats: &[(&'static str, u64, u64)]) -> Result<(), InvariantViolation> {
        match stats.iter().find(|(_, counted, actual)| counted != actual) {
            Some(&(stat, counted, actual)) => Err(InvariantViolation::Stat {
                stat,
                counted,
                actual,
            }),
            None => Ok(()),
        }
    }
}
