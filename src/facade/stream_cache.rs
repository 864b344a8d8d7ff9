//! Per-thread caches of freed buffers, each entry tagged with the stream it was freed on, in front of the
//! strategy's lock: what lets a thread reuse freed memory of its stream without taking that lock, and threads
//! on different (or the same) streams without waiting for each other, or for another stream's driver calls
//! (docs/library.md, "Locking").
//!
//! A cached entry is a block the strategy still counts as allocated: the facade kept it back at `free`,
//! and hands it out again to the next request of exactly the same size on the same stream from the thread
//! that freed it. Reuse on the stream that freed it is safe without any event, as in the strategy itself
//! (stream order), whichever thread allocated the buffer. Entries go back to the strategy when the shard is
//! full (the oldest), and all of them whenever the facade needs the strategy's own view to be exact:
//! statistics, summaries, snapshots, `empty_cache`, `trim`, invariant checks, and before retrying an
//! allocation (or a wake) that ran out of memory. While a snapshot's history records, they keep nothing
//! ([`StreamCaches::suspend`]), so that every alloc and free is recorded.
//!
//! The caches are *on* from the start when eager (`stream_cache_eager`, the Rust library's default).
//! Otherwise they start *off*: every free goes straight to the strategy, so a program that never contends
//! sees exactly the strategy's behaviour, until a thread first finds the strategy's lock taken; from then on
//! every thread's frees are kept back.
//!
//! Shards are the calling thread's (`base::sync::thread_slot`): a thread that frees and asks again takes
//! only its own shard's lock, which other threads take only to read every shard (a drain, the bytes held,
//! a double-free check, invariants). A buffer freed on another thread than its own goes to the freeing
//! thread's shard. Threads share a shard only beyond [`SHARDS`] of them; that costs contention on the
//! shard's lock, never correctness, since entries carry their stream.

use crate::base::sync::{AtomicBool, AtomicUsize, Mutex, thread_slot};
use crate::driver::StreamId;
use crate::strategy::error::InvariantViolation;
use std::collections::VecDeque;
use std::sync::atomic::Ordering;

/// Number of shards (a power of two): one per thread for up to this many threads. Two in loom builds, which
/// model-check the same code with fewer locks to interleave.
const SHARDS: usize = if cfg!(loom) { 2 } else { 64 };
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
    /// `held.entries.len()`, readable without the lock so that an empty shard costs a request one load.
    len: AtomicUsize,
    held: Mutex<Held>,
}

impl Shard {
    fn new() -> Self {
        Self {
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
    /// Whether frees are kept back now. Written only when the caches turn on; read with every request and
    /// free, so it shares no cache line with anything written often.
    on: AtomicBool,
    /// Whether frees are refused, whatever `on` says, while the strategy records every event for a
    /// snapshot's history ([`suspend`](Self::suspend)). Read by `put` under its shard's lock.
    suspended: AtomicBool,
    /// A bug planted on purpose, for `tests/loom.rs` to show that its model catches it: `take` looks the
    /// entry up under one lock and removes it under another, so two requests can get the same buffer.
    #[cfg(loom)]
    seeded_bug: std::sync::atomic::AtomicBool,
}

impl StreamCaches {
    /// Caches of `capacity` bytes per shard (0 turns them off for good), on from the start if `eager`.
    pub(crate) fn new(capacity: u64, eager: bool) -> Self {
        Self {
            shards: (0..SHARDS).map(|_| Shard::new()).collect(),
            capacity,
            on: AtomicBool::new(eager && capacity > 0),
            suspended: AtomicBool::new(false),
            #[cfg(loom)]
            seeded_bug: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Whether a buffer of `size` bytes may be cached.
    #[inline]
    pub(crate) fn cacheable(&self, size: u64) -> bool {
        size <= self.capacity
    }

    /// The calling thread's shard.
    #[inline]
    fn own_shard(&self) -> &Shard {
        &self.shards[thread_slot() % SHARDS]
    }

    /// Whether frees are kept back now.
    #[inline]
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(Ordering::Relaxed)
    }

    /// Starts keeping frees back (threads contend).
    pub(crate) fn turn_on(&self) {
        if self.capacity > 0 && !self.is_on() {
            self.on.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the calling thread's shard holds anything: if not, [`take`](Self::take) finds nothing, and a
    /// request need not ask whether its stream is being captured before trying.
    #[inline]
    pub(crate) fn may_hold(&self) -> bool {
        self.own_shard().len.load(Ordering::Relaxed) != 0
    }

    /// A buffer of exactly `size` bytes freed on `stream` that the calling thread's shard holds, newest
    /// first, if there is one.
    #[inline]
    pub(crate) fn take(&self, stream: StreamId, size: u64) -> Option<u64> {
        let shard = self.own_shard();
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

    /// Keeps the buffer at `ptr` of `size` bytes, freed on `stream`, in the calling thread's shard, pushing
    /// out its oldest entry if the shard is full.
    pub(crate) fn put(&self, stream: StreamId, size: u64, ptr: u64) -> Put {
        if !self.cacheable(size) {
            return Put::Refused;
        }
        let shard = self.own_shard();
        let mut held = shard.held.lock();
        if self.suspended.load(Ordering::Relaxed) {
            return Put::Refused;
        }
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
        evicted.map_or(Put::Kept, Put::KeptEvicting)
    }

    /// Plants the bug of `seeded_bug` (loom builds only).
    #[cfg(loom)]
    pub(crate) fn seed_bug(&self) {
        self.seeded_bug.store(true, Ordering::Relaxed);
    }

    /// Whether `ptr` is cached (freed): a second free of it is the caller's double free.
    pub(crate) fn holds(&self, ptr: u64) -> bool {
        self.is_on()
            && self.shards.iter().any(|shard| {
                shard.len.load(Ordering::Relaxed) != 0
                    && shard.held.lock().entries.iter().any(|e| e.ptr == ptr)
            })
    }

    /// Whether any shard holds a buffer.
    pub(crate) fn any_held(&self) -> bool {
        self.is_on()
            && self
                .shards
                .iter()
                .any(|shard| shard.len.load(Ordering::Relaxed) != 0)
    }

    /// Empties every shard; returns the addresses, for the caller to free to the strategy. The caches stay
    /// on: threads that contended once will likely again, and caches turned off would send their next frees
    /// to a lock that a slow operation may hold.
    pub(crate) fn drain(&self) -> Vec<u64> {
        // A put racing this drain comes after it, as if the free had come after the drain.
        self.empty_shards(|shard| shard.len.load(Ordering::Relaxed) != 0)
    }

    /// Empties the shards that `locks` picks, each under its lock; returns the addresses they held.
    fn empty_shards(&self, locks: impl Fn(&Shard) -> bool) -> Vec<u64> {
        let mut ptrs = Vec::new();
        for shard in self.shards.iter().filter(|shard| locks(shard)) {
            let mut held = shard.held.lock();
            ptrs.extend(held.entries.drain(..).map(|e| e.ptr));
            held.bytes = 0;
            shard.len.store(0, Ordering::Relaxed);
        }
        ptrs
    }

    /// Refuses every free from now on, until [`resume`](Self::resume), and empties every shard; returns the
    /// addresses, for the caller to free to the strategy. While a snapshot's history records, each alloc and
    /// free must reach the strategy, which records it, as PyTorch's allocator records every one.
    ///
    /// Every shard is locked, even one that looks empty: a `put` that took its shard's lock before this
    /// did is drained here, and one that takes it after sees `suspended` (the lock orders them), so no
    /// buffer is left behind.
    pub(crate) fn suspend(&self) -> Vec<u64> {
        self.suspended.store(true, Ordering::Relaxed);
        self.empty_shards(|_| true)
    }

    /// Keeps frees back again, as before [`suspend`](Self::suspend).
    pub(crate) fn resume(&self) {
        self.suspended.store(false, Ordering::Relaxed);
    }

    /// Buffers and bytes held now, over all shards.
    pub(crate) fn held(&self) -> (usize, u64) {
        self.shards.iter().fold((0, 0), |(n, bytes), shard| {
            let held = shard.held.lock();
            (n + held.entries.len(), bytes + held.bytes)
        })
    }

    /// Each shard's counters agree with its entries and stay within its capacity, no address is held twice,
    /// and none of the addresses `live` gives (called with every shard locked, so that no buffer moves
    /// between a cache and the live set meanwhile) is held: what the shards' locks guard, so it holds while
    /// other threads use the caches. (Whether the
    /// caches are on is a hint, read and written without a lock; a stale value only sends a free the slow
    /// way, or lets a double free through `free_raw` go unnoticed while the caches turn on.)
    pub(crate) fn check_invariants(
        &self,
        live: impl FnOnce() -> Vec<u64>,
    ) -> Result<(), InvariantViolation> {
        // Every shard locked at once, in order (no other path holds two), so that a buffer that another
        // thread takes from one shard and frees into another is not seen in both.
        let guards: Vec<_> = self.shards.iter().map(|shard| shard.held.lock()).collect();
        let mut seen = rustc_hash::FxHashSet::default();
        for (shard, held) in self.shards.iter().zip(&guards) {
            let bytes: u64 = held.entries.iter().map(|e| e.size).sum();
            InvariantViolation::check_stats(&[
                ("stream cache bytes", held.bytes, bytes),
                (
                    "stream cache entries",
                    shard.len.load(Ordering::Relaxed) as u64,
                    held.entries.len() as u64,
                ),
            ])?;
            if held.bytes > self.capacity || held.entries.len() > MAX_ENTRIES {
                let addr = held.entries.back().map_or(0, |e| e.ptr);
                return Err(InvariantViolation::StreamCache { addr });
            }
            for entry in &held.entries {
                if !seen.insert(entry.ptr) {
                    return Err(InvariantViolation::StreamCache { addr: entry.ptr });
                }
            }
        }
        match live().into_iter().find(|addr| seen.contains(addr)) {
            Some(addr) => Err(InvariantViolation::StreamCache { addr }),
            None => Ok(()),
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use crate::base::size::MIB;

    const KIB: u64 = 1 << 10;

    #[test]
    fn takes_back_only_the_same_size_on_the_same_stream_newest_first() {
        let caches = StreamCaches::new(MIB, true);
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
        caches.check_invariants(Vec::new).unwrap();
    }

    #[test]
    fn a_thread_takes_only_what_its_own_shard_holds() {
        let caches = StreamCaches::new(MIB, true);
        let s = StreamId(5);
        let other = std::thread::scope(|scope| {
            let put = scope.spawn(|| {
                assert_eq!(caches.put(s, 4 * KIB, 0x1000), Put::Kept);
                thread_slot()
            });
            put.join().unwrap()
        });
        // Another thread's free of the same size and stream is not this thread's to take (unless the two
        // threads' slots share a shard, past `SHARDS` threads made by the test binary)...
        if other % SHARDS != thread_slot() % SHARDS {
            assert_eq!(caches.take(s, 4 * KIB), None);
        }
        assert_eq!(caches.put(s, 4 * KIB, 0x2000), Put::Kept);
        assert_eq!(caches.take(s, 4 * KIB), Some(0x2000));
        // ...and a drain gives both back.
        assert_eq!(caches.put(s, 4 * KIB, 0x2000), Put::Kept);
        let mut ptrs = caches.drain();
        ptrs.sort_unstable();
        assert_eq!(ptrs, [0x1000, 0x2000]);
        caches.check_invariants(Vec::new).unwrap();
    }

    #[test]
    fn a_full_shard_pushes_out_its_oldest_entry() {
        let caches = StreamCaches::new(128 * KIB, true);
        let s = StreamId(7);
        assert_eq!(caches.put(s, 64 * KIB, 0x1000), Put::Kept);
        assert_eq!(caches.put(s, 64 * KIB, 0x2000), Put::Kept);
        assert_eq!(caches.put(s, 64 * KIB, 0x3000), Put::KeptEvicting(0x1000));
        assert_eq!(caches.held(), (2, 128 * KIB));
        assert_eq!(caches.put(s, 256 * KIB, 0x4000), Put::Refused);
        assert!(caches.holds(0x3000) && !caches.holds(0x1000));
        caches.check_invariants(Vec::new).unwrap();
    }

    #[test]
    fn draining_empties_every_shard_and_leaves_the_caches_on() {
        let caches = StreamCaches::new(MIB, false);
        assert!(!caches.is_on());
        caches.turn_on();
        std::thread::scope(|scope| {
            for stream in 0..8 {
                let caches = &caches;
                scope.spawn(move || {
                    let put = caches.put(StreamId(stream), KIB, 0x1000 * (stream + 1));
                    assert_eq!(put, Put::Kept);
                });
            }
        });
        assert!(caches.any_held() && caches.is_on());
        let mut ptrs = caches.drain();
        ptrs.sort_unstable();
        assert_eq!(ptrs, (1..=8).map(|i| 0x1000 * i).collect::<Vec<_>>());
        assert!(!caches.any_held() && caches.is_on());
        assert_eq!(caches.held(), (0, 0));
    }

    #[test]
    fn buffers_over_the_capacity_and_a_zero_capacity_are_never_cached() {
        let off = StreamCaches::new(0, true);
        off.turn_on();
        assert!(!off.cacheable(KIB) && !off.is_on());
        let caches = StreamCaches::new(32 * MIB, true);
        assert!(caches.cacheable(20 * MIB) && !caches.cacheable(32 * MIB + 1));
        assert_eq!(caches.put(StreamId(0), 20 * MIB, 0x1000), Put::Kept);
        assert_eq!(caches.put(StreamId(0), 64 * MIB, 0x2000), Put::Refused);
    }

    #[test]
    fn an_entry_counted_wrong_is_reported() {
        let caches = StreamCaches::new(MIB, true);
        caches.put(StreamId(0), KIB, 0x1000);
        caches.own_shard().held.lock().bytes += 1;
        assert!(matches!(
            caches.check_invariants(Vec::new),
            Err(InvariantViolation::Stat { .. })
        ));
    }
}
