//! Memory the caller holds back from the allocator: blocks still allocated here that the caller keeps for
//! reuse (the facade's stream caches, `facade/stream_cache.rs`) and gives back when a request would
//! otherwise run out of memory. A request that runs out frees them and tries once more, as part of its one
//! retry (`request.rs`), so that no second release of the cache and no second out-of-memory are counted.

use std::fmt::Debug;

/// Memory the caller keeps back from the allocator and would give back rather than see a request run out
/// of memory: blocks still allocated here, which the caller holds for reuse (the facade's stream caches).
pub(crate) trait HeldBack: Debug + Send {
    /// Whether anything is held back now.
    fn any(&self) -> bool;

    /// Gives everything held back up: the addresses, for the allocator to free.
    fn take_all(&self) -> Vec<u64>;
}
