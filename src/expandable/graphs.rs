//! CUDA graphs: private pools and the captures that allocate to them (see [`crate::strategy::graph_pool`]).
//!
//! While a pool is begun (a capture is *underway*; but see marked captures below), the allocator makes no
//! driver call that CUDA refuses during a capture or that would invalidate it: no event query, no
//! synchronization, no unmap or release.
//! So an allocation then takes only free blocks, pooled handles and new handles (no compaction, no borrowing
//! from other streams, no release-and-retry on out-of-memory), and a free of a block used on other streams
//! is *deferred*: the block is freed at once (no longer allocated; still active and a user of its pages, as
//! a parked block) and keeps its streams here until no capture is underway, when its events are recorded
//! as for any free (PyTorch's `needs_events_deferred_until_no_capture`).
//!
//! A segment belongs to one pool or to none. Segments of a *live* pool (begun more times than released)
//! are pinned: their idle pages are never unmapped, lent or taken by compaction, and their blocks are never
//! borrowed by another stream, so the addresses a graph baked in keep their memory. Once a pool is
//! released as many times as it was begun, its segments are unpinned: their idle pages go back to common
//! use like any other, and the segments are freed once empty.
//!
//! A capture the allocator was not told of is found, when capture detection is on (the facade turns it on
//! for programs), by a capture query of the allocating stream: its allocations go to an *implicit* pool,
//! never released, since the allocator cannot know when the graph dies.
//!
//! A pool is also begun without a capture: PyTorch's `use_mem_pool` routes a thread's allocations to a
//! `MemPool`, and cudagraph trees' warm-up runs to a graph's pool. A caller that *marks* its captures
//! ([`Graphs::mark_captures`]; PyTorch 2.13 on calls `markCaptureBegin`/`End` around every capture it
//! makes) has the rules above only while a marked capture is underway, or a pool whose filter is a capture
//! (an implicit one, or one begun with [`StreamFilter::Capture`]): a pool begun alone then allocates as any
//! request does, releasing the cache and compacting when memory runs short. Until a caller marks them,
//! every pool being allocated to counts as a capture, since one may begin any moment.

use super::segments::Segments;
use super::streams::{StreamUses, StreamWaits};
use crate::driver::{CaptureStatus, Driver, StreamId};
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use rustc_hash::FxHashMap;

/// A pool being allocated to.
#[derive(Debug)]
struct Underway {
    pool: GraphPool,
    filter: StreamFilter,
    /// For an implicit pool, the capturing stream that revealed it (queried to see the capture end).
    revealed_by: Option<StreamId>,
}

/// The private pools and the captures underway.
#[derive(Debug, Default)]
pub(super) struct Graphs {
    /// Pools being allocated to, in the order they were begun.
    underway: Vec<Underway>,
    /// Live pools and how many users each has (begins and increfs not yet released); 0 for a pool released
    /// while still being allocated to, live until its end.
    live: FxHashMap<GraphPool, usize>,
    /// Released pools whose segments still exist: forgotten once the last is freed.
    released: Vec<GraphPool>,
    /// Blocks freed during a capture (pending, `blocks.rs`), with the other streams that used them, whose
    /// events wait until no capture is underway.
    deferred: Vec<(u64, StreamUses)>,
    /// Whether an allocation asks the driver if its stream is capturing (captures not announced).
    detect: bool,
    /// Pools whose free memory may serve an allocation outside every pool that would otherwise fail
    /// (PyTorch's `MemPool(use_on_oom=True)`), in the order they were named.
    use_on_oom: Vec<GraphPool>,
    /// Pools whose allocations take whole pages, so that no two of them share a page (PyTorch's
    /// `MemPool(no_split=True)`).
    no_split: Vec<GraphPool>,
    /// Once the caller marks its captures: how many marked captures are underway. `None` before: every
    /// pool being allocated to counts as a capture.
    marked: Option<usize>,
}

impl Underway {
    /// Whether the pool's filter takes only capturing streams: a capture is underway while it is begun.
    fn is_capture(&self) -> bool {
        matches!(self.filter, StreamFilter::Capture(_))
    }
}

impl Graphs {
    /// Whether a capture may be underway: some pool is being allocated to; once captures are marked
    /// ([`mark_captures`](Self::mark_captures)), a marked capture has begun and not ended, or a pool whose
    /// filter is a capture's is begun. While it is, no driver call may refuse or break a capture (the
    /// module's comment).
    #[inline]
    pub(super) fn capturing(&self) -> bool {
        match self.marked {
            None => !self.underway.is_empty(),
            Some(marked) => marked > 0 || self.underway.iter().any(Underway::is_capture),
        }
    }

    /// Whether any pool is being allocated to (a capture underway, or a pool begun without one): requests
    /// are routed to pools, and nothing may begin that a capture beginning now would break (the copies of
    /// a sleep or a wake, which run without the caller's lock).
    #[inline]
    pub(super) fn routing(&self) -> bool {
        !self.underway.is_empty()
    }

    /// From now on, the caller marks every capture it makes ([`mark_capture`](Self::mark_capture)) after
    /// beginning its pool: a pool begun without a mark is not a capture. Idempotent.
    pub(super) fn mark_captures(&mut self) {
        self.marked.get_or_insert(0);
    }

    /// A capture begins (`begun`, after its pool was begun and `cuStreamBeginCapture`) or ends (after
    /// `cuStreamEndCapture`, before its pool ends). Marks captures from now on. An end with no capture
    /// marked is ignored: a capture abandoned before its end leaves a mark that goes with its pool.
    pub(super) fn mark_capture(&mut self, begun: bool) {
        let marked = self.marked.get_or_insert(0);
        *marked = if begun {
            marked.saturating_add(1)
        } else {
            marked.saturating_sub(1)
        };
    }

    /// No more captures are marked than pools are being allocated to: each marked capture allocates to a
    /// pool of its own, so the mark of a capture abandoned without its end goes once its pool ends.
    fn bound_marks(&mut self) {
        if let Some(marked) = &mut self.marked {
            *marked = (*marked).min(self.underway.len());
        }
    }

    /// How many pools are being allocated to.
    pub(super) fn underway_count(&self) -> usize {
        self.underway.len()
    }

    /// Whether `pool` is live: begun more times than released. Its segments are pinned.
    pub(super) fn pool_is_live(&self, pool: GraphPool) -> bool {
        self.live.contains_key(&pool)
    }

    /// Whether `pool` is known: live, or released with segments left.
    pub(super) fn is_known(&self, pool: GraphPool) -> bool {
        self.pool_is_live(pool) || self.released.contains(&pool)
    }

    /// Turns the capture query at each allocation on or off.
    pub(super) fn set_detect(&mut self, on: bool) {
        self.detect = on;
    }

    /// Whether captures nobody announced are detected.
    pub(super) fn detects(&self) -> bool {
        self.detect
    }

    /// Whether the free of the block at `addr` is deferred (for `check_invariants()`).
    pub(super) fn is_deferred(&self, addr: u64) -> bool {
        self.deferred.iter().any(|&(a, _)| a == addr)
    }

    /// How many frees are deferred.
    pub(super) fn deferred_count(&self) -> usize {
        self.deferred.len()
    }

    /// Whether any free is deferred.
    #[inline]
    pub(super) fn any_deferred(&self) -> bool {
        !self.deferred.is_empty()
    }

    /// Defers the events of the block at `addr`, freed during a capture and used on `streams`, until no
    /// capture is underway.
    pub(super) fn defer(&mut self, addr: u64, streams: StreamUses) {
        self.deferred.push((addr, streams));
    }

    /// The last deferred free, if any: the block's address and its other streams.
    pub(super) fn last_deferred(&self) -> Option<(u64, &StreamUses)> {
        self.deferred.last().map(|(addr, streams)| (*addr, streams))
    }

    /// Forgets the last deferred free, whose events are recorded.
    pub(super) fn deferred_done(&mut self) {
        self.deferred.pop();
    }

    /// Forgets the released `pool`, whose last segment is gone.
    pub(super) fn forget_released(&mut self, pool: GraphPool) {
        self.released.retain(|&p| p != pool);
    }

    /// How many users `pool` has: begins and increfs not yet released (0 for a pool that is not live).
    pub(super) fn use_count(&self, pool: GraphPool) -> usize {
        self.live.get(&pool).copied().unwrap_or(0)
    }

    /// Says whether `pool`'s free memory may serve an allocation that would otherwise run out of memory.
    pub(super) fn set_use_on_oom(&mut self, pool: GraphPool, on: bool) {
        self.use_on_oom.retain(|&p| p != pool);
        if on {
            self.use_on_oom.push(pool);
        }
    }

    /// The live pools whose free memory may serve an allocation that would otherwise fail, in the order
    /// they were named.
    pub(super) fn use_on_oom(&self) -> Vec<GraphPool> {
        (self.use_on_oom.iter().copied())
            .filter(|&pool| self.pool_is_live(pool))
            .collect()
    }

    /// From now on, `pool`'s allocations take whole pages.
    pub(super) fn set_no_split(&mut self, pool: GraphPool) {
        if !self.no_split.contains(&pool) {
            self.no_split.push(pool);
        }
    }

    /// Whether an allocation in `pool` takes whole pages.
    #[inline]
    pub(super) fn no_split(&self, pool: Option<GraphPool>) -> bool {
        !self.no_split.is_empty() && pool.is_some_and(|pool| self.no_split.contains(&pool))
    }
}

impl Graphs {
    /// Starts allocating to `pool` for the streams `filter` accepts.
    pub(super) fn begin_pool(
        &mut self,
        pool: GraphPool,
        filter: StreamFilter,
        revealed_by: Option<StreamId>,
    ) -> Result<(), Error> {
        let refuse = |problem| Error::GraphPool {
            operation: "begin_allocate_to_pool",
            pool,
            problem,
        };
        if pool == GraphPool::NONE {
            return Err(refuse("{0, 0} names no pool"));
        }
        if self.underway.iter().any(|u| u.pool == pool) {
            return Err(refuse("the pool is already being allocated to"));
        }
        self.forget_released(pool);
        *self.live.entry(pool).or_default() += 1;
        self.underway.push(Underway {
            pool,
            filter,
            revealed_by,
        });
        tracing::debug!(%pool, "cuvmm: allocating to a graph pool");
        Ok(())
    }

    /// Stops allocating to `pool`; a pool whose last user was released meanwhile goes now.
    pub(super) fn end_pool(&mut self, pool: GraphPool, segments: &Segments) -> Result<(), Error> {
        let at = (self.underway.iter().position(|u| u.pool == pool)).ok_or(Error::GraphPool {
            operation: "end_allocate_to_pool",
            pool,
            problem: "the pool is not being allocated to",
        })?;
        self.underway.remove(at);
        self.bound_marks();
        tracing::debug!(%pool, "cuvmm: stopped allocating to a graph pool");
        if self.live.get(&pool) == Some(&0) {
            self.forget_live(pool, segments);
        }
        Ok(())
    }

    /// One more user of `pool` (PyTorch's `createOrIncrefPool`, which a `MemPool` calls when made): it is
    /// live, and its segments pinned, until released once more.
    pub(super) fn incref_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        if pool == GraphPool::NONE {
            return Err(Error::GraphPool {
                operation: "incref_pool",
                pool,
                problem: "{0, 0} names no pool",
            });
        }
        self.forget_released(pool);
        *self.live.entry(pool).or_default() += 1;
        Ok(())
    }

    /// One graph that used `pool` is gone; once none is left, the pool's segments are unpinned.
    pub(super) fn drop_pool_use(
        &mut self,
        pool: GraphPool,
        segments: &Segments,
    ) -> Result<(), Error> {
        let uses = self.live.get_mut(&pool).ok_or(Error::GraphPool {
            operation: "release_pool",
            pool,
            problem: "the pool is not live (never begun, or released as often as begun)",
        })?;
        if *uses == 0 {
            return Err(Error::GraphPool {
                operation: "release_pool",
                pool,
                problem: "the pool has no user left (released as often as begun, while still being allocated to)",
            });
        }
        *uses -= 1;
        // A pool released while still being allocated to (a MemPool deleted inside its own `use_mem_pool`,
        // a graph dropped during its capture) stays live, with no user, until its end, as PyTorch's
        // allocator keeps serving a capture underway whatever its pool's count.
        if *uses == 0 && !self.underway.iter().any(|u| u.pool == pool) {
            self.forget_live(pool, segments);
        }
        Ok(())
    }

    /// `pool` has no user left and is not being allocated to: its segments are unpinned, and its settings
    /// forgotten (a `MemPool`'s id is never used again once it is deleted), so a program making a pool per
    /// step keeps none of them.
    fn forget_live(&mut self, pool: GraphPool, segments: &Segments) {
        self.live.remove(&pool);
        self.use_on_oom.retain(|&p| p != pool);
        self.no_split.retain(|&p| p != pool);
        if segments.any_of_graph(pool) {
            self.released.push(pool);
        }
        tracing::debug!(%pool, "cuvmm: graph pool released");
    }

    /// The pool an allocation on `stream` goes to, if any: the pool begun last whose filter accepts the
    /// stream (PyTorch searches its captures underway from the newest, so a `use_mem_pool` inside another
    /// allocates to the inner pool); with capture detection on, an implicit pool for a capture not
    /// announced. Ends the implicit pools whose capture has ended.
    pub(super) fn pool_for<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
    ) -> Result<Option<GraphPool>, Error> {
        if !self.detect && !self.routing() {
            return Ok(None);
        }
        // The stream's capture status, asked once, when a filter or the detection needs it.
        let mut status: Option<CaptureStatus> = None;
        self.end_finished_implicit_pools(driver)?;
        for i in (0..self.underway.len()).rev() {
            let accepts = match &self.underway[i].filter {
                StreamFilter::Streams(streams) => streams.contains(&stream),
                StreamFilter::Custom(accepts) => accepts(stream),
                &StreamFilter::Capture(id) => {
                    let now = match status {
                        Some(now) => now,
                        None => *status.insert(driver.capture_status(stream)?),
                    };
                    matches!(now, CaptureStatus::Active { id: active, .. } if active == id)
                }
            };
            if accepts {
                return Ok(Some(self.underway[i].pool));
            }
        }
        if !self.detect {
            return Ok(None);
        }
        let now = match status {
            Some(now) => now,
            None => driver.capture_status(stream)?,
        };
        let CaptureStatus::Active { id, .. } = now else {
            return Ok(None);
        };
        let pool = GraphPool::implicit(id);
        tracing::warn!(
            stream = stream.0,
            capture = id,
            "cuvmm: allocation on a capturing stream with no pool begun: its memory goes to a pool kept \
             until the allocator is dropped (call begin_allocate_to_pool / release_pool to get it back)"
        );
        self.begin_pool(pool, StreamFilter::Capture(id), Some(stream))?;
        Ok(Some(pool))
    }

    /// Ends the implicit pools whose capture is over (their stream no longer captures with that id).
    fn end_finished_implicit_pools<D: Driver>(&mut self, driver: &mut D) -> Result<(), Error> {
        let mut i = 0;
        while i < self.underway.len() {
            let underway = &self.underway[i];
            if let (Some(stream), StreamFilter::Capture(id)) =
                (underway.revealed_by, &underway.filter)
            {
                let id = *id;
                let still = matches!(driver.capture_status(stream)?,
                    CaptureStatus::Active { id: active, .. } if active == id);
                if !still {
                    self.underway.remove(i);
                    self.bound_marks();
                    continue;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// The graph part of `check_invariants()`: every segment's pool is live or released (and a released
    /// pool still has a segment), every pool being allocated to is live, and every deferred free is of a
    /// distinct pending block that is not parked, with other streams than its segment's.
    pub(super) fn check_graphs(
        &self,
        segments: &Segments,
        waits: &StreamWaits,
    ) -> Result<(), InvariantViolation> {
        let broken = |addr| InvariantViolation::GraphPool { addr };
        for seg in segments.live() {
            if seg.graph.is_some_and(|pool| !self.is_known(pool)) {
                return Err(broken(seg.va.start));
            }
        }
        for &pool in &self.released {
            if self.pool_is_live(pool) || !segments.any_of_graph(pool) {
                return Err(broken(0));
            }
        }
        if (self.underway.iter()).any(|u| !self.pool_is_live(u.pool)) {
            return Err(broken(0));
        }
        for (i, (addr, streams)) in self.deferred.iter().enumerate() {
            let addr = *addr;
            let pending = segments.slot_of(addr).is_some_and(|slot| {
                let seg = segments.at(slot);
                (seg.block_at(addr)).is_some_and(|block| block.is_pending())
                    && !streams.iter().any(|stream| stream == seg.stream)
            });
            if !pending
                || waits.is_parked(addr)
                || waits.used_elsewhere(addr)
                || self.deferred[..i].iter().any(|&(a, _)| a == addr)
            {
                return Err(broken(addr));
            }
        }
        Ok(())
    }

    /// Mapped bytes of live pools' segments, and how many pools are live.
    pub(super) fn pool_bytes(&self, segments: &Segments, page_size: u64) -> (u64, u64) {
        let bytes = segments
            .live()
            .filter(|seg| seg.graph.is_some_and(|pool| self.pool_is_live(pool)))
            .map(|seg| seg.pages.mapped_count() as u64 * page_size)
            .sum();
        (bytes, self.live.len() as u64)
    }
}
