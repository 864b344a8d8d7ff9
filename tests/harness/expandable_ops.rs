//! The `expandable_ops` harness: fuzzer bytes decoded into allocator operations, some with a driver fault
//! armed, applied to an `Expandable<SimDriver>` with the backing store on, and checked against a model of
//! the live allocations. The fuzz target and `tests/fuzz_corpus.rs` run it through the generic
//! [`crate::strategy_ops`]. The input format is [`crate::expandable_input`]'s; the code
//! shared with `split_ops` is in [`crate::ops_common`].
//!
//! Properties checked after every operation:
//! - `check_invariants()` holds;
//! - live allocations are 512 B aligned and never overlap; the `allocated`, `requested` and `allocation`
//!   statistics equal the model's sums; `reserved_bytes` equals the physical bytes the driver holds and
//!   never exceeds the device;
//! - every live allocation reads back, byte for byte, what was written into it when it was handed out
//!   (filled through `DeviceBytes::memset`, with a marker every page's worth of bytes and at its end; read
//!   through `DeviceBytes::copy_to_host`);
//! - an operation during which no planned fault fired succeeds, except an allocation refused for the
//!   reason it earns: size 0 (`ZeroSize`), larger than the device (`TooLarge`), or out of memory when the
//!   pages the live blocks could touch do not fit the device (idle pages are always found and reused), or,
//!   with chunks that cannot be lent (no partial mappings, as on CUDA), the chunks they touch;
//! - an operation during which a fault fired either succeeds or fails with a typed driver or
//!   out-of-memory error (never a panic), and the allocator keeps working afterwards; a `free` that fails
//!   in the driver has still freed its block (the error comes from giving idle memory back);
//! - `free` of an address that is not live is refused with `DoubleFree` or `UnknownAddress` and makes no
//!   driver call;
//! - a successful `empty_cache` leaves nothing idle but, with chunks (`Setup::chunk_pages` > 1), the idle
//!   pages of the chunks that live blocks' ends lie in and of the chunks that lend pages to live blocks,
//!   and no lent page outside the live blocks; `trim` gives back what was asked (with single pages),
//!   within what was idle; `release_stranded` gives back no page of a live block (none without chunks),
//!   and reserved memory falls by what it says it gave back;
//! - the memory mapped, as a trace tracker sees it from the `segment_map` and `segment_unmap` events (the
//!   view NCCL's registration hooks keep), is what the driver has mapped, page for page: nothing is
//!   reported mapped twice, nothing unmapped that was not mapped, and no mapping goes unreported;
//! - `share` of a live allocation returns whole mappings that cover it; sharing it again makes no
//!   export call and hands out the same descriptors (a handle is exported once, until its release);
//! - at the end, with faults cleared: every free succeeds, `empty_cache` leaves nothing reserved and no
//!   segment, and the simulated driver reports no leak.
//!

use crate::expandable_input::{Action, PAGE, Setup, decode};
use crate::mapped_events::MappedEvents;
use crate::ops_common::{Content, Faults, Live, LiveSet, Model, OnSim, Summary, check_bad_free};
use crate::strategy_ops::OpsHarness;
use cuvmm::config::Compaction;
use cuvmm::driver::Op;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::Controls as _;
use cuvmm::strategy::Sharing as _;
use cuvmm::strategy::Snapshots as _;
use cuvmm::{Config, Error, Strategy as _, StreamId};
use std::sync::Arc;

/// Every request is rounded up to this many bytes.
const ROUND: u64 = 512;
/// What every live allocation holds: a marker every page's worth of bytes, and every byte read back.
const CONTENT: Content = Content {
    every: PAGE,
    sample: PAGE,
};

impl OnSim for Expandable<SimDriver> {
    fn sim_mut(&mut self) -> &mut SimDriver {
        self.driver_mut()
    }
}

impl OpsHarness for Expandable<SimDriver> {
    type Setup = Setup;
    type Model = State;

    fn decode(data: &[u8]) -> (Setup, Vec<Action>) {
        decode(data)
    }

    fn model(setup: &Setup) -> State {
        State::new(setup)
    }
}
/// The allocator, the model of its live allocations, and the faults armed but not fired yet.
pub struct State {
    alloc: Expandable<SimDriver>,
    faults: Faults,
    capacity: u64,
    chunk_pages: u64,
    /// Whether idle pages of a chunk in use can be lent (the simulator maps parts of handles).
    lends: bool,
    live: LiveSet,
    summary: Summary,
    /// The pages mapped, as a trace tracker sees them.
    mapped: MappedEvents,
}

impl State {
    fn new(setup: &Setup) -> Self {
        let capacity = setup.pages * PAGE;
        let sim = SimDriver::new(
            SimConfig::default()
                .with_capacity(capacity)
                .with_granularity(PAGE)
                .with_backing_store(true)
                .with_partial_mappings(setup.partial_mappings),
        );
        let config = Config {
            small_size: setup.small_size,
            large_handle: setup.chunk_pages * PAGE,
            compaction: match setup.split {
                true => Compaction::Split,
                false => Compaction::Pressure,
            },
            ..Config::default()
        }
        .with_max_idle_bytes(setup.max_idle_bytes);
        let mut alloc = Expandable::new(sim, config).expect("a valid configuration");
        let mapped = MappedEvents::attach(&mut alloc, PAGE);
        Self {
            alloc,
            mapped,
            faults: Faults::default(),
            capacity,
            chunk_pages: setup.chunk_pages,
            lends: setup.partial_mappings,
            live: LiveSet::default(),
            summary: Summary::default(),
        }
    }

    /// Whether an armed fault fired since the last call; forgets the faults that fired.
    fn faults_fired(&mut self) -> bool {
        self.faults.fired_since(&self.alloc.driver_counters())
    }

    /// An error is acceptable only from an operation during which a fault fired, and only a typed driver
    /// or out-of-memory error.
    fn fault_error(&mut self, what: &str, err: Error, fired: bool) -> Result<(), String> {
        self.faults.accept(what, err, fired)
    }

    fn check_alloc(
        &mut self,
        size: u64,
        result: Result<u64, Error>,
        fired: bool,
    ) -> Result<(), String> {
        let rounded = size.checked_next_multiple_of(ROUND);
        let fits = rounded.is_some_and(|r| r <= self.capacity);
        match result {
            Ok(addr) if size == 0 || !fits => Err(format!("alloc({size}) succeeded at {addr:#x}")),
            Ok(addr) => self.record_alloc(addr, size),
            Err(Error::ZeroSize) if size == 0 => Ok(()),
            Err(Error::TooLarge { .. }) if size > 0 && !fits => Ok(()),
            Err(err) if size == 0 || !fits => Err(format!("alloc({size}) failed with {err:?}")),
            Err(Error::OutOfMemory(oom)) if !fired => {
                // Each live block touches at most its own pages plus one partial page at each end. Where
                // chunks cannot be lent (no partial mappings, as on CUDA), a chunk is unmapped whole, so a
                // block holds every page of the chunks it touches: at most its own chunks plus one.
                let chunk = self.chunk_pages * PAGE;
                let stranding = self.chunk_pages > 1 && !self.lends;
                let bound: u64 = self
                    .live
                    .iter()
                    .map(|(_, l)| l.size)
                    .chain([size])
                    .map(|s| {
                        let s = s.next_multiple_of(ROUND);
                        if stranding {
                            (s.div_ceil(chunk) + 1) * self.chunk_pages
                        } else {
                            s.div_ceil(PAGE) + 2
                        }
                    })
                    .sum::<u64>()
                    * PAGE;
                if bound <= self.capacity {
                    return Err(format!(
                        "out of memory for {size} B though live pages fit: {oom}"
                    ));
                }
                self.summary.ooms += 1;
                Ok(())
            }
            Err(err) => {
                if err.is_out_of_memory() {
                    self.summary.ooms += 1;
                }
                self.fault_error(&format!("alloc({size})"), err, fired)
            }
        }
    }

    /// Checks a new allocation against the live ones, fills it, writes its markers and records it.
    fn record_alloc(&mut self, addr: u64, size: u64) -> Result<(), String> {
        self.live
            .check_new(addr, size, ROUND, |s| s.next_multiple_of(ROUND))?;
        let live = self.live.insert(addr, size);
        CONTENT.write(&mut self.alloc, addr, live)?;
        self.summary.allocs += 1;
        Ok(())
    }

    /// Shares a live allocation twice: whole mappings that cover it, and the second time the same
    /// descriptors with no export call. Sharing makes no call a fault is armed on.
    fn share(&mut self, pick: u8) -> Result<(), String> {
        let Some(addr) = self.live.pick(u16::from(pick)) else {
            return Ok(());
        };
        let size = self
            .live
            .iter()
            .find(|&(a, _)| a == addr)
            .map_or(0, |(_, l)| l.size);
        let exports = |alloc: &Expandable<SimDriver>| alloc.driver_counters().get(Op::Export);
        let first = (self.alloc.share(addr)).map_err(|err| format!("share({addr:#x}): {err}"))?;
        let made = exports(&self.alloc);
        let again =
            (self.alloc.share(addr)).map_err(|err| format!("share({addr:#x}) again: {err}"))?;
        let covers = first.offset + size <= first.range_size() && first.size >= size;
        let same = first.parts.len() == again.parts.len()
            && (first.parts.iter().zip(&again.parts)).all(|(a, b)| Arc::ptr_eq(&a.fd, &b.fd));
        if !covers || !same || exports(&self.alloc) != made || again.offset != first.offset {
            return Err(format!(
                "share({addr:#x}) of {size} B: {first:?}, then {again:?} ({} export calls more)",
                exports(&self.alloc) - made
            ));
        }
        Ok(())
    }

    /// Frees a live allocation; a failure in the driver must still have freed it.
    fn free(&mut self, pick: u16) -> Result<(), String> {
        let Some(addr) = self.live.pick(pick) else {
            return Ok(());
        };
        let result = self.alloc.free(addr);
        let fired = self.faults_fired();
        if let Err(err) = result {
            self.fault_error(&format!("free({addr:#x})"), err, fired)?;
            let left = self.alloc.stats().allocation.current;
            if left != self.live.len() as u64 - 1 {
                return Err(format!(
                    "free({addr:#x}) failed in the driver and left {left} allocations of {}",
                    self.live.len()
                ));
            }
        }
        self.live.remove(addr);
        Ok(())
    }
}

impl Model for State {
    type Action = Action;

    fn summary(&self) -> Summary {
        Summary {
            faults_fired: self.faults.fired,
            failed_by_fault: self.faults.failed,
            ..self.summary
        }
    }

    /// Applies one operation and checks what it returned.
    fn apply(&mut self, action: &Action) -> Result<(), String> {
        match *action {
            Action::Alloc { size, stream } => {
                let result = self.alloc.alloc(size, StreamId(stream));
                let fired = self.faults_fired();
                self.check_alloc(size, result, fired)
            }
            Action::Free { pick } => self.free(pick),
            Action::BadFree { pick } => check_bad_free(&mut self.alloc, self.live.non_live(pick)),
            Action::EmptyCache => {
                let result = self.alloc.empty_cache();
                match (result, self.faults_fired()) {
                    (Ok(()), _) => {
                        let stats = self.alloc.stats();
                        // A chunk is unmapped whole: each live block may keep the idle pages of the
                        // chunks its two ends lie in, and each page lent into it (mapped a second time
                        // there) those of its lender chunk. A lent page outside every live block goes home.
                        let spanned: u64 = (self.live.iter())
                            .map(|(addr, l)| ((addr + l.size).div_ceil(PAGE) - addr / PAGE) * PAGE)
                            .sum();
                        let pinning = 2 * self.live.len() as u64 + stats.lent_bytes / PAGE;
                        let stranded = pinning * (self.chunk_pages - 1) * PAGE;
                        if stats.idle_handle_bytes != 0
                            || stats.lent_bytes > spanned
                            || stats.idle_mapped_bytes > stranded
                        {
                            return Err(format!("empty_cache left idle memory: {stats:?}"));
                        }
                        Ok(())
                    }
                    (Err(err), fired) => self.fault_error("empty_cache", err, fired),
                }
            }
            Action::Trim { pages } => {
                let stats = self.alloc.stats();
                let idle = stats.idle_mapped_bytes + stats.idle_handle_bytes;
                let result = self.alloc.trim(pages * PAGE);
                match (result, self.faults_fired()) {
                    (Ok(released), _) if released > idle => {
                        Err(format!("trim released {released} of {idle} idle bytes"))
                    }
                    // Idle pages of a chunk in use cannot be given back: no lower bound with chunks.
                    (Ok(released), false)
                        if self.chunk_pages == 1 && released < (pages * PAGE).min(idle) =>
                    {
                        Err(format!(
                            "trim({}) released only {released} of {idle} idle bytes",
                            pages * PAGE
                        ))
                    }
                    (Ok(_), _) => Ok(()),
                    (Err(err), fired) => self.fault_error("trim", err, fired),
                }
            }
            Action::ReleaseStranded => {
                let stats = self.alloc.stats();
                let result = self.alloc.release_stranded();
                let after = self.alloc.stats().reserved_bytes.current;
                match (result, self.faults_fired()) {
                    // The frees that wait are settled first: their blocks' pages may go too.
                    (Ok(released), _)
                        if released
                            > (stats.reserved_bytes.current)
                                .saturating_sub(stats.allocated_bytes.current) =>
                    {
                        Err(format!(
                            "release_stranded gave back {released} B of {} B reserved, {} B allocated",
                            stats.reserved_bytes.current, stats.allocated_bytes.current
                        ))
                    }
                    (Ok(released), _) if released > 0 && self.chunk_pages == 1 => Err(format!(
                        "release_stranded gave back {released} B without chunks"
                    )),
                    (Ok(released), false) if after != stats.reserved_bytes.current - released => {
                        Err(format!(
                            "release_stranded gave back {released} B but reserved went from {} to {after}",
                            stats.reserved_bytes.current
                        ))
                    }
                    (Ok(_), _) => Ok(()),
                    (Err(err), fired) => self.fault_error("release_stranded", err, fired),
                }
            }
            Action::Fault { op, n, kind } => {
                self.faults.arm(&mut self.alloc, op, n, kind);
                Ok(())
            }
            Action::Share { pick } => self.share(pick),
        }
    }

    /// The properties that hold after every operation.
    fn check(&mut self) -> Result<(), String> {
        self.alloc
            .check_invariants()
            .map_err(|v| format!("invariant broken: {v}"))?;
        let stats = self.alloc.stats();
        let rounded: u64 = self
            .live
            .iter()
            .map(|(_, l)| l.size.next_multiple_of(ROUND))
            .sum();
        let mut requested: u64 = self.live.iter().map(|(_, l)| l.size).sum();
        if stats.active_bytes.current != stats.allocated_bytes.current {
            // Blocks freed and waiting for other streams' events: their requested bytes count until then,
            // as PyTorch's.
            let snapshot = (self.alloc.snapshot()).map_err(|e| format!("snapshot: {e}"))?;
            requested += snapshot.pending_requested_bytes();
        }
        let counts = (
            stats.allocated_bytes.current,
            stats.requested_bytes.current,
            stats.allocation.current,
        );
        if counts != (rounded, requested, self.live.len() as u64) {
            return Err(format!(
                "stats (allocated, requested, allocations) = {counts:?}, model has {:?}",
                (rounded, requested, self.live.len())
            ));
        }
        let used = self.alloc.driver().used_bytes();
        if stats.reserved_bytes.current != used || used > self.capacity {
            return Err(format!(
                "reserved {} B, driver holds {used} B of {}",
                stats.reserved_bytes.current, self.capacity
            ));
        }
        let live: Vec<(u64, Live)> = self.live.iter().collect();
        for (addr, l) in live {
            CONTENT.verify(&mut self.alloc, addr, l)?;
        }
        self.mapped.check(&self.alloc)
    }

    /// Clears the faults, frees everything and checks that the device is left holding nothing.
    fn finish(&mut self) -> Result<(), String> {
        self.faults.clear(&mut self.alloc);
        for (addr, _) in std::mem::take(&mut self.live).iter() {
            self.alloc
                .free(addr)
                .map_err(|e| format!("free({addr:#x}): {e:?}"))?;
        }
        self.alloc
            .empty_cache()
            .map_err(|e| format!("empty_cache: {e:?}"))?;
        self.check()?;
        let stats = self.alloc.stats();
        if stats.reserved_bytes.current != 0 || stats.segment.current != 0 {
            return Err(format!("empty_cache kept memory: {stats:?}"));
        }
        let leaks = self.alloc.driver().leak_report();
        if !leaks.is_empty() {
            return Err(format!("the driver reports leaks: {leaks}"));
        }
        Ok(())
    }
}
