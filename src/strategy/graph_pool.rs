//! CUDA graphs' private pools, as the strategies and the facade name them: [`GraphPool`], the id of a pool
//! (PyTorch's `MempoolId_t`), and [`StreamFilter`], which streams allocate to it while it is begun.
//!
//! A CUDA graph bakes the addresses its kernels use into the graph, so memory a graph uses must stay where
//! it is, mapped, and out of everyone else's hands for as long as the graph lives, whether it is replaying
//! or idle. Allocations made while a graph is captured therefore come from a *private pool*: memory freed
//! inside the pool is reused only by the pool, and nothing of a live pool is unmapped, lent, compacted or
//! given to another stream or pool. The program says when a pool starts and stops receiving allocations
//! (`begin_allocate_to_pool` / `end_allocate_to_pool`, around a capture) and when no graph uses it any more
//! (`release_pool`, once per begin): PyTorch's `CUDAGraph` makes exactly these calls.

use crate::driver::StreamId;
use std::fmt;

/// The id of a private pool: PyTorch's `MempoolId_t`, a pair of integers (`{graph id, 0}` for a graph's
/// own pool, `{0, n}` for a pool made by `graph_pool_handle()`). `{0, 0}` names no pool.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub struct GraphPool(pub u64, pub u64);

impl GraphPool {
    /// `{0, 0}`: no pool. Refused by every pool operation.
    pub const NONE: GraphPool = GraphPool(0, 0);

    /// The pool cuvmm makes for a capture it was not told of (found by a capture query at an allocation):
    /// `{u64::MAX, capture id}`, a range PyTorch never hands out.
    pub fn implicit(capture_id: u64) -> GraphPool {
        GraphPool(u64::MAX, capture_id)
    }

    /// Whether this is a pool cuvmm made for a capture it was not told of.
    pub fn is_implicit(self) -> bool {
        self.0 == u64::MAX
    }
}

impl fmt::Display for GraphPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "graph pool ({}, {})", self.0, self.1)
    }
}

/// A live block of a private pool: what a checkpoint of the pool keeps of it, so that the pool can be put
/// back as it was (PyTorch's cudagraph trees checkpoint a pool after each recording and put it back before
/// recording another branch).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PoolBlock {
    /// Where the block starts.
    pub addr: u64,
    /// Its size, rounded as the allocator rounded it.
    pub size: u64,
    /// The size its allocation asked for.
    pub requested: u64,
}

/// Which streams allocate to a pool while it is begun.
pub enum StreamFilter {
    /// These streams.
    Streams(Vec<StreamId>),
    /// The streams being captured by the capture with this id (`cuStreamGetCaptureInfo`'s id): what
    /// PyTorch's `CUDAGraph` passes. Asks the driver at each allocation while the pool is begun.
    Capture(u64),
    /// A function of the program's (the C ABI's callback). Called with the allocator's lock held: it must
    /// not call the allocator.
    Custom(Box<dyn Fn(StreamId) -> bool + Send>),
}

impl fmt::Debug for StreamFilter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StreamFilter::Streams(streams) => f.debug_tuple("Streams").field(streams).finish(),
            StreamFilter::Capture(id) => f.debug_tuple("Capture").field(id).finish(),
            StreamFilter::Custom(_) => f.write_str("Custom(..)"),
        }
    }
}
