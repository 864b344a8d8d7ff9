//! CUDA graphs: private pools and the captures that allocate to them (see [`crate::strategy::graph_pool`]).
//!
//! While a pool is begun (a capture is *underway*), the allocator makes no driver call that CUDA refuses
//! during a capture or that would invalidate it: no event query, no synchronization, no unmap or release.
//! So an allocation then takes only free blocks, pooled handles and new handles (no compaction, no borrowing
//! from other streams, no release-and-retry on out-of-memory), and a free of a block used on other streams
//! is *deferred*: the block stays live, with its streams, until no capture is underway, when its events are
//! recorded as for any free (PyTorch's `needs_events_deferred_until_no_capture`).
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

use super::Expandable;
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
    /// Live pools and how many graphs use each (begins not yet released).
    live: FxHashMap<GraphPool, usize>,
    /// Released pools whose segments still exist: forgotten once the last is freed.
    released: Vec<GraphPool>,
    /// Live blocks freed during a capture whose other streams' events wait until no capture is underway.
    pub(super) deferred: Vec<u64>,
    /// Whether an allocation asks the driver if its stream is capturing (captures not announced).
    pub(super) detect: bool,
}

impl Graphs {
    /// Whether any capture is underway (some pool is being allocated to).
    #[inline]
    pub(super) fn capturing(&self) -> bool {
        !self.underway.is_empty()
    }

    /// How many pools are being allocated to.
    pub(super) fn underway_count(&self) -> usize {
        self.underway.len()
    }

    /// Whether `pool` is live: begun more times than released. Its segments are pinned.
    pub(super) fn is_live(&self, pool: GraphPool) -> bool {
        self.live.contains_key(&pool)
    }

    /// Whether `pool` is known: live, or released with segments left.
    pub(super) fn is_known(&self, pool: GraphPool) -> bool {
        self.is_live(pool) || self.released.contains(&pool)
    }

    /// Forgets the released `pool`, whose last segment is gone.
    pub(super) fn forget_released(&mut self, pool: GraphPool) {
        self.released.retain(|&p| p != pool);
    }
}

impl<D: Driver> Expandable<D> {
    /// Turns on (or off) the capture query at each allocation, which finds captures the allocator was not
    /// told of: their allocations go to an implicit pool that is never released. Off by default (a trace
    /// replay has no captures); the facade turns it on.
    pub fn detect_captures(&mut self, on: bool) {
        self.graphs.detect = on;
    }

    /// Whether any capture is underway (some pool is being allocated to).
    #[inline]
    pub(super) fn capturing(&self) -> bool {
        self.graphs.capturing()
    }

    /// Whether segment `slot` belongs to a live pool (its pages stay mapped where they are and its blocks
    /// stay the pool's) or to a sleeping tag (`sleep.rs`: nothing of it is taken or placed).
    pub(super) fn pinned(&self, slot: usize) -> bool {
        (self.segment(slot).graph).is_some_and(|pool| self.graphs.is_live(pool))
            || self.asleep(slot)
    }

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
        if self.graphs.underway.iter().any(|u| u.pool == pool) {
            return Err(refuse("the pool is already being allocated to"));
        }
        self.graphs.forget_released(pool);
        *self.graphs.live.entry(pool).or_default() += 1;
        self.graphs.underway.push(Underway {
            pool,
            filter,
            revealed_by,
        });
        tracing::debug!(%pool, "cuvmm: allocating to a graph pool");
        Ok(())
    }

    /// Stops allocating to `pool`.
    pub(super) fn end_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        let at =
            (self.graphs.underway.iter().position(|u| u.pool == pool)).ok_or(Error::GraphPool {
                operation: "end_allocate_to_pool",
                pool,
                problem: "the pool is not being allocated to",
            })?;
        self.graphs.underway.remove(at);
        tracing::debug!(%pool, "cuvmm: stopped allocating to a graph pool");
        Ok(())
    }

    /// One more user of `pool` (PyTorch's `createOrIncrefPool`, which a `MemPool` calls when made): it is
    /// live, and its segments pinned, until released once more.
    pub(super) fn incref_graph_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        if pool == GraphPool::NONE {
            return Err(Error::GraphPool {
                operation: "incref_pool",
                pool,
                problem: "{0, 0} names no pool",
            });
        }
        self.graphs.forget_released(pool);
        *self.graphs.live.entry(pool).or_default() += 1;
        Ok(())
    }

    /// One graph that used `pool` is gone; once none is left, the pool's segments are unpinned.
    pub(super) fn release_graph_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        let uses = self.graphs.live.get_mut(&pool).ok_or(Error::GraphPool {
            operation: "release_pool",
            pool,
            problem: "the pool is not live (never begun, or released as often as begun)",
        })?;
        *uses -= 1;
        if *uses == 0 {
            self.graphs.live.remove(&pool);
            if self.live_segments().any(|seg| seg.graph == Some(pool)) {
                self.graphs.released.push(pool);
            }
            tracing::debug!(%pool, "cuvmm: graph pool released");
        }
        Ok(())
    }

    /// The pool an allocation on `stream` goes to, if any: the first pool underway whose filter accepts the
    /// stream; with capture detection on, an implicit pool for a capture not announced. Ends the implicit
    /// pools whose capture has ended.
    pub(super) fn pool_for(&mut self, stream: StreamId) -> Result<Option<GraphPool>, Error> {
        if !self.graphs.detect && !self.graphs.capturing() {
            return Ok(None);
        }
        // The stream's capture status, asked once, when a filter or the detection needs it.
        let mut status: Option<CaptureStatus> = None;
        self.end_finished_implicit_pools()?;
        for i in 0..self.graphs.underway.len() {
            let accepts = match &self.graphs.underway[i].filter {
                StreamFilter::Streams(streams) => streams.contains(&stream),
                StreamFilter::Custom(accepts) => accepts(stream),
                &StreamFilter::Capture(id) => {
                    let now = match status {
                        Some(now) => now,
                        None => *status.insert(self.driver.capture_status(stream)?),
                    };
                    matches!(now, CaptureStatus::Active { id: active, .. } if active == id)
                }
            };
            if accepts {
                return Ok(Some(self.graphs.underway[i].pool));
            }
        }
        if !self.graphs.detect {
            return Ok(None);
        }
        let now = match status {
            Some(now) => now,
            None => self.driver.capture_status(stream)?,
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
    fn end_finished_implicit_pools(&mut self) -> Result<(), Error> {
        let mut i = 0;
        while i < self.graphs.underway.len() {
            let underway = &self.graphs.underway[i];
            if let (Some(stream), StreamFilter::Capture(id)) =
                (underway.revealed_by, &underway.filter)
            {
                let id = *id;
                let still = matches!(self.driver.capture_status(stream)?,
                    CaptureStatus::Active { id: active, .. } if active == id);
                if !still {
                    self.graphs.underway.remove(i);
                    continue;
                }
            }
            i += 1;
        }
        Ok(())
    }

    /// Frees the blocks whose free was deferred during a capture: records events on their other streams
    /// and parks them. Only once no capture is underway.
    pub(super) fn insert_deferred_events(&mut self) -> Result<(), Error> {
        while let Some(&addr) = self.graphs.deferred.last() {
            let slot = self.slot_of(addr).ok_or(Error::UnknownAddress { addr })?;
            let streams =
                (self.stream_uses.remove(&addr)).expect("a deferred free keeps its streams");
            // On failure the block stays live with its streams, and stays deferred.
            self.park_block(slot, addr, streams)?;
            self.graphs.deferred.pop();
        }
        Ok(())
    }

    /// Lets device `peer` reach every range mapped now and every one mapped later.
    pub(super) fn grant_peer(&mut self, peer: usize) -> Result<(), Error> {
        self.driver.add_peer(peer)?;
        let mut runs = Vec::new();
        for seg in self.live_segments() {
            for run in seg.pages.accessible_runs(0..seg.pages.len()) {
                runs.push((seg.page_addr(run.start), run.len() as u64 * self.page_size));
            }
        }
        for (va, size) in runs {
            self.driver.set_access(va, size)?;
        }
        tracing::info!(peer, "cuvmm: peer device given access");
        Ok(())
    }

    /// The graph part of `check_invariants()`: every segment's pool is live or released (and a released
    /// pool still has a segment), every pool being allocated to is live, and every deferred free is of a
    /// distinct live block that still has its streams.
    pub(super) fn check_graphs(&self) -> Result<(), InvariantViolation> {
        let broken = |addr| InvariantViolation::GraphPool { addr };
        for seg in self.live_segments() {
            if seg.graph.is_some_and(|pool| !self.graphs.is_known(pool)) {
                return Err(broken(seg.va.start));
            }
        }
        for &pool in &self.graphs.released {
            if self.graphs.is_live(pool) || !self.live_segments().any(|s| s.graph == Some(pool)) {
                return Err(broken(0));
            }
        }
        if (self.graphs.underway.iter()).any(|u| !self.graphs.is_live(u.pool)) {
            return Err(broken(0));
        }
        for (i, &addr) in self.graphs.deferred.iter().enumerate() {
            let live = self.slot_of(addr).is_some_and(|slot| {
                (self.segment(slot).block_at(addr)).is_some_and(|block| block.is_live())
            });
            if !live
                || !self.stream_uses.contains_key(&addr)
                || self.graphs.deferred[..i].contains(&addr)
            {
                return Err(broken(addr));
            }
        }
        Ok(())
    }

    /// Mapped bytes of live pools' segments, and how many pools are live.
    pub(super) fn graph_pool_bytes(&self) -> (u64, u64) {
        let bytes = self
            .live_segments()
            .filter(|seg| seg.graph.is_some_and(|pool| self.graphs.is_live(pool)))
            .map(|seg| seg.pages.mapped_count() as u64 * self.page_size)
            .sum();
        (bytes, self.graphs.live.len() as u64)
    }
}
