//! Per-stream caches of freed buffers, in front of the strategy's lock: what lets threads on different
//! streams reuse their own freed memory without waiting for each other, or for another stream's driver
//! calls (docs/DESIGN.md, "Locking").
//!
//! A cached entry is a block the strategy still counts as allocated: the facade kept it back at `free`,
//! and hands it out again to the next request of exactly the same size on the same stream. Reuse on the
//! stream that freed it is safe without any event, as in the strategy itself (stream order). Entries go
//! back to the strategy when the shard is full (the oldest), and all of them whenever the facade needs the
//! strategy's own view to be exact: statistics, summaries, snapshots, `empty_cache`, `trim`, invariant
//! checks, and before retrying an allocation that ran out of memory.
//!
//! A shard starts *inactive*: its streams' frees go straight to the strategy, so a program that never
//! contends sees exactly the strategy's behaviour. The first time one of its streams finds the strategy's
//! lock taken, the shard turns active and keeps freed buffers from then on; so does the shard of any stream
//! that reaches the strategy once another shard is active (threads contend: the stream that held the lock
//! never finds it taken, and would otherwise stay on the strategy's path while the other's cache serves it).
//!
//! Streams share a shard when their ids hash alike; that costs contention on the shard's lock, never
//! correctness, since entries carry their stream.

use crate::base::size::MIB;
use crate::base::sync::{AtomicBool, AtomicUsize, Mutex};
use crate::driver::StreamId;
use crate::strategy::error::InvariantViolation;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// Number of shards (a power of two). Two in loom builds, which model-check the same code with fewer
/// locks to interleave.
const SHARDS: usize = if cfg!(loom) { 2 } else { 16 };
/// Blocks larger than this are never cached: they are PyTorch's large pool, where a request costs more
/// than the lock, and holding them back would strand megabytes.
pub const MAX_CACHED_BLOCK: u64 = MIB;
/// Entries per shard at most: a request scans them, newest first.
const MAX_ENTRIES: usize = 64;

/// A freed buffer kept back for its stream.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Entry {
    stream: StreamId,
    size: u64,
    ptr: u64,
}

#[derive(Debug, Default)]
struct Held {
    /// Oldest first.
    entries: VecDeque<Entry>,
    bytes: u64,
}

/// One shard, on a cache line of its own so that threads on different shards never share one.
#[derive(Debug)]
#[repr(align(128))]
struct Shard {
    /// Whether frees on this shard's streams are kept back.
    active: AtomicBool,
    /// `held.entries.len()`, readable without the lock so that an empty shard costs a request one load.
    len: AtomicUsize,
    held: Mutex<Held>,
}

impl Shard {
    fn new() -> Self {
        Self {
            active: AtomicBool::new(false),
            len: AtomicUsize::new(0),
            held: Mutex::new(Held::default()),
        }
    }
}

/// What [`StreamCaches::put`] did with a freed buffer.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Put {
    /// Kept.
    Kept,
    /// Kept, pushing out the oldest entry, whose address the caller must free to the strategy.
    KeptEvicting(u64),
    /// Not kept (the buffer alone is over the shard's capacity): free it to the strategy.
    Refused,
}

/// The shards, and how many bytes each may hold.
#[derive(Debug)]
pub(crate) struct StreamCaches {
    shards: Box<[Shard]>,
    capacity: u64,
    /// Shards active: 0 (a program that never contends) lets `holds` and `any_held` skip the shards.
    /// Written only when a shard turns active.
    active_shards: AtomicUsize,
    /// A bug planted on purpose, for `tests/loom.rs` to show that its model catches it: `take` looks the
    /// entry up under one lock and removes it under another, so two requests can get the same buffer.
    #[cfg(loom)]
    seeded_bug: std::sync::atomic::AtomicBool,
}

impl StreamCaches {
    /// Caches of `capacity` bytes per shard; 0 turns them off.
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::new()).collect(),
            capacity,
            active_shards: AtomicUsize::new(0),
            #[cfg(loom)]
            seeded_bug: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a buffer of `size` bytes may be cached.
    #[inline]
    pub(crate) fn cacheable(&self, size: u64) -> bool {
        size <= MAX_CACHED_BLOCK && size <= self.capacity
    }

    #[inline]
    fn shard(&self, stream: StreamId) -> &Shard {
        // Fibonacci hashing: stream ids are small integers on the simulator and aligned pointers on CUDA;
        // the top bits of the product spread both.
        let index = stream.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - SHARDS.trailing_zeros());
        &self.shards[index as usize]
    }

    /// Whether frees on `stream` are kept back now.
    #[inline]
    pub(crate) fn is_active(&self, stream: StreamId) -> bool {
        self.shard(stream).active.load(Ordering::Relaxed)
    }

    /// Starts keeping back frees on `stream` (and the streams sharing its shard).
    pub(crate) fn activate(&self, stream: StreamId) {
        if !self.shard(stream).active.swap(true, Ordering::Relaxed) {
            self.active_shards.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A cached buffer of exactly `size` bytes freed on `stream`, newest first, if there is one.
    #[inline]
    pub(crate) fn take(&self, stream: StreamId, size: u64) -> Option<u64> {
        let shard = self.shard(stream);
        if shard.len.load(Ordering::Relaxed) == 0 {
            return None;
        }
        let mut held = shard.held.lock();
        let at = held
            .entries
            .iter()
            .rposition(|e| e.stream == stream && e.size == size)?;
        #[cfg(loom)]
        if self.seeded_bug.load(Ordering::Relaxed) {
            let ptr = held.entries[at].ptr;
            drop(held);
            let mut held = shard.held.lock();
            let last = held.entries.len().saturating_sub(1);
            if let Some(entry) = held.entries.remove(at.min(last)) {
                held.bytes -= entry.size;
            }
            shard.len.store(held.entries.len(), Ordering::Relaxed);
            return Some(ptr);
        }
        let entry = held.entries.remove(at)?;
        held.bytes -= entry.size;
        shard.len.store(held.entries.len(), Ordering::Relaxed);
        Some(entry.ptr)
    }

    /// Keeps the buffer at `ptr` of `size` bytes, freed on `stream`, pushing out the oldest entries while
    /// the shard is over its capacity.
    pub(crate) fn put(&self, stream: StreamId, size: u64, ptr: u64) -> Put {
        if !self.cacheable(size) {
            return Put::Refused;
        }
        let shard = self.shard(stream);
        let mut held = shard.held.lock();
        let mut evicted = None;
        if held.entries.len() == MAX_ENTRIES || held.bytes + size > self.capacity {
            // One out, one in: a full shard stays full, and the caller frees one buffer, as it would have.
            match held.entries.pop_front() {
                Some(old) if held.bytes - old.size + size <= self.capacity => {
                    held.bytes -= old.size;
                    evicted = Some(old.ptr);
                }
                Some(old) => {
                    held.entries.push_front(old);
                    return Put::Refused;
                }
                None => return Put::Refused,
            }
        }
        held.entries.push_back(Entry { stream, size, ptr });
        held.bytes += size;
        shard.len.store(held.entries.len(), Ordering::Relaxed);
        // A shard that holds entries is active.
        if !shard.active.load(Ordering::Relaxed) {
            self.activate(stream);
        }
        evicted.map_or(Put::Kept, Put::KeptEvicting)
    }

    /// Plants the bug of `seeded_bug` (loom builds only).
    #[cfg(loom)]
    pub(crate) fn seed_bug(&self) {
        self.seeded_bug.store(true, Ordering::Relaxed);
    }

    /// Whether `ptr` is cached (freed): a second free of it is the caller's double free.
    pub(crate) fn holds(&self, ptr: u64) -> bool {
        self.active_shards.load(Ordering::Relaxed) != 0
            && self.shards.iter().any(|shard| {
                shard.len.load(Ordering::Relaxed) != 0
                    && shard.held.lock().entries.iter().any(|e| e.ptr == ptr)
            })
    }

    /// Whether any shard is active: threads have contended for the strategy's lock.
    #[inline]
    pub(crate) fn any_active(&self) -> bool {
        self.active_shards.load(Ordering::Relaxed) != 0
    }

    /// Whether any shard holds a buffer.
    pub(crate) fn any_held(&self) -> bool {
        self.active_shards.load(Ordering::Relaxed) != 0
            && self
                .shards
                .iter()
                .any(|shard| shard.len.load(Ordering::Relaxed) != 0)
    }

    /// Empties every shard; returns the addresses, for the caller to free to the strategy. Shards stay
    /// active: a stream that contended once will likely again, and an inactive shard would send its next
    /// frees to a lock that a slow operation may hold.
    pub(crate) fn drain(&self) -> Vec<u64> {
        let mut ptrs = Vec::new();
        for shard in self.shards.iter() {
            // A put racing this drain comes after it, as if the free had come after the drain.
            if shard.len.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let mut held = shard.held.lock();
            ptrs.extend(held.entries.drain(..).map(|e| e.ptr));
            held.bytes = 0;
            shard.len.store(0, Ordering::Relaxed);
        }
        ptrs
    }

    /// Buffers and bytes held now, over all shards.
    pub(crate) fn held(&self) -> (usize, u64) {
        self.shards.iter().fold((0, 0), |(n, bytes), shard| {
            let held = shard.held.lock();
            (n + held.entries.len(), bytes + held.bytes)
        })
    }

    /// Each shard's counters agree with its entries, each entry is in its stream's shard, and no address
    /// is held twice: what each shard's lock guards, so it holds while other threads use the caches. (Whether
    /// a shard is active is a hint, read and written without the lock; a stale value only sends a free or a
    /// request the slow way, or lets a double free through `free_raw` go unnoticed while a drain races it.)
    pub(crate) fn check_invariants(&self) -> Result<(), InvariantViolation> {
        let mut seen = rustc_hash::FxHashSet::default();
        for shard in self.shards.iter() {
            let held = shard.held.lock();
            let bytes: u64 = held.entries.iter().map(|e| e.size).sum();
            InvariantViolation::check_stats(&[
                ("stream cache bytes", held.bytes, bytes),
                (
                    "stream cache entries",
                    shard.len.load(Ordering::Relaxed) as u64,
                    held.entries.len() as u64,
                ),
            ])?;
            for entry in &held.entries {
                if !std::ptr::eq(self.shard(entry.stream), shard) || !seen.insert(entry.ptr) {
                    return Err(InvariantViolation::StreamCache { addr: entry.ptr });
                }
            }
        }
        Ok(())
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    const KIB: u64 = 1 << 10;

    #[test]
    fn takes_back_only_the_same_size_on_the_same_stream_newest_first() {
        let caches = StreamCaches::new(MIB);
        let (s0, s1) = (StreamId(0), StreamId(1));
        assert_eq!(caches.put(s0, 64 * KIB, 0x1000), Put::Kept);
        assert_eq!(caches.put(s0, 64 * KIB, 0x2000), Put::Kept);
        assert_eq!(caches.put(s0, 32 * KIB, 0x3000), Put::Kept);
        assert_eq!(caches.take(s1, 64 * KIB), None);
        assert_eq!(caches.take(s0, 48 * KIB), None);
        assert_eq!(caches.take(s0, 64 * KIB), Some(0x2000));
        assert_eq!(caches.take(s0, 64 * KIB), Some(0x1000));
        assert_eq!(caches.take(s0, 64 * KIB), None);
        assert_eq!(caches.held(), (1, 32 * KIB));
        caches.check_invariants().unwrap();
    }

    #[test]
    fn a_full_shard_pushes_out_its_oldest_entry() {
        let caches = StreamCaches::new(128 * KIB);
        let s = StreamId(7);
        assert_eq!(caches.put(s, 64 * KIB, 0x1000), Put::Kept);
        assert_eq!(caches.put(s, 64 * KIB, 0x2000), Put::Kept);
        assert_eq!(caches.put(s, 64 * KIB, 0x3000), Put::KeptEvicting(0x1000));
        assert_eq!(caches.held(), (2, 128 * KIB));
        assert_eq!(caches.put(s, 256 * KIB, 0x4000), Put::Refused);
        assert!(caches.holds(0x3000) && !caches.holds(0x1000));
        caches.check_invariants().unwrap();
    }

    #[test]
    fn draining_empties_every_shard_and_leaves_it_active() {
        let caches = StreamCaches::new(MIB);
        for stream in 0..40 {
            caches.activate(StreamId(stream));
            assert_eq!(
                caches.put(StreamId(stream), KIB, 0x1000 * (stream + 1)),
                Put::Kept
            );
        }
        assert!(caches.any_held() && caches.is_active(StreamId(3)));
        let mut ptrs = caches.drain();
        ptrs.sort_unstable();
        assert_eq!(ptrs, (1..=40).map(|i| 0x1000 * i).collect::<Vec<_>>());
        assert!(!caches.any_held() && caches.is_active(StreamId(3)));
        assert_eq!(caches.held(), (0, 0));
    }

    #[test]
    fn large_blocks_and_a_zero_capacity_are_never_cached() {
        assert!(!StreamCaches::new(0).cacheable(KIB));
        let caches = StreamCaches::new(64 * MIB);
        assert!(caches.cacheable(MAX_CACHED_BLOCK) && !caches.cacheable(MAX_CACHED_BLOCK + 1));
        assert_eq!(caches.put(StreamId(0), 2 * MIB, 0x1000), Put::Refused);
    }

    #[test]
    fn an_entry_counted_wrong_is_reported() {
        let caches = StreamCaches::new(MIB);
        caches.put(StreamId(0), KIB, 0x1000);
        caches.shard(StreamId(0)).held.lock().bytes += 1;
        assert!(matches!(
            caches.check_invariants(),
            Err(InvariantViolation::Stat { .. })
        ));
    }
}
