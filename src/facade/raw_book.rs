//! What the facade knows of live raw allocations (`Allocator::alloc_raw`, the C ABI's and PyTorch's
//! entry point): each one's size and stream, so that `free_raw` can keep the block back in its stream's
//! cache exactly as a [`DeviceBuffer`](crate::DeviceBuffer)'s drop does, without the strategy's lock
//! (docs/library.md, "Locking").
//!
//! A block is entered only when it could be cached at its free: its stream's cache shard is active (its
//! stream has contended for the strategy's lock), its size is one the caches keep, and no CUDA graph
//! capture was underway when it was allocated (its memory may be a private pool's). Every other raw block
//! is freed to the strategy as before, so a program that never contends pays one relaxed load per free and
//! sees exactly the strategy.
//!
//! The book is sharded by address, each shard on a cache line of its own with its own lock, so that threads
//! allocating on different streams (hence different addresses) rarely share a lock, and never the
//! strategy's.

use crate::base::sync::{AtomicBool, Mutex};
use crate::driver::StreamId;
use rustc_hash::FxHashMap;
use std::sync::atomic::Ordering;

/// Number of shards (a power of two): enough that the few addresses each thread keeps reusing rarely share
/// one with another thread's. Two in loom builds, as the stream caches.
const SHARDS: usize = if cfg!(loom) { 2 } else { 64 };

/// A live raw allocation the stream caches may keep back when it is freed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawBlock {
    /// The bytes asked for.
    pub(crate) size: u64,
    /// The stream it was allocated for: the only stream whose requests may reuse it without an event.
    pub(crate) stream: StreamId,
}

/// One shard, on a cache line of its own.
#[derive(Debug)]
#[repr(align(128))]
struct Shard {
    blocks: Mutex<FxHashMap<u64, RawBlock>>,
}

/// Live raw allocations by address.
#[derive(Debug)]
pub(crate) struct RawBook {
    /// No count of entries beside them: a counter every thread writes at every allocation would be the
    /// one cache line all of them share.
    shards: Box<[Shard]>,
    /// Whether anything was ever entered, so that a program whose streams never contend pays one load per
    /// free. Set before the first insert by the inserting thread and never cleared: whoever frees an address
    /// got it from that thread, after the insert, so it reads `true` (write-read coherence), even relaxed.
    entered: AtomicBool,
}

impl RawBook {
    pub(crate) fn new() -> Self {
        Self {
            shards: (0..SHARDS)
                .map(|_| Shard {
                    blocks: Mutex::new(FxHashMap::default()),
                })
                .collect(),
            entered: AtomicBool::new(false),
        }
    }

    #[inline]
    fn shard(&self, ptr: u64) -> &Shard {
        // Addresses are 512-byte aligned: drop those bits, then Fibonacci hashing spreads the rest.
        let index =
            (ptr >> 9).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARDS.trailing_zeros());
        &self.shards[index as usize]
    }

    /// Enters the live allocation at `ptr`. Returns the entry it replaced: some only if the same address
    /// was handed out twice, which is a broken invariant the caller reports.
    pub(crate) fn insert(&self, ptr: u64, block: RawBlock) -> Option<RawBlock> {
        if !self.entered.load(Ordering::Relaxed) {
            self.entered.store(true, Ordering::Relaxed);
        }
        self.shard(ptr).blocks.lock().insert(ptr, block)
    }

    /// Removes and returns the entry of `ptr`, if the allocation is in the book.
    #[inline]
    pub(crate) fn remove(&self, ptr: u64) -> Option<RawBlock> {
        if !self.entered.load(Ordering::Relaxed) {
            return None;
        }
        self.shard(ptr).blocks.lock().remove(&ptr)
    }

    /// Every address in the book, for invariant checks.
    pub(crate) fn addresses(&self) -> Vec<u64> {
        self.shards
            .iter()
            .flat_map(|shard| shard.blocks.lock().keys().copied().collect::<Vec<_>>())
            .collect()
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn an_entry_is_removed_once() {
        let book = RawBook::new();
        let block = RawBlock {
            size: 4096,
            stream: StreamId(3),
        };
        assert_eq!(book.remove(0x1000), None);
        assert_eq!(book.insert(0x1000, block), None);
        assert_eq!(book.insert(0x2000, block), None);
        assert_eq!(book.remove(0x1000), Some(block));
        assert_eq!(book.remove(0x1000), None);
        assert_eq!(book.addresses(), vec![0x2000]);
        assert_eq!(book.insert(0x2000, block), Some(block));
    }
}
