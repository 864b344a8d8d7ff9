//! What cuvmm's allocator offers through the strategy traits: [`Strategy`], which every allocator has, and
//! each capability (`crate::strategy::capabilities`), all of which it has. Each method passes the call to
//! the orchestrator's own method or part that owns it.

use super::Expandable;
use super::accounting::Derived;
use super::invariants;
use crate::driver::{CaptureProbe, Driver, DriverCounters, HostMemory, StreamId};
use crate::strategy::Strategy;
use crate::strategy::capabilities::{
    Controls, DeviceBytes, GraphPools, Peers, Sharing, Snapshots, StreamUses, Tags,
};
use crate::strategy::config::ConfigError;
use crate::strategy::error::{Error, InvariantViolation};
use crate::strategy::graph_pool::{GraphPool, StreamFilter};
use crate::strategy::history::{TraceAction, TraceTracker};
use crate::strategy::sharing::{SharedMemory, SharedPart};
use crate::strategy::snapshot::MemorySnapshot;
use crate::strategy::stats::Stats;
use crate::strategy::tags::{Begun, TagCopy, TagInfo};
use std::os::fd::BorrowedFd;

impl<D: Driver> Strategy for Expandable<D> {
    fn name(&self) -> &'static str {
        "cuvmm"
    }

    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        self.alloc_in(size, stream, None)
    }

    /// Frees the block at `addr`. Once the block is free this returns `Ok`: if giving idle memory beyond
    /// `max_idle_bytes` back to the driver then fails, the memory stays idle (the next free tries again) and
    /// the failure is reported through `tracing`, so a caller never sees an error for a free that happened.
    fn free(&mut self, addr: u64) -> Result<(), Error> {
        self.free_block(addr)?;
        self.release_excess_idle();
        Ok(())
    }

    fn empty_cache(&mut self) -> Result<(), Error> {
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway {
                operation: "empty_cache",
            });
        }
        let (supply, mut parts) = self.supply_and_parts();
        supply.release_cache(&mut parts)?;
        self.free_empty_segments()
    }

    /// Releases what is idle now. Pending blocks are not idle: the next allocation polls their events, and
    /// `empty_cache` waits for them.
    fn trim(&mut self, bytes: u64) -> Result<u64, Error> {
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway { operation: "trim" });
        }
        let (supply, mut parts) = self.supply_and_parts();
        supply.release_idle(&mut parts, bytes)
    }

    fn stats(&self) -> Stats {
        let (graph_pool_bytes, graph_pools) =
            self.graphs.pool_bytes(&self.segments, self.page_size);
        let [lent_small, lent_large] = self.books.lent_pages();
        self.books.counters.stats(Derived {
            largest_free_block: self.segments.largest_free_mapped_block(),
            idle_mapped_bytes: self.books.idle_pages() as u64 * self.page_size,
            idle_handle_bytes: self.supply.physical().pooled_pages() as u64 * self.page_size,
            lent_bytes: (lent_small + lent_large) as u64 * self.page_size,
            graph_pool_bytes,
            graph_pools,
            asleep_bytes: self.tags.asleep_bytes(&self.segments, self.page_size),
            host_kept_bytes: self.tags.host_bytes(),
            driver: self.driver.counters(),
        })
    }

    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        invariants::check(self)
    }

    fn driver_counters(&self) -> DriverCounters {
        self.driver.counters()
    }

    fn ordinal(&self) -> usize {
        self.driver.ordinal()
    }

    fn reserved_bytes(&self) -> u64 {
        self.books.counters.reserved.current
    }

    fn captures_underway(&self) -> usize {
        self.graphs.underway_count()
    }

    fn capture_probe(&self) -> Option<CaptureProbe> {
        self.graphs
            .detects()
            .then(|| self.driver.capture_probe())
            .flatten()
    }

    fn stream_uses(&mut self) -> Option<&mut dyn StreamUses> {
        Some(self)
    }

    fn snapshots(&mut self) -> Option<&mut dyn Snapshots> {
        Some(self)
    }

    fn tags(&self) -> Option<&dyn Tags> {
        Some(self)
    }

    fn device_bytes(&mut self) -> Option<&mut dyn DeviceBytes> {
        Some(self)
    }
}

impl<D: Driver> StreamUses for Expandable<D> {
    fn record_stream(&mut self, addr: u64, stream: StreamId) -> Result<(), Error> {
        self.record_stream_use(addr, stream)
    }
}

impl<D: Driver> GraphPools for Expandable<D> {
    fn begin_allocate_to_pool(
        &mut self,
        pool: GraphPool,
        filter: StreamFilter,
    ) -> Result<(), Error> {
        self.ready_to_begin_pool()?;
        self.graphs.begin_pool(pool, filter, None)
    }

    fn ready_to_begin_pool(&self) -> Result<(), Error> {
        match self.tags.host_job() {
            Some(id) => Err(self.tags.busy_error("begin_allocate_to_pool", id)),
            None => Ok(()),
        }
    }

    fn end_allocate_to_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.graphs.end_pool(pool, &self.segments)
    }

    fn mark_captures(&mut self) {
        self.graphs.mark_captures();
    }

    fn mark_capture(&mut self, begun: bool) {
        self.graphs.mark_capture(begun);
    }

    fn release_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.graphs.drop_pool_use(pool, &self.segments)
    }

    fn incref_pool(&mut self, pool: GraphPool) -> Result<(), Error> {
        self.graphs.incref_pool(pool)
    }
}

impl<D: Driver> Tags for Expandable<D> {
    fn alloc_tagged(&mut self, size: u64, stream: StreamId, tag: &str) -> Result<u64, Error> {
        Expandable::alloc_tagged(self, size, stream, tag)
    }

    fn sleep(&mut self, tag: &str, keep: bool) -> Result<u64, Error> {
        Expandable::sleep(self, tag, keep)
    }

    fn wake(&mut self, tag: &str) -> Result<(), Error> {
        Expandable::wake(self, tag)
    }

    fn begin_sleep(&mut self, tag: &str, keep: bool) -> Result<Begun<u64>, Error> {
        Expandable::begin_sleep(self, tag, keep)
    }

    fn finish_sleep(&mut self, copy: TagCopy) -> Result<u64, Error> {
        Expandable::finish_sleep(self, copy)
    }

    fn begin_wake(&mut self, tag: &str) -> Result<Begun<()>, Error> {
        Expandable::begin_wake(self, tag)
    }

    fn finish_wake(&mut self, copy: TagCopy) -> Result<(), Error> {
        Expandable::finish_wake(self, copy)
    }

    fn begin_prepare_sleep(&mut self, tag: &str) -> Result<Begun<u64>, Error> {
        Expandable::begin_prepare_sleep(self, tag)
    }

    fn finish_prepare_sleep(&mut self, copy: TagCopy) -> Result<u64, Error> {
        Expandable::finish_prepare_sleep(self, copy)
    }

    fn asleep_tags(&self) -> Vec<(String, u64)> {
        Expandable::asleep_tags(self)
    }

    fn release_host_buffers(&mut self, tag: Option<&str>) -> Result<u64, Error> {
        Expandable::release_host_buffers(self, tag)
    }

    fn read_kept(&self, addr: u64, out: &mut [u8]) -> Result<Option<String>, Error> {
        Expandable::read_kept(self, addr, out)
    }

    fn take_freed_host(&mut self) -> Vec<HostMemory> {
        Expandable::take_freed_host(self)
    }

    fn tag_infos(&self) -> Vec<TagInfo> {
        Expandable::tag_infos(self)
    }
}

impl<D: Driver> Sharing for Expandable<D> {
    fn share(&mut self, addr: u64) -> Result<SharedMemory, Error> {
        self.share_block(addr)
    }

    fn open_shared(&mut self, parts: &[SharedPart<BorrowedFd<'_>>]) -> Result<u64, Error> {
        self.imports.open(&mut self.driver, parts)
    }

    fn close_shared(&mut self, addr: u64) -> Result<(), Error> {
        self.imports.close(&mut self.driver, addr)
    }
}

impl<D: Driver> Peers for Expandable<D> {
    fn add_peer(&mut self, peer: usize) -> Result<(), Error> {
        self.grant_peer(peer)
    }
}

impl<D: Driver> Snapshots for Expandable<D> {
    fn snapshot(&self) -> Result<MemorySnapshot, Error> {
        Ok(self.memory_snapshot())
    }

    fn record_history(&mut self, max_entries: Option<usize>) -> Result<(), Error> {
        self.books.record_history(max_entries);
        Ok(())
    }

    fn attach_trace_tracker(&mut self, tracker: TraceTracker) -> Result<(), Error> {
        self.books.attach_trace_tracker(tracker);
        Ok(())
    }

    fn record_event(
        &mut self,
        action: TraceAction,
        addr: u64,
        size: u64,
        stream: StreamId,
        pool: GraphPool,
    ) {
        self.books.record(action, addr, size, stream, Some(pool));
    }
}

impl<D: Driver> DeviceBytes for Expandable<D> {
    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error> {
        Ok(self.driver.memset_d8(addr, len, value)?)
    }

    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        Ok(self.driver.copy_to_host(addr, out)?)
    }
}

impl<D: Driver> Controls for Expandable<D> {
    fn reset_peak_stats(&mut self) -> Result<(), Error> {
        self.books.counters.reset_peaks();
        Ok(())
    }

    fn reset_accumulated_stats(&mut self) -> Result<(), Error> {
        self.books.counters.reset_accumulated();
        Ok(())
    }

    /// The growth budget follows the new limit ([`Config::budget_bytes`](crate::Config::budget_bytes)), up
    /// or down, as PyTorch's garbage collection threshold follows its `allowed_memory_maximum`.
    fn set_memory_fraction(&mut self, fraction: f64) -> Result<(), Error> {
        if !(0.0..=1.0).contains(&fraction) {
            return Err(ConfigError::BadValue {
                key: "per_process_memory_fraction".into(),
                value: fraction.to_string(),
                expected: "a fraction in [0, 1]",
            }
            .into());
        }
        let limit = (fraction * self.device_total as f64) as u64;
        let budget = (self.config).budget_bytes(self.device_total, self.device_free, Some(limit));
        self.supply
            .set_limit(limit, budget, self.books.counters.reserved.current);
        Ok(())
    }

    fn release_stranded(&mut self) -> Result<u64, Error> {
        if self.graphs.capturing() {
            return Err(Error::CaptureUnderway {
                operation: "release_stranded",
            });
        }
        let (supply, mut parts) = self.supply_and_parts();
        supply.release_stranded(&mut parts)
    }

    fn memory_fraction(&self) -> Option<f64> {
        let total = self.device_total.max(1) as f64;
        (self.supply.physical().limit()).map(|limit| limit as f64 / total)
    }

    fn set_device_margin(&mut self, bytes: u64) {
        self.supply.set_margin(bytes);
    }
}
