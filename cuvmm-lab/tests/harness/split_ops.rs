//! The `split_ops` harness: fuzzer bytes decoded into allocator operations, some with a driver fault armed,
//! applied to the model of PyTorch's allocator (`Split<SimDriver>`, classic or `expandable_segments:True`)
//! with the backing store on, and checked against a model of the live allocations. The fuzz target and
//! `tests/fuzz_corpus.rs` run it through the generic [`crate::strategy_ops`]. The input format
//! is [`crate::split_input`]'s; the code shared with `expandable_ops` is in [`crate::ops_common`].
//!
//! Properties checked after every operation:
//! - `check_invariants()` holds;
//! - live allocations are 512 B aligned and never overlap; the `requested` and `allocation` statistics
//!   equal the model's sums and `allocated_bytes` is at least the rounded sizes' sum; `reserved_bytes`
//!   equals the physical bytes the driver holds and never exceeds the device (nor, in the classic mode,
//!   the memory fraction);
//! - every live allocation reads back what was written into it when it was handed out (filled through
//!   `DeviceBytes::memset`, with a marker every 1 MiB and at its end; read through `DeviceBytes::copy_to_host`:
//!   every marker and a sample of the fill after each);
//! - an operation during which no planned fault fired succeeds, except an allocation refused for the
//!   reason it earns: size 0 (`ZeroSize`), larger than the device (`TooLarge`), or out of memory when the
//!   memory pinned by live blocks (whole segments; pages in expandable mode) plus what the request needs
//!   does not fit (everything else is released before PyTorch's retry);
//! - an operation during which a fault fired either succeeds or fails with a typed driver or
//!   out-of-memory error (never a panic), and the allocator keeps working afterwards;
//! - `free` of an address that is not live is refused with `DoubleFree` or `UnknownAddress`; no free makes
//!   a driver call;
//! - a successful `empty_cache` leaves only the pinned memory reserved; `trim` gives back at least what was
//!   asked (or everything releasable) and no more than it reports;
//! - at the end, with faults cleared: every free succeeds, `empty_cache` leaves nothing reserved and no
//!   segment, and the simulated driver reports no leak.
//!

use crate::ops_common::{Content, Faults, Live, LiveSet, Model, OnSim, Summary, check_bad_free};
use crate::split_input::{Action, GRANULE, MIB, Setup, decode};
use crate::strategy_ops::OpsHarness;
use cuvmm::config::RoundupDivisions;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::pool::Pool;
use cuvmm::{Config, Error, Strategy as _, StreamId};
use cuvmm_lab::pytorch_model::{Split, rules};
use std::collections::BTreeSet;

/// The memory fraction set when garbage collection is on.
const FRACTION: f64 = 0.9;
/// What every live allocation holds: allocations run to tens of MiB, so a marker every 1 MiB and a sample
/// of the fill after each.
const CONTENT: Content = Content {
    every: MIB,
    sample: 32,
};

impl OnSim for Split<SimDriver> {
    fn sim_mut(&mut self) -> &mut SimDriver {
        self.driver_mut()
    }
}

impl OpsHarness for Split<SimDriver> {
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
    alloc: Split<SimDriver>,
    faults: Faults,
    /// The most the allocator may hold: the device, or the memory fraction of it.
    limit: u64,
    capacity: u64,
    roundup: RoundupDivisions,
    live: LiveSet,
    summary: Summary,
}

impl State {
    fn new(setup: &Setup) -> Self {
        let capacity = setup.granules * GRANULE;
        let sim = SimDriver::new(
            SimConfig::default()
                .with_capacity(capacity)
                .with_granularity(GRANULE)
                .with_backing_store(true),
        );
        let roundup = if setup.roundup {
            RoundupDivisions::Uniform(4)
        } else {
            RoundupDivisions::None
        };
        let config = Config {
            expandable_segments: setup.expandable,
            max_split_size: setup.max_split_mb.map(|mb| mb * MIB),
            roundup_power2_divisions: roundup.clone(),
            garbage_collection_threshold: setup.gc.then_some(0.6),
            ..Config::default()
        };
        let mut alloc = Split::new(sim, config).expect("a valid configuration");
        let mut limit = capacity;
        if setup.gc {
            alloc
                .set_memory_fraction(FRACTION)
                .expect("a valid fraction");
            limit = (FRACTION * capacity as f64) as u64;
        }
        Self {
            alloc,
            faults: Faults::default(),
            limit,
            capacity,
            roundup,
            live: LiveSet::default(),
            summary: Summary {
                expandable: setup.expandable,
                ..Summary::default()
            },
        }
    }

    /// Whether an armed fault fired since the last call; forgets the faults that fired.
    fn faults_fired(&mut self) -> bool {
        self.faults.fired_since(&self.alloc.driver_counters())
    }

    /// The size the model rounds a request to, if it can.
    fn rounded(&self, size: u64) -> Option<u64> {
        rules::round_size(size, &self.roundup).filter(|&r| r <= self.capacity)
    }

    /// An error is acceptable only from an operation during which a fault fired, and only a typed driver
    /// or out-of-memory error.
    fn fault_error(&mut self, what: &str, err: Error, fired: bool) -> Result<(), String> {
        self.faults.accept(what, err, fired)
    }

    fn check_alloc(
        &mut self,
        size: u64,
        stream: u64,
        result: Result<u64, Error>,
        fired: bool,
    ) -> Result<(), String> {
        let rounded = self.rounded(size);
        match result {
            Ok(addr) if size == 0 || rounded.is_none() => {
                Err(format!("alloc({size}) succeeded at {addr:#x}"))
            }
            Ok(addr) => self.record_alloc(addr, size),
            Err(Error::ZeroSize) if size == 0 => Ok(()),
            Err(Error::TooLarge { .. }) if size > 0 && rounded.is_none() => Ok(()),
            // Beyond the device, PyTorch releases its cache before failing: a fault there may be the error.
            Err(err) if size == 0 || (rounded.is_none() && !fired) => {
                Err(format!("alloc({size}) failed with {err:?}"))
            }
            Err(Error::OutOfMemory(oom)) if !fired => {
                let rounded = rounded.unwrap_or(size);
                let (counted, physical) = self.need(rounded);
                let pinned = self.pinned();
                if pinned + counted <= self.limit && pinned + physical <= self.capacity {
                    return Err(format!(
                        "out of memory for {size} B on stream {stream} though live blocks pin \
                         {pinned} B and it needs {counted} B of {} ({physical} B of {} physically): \
                         {oom}",
                        self.limit, self.capacity
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

    /// What a request of `rounded` bytes needs beyond what live blocks pin: the size PyTorch checks
    /// against the memory fraction (`alloc_size`), and the most physical memory it can map.
    fn need(&self, rounded: u64) -> (u64, u64) {
        let segment = rules::allocation_size(rounded).unwrap_or(u64::MAX);
        if !self.alloc.is_expandable() {
            return (segment, segment);
        }
        let page = page_of(rules::pool_for(rounded));
        (segment, (rounded.div_ceil(page) + 1) * page)
    }

    /// Device memory that live blocks keep: every segment that holds one (classic), or every page that one
    /// touches (expandable segments). Everything else is released before PyTorch's retry.
    fn pinned(&self) -> u64 {
        let segments = self.alloc.segments();
        let mut pinned = 0;
        let mut pages: BTreeSet<(u64, u64)> = BTreeSet::new();
        for (addr, live) in self.live.iter() {
            let Some((range, _, pool)) = segments
                .iter()
                .find(|(range, ..)| range.contains_range(addr, live.size))
            else {
                continue;
            };
            if self.alloc.is_expandable() {
                let page = page_of(*pool);
                let first = (addr - range.start) / page;
                let end = (addr - range.start + self.rounded(live.size).unwrap_or(live.size))
                    .div_ceil(page);
                pages.extend((first..end).map(|p| (range.start, p * page)));
            } else {
                pages.insert((range.start, 0));
            }
        }
        for (start, offset) in pages {
            let (range, _, pool) = segments
                .iter()
                .find(|(range, ..)| range.start == start)
                .expect("a segment found above");
            pinned += if self.alloc.is_expandable() {
                page_of(*pool).min(range.size - offset)
            } else {
                range.size
            };
        }
        pinned
    }

    /// Checks a new allocation against the live ones, fills it, writes its markers and records it.
    fn record_alloc(&mut self, addr: u64, size: u64) -> Result<(), String> {
        self.live
            .check_new(addr, size, rules::MIN_BLOCK_SIZE, |s| {
                self.rounded(s).unwrap_or(s)
            })?;
        let live = self.live.insert(addr, size);
        CONTENT.write(&mut self.alloc, addr, live)?;
        self.summary.allocs += 1;
        Ok(())
    }

    /// Frees a live allocation: it must succeed, without a driver call.
    fn free(&mut self, pick: u16) -> Result<(), String> {
        let Some(addr) = self.live.pick(pick) else {
            return Ok(());
        };
        let calls = self.alloc.driver_counters().total();
        self.alloc
            .free(addr)
            .map_err(|e| format!("free({addr:#x}) failed: {e:?}"))?;
        if self.alloc.driver_counters().total() != calls {
            return Err(format!("free({addr:#x}) made a driver call"));
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
                self.check_alloc(size, stream, result, fired)
            }
            Action::Free { pick } => self.free(pick),
            Action::BadFree { pick } => check_bad_free(&mut self.alloc, self.live.non_live(pick)),
            Action::EmptyCache => {
                let result = self.alloc.empty_cache();
                match (result, self.faults_fired()) {
                    (Ok(()), _) => {
                        let reserved = self.alloc.stats().reserved_bytes.current;
                        let pinned = self.pinned();
                        if reserved != pinned {
                            return Err(format!(
                                "empty_cache left {reserved} B reserved, live blocks pin {pinned} B"
                            ));
                        }
                        Ok(())
                    }
                    (Err(err), fired) => self.fault_error("empty_cache", err, fired),
                }
            }
            Action::Trim { mib } => {
                let before = self.alloc.stats().reserved_bytes.current;
                let releasable = before - self.pinned();
                let result = self.alloc.trim(mib * MIB);
                let after = self.alloc.stats().reserved_bytes.current;
                match (result, self.faults_fired()) {
                    (Ok(released), _) if released != before - after => Err(format!(
                        "trim reported {released} B released, reserved went from {before} to {after}"
                    )),
                    (Ok(released), false) if released < (mib * MIB).min(releasable) => {
                        Err(format!(
                            "trim({} MiB) released only {released} of {releasable} releasable bytes",
                            mib
                        ))
                    }
                    (Ok(_), _) => Ok(()),
                    (Err(err), fired) => self.fault_error("trim", err, fired),
                }
            }
            Action::Fault { op, n, kind } => {
                self.faults.arm(&mut self.alloc, op, n, kind);
                Ok(())
            }
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
            .map(|(_, l)| self.rounded(l.size).unwrap_or(l.size))
            .sum();
        let requested: u64 = self.live.iter().map(|(_, l)| l.size).sum();
        let counts = (stats.requested_bytes.current, stats.allocation.current);
        if counts != (requested, self.live.len() as u64) || stats.allocated_bytes.current < rounded
        {
            return Err(format!(
                "stats (allocated, requested, allocations) = ({}, {}, {}), model has (>= {rounded}, \
                 {requested}, {})",
                stats.allocated_bytes.current,
                counts.0,
                counts.1,
                self.live.len()
            ));
        }
        // The memory fraction bounds only the classic model: PyTorch checks a request's `alloc_size`
        // against it, and expandable segments may map more (whole 20 MiB pages).
        let used = self.alloc.driver().used_bytes();
        let bound = if self.alloc.is_expandable() {
            self.capacity
        } else {
            self.limit
        };
        if stats.reserved_bytes.current != used || used > bound {
            return Err(format!(
                "reserved {} B, driver holds {used} B of {bound}",
                stats.reserved_bytes.current
            ));
        }
        let live: Vec<(u64, Live)> = self.live.iter().collect();
        for (addr, l) in live {
            CONTENT.verify(&mut self.alloc, addr, l)?;
        }
        Ok(())
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
        if stats.reserved_bytes.current != 0 || !self.alloc.segments().is_empty() {
            return Err(format!(
                "empty_cache kept memory: {} B reserved, segments {:?}",
                stats.reserved_bytes.current,
                self.alloc.segments()
            ));
        }
        let leaks = self.alloc.driver().leak_report();
        if !leaks.is_empty() {
            return Err(format!("the driver reports leaks: {leaks}"));
        }
        Ok(())
    }
}

/// The page size of a pool in expandable mode.
fn page_of(pool: Pool) -> u64 {
    match pool {
        Pool::Small => rules::SMALL_BUFFER,
        Pool::Large => rules::LARGE_BUFFER,
    }
}
