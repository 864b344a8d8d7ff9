//! A request for memory, from its start to its answer, and the one place that decides what a request that
//! runs out of memory does (PyTorch's `num_alloc_retries` and `num_ooms` count what happens here):
//! 1. the block path tries it (`alloc.rs`: place, carve, back with pages);
//! 2. when the driver runs out creating pages, the supply releases the cache and creates again, once per
//!    request, never during a capture: the request hands it that allowance ([`Shortage`]) and reads back
//!    whether it was used;
//! 3. still out of memory, memory the caller holds back from this allocator (the facade's stream caches,
//!    `held_back.rs`) is given back and the request tried once more, without a second release;
//! 4. still out of memory, the request gives back what it gathered (its handles and the pages its block had
//!    mapped; the whole cache if it was not released yet) and fails with the diagnosis ([`OutOfMemory`]).
//!
//! At most one retry and one out-of-memory are counted per request. A wake maps its blocks as one request,
//! with the same allowance and the same retry (but gives nothing back and counts no out-of-memory: it
//! leaves the tag asleep to wake again).

use super::alloc::{Request, Unserved};
use super::segment::TagId;
use super::supply::Shortage;
use super::{Expandable, ROUND};
use crate::base::size::round_up;
use crate::driver::{Driver, MemInfo, StreamId};
use crate::strategy::config::Compaction;
use crate::strategy::error::{Error, OutOfMemory, ReclaimStep, StrandedRemedy};
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::pool::Pool;

impl<D: Driver> Expandable<D> {
    /// Allocates `size` bytes on `stream`, under `tag` if given.
    pub(super) fn alloc_in(
        &mut self,
        size: u64,
        stream: StreamId,
        tag: Option<TagId>,
    ) -> Result<u64, Error> {
        let graph = self.graphs.pool_for(&mut self.driver, stream)?;
        // Event queries are refused during a capture; pending frees wait until it ends.
        if !self.graphs.capturing() {
            self.poll_pending()?;
        }
        self.allocate(size, stream, graph, tag)
    }

    /// Allocates `size` bytes on `stream` (see the module's doc for what happens on out-of-memory).
    fn allocate(
        &mut self,
        size: u64,
        stream: StreamId,
        graph: Option<GraphPool>,
        tag: Option<TagId>,
    ) -> Result<u64, Error> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let rounded = match round_up(size, ROUND) {
            Some(rounded) if rounded <= self.device_total => rounded,
            _ => {
                // Never fits, so nothing is released for it; but it is an out-of-memory, counted and
                // recorded as PyTorch does.
                self.books.counters.ooms += 1;
                let device_free = self.driver.mem_info().map_or(0, |info| info.free);
                self.books.record_oom(size, stream, graph, device_free);
                return Err(Error::TooLarge {
                    requested: size,
                    capacity: self.device_total,
                });
            }
        };
        let pool = if rounded <= self.config.small_size {
            Pool::Small
        } else {
            Pool::Large
        };
        // A pool that splits no page (`MemPool(no_split=True)`): each allocation takes whole pages.
        let rounded = match self.graphs.no_split(graph) {
            true => round_up(rounded, self.page_size).unwrap_or(rounded),
            false => rounded,
        };
        let marks = self.reclaim_marks();
        let request = Request {
            size,
            rounded,
            stream,
            pool,
            graph,
            tag,
        };
        // Releasing the cache waits and unmaps, which a capture forbids.
        let mut shortage = Shortage::allowing(!self.graphs.capturing()).keeping_margin();
        let mut result = self.serve(request, &mut shortage);
        let (mut gave_back, mut give_back_error) = (false, None);
        if matches!(&result, Err(Unserved::Backing(err)) if err.is_out_of_memory()) {
            match self.give_back_held() {
                Ok(true) => {
                    gave_back = true;
                    result = self.serve(request, &mut shortage);
                }
                Ok(false) => {}
                Err(err) => give_back_error = Some(err),
            }
        }
        self.count_retry(&shortage, gave_back);
        match result {
            Ok(addr) => Ok(addr),
            Err(Unserved::Placing(err)) => Err(err),
            Err(Unserved::Backing(err)) if !err.is_out_of_memory() => Err(err),
            Err(Unserved::Backing(_)) => {
                // The free memory of pools that lend it when memory runs out (`use_on_oom`, `carve.rs`).
                if graph.is_none()
                    && tag.is_none()
                    && let Some(addr) = self.serve_from_pools(size, rounded, stream, pool)?
                {
                    return Ok(addr);
                }
                let oom = self.give_up(&shortage, request, marks);
                // A held-back block that could not be freed is the caller's bug: said rather than the
                // out-of-memory it left unretried.
                Err(give_back_error.unwrap_or(oom))
            }
        }
    }

    /// Maps the pages under `blocks` (a tag's wake) as one request: the cache released once if the driver
    /// runs out, then, still out of memory, what the caller holds back given back and the blocks tried
    /// once more.
    pub(super) fn map_blocks(&mut self, blocks: &[(u64, u64)]) -> Result<(), Error> {
        let mut shortage = Shortage::allowing(!self.graphs.capturing());
        let mut result = self.back_blocks(blocks, &mut shortage);
        let mut gave_back = false;
        if result.as_ref().is_err_and(Error::is_out_of_memory) {
            gave_back = self.give_back_held()?;
            if gave_back {
                result = self.back_blocks(blocks, &mut shortage);
            }
        }
        self.count_retry(&shortage, gave_back);
        result
    }

    /// Counts the request's retry, if it made one: released the cache, created single pages for a chunk
    /// that ran out, or was tried again with memory given back (PyTorch counts one per request).
    fn count_retry(&mut self, shortage: &Shortage, gave_back: bool) {
        if shortage.released() || shortage.fell_back() || gave_back {
            self.books.counters.retries += 1;
        }
    }

    /// Frees what the caller holds back ([`HeldBack`](super::HeldBack)), if anything; says whether it gave
    /// anything back. A free that fails is returned after the others are done.
    fn give_back_held(&mut self) -> Result<bool, Error> {
        let Some(held) = self.held_back.as_ref().filter(|held| held.any()) else {
            return Ok(false);
        };
        let addrs = held.take_all();
        let mut first_error = None;
        for &addr in &addrs {
            match self.free_block(addr) {
                Ok(()) => self.release_excess_idle(),
                Err(err) => {
                    first_error.get_or_insert(err);
                }
            }
        }
        tracing::info!(
            blocks = addrs.len(),
            "cuvmm: out of memory; gave back the memory held back and trying once more"
        );
        first_error.map_or(Ok(!addrs.is_empty()), Err)
    }

    /// The request that ran out of memory gives back what it gathered (the handles it obtained and the pages
    /// its block had mapped; the whole cache if it was not released for it, unless a capture forbids it),
    /// and is counted and recorded as an out-of-memory: the error, with the diagnosis.
    fn give_up(&mut self, shortage: &Shortage, request: Request, marks: ReclaimMarks) -> Error {
        let Request {
            size,
            rounded,
            stream,
            graph,
            ..
        } = request;
        if !self.graphs.capturing() {
            let (supply, mut parts) = self.supply_and_parts();
            let gave = match shortage.released() {
                true => supply.release_all_idle(&mut parts),
                false => supply.release_cache(&mut parts),
            };
            if let Err(release_err) = gave {
                tracing::warn!(%release_err, "cuvmm: releasing the cache after out-of-memory failed");
            }
        }
        self.books.counters.ooms += 1;
        let oom = self.out_of_memory(size, rounded, stream, marks);
        (self.books).record_oom(rounded, stream, graph, oom.device_free);
        tracing::info!(
            requested = size,
            stream = stream.0,
            allocated = oom.allocated,
            reserved = oom.reserved,
            "cuvmm: out of memory"
        );
        Error::OutOfMemory(Box::new(oom))
    }

    /// The counters that say which reclaim steps ran, read when a request starts.
    fn reclaim_marks(&self) -> ReclaimMarks {
        ReclaimMarks {
            compacted: self.books.counters.compacted,
            released: self.books.counters.released,
            retries: self.books.counters.retries,
        }
    }

    /// The out-of-memory error for a request of `requested` bytes (`rounded` after rounding), with the
    /// allocator's state for diagnosis and the reclaim steps run since `marks` were read.
    fn out_of_memory(
        &mut self,
        requested: u64,
        rounded: u64,
        stream: StreamId,
        marks: ReclaimMarks,
    ) -> OutOfMemory {
        let info = self.driver.mem_info().unwrap_or(MemInfo {
            free: 0,
            total: self.device_total,
        });
        let c = &self.books.counters;
        let mut reclaim = Vec::new();
        if c.compacted > marks.compacted {
            reclaim.push(ReclaimStep::Compaction {
                pages: c.compacted - marks.compacted,
            });
        }
        if c.released > marks.released {
            reclaim.push(ReclaimStep::ReleaseCache {
                bytes: (c.released - marks.released) * self.page_size,
            });
        }
        let retried = c.retries > marks.retries;
        if retried {
            reclaim.push(ReclaimStep::Retry);
        }
        let physical = self.supply.physical();
        OutOfMemory {
            allocator: "cuvmm",
            device: self.driver.ordinal(),
            requested,
            alloc_size: rounded,
            stream,
            device_total: info.total,
            device_free: info.free,
            allowed: physical.limit(),
            margin: physical.margin(),
            allocated: c.allocated.current(),
            reserved: c.reserved.current,
            idle: self.supply.idle_bytes(&self.books),
            idle_handles: physical.pooled_pages() as u64 * self.page_size,
            stranded: self.supply.stranded_pages(&self.segments) as u64 * self.page_size,
            stranded_remedy: Some(match self.config.compaction {
                Compaction::Split => StrandedRemedy::SinglePages {
                    page_size: self.page_size,
                },
                Compaction::Pressure | Compaction::Eager => StrandedRemedy::Split,
            }),
            largest_free_block: self.segments.largest_free_mapped_block(),
            retried,
            graph_pool_bytes: self.graphs.pool_bytes(&self.segments, self.page_size).0,
            capturing: self.graphs.capturing(),
            asleep: self.tags.asleep_list(&self.segments, self.page_size),
            reclaim,
        }
    }
}

/// Counters read when a request starts, to tell which reclaim steps it ran.
#[derive(Clone, Copy, Debug)]
struct ReclaimMarks {
    compacted: u64,
    released: u64,
    retries: u64,
}
