//! The facade: a thread-safe [`Allocator`] handle around any [`Strategy`], and
//! [`DeviceBuffer`](crate::DeviceBuffer), which frees its memory when dropped.
//!
//! The strategies are plain `&mut self` state machines; the facade is the only place that locks. One
//! `parking_lot::Mutex` guards the strategy: every operation on it holds the lock for a few microseconds of
//! bookkeeping, plus driver calls on the cold paths (growth, compaction, release). In front of it, per-thread
//! stream caches (`facade/stream_cache.rs`) keep freed buffers back for their stream (from the start, or once
//! threads have contended for that lock), so that steady-state reuse on a stream takes no lock another thread
//! holds and never waits for another stream's driver calls (docs/library.md, "Locking").

use crate::base::sync::{self, Arc, AtomicU64, AtomicUsize, Mutex};
use crate::driver::{CaptureProbe, CaptureStatus, Driver, StreamId};
use crate::expandable::{Expandable, HeldBack};
use crate::facade::raw_book::{RawBlock, RawBook};
use crate::facade::stream_cache::{Put, StreamCaches};
use crate::facade::thread_handles::ThreadHandles;
use crate::strategy::Strategy;
use crate::strategy::capabilities::{Controls, GraphPools, Peers, Snapshots, StreamUses};
use crate::strategy::config::Config;
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use crate::strategy::history::TraceEntry;
use crate::strategy::stats::Stats;
use rustc_hash::FxHashSet;
use std::fmt;
use std::ops::DerefMut;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Bytes each stream cache shard may hold unless configured (`stream_cache_mb`).
pub const DEFAULT_STREAM_CACHE: u64 = crate::strategy::config::DEFAULT_STREAM_CACHE;

/// How long [`Allocator::begin_allocate_to_pool`] waits for a sleep's or a wake's copies: far longer than
/// any copy at a link's speed, so that only copies that will never end (a thread that panicked in them)
/// reach it.
const COPIES_WAIT_LIMIT: Duration = Duration::from_secs(600);

struct Shared<S> {
    strategy: Mutex<S>,
    /// Shared with the strategy when it takes them back itself on out-of-memory ([`CachedBuffers`]).
    caches: Arc<StreamCaches>,
    /// Whether the strategy gives the stream caches back itself when a request runs out of memory, as part
    /// of its one retry (cuvmm's, `expandable/request.rs`); if not, the facade drains them and asks again.
    strategy_takes_caches: bool,
    /// The size and stream of each live raw allocation that its stream's cache may keep back at its free
    /// ([`Allocator::alloc_raw`]).
    raw: RawBook,
    /// Live allocations used on other streams ([`Allocator::record_stream`]): never cached, since their
    /// memory may be reused only once the strategy has seen those streams' work complete.
    recorded: Mutex<FxHashSet<u64>>,
    /// `recorded.len()`, readable without its lock, so that a program that never records a stream pays
    /// one load per free.
    recorded_len: AtomicUsize,
    /// Allocations the strategy counted as out of memory that the facade's retry after draining the stream
    /// caches served (a strategy that does not take the caches back itself): `stats()` reports them as
    /// retries, not OOMs.
    recovered_ooms: AtomicU64,
    /// Errors raised where they could not be returned (freeing in `Drop`), kept for the program to collect.
    deferred: Mutex<Vec<Error>>,
    /// Private pools being allocated to (captures underway), as the strategy last said: while it is not
    /// zero the stream caches are bypassed, so no buffer freed before a capture is baked into its graph.
    capturing: AtomicUsize,
    /// The strategy's [`capture_probe`](Strategy::capture_probe), taken when the allocator was made: an
    /// active stream cache asks it before serving a request, so a capture nobody announced gets no cached
    /// buffer (and the strategy gives it a pool of its own).
    capture_probe: Option<CaptureProbe>,
    /// The program's own handles alive (clones of the one the allocator was made as): when the last is
    /// dropped, `thread_handles` lets go of its handles, which refer back to this state.
    handles: AtomicUsize,
    /// The handles [`DeviceBuffer`](crate::DeviceBuffer)s hold, one per thread slot.
    thread_handles: ThreadHandles<Allocator<S>>,
}

/// Frees every address in `ptrs` to `strategy` (buffers a stream cache held); the first error, if any, once
/// all are freed.
fn free_all<S: Strategy>(strategy: &mut S, ptrs: Vec<u64>) -> Result<(), Error> {
    let mut first_error = None;
    for ptr in ptrs {
        if let Err(err) = strategy.free(ptr) {
            first_error.get_or_insert(err);
        }
    }
    first_error.map_or(Ok(()), Err)
}

/// A thread-safe allocator handle. Cloning it is cheap and shares the same allocator.
pub struct Allocator<S> {
    shared: Arc<Shared<S>>,
    /// Whether this is one of the program's handles, counted in `handles` (else one of `thread_handles`).
    counted: bool,
}

impl<S> Clone for Allocator<S> {
    fn clone(&self) -> Self {
        self.shared.handles.fetch_add(1, Ordering::Relaxed);
        Self {
            shared: Arc::clone(&self.shared),
            counted: true,
        }
    }
}

impl<S> Drop for Allocator<S> {
    fn drop(&mut self) {
        // The last of the program's handles: the per-thread ones go with their last buffer from now on.
        // (Acquire-release, as `Arc`'s own count: whatever a handle did happens before the cycle is broken.)
        if self.counted && self.shared.handles.fetch_sub(1, Ordering::AcqRel) == 1 {
            drop(self.shared.thread_handles.take_all());
        }
    }
}

impl<S> fmt::Debug for Allocator<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Allocator").finish_non_exhaustive()
    }
}

impl<D: Driver> Allocator<Expandable<D>> {
    /// cuvmm's expandable allocator on `driver`, for a program: an allocation on a stream that is being
    /// captured into a CUDA graph with no pool begun for it goes to a pool of its own
    /// ([`Expandable::detect_captures`]), at the cost of one capture query per allocation that reaches the
    /// strategy or the stream caches, unless [`Config::capture_detection`] is off. The stream caches keep
    /// frees back from the start unless [`Config::stream_cache_eager`] says otherwise.
    ///
    /// A request that runs out of memory gets the buffers the stream caches hold back within its one retry
    /// (the strategy frees them and tries once more, after it released its own cache once), so one request
    /// counts at most one retry and one out-of-memory, and the cache is released once.
    pub fn expandable(driver: D, config: Config) -> Result<Self, Error> {
        let caches = Arc::new(StreamCaches::new(
            config.stream_cache,
            config.stream_cache_eager.unwrap_or(true),
        ));
        let detect = config.capture_detection;
        let mut strategy = Expandable::new(driver, config)?;
        strategy.detect_captures(detect);
        strategy.hold_back(Box::new(CachedBuffers(Arc::clone(&caches))));
        Ok(Self::with_caches(strategy, caches, true))
    }
}

/// The stream caches as memory the strategy may take back when a request runs out ([`HeldBack`]).
#[derive(Debug)]
struct CachedBuffers(Arc<StreamCaches>);

impl HeldBack for CachedBuffers {
    fn any(&self) -> bool {
        self.0.any_held()
    }

    fn take_all(&self) -> Vec<u64> {
        self.0.drain()
    }
}

impl<S: Strategy> Allocator<S> {
    /// Wraps a strategy, with stream caches of [`DEFAULT_STREAM_CACHE`] bytes per shard, on from the start.
    pub fn new(strategy: S) -> Self {
        Self::with_stream_cache(strategy, DEFAULT_STREAM_CACHE, true)
    }

    /// Wraps a strategy, with stream caches of `bytes` per shard; 0 turns them off, so that every free
    /// goes straight to the strategy. `eager`: they keep frees back from the start; else only once a thread
    /// finds the strategy's lock taken, so that a program that never contends sees exactly the strategy
    /// ([`Config::stream_cache_eager`]).
    ///
    /// A request that runs out of memory while the caches hold buffers is asked again once they are given
    /// back (the strategy's own release and retry then runs twice; [`Allocator::expandable`] gives cuvmm's
    /// strategy the caches to take back within its one retry instead).
    pub fn with_stream_cache(strategy: S, bytes: u64, eager: bool) -> Self {
        Self::with_caches(strategy, Arc::new(StreamCaches::new(bytes, eager)), false)
    }

    /// Wraps a strategy with `caches`; `strategy_takes_caches`: the strategy takes them back itself when a
    /// request runs out of memory.
    fn with_caches(strategy: S, caches: Arc<StreamCaches>, strategy_takes_caches: bool) -> Self {
        let capture_probe = strategy.capture_probe();
        Self {
            shared: Arc::new(Shared {
                strategy: Mutex::new(strategy),
                caches,
                strategy_takes_caches,
                raw: RawBook::new(),
                recorded: Mutex::new(FxHashSet::default()),
                recorded_len: AtomicUsize::new(0),
                recovered_ooms: AtomicU64::new(0),
                deferred: Mutex::new(Vec::new()),
                capturing: AtomicUsize::new(0),
                capture_probe,
                handles: AtomicUsize::new(1),
                thread_handles: ThreadHandles::new(),
            }),
            counted: true,
        }
    }

    /// The calling thread's handle for a [`DeviceBuffer`](crate::DeviceBuffer) to hold
    /// (`facade/thread_handles.rs`).
    pub(super) fn buffer_handle(&self) -> Arc<Self> {
        (self.shared.thread_handles).get(|| Self {
            shared: Arc::clone(&self.shared),
            counted: false,
        })
    }

    /// Allocates without a guard: the caller must pass the address to [`free_raw`](Allocator::free_raw).
    /// While the stream caches are on, the allocator notes the block's size and stream (in a book sharded by
    /// address), so that its free is served by the caches as a [`DeviceBuffer`](crate::DeviceBuffer)'s drop
    /// is.
    pub fn alloc_raw(&self, size: u64, stream: StreamId) -> Result<u64, Error> {
        let (ptr, in_capture) = self.allocate(size, stream, true, |s| s.alloc(size, stream))?;
        let shared = &*self.shared;
        // Memory allocated during a capture may be a graph pool's: never entered, so never cached.
        if !in_capture && shared.caches.cacheable(size) && shared.caches.is_on() {
            if let Some(old) = shared.raw.insert(ptr, RawBlock { size, stream }) {
                tracing::error!(ptr, ?old, "cuvmm: an address was handed out twice");
                debug_assert!(false, "address {ptr:#x} handed out twice");
            }
        }
        Ok(ptr)
    }

    /// Allocates `size` bytes on `stream` (`strategy_alloc` asks the strategy, if a stream cache cannot
    /// serve it); says whether a capture was underway, in which case the memory may be a graph pool's and
    /// must never enter a stream cache. `cached`: whether a stream cache may serve it at all (tagged memory
    /// never comes from, nor goes to, one).
    pub(super) fn allocate(
        &self,
        size: u64,
        stream: StreamId,
        cached: bool,
        strategy_alloc: impl Fn(&mut S) -> Result<u64, Error>,
    ) -> Result<(u64, bool), Error> {
        let shared = &*self.shared;
        let cacheable = shared.caches.cacheable(size) && cached;
        let capturing = shared.capturing.load(Ordering::Acquire) > 0;
        // The capture query (a driver call on CUDA) only when the thread's cache could serve the request.
        if cacheable && !capturing && shared.caches.may_hold() && !self.unannounced_capture(stream)
        {
            if let Some(ptr) = shared.caches.take(stream, size) {
                return Ok((ptr, false));
            }
        }
        let mut strategy = self.strategy_for(cacheable);
        let result = strategy_alloc(&mut strategy);
        // The strategy may have found a capture it was not told of.
        let underway = strategy.captures_underway();
        shared.capturing.store(underway, Ordering::Release);
        drop(strategy);
        let in_capture = capturing || underway > 0;
        let result = match result {
            Err(Error::OutOfMemory(_)) if self.retries_after_drain() => {
                self.drain_caches()?;
                let retry = strategy_alloc(&mut shared.strategy.lock());
                if retry.is_ok() {
                    shared.recovered_ooms.fetch_add(1, Ordering::Relaxed);
                }
                retry
            }
            other => other,
        };
        result.map(|ptr| (ptr, in_capture))
    }

    /// Whether a request (or wake) that ran out of memory is asked again after the stream caches are given
    /// back: when they hold buffers and the strategy did not take them back itself.
    pub(super) fn retries_after_drain(&self) -> bool {
        !self.shared.strategy_takes_caches && self.shared.caches.any_held()
    }

    /// Whether the stream caches could serve a request while `stream` is captured with no pool begun: they
    /// are on and the capture probe says the stream captures (or cannot tell). Asked only while the caches
    /// are on, so a program whose caches wait for contention and never contends makes no call for it.
    fn unannounced_capture(&self, stream: StreamId) -> bool {
        let shared = &*self.shared;
        match &shared.capture_probe {
            Some(probe) if shared.caches.is_on() => {
                !matches!(probe.status(stream), Ok(CaptureStatus::None))
            }
            _ => false,
        }
    }

    /// Frees an address from [`alloc_raw`](Allocator::alloc_raw) (or a
    /// [`DeviceBuffer`](crate::DeviceBuffer)'s, which must then not be dropped). A block whose size and
    /// stream the allocator noted goes where a buffer's would, the calling thread's stream cache while the
    /// caches are on; any other to the strategy.
    ///
    /// A second `free_raw` of an address is a [`Error::DoubleFree`] when the first has returned; two frees
    /// of one address racing each other, or a buffer dropped after its address was freed here, are the
    /// caller's bug, found at the latest when the caches are next drained (the drop's error is then
    /// deferred, [`take_deferred_errors`](Self::take_deferred_errors)).
    pub fn free_raw(&self, ptr: u64) -> Result<(), Error> {
        let shared = &*self.shared;
        if let Some(block) = shared.raw.remove(ptr) {
            return self.free_buffer(ptr, block.size, block.stream, true);
        }
        if shared.caches.holds(ptr) {
            return Err(Error::DoubleFree { addr: ptr });
        }
        self.forget_recorded(ptr);
        shared.strategy.lock().free(ptr)
    }

    /// Whether `ptr` was used on another stream, forgetting it (it is being freed).
    fn forget_recorded(&self, ptr: u64) -> bool {
        let shared = &*self.shared;
        if shared.recorded_len.load(Ordering::Acquire) == 0 {
            return false;
        }
        let mut recorded = shared.recorded.lock();
        let was = recorded.remove(&ptr);
        shared.recorded_len.store(recorded.len(), Ordering::Release);
        was
    }

    /// Frees a buffer whose size and stream are known: into the calling thread's stream cache when the caches
    /// are on (or the strategy is busy, which turns them on), else to the strategy.
    pub(super) fn free_buffer(
        &self,
        ptr: u64,
        size: u64,
        stream: StreamId,
        cacheable: bool,
    ) -> Result<(), Error> {
        let shared = &*self.shared;
        let recorded = self.forget_recorded(ptr);
        if !recorded && cacheable && shared.caches.cacheable(size) {
            if !shared.caches.is_on() {
                match shared.strategy.try_lock() {
                    Some(mut strategy) => return strategy.free(ptr),
                    None => shared.caches.turn_on(),
                }
            }
            match shared.caches.put(stream, size, ptr) {
                Put::Kept => return Ok(()),
                Put::KeptEvicting(old) => return shared.strategy.lock().free(old),
                Put::Refused => {}
            }
        }
        shared.strategy.lock().free(ptr)
    }

    /// The strategy, locked. When another thread holds it, the stream caches turn on (for a request they
    /// could serve).
    fn strategy_for(&self, cacheable: bool) -> impl DerefMut<Target = S> + '_ {
        if let Some(strategy) = self.shared.strategy.try_lock() {
            return strategy;
        }
        if cacheable {
            self.shared.caches.turn_on();
        }
        self.shared.strategy.lock()
    }

    /// Gives every buffer the stream caches hold back to the strategy, so that its view is exact.
    pub(super) fn drain_caches(&self) -> Result<(), Error> {
        let ptrs = self.shared.caches.drain();
        if ptrs.is_empty() {
            return Ok(());
        }
        free_all(&mut *self.shared.strategy.lock(), ptrs)
    }

    /// [`drain_caches`](Self::drain_caches) where an error cannot be returned: it is deferred.
    pub(super) fn drain_caches_deferring(&self) {
        if let Err(err) = self.drain_caches() {
            tracing::error!(%err, "cuvmm: freeing a cached buffer failed");
            self.shared.deferred.lock().push(err);
        }
    }

    /// A snapshot of the statistics. The stream caches are drained first, so current values are exact;
    /// peaks may include buffers that sat in a stream cache once threads had contended (docs/library.md,
    /// "Locking").
    pub fn stats(&self) -> Stats {
        self.drain_caches_deferring();
        let mut stats = self.shared.strategy.lock().stats();
        let recovered = self.shared.recovered_ooms.load(Ordering::Relaxed);
        stats.num_ooms = stats.num_ooms.saturating_sub(recovered);
        stats.num_alloc_retries += recovered;
        stats
    }

    /// Counts the last out-of-memory as recovered from: its caller freed memory of its own (PyTorch's
    /// free-memory callbacks) and the request then succeeded. [`stats`](Self::stats) shows it as a retry,
    /// not an out-of-memory, as it shows the caches' drain and retry.
    pub fn count_recovered_oom(&self) {
        self.shared.recovered_ooms.fetch_add(1, Ordering::Relaxed);
    }

    /// The statistics as PyTorch's `torch.cuda.memory_summary()` table, plus cuvmm's own rows
    /// ([`summary::memory_summary`](crate::facade::summary::memory_summary)).
    pub fn memory_summary(&self) -> String {
        let stats = self.stats();
        let strategy = self.shared.strategy.lock();
        let asleep = (strategy.tags()).map_or_else(Vec::new, |tags| tags.asleep_tags());
        crate::facade::summary::memory_summary_asleep(
            &stats,
            strategy.ordinal(),
            strategy.name(),
            &asleep,
        )
    }

    /// Gives all cached memory back to the driver.
    pub fn empty_cache(&self) -> Result<(), Error> {
        self.drain_caches()?;
        self.shared.strategy.lock().empty_cache()
    }

    /// Gives up to `bytes` of cached memory back to the driver; returns the bytes given back.
    pub fn trim(&self, bytes: u64) -> Result<u64, Error> {
        self.drain_caches()?;
        self.shared.strategy.lock().trim(bytes)
    }

    /// Walks the whole state for broken invariants (for tests): the stream caches', then, with them
    /// drained, the strategy's.
    pub fn check_invariants(&self) -> Result<(), InvariantViolation> {
        // A block in the raw book is live: no cache may hold its address. Read with the caches locked, as a
        // free moves a block from the book to a cache (and an allocation back) one lock at a time.
        (self.shared.caches).check_invariants(|| self.shared.raw.addresses())?;
        self.drain_caches_deferring();
        self.shared.strategy.lock().check_invariants()
    }

    /// Buffers and bytes the stream caches hold now (kept back from the strategy; see
    /// [`stats`](Self::stats)).
    pub fn stream_cached(&self) -> (usize, u64) {
        self.shared.caches.held()
    }

    /// Runs `f` with the strategy locked (to reach the driver in tests, say). Buffers of this allocator
    /// dropped inside `f` go to their stream's cache, as when another thread holds the lock.
    pub fn with_strategy<R>(&self, f: impl FnOnce(&mut S) -> R) -> R {
        f(&mut self.shared.strategy.lock())
    }

    /// Plants a known bug in the stream caches (two requests can be handed the same cached buffer), for
    /// `tests/loom.rs` to show its model catches it. Exists only in `--cfg loom` builds.
    #[cfg(loom)]
    pub fn seed_stream_cache_bug(&self) {
        self.shared.caches.seed_bug();
    }

    /// Keeps an error raised where it could not be returned (a buffer's drop), for
    /// [`take_deferred_errors`](Self::take_deferred_errors).
    pub(super) fn defer(&self, err: Error) {
        self.shared.deferred.lock().push(err);
    }

    /// Errors raised while dropping buffers, oldest first. Each was also reported through `tracing`.
    pub fn take_deferred_errors(&self) -> Vec<Error> {
        std::mem::take(&mut *self.shared.deferred.lock())
    }
}

impl<S: Strategy + StreamUses> Allocator<S> {
    /// Records that the allocation at `ptr` is also used by work queued on `stream`: once freed, its memory
    /// is reused only after that work has completed. See [`DeviceBuffer::record_stream`](crate::DeviceBuffer::record_stream).
    pub fn record_stream(&self, ptr: u64, stream: StreamId) -> Result<(), Error> {
        let shared = &*self.shared;
        shared.strategy.lock().record_stream(ptr, stream)?;
        let mut recorded = shared.recorded.lock();
        recorded.insert(ptr);
        shared.recorded_len.store(recorded.len(), Ordering::Release);
        Ok(())
    }
}

impl<S: Strategy + Snapshots> Allocator<S> {
    /// The segments and blocks now, with the events recorded since [`record_history`](Self::record_history)
    /// (PyTorch's `torch.cuda.memory._snapshot()`); `snapshot::pickle` pickles it for PyTorch's
    /// memory viewer.
    pub fn snapshot(&self) -> Result<crate::strategy::snapshot::MemorySnapshot, Error> {
        self.drain_caches()?;
        self.shared.strategy.lock().snapshot()
    }

    /// Starts recording events for [`snapshot`](Self::snapshot), keeping the last `max_entries`, or stops
    /// with `None` (PyTorch's `torch.cuda.memory._record_memory_history`).
    ///
    /// While it records, the stream caches keep nothing back, so that the history holds every alloc and
    /// free, as PyTorch's does: what they held goes back to the strategy before recording starts (those
    /// frees came before it), and they keep frees back again once it stops.
    pub fn record_history(&self, max_entries: Option<usize>) -> Result<(), Error> {
        let caches = &self.shared.caches;
        let mut strategy = self.shared.strategy.lock();
        if max_entries.is_none() {
            strategy.record_history(None)?;
            caches.resume();
            return Ok(());
        }
        let drained = free_all(&mut *strategy, caches.suspend());
        let recording = strategy.record_history(max_entries);
        if recording.is_err() {
            caches.resume();
        }
        drained.and(recording)
    }

    /// Calls `tracker` with every event from now on, recording or not (PyTorch's
    /// `attachAllocatorTraceTracker`, which NCCL's memory-registration hooks use): on the thread of the
    /// event, under the allocator's lock, so it must not call this allocator. Segment events always reach
    /// it; while the history is not recording ([`record_history`](Self::record_history)), the alloc and
    /// free events of buffers a stream cache serves do not (with `stream_cache_eager`, the default, from a
    /// thread's first free; else once threads contend).
    /// A panic in it is caught and logged.
    pub fn attach_trace_tracker(
        &self,
        tracker: impl Fn(&TraceEntry) + Send + Sync + 'static,
    ) -> Result<(), Error> {
        (self.shared.strategy.lock()).attach_trace_tracker(std::sync::Arc::new(tracker))
    }
}

impl<S: Strategy + GraphPools> Allocator<S> {
    /// From now on, allocations on the streams `filter` accepts come from the private pool `pool`, whose
    /// memory stays where it is and is reused by nothing else while a graph uses it (PyTorch's
    /// `beginAllocateToPool`; call it before beginning a capture, with [`StreamFilter::Capture`] or the
    /// capturing streams). Until [`end_allocate_to_pool`](Self::end_allocate_to_pool), the allocator makes
    /// no call CUDA refuses during a capture (once captures are marked,
    /// [`mark_captures`](Self::mark_captures), only while a marked capture runs). See
    /// [`crate::strategy::graph_pool`].
    ///
    /// While another thread's sleep or wake copies a tag's bytes, or its `prepare_sleep` pins host memory
    /// (without the lock), this waits for that to end ([`GraphPools::ready_to_begin_pool`]): they pin host
    /// memory, which a global-mode capture forbids on every thread. After ten minutes of copies it gives
    /// up with [`Error::TagBusy`].
    pub fn begin_allocate_to_pool(
        &self,
        pool: GraphPool,
        filter: StreamFilter,
    ) -> Result<(), Error> {
        let mut strategy = self.shared.strategy.lock();
        let mut waited = Duration::ZERO;
        while let Err(busy) = strategy.ready_to_begin_pool() {
            if waited >= COPIES_WAIT_LIMIT {
                return Err(busy);
            }
            drop(strategy);
            waited += sync::pause();
            strategy = self.shared.strategy.lock();
        }
        let result = strategy.begin_allocate_to_pool(pool, filter);
        (self.shared.capturing).store(strategy.captures_underway(), Ordering::Release);
        result
    }

    /// Allocations stop going to `pool` (after the capture ended); its memory stays the pool's until
    /// [`release_pool`](Self::release_pool).
    pub fn end_allocate_to_pool(&self, pool: GraphPool) -> Result<(), Error> {
        let mut strategy = self.shared.strategy.lock();
        let result = strategy.end_allocate_to_pool(pool);
        (self.shared.capturing).store(strategy.captures_underway(), Ordering::Release);
        result
    }

    /// From now on the program marks every capture it makes with
    /// [`mark_capture_begin`](Self::mark_capture_begin) and [`mark_capture_end`](Self::mark_capture_end)
    /// (PyTorch 2.13 on does): a pool begun without a capture (PyTorch's `use_mem_pool`) then allocates as
    /// any request does, waiting for events, releasing the cache and compacting when memory runs short.
    /// Until then, every pool begun counts as a capture. A capture not marked is still safe if its pool was
    /// begun with [`StreamFilter::Capture`], or, with capture detection on, if no pool was begun for its
    /// streams. Sleeps and wakes still wait until no pool is begun. Idempotent.
    pub fn mark_captures(&self) {
        self.shared.strategy.lock().mark_captures();
    }

    /// A capture begins: call it after [`begin_allocate_to_pool`](Self::begin_allocate_to_pool) and
    /// `cuStreamBeginCapture` (PyTorch's `markCaptureBegin`). Marks captures from now on
    /// ([`mark_captures`](Self::mark_captures)).
    pub fn mark_capture_begin(&self) {
        self.shared.strategy.lock().mark_capture(true);
    }

    /// A capture ended: call it after `cuStreamEndCapture`, before
    /// [`end_allocate_to_pool`](Self::end_allocate_to_pool) (PyTorch's `markCaptureEnd`). The mark of a
    /// capture abandoned without this goes once its pool ends.
    pub fn mark_capture_end(&self) {
        self.shared.strategy.lock().mark_capture(false);
    }

    /// A graph that used `pool` is gone (call it once per begin): once none is left, the pool's memory goes
    /// back to common use as its blocks are freed.
    pub fn release_pool(&self, pool: GraphPool) -> Result<(), Error> {
        self.shared.strategy.lock().release_pool(pool)
    }

    /// One more user of `pool` without allocating to it (PyTorch's `createOrIncrefPool`, made by a
    /// `MemPool`): it stays live until [`release_pool`](Self::release_pool) is called once more.
    pub fn incref_pool(&self, pool: GraphPool) -> Result<(), Error> {
        self.shared.strategy.lock().incref_pool(pool)
    }
}

impl<S: Strategy + Peers> Allocator<S> {
    /// Lets device `peer` read and write every range mapped now and every one mapped later.
    pub fn add_peer(&self, peer: usize) -> Result<(), Error> {
        self.shared.strategy.lock().add_peer(peer)
    }
}

impl<S: Strategy + Controls> Allocator<S> {
    /// Sets every statistic's peak to its current value ([`Controls::reset_peak_stats`]). The stream
    /// caches are drained first, so the peaks start from exact current values.
    pub fn reset_peak_stats(&self) -> Result<(), Error> {
        self.drain_caches()?;
        self.shared.strategy.lock().reset_peak_stats()
    }

    /// Sets the cumulative counts to 0 ([`Controls::reset_accumulated_stats`]).
    pub fn reset_accumulated_stats(&self) -> Result<(), Error> {
        let mut strategy = self.shared.strategy.lock();
        strategy.reset_accumulated_stats()?;
        self.shared.recovered_ooms.store(0, Ordering::Relaxed);
        Ok(())
    }

    /// Limits reserved memory to `fraction` of the device's from now on
    /// ([`Controls::set_memory_fraction`]).
    pub fn set_memory_fraction(&self, fraction: f64) -> Result<(), Error> {
        self.shared.strategy.lock().set_memory_fraction(fraction)
    }

    /// Sets the bytes of the device that a request's growth leaves free, counting other processes' use,
    /// from now on ([`Config::device_margin`](crate::Config::device_margin), torch_memory_saver's
    /// `memory_margin_bytes`; 0: none): a request that would leave less is served from idle memory or
    /// fails with out-of-memory. A wake is exempt ([`Controls::set_device_margin`]).
    pub fn set_device_margin(&self, bytes: u64) {
        self.shared.strategy.lock().set_device_margin(bytes);
    }

    /// The memory limit as a fraction of the device's memory, `None` without one
    /// ([`Controls::memory_fraction`]).
    pub fn memory_fraction(&self) -> Option<f64> {
        self.shared.strategy.lock().memory_fraction()
    }

    /// Gives back the idle pages stranded in multi-page handles that live allocations still touch, by
    /// re-creating their live parts as single pages at the same addresses
    /// ([`Controls::release_stranded`]); returns the bytes given back. Call it where no other thread
    /// launches work on this allocator's memory until it returns (between steps of a training loop, say):
    /// the live bytes move. The stream caches are drained first, so the blocks they hold strand nothing.
    pub fn release_stranded(&self) -> Result<u64, Error> {
        self.drain_caches()?;
        self.shared.strategy.lock().release_stranded()
    }
}
