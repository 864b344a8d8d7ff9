//! The `split_ops` harness: fuzzer bytes decoded into allocator operations, some with a driver fault armed,
//! applied to the model of PyTorch's allocator (`Split<SimDriver>`, classic or `expandable_segments:True`)
//! with the backing store on, and checked against a model of the live allocations. The fuzz target and
//! `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked after every operation:
//! - `check_invariants()` holds;
//! - live allocations are 512 B aligned and never overlap; the `requested` and `allocation` statistics
//!   equal the model's sums and `allocated_bytes` is at least the rounded sizes' sum; `reserved_bytes`
//!   equals the physical bytes the driver holds and never exceeds the device (nor, in the classic mode,
//!   the memory fraction);
//! - every live allocation reads back what was written into it when it was handed out (filled through
//!   `Strategy::memset`, with a marker every 1 MiB and at its end; read through `Strategy::copy_to_host`:
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
//! Input layout: byte 0 sets the device's size (24 to 88 units of 2 MiB); byte 1 the configuration (bit 0:
//! expandable segments; bits 1-2: `max_split_size_mb` none, 20, 40, none; bit 3:
//! `roundup_power2_divisions:4`; bit 4: `garbage_collection_threshold:0.6` with a memory fraction of 0.9);
//! then one operation per opcode byte and its arguments (see [`decode`]), at most [`MAX_ACTIONS`] of them.

use crate::input::Input;
use cuvmm::config::RoundupDivisions;
use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Pool;
use cuvmm::split::{Split, rules};
use cuvmm::{Config, Error, Strategy as _, StreamId};
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// The simulated device's granularity: PyTorch's small page, so both modes run on it.
pub const GRANULE: u64 = 2 * MIB;
/// Operations decoded from one input at most, so every input runs in milliseconds.
pub const MAX_ACTIONS: usize = 120;
/// The largest ordinary request.
const MAX_SIZE: u64 = 48 * MIB;
/// The memory fraction set when garbage collection is on.
const FRACTION: f64 = 0.9;
/// Sizes on either side of the split model's thresholds (512 B, 1 MiB, 10 MiB, 20 MiB, 40 MiB).
const THRESHOLDS: [u64; 14] = [
    512,
    MIB - 512,
    MIB,
    MIB + 512,
    2 * MIB,
    2 * MIB + 1,
    10 * MIB - 512,
    10 * MIB,
    10 * MIB + 1,
    20 * MIB - 512,
    20 * MIB,
    20 * MIB + 512,
    40 * MIB,
    40 * MIB + 1,
];
/// Spacing of the markers written into every allocation.
const MARKER_EVERY: u64 = MIB;
/// Bytes of one marker.
const MARKER: u64 = 16;
/// The driver calls a fault may be armed on: every call the split model makes after it is built.
const FAULT_OPS: [Op; 11] = [
    Op::Malloc,
    Op::Free,
    Op::Reserve,
    Op::Create,
    Op::Map,
    Op::SetAccess,
    Op::Unmap,
    Op::Release,
    Op::FreeReservation,
    Op::Synchronize,
    Op::MemInfo,
];

/// The device and allocator an input asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// Device size in units of [`GRANULE`].
    pub granules: u64,
    /// PyTorch's `expandable_segments`.
    pub expandable: bool,
    /// `max_split_size_mb`.
    pub max_split_mb: Option<u64>,
    /// `roundup_power2_divisions:4`.
    pub roundup: bool,
    /// `garbage_collection_threshold:0.6` and a memory fraction of [`FRACTION`].
    pub gc: bool,
}

/// One operation.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Allocates `size` bytes on stream `stream`.
    Alloc {
        /// Bytes asked for (0 and sizes beyond the device included).
        size: u64,
        /// Stream number.
        stream: u64,
    },
    /// Frees the live allocation picked by `pick` (modulo their number); nothing if there is none.
    Free {
        /// Picks the allocation.
        pick: u16,
    },
    /// Frees an address that is not live: one freed earlier, or one never handed out.
    BadFree {
        /// Picks the address.
        pick: u16,
    },
    /// `empty_cache()`.
    EmptyCache,
    /// `trim(mib * MIB)`.
    Trim {
        /// Mebibytes to give back.
        mib: u64,
    },
    /// Makes the `n`th next call of `op` fail with `kind`.
    Fault {
        /// The driver call.
        op: Op,
        /// Which call from now (1 = the next).
        n: u64,
        /// How it fails.
        kind: FaultKind,
    },
}

/// What one input exercised, so the corpus test can tell a meaningful corpus from an empty one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Summary {
    /// Operations applied.
    pub actions: usize,
    /// Allocations that succeeded.
    pub allocs: usize,
    /// Allocations refused for lack of memory.
    pub ooms: usize,
    /// Armed faults that fired.
    pub faults_fired: usize,
    /// Operations that failed because of a fault.
    pub failed_by_fault: usize,
    /// Whether the model ran in expandable mode.
    pub expandable: bool,
}

/// A property that did not hold, with the operations that led there.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The setup decoded from the input.
    pub setup: Setup,
    /// The operations applied, the failing one last (all of them if the final cleanup failed).
    pub actions: Vec<Action>,
    /// What went wrong.
    pub message: String,
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.message)?;
        writeln!(f, "setup: {:?}", self.setup)?;
        for (i, action) in self.actions.iter().enumerate() {
            writeln!(f, "  {i:3}: {action:?}")?;
        }
        Ok(())
    }
}

/// Decodes `data`: the setup, then one operation per opcode byte (`byte % 16`: 0-6 alloc, 7-10 free,
/// 11 bad free, 12 empty_cache, 13 trim, 14-15 arm a fault).
pub fn decode(data: &[u8]) -> (Setup, Vec<Action>) {
    let mut input = Input::new(data);
    let granules = 24 + u64::from(input.below(65));
    let flags = input.byte();
    let setup = Setup {
        granules,
        expandable: flags & 1 != 0,
        max_split_mb: [None, Some(20), Some(40), None][usize::from((flags >> 1) & 3)],
        roundup: flags & 8 != 0,
        gc: flags & 16 != 0,
    };
    let capacity = granules * GRANULE;
    let mut actions = Vec::new();
    while !input.is_empty() && actions.len() < MAX_ACTIONS {
        let action = match input.below(16) {
            0..=6 => Action::Alloc {
                size: decode_size(&mut input, capacity),
                stream: u64::from(input.below(3)),
            },
            7..=10 => Action::Free { pick: input.u16() },
            11 => Action::BadFree { pick: input.u16() },
            12 => Action::EmptyCache,
            13 => Action::Trim {
                mib: u64::from(input.below(64)),
            },
            _ => {
                let b = input.byte();
                Action::Fault {
                    op: FAULT_OPS[usize::from(b & 0x7f) % FAULT_OPS.len()],
                    n: 1 + u64::from(input.below(4)),
                    kind: if b & 0x80 == 0 {
                        FaultKind::Error
                    } else {
                        FaultKind::OutOfMemory
                    },
                }
            }
        };
        actions.push(action);
    }
    (setup, actions)
}

/// The bytes that [`decode`] turns into `setup` and `actions`: how the seed corpus is written.
///
/// # Panics
/// If a value cannot be encoded: a setup outside the decoded choices, a size no size byte decodes to.
#[allow(dead_code)] // Used by tests/fuzz_corpus.rs to write seeds; the fuzz target only decodes.
pub fn encode(setup: &Setup, actions: &[Action]) -> Vec<u8> {
    assert!((24..=88).contains(&setup.granules), "24 to 88 granules");
    let split = match setup.max_split_mb {
        None => 0,
        Some(20) => 1,
        Some(40) => 2,
        Some(other) => panic!("max_split_size_mb {other} is not one decode() produces"),
    };
    let flags = u8::from(setup.expandable)
        | split << 1
        | u8::from(setup.roundup) << 3
        | u8::from(setup.gc) << 4;
    let capacity = setup.granules * GRANULE;
    let mut out = vec![(setup.granules - 24) as u8, flags];
    for action in actions {
        match *action {
            Action::Alloc { size, stream } => {
                out.push(0);
                out.extend(encode_size(size, capacity));
                out.push(stream as u8);
            }
            Action::Free { pick } => out.extend([7, pick as u8, (pick >> 8) as u8]),
            Action::BadFree { pick } => out.extend([11, pick as u8, (pick >> 8) as u8]),
            Action::EmptyCache => out.push(12),
            Action::Trim { mib } => out.extend([13, mib as u8]),
            Action::Fault { op, n, kind } => {
                let index = FAULT_OPS.iter().position(|&o| o == op).expect("a fault op") as u8;
                let oom = if kind == FaultKind::OutOfMemory {
                    0x80
                } else {
                    0
                };
                out.extend([14, index | oom, (n - 1) as u8]);
            }
        }
    }
    out
}

/// The three size bytes that [`decode_size`] turns into `size`.
fn encode_size(size: u64, capacity: u64) -> [u8; 3] {
    let bytes = |b: u8, frac: u64| [b, frac as u8, (frac >> 8) as u8];
    if size == 0 {
        return bytes(255, 0);
    }
    if size > capacity {
        assert!(
            size - capacity - 1 <= u64::from(u16::MAX),
            "{size} is too far beyond the device"
        );
        return bytes(254, size - capacity - 1);
    }
    if let Some(i) = THRESHOLDS.iter().position(|&t| t == size) {
        return bytes(240 + i as u8, 0);
    }
    for b in 224..=227u8 {
        for frac in 0..96 {
            if whole_mib(b, frac) == size {
                return bytes(b, frac);
            }
        }
    }
    for b in 0..26u8 {
        for frac in 0..=u64::from(u16::MAX) {
            if (((MAX_SIZE >> b).max(1) * (frac + 1)) >> 16).max(1) == size {
                return bytes(b, frac);
            }
        }
    }
    panic!("no size bytes decode to {size}");
}

/// A request size: mostly log-uniform from 1 byte to [`MAX_SIZE`], sometimes a whole number of MiB (give
/// or take a little), a threshold of the split rules, 0, or more than the device holds.
fn decode_size(input: &mut Input<'_>, capacity: u64) -> u64 {
    let b = input.byte();
    let frac = u64::from(input.u16());
    match b {
        255 => 0,
        254 => capacity + 1 + frac,
        240..=253 => THRESHOLDS[usize::from(b - 240)],
        224..=239 => whole_mib(b, frac),
        _ => (((MAX_SIZE >> (b % 26)).max(1) * (frac + 1)) >> 16).max(1),
    }
}

/// 1 to 96 MiB, plus 0, 512 or 1 bytes, or less 512 bytes, as `b` says.
fn whole_mib(b: u8, frac: u64) -> u64 {
    let mib = (1 + frac % 96) * MIB;
    match (b - 224) % 4 {
        0 => mib,
        1 => mib + 512,
        2 => mib + 1,
        _ => mib - 512,
    }
}

/// Decodes `data`, applies every operation and checks the properties listed in the module docs.
pub fn run(data: &[u8]) -> Result<Summary, Failure> {
    let (setup, actions) = decode(data);
    let mut state = State::new(&setup);
    for (step, action) in actions.iter().enumerate() {
        if let Err(message) = state.apply(action).and_then(|()| state.check()) {
            return Err(Failure {
                setup,
                actions: actions[..=step].to_vec(),
                message: format!("step {step}: {message}"),
            });
        }
    }
    state.summary.actions = actions.len();
    match state.finish() {
        Ok(()) => Ok(state.summary),
        Err(message) => Err(Failure {
            setup,
            actions,
            message: format!("cleanup: {message}"),
        }),
    }
}

/// A live allocation of the model.
#[derive(Debug, Clone, Copy)]
struct Live {
    size: u64,
    id: u64,
}

/// The allocator, the model of its live allocations, and the faults armed but not fired yet.
struct State {
    alloc: Split<SimDriver>,
    /// The most the allocator may hold: the device, or the memory fraction of it.
    limit: u64,
    capacity: u64,
    roundup: RoundupDivisions,
    live: BTreeMap<u64, Live>,
    /// Addresses freed earlier, for `BadFree` (the most recent few).
    freed: Vec<u64>,
    /// Armed faults as (operation, absolute call number).
    armed: Vec<(Op, u64)>,
    next_id: u64,
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
            limit,
            capacity,
            roundup,
            live: BTreeMap::new(),
            freed: Vec::new(),
            armed: Vec::new(),
            next_id: 0,
            summary: Summary {
                expandable: setup.expandable,
                ..Summary::default()
            },
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
            Action::BadFree { pick } => self.bad_free(pick),
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
                let call = self.alloc.driver_counters().get(op) + n.max(1);
                self.alloc.driver_mut().fail_nth(op, n, kind);
                self.armed.push((op, call));
                Ok(())
            }
        }
    }

    /// Whether an armed fault fired since the last call; forgets the faults that fired.
    fn faults_fired(&mut self) -> bool {
        let counters = self.alloc.driver_counters();
        let before = self.armed.len();
        self.armed.retain(|&(op, call)| counters.get(op) < call);
        let fired = before - self.armed.len();
        self.summary.faults_fired += fired;
        fired > 0
    }

    /// An error is acceptable only from an operation during which a fault fired, and only a typed driver
    /// or out-of-memory error.
    fn fault_error(&mut self, what: &str, err: Error, fired: bool) -> Result<(), String> {
        if fired && (matches!(err, Error::Driver(_)) || err.is_out_of_memory()) {
            self.summary.failed_by_fault += 1;
            Ok(())
        } else {
            Err(format!("{what} failed (fault fired: {fired}): {err:?}"))
        }
    }

    /// The size the model rounds a request to, if it can.
    fn rounded(&self, size: u64) -> Option<u64> {
        rules::round_size(size, &self.roundup).filter(|&r| r <= self.capacity)
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
            Ok(addr) => self.record_alloc(addr, size, rounded.unwrap_or(size)),
            Err(Error::ZeroSize) if size == 0 => Ok(()),
            Err(Error::TooLarge { .. }) if size > 0 && rounded.is_none() => Ok(()),
            Err(err) if size == 0 || rounded.is_none() => {
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
        for (&addr, live) in &self.live {
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
    fn record_alloc(&mut self, addr: u64, size: u64, rounded: u64) -> Result<(), String> {
        if addr % rules::MIN_BLOCK_SIZE != 0 {
            return Err(format!("alloc({size}) returned misaligned {addr:#x}"));
        }
        if let Some((&prev, l)) = self.live.range(..=addr).next_back()
            && prev + self.rounded(l.size).unwrap_or(l.size) > addr
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {prev:#x}"));
        }
        if let Some((&next, _)) = self.live.range(addr..).next()
            && next < addr + rounded
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {next:#x}"));
        }
        self.next_id += 1;
        let id = self.next_id;
        self.alloc
            .memset(addr, size, fill(id))
            .map_err(|e| format!("memset of new allocation {addr:#x}+{size}: {e}"))?;
        for (offset, len, _) in markers(size) {
            self.alloc
                .driver_mut()
                .write(addr + offset, &marker(id, offset)[..len as usize])
                .map_err(|e| format!("marker write into {addr:#x}+{offset}: {e}"))?;
        }
        self.live.insert(addr, Live { size, id });
        self.freed.retain(|&a| a != addr);
        self.summary.allocs += 1;
        Ok(())
    }

    fn free(&mut self, pick: u16) -> Result<(), String> {
        let Some(&addr) = self
            .live
            .keys()
            .nth(usize::from(pick) % self.live.len().max(1))
        else {
            return Ok(());
        };
        let calls = self.alloc.driver_counters().total();
        self.alloc
            .free(addr)
            .map_err(|e| format!("free({addr:#x}) failed: {e:?}"))?;
        if self.alloc.driver_counters().total() != calls {
            return Err(format!("free({addr:#x}) made a driver call"));
        }
        self.live.remove(&addr);
        self.freed.push(addr);
        if self.freed.len() > 16 {
            self.freed.remove(0);
        }
        Ok(())
    }

    fn bad_free(&mut self, pick: u16) -> Result<(), String> {
        let addr = match self.freed.len() {
            0 => 0x1000 + u64::from(pick),
            n => self.freed[usize::from(pick) % n],
        };
        let calls = self.alloc.driver_counters().total();
        match self.alloc.free(addr) {
            Err(Error::DoubleFree { .. } | Error::UnknownAddress { .. }) => {}
            other => return Err(format!("free of non-live {addr:#x} gave {other:?}")),
        }
        if self.alloc.driver_counters().total() != calls {
            return Err(format!("refused free of {addr:#x} made a driver call"));
        }
        Ok(())
    }

    /// The properties that hold after every operation.
    fn check(&mut self) -> Result<(), String> {
        self.alloc
            .check_invariants()
            .map_err(|v| format!("invariant broken: {v}"))?;
        let stats = self.alloc.stats();
        let rounded: u64 = self
            .live
            .values()
            .map(|l| self.rounded(l.size).unwrap_or(l.size))
            .sum();
        let requested: u64 = self.live.values().map(|l| l.size).sum();
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
        let live: Vec<(u64, Live)> = self.live.iter().map(|(&a, &l)| (a, l)).collect();
        for (addr, l) in live {
            self.verify(addr, l)?;
        }
        Ok(())
    }

    /// Reads back every marker of a live allocation, and a sample of its fill after each.
    fn verify(&mut self, addr: u64, l: Live) -> Result<(), String> {
        let mut buf = [0u8; 2 * MARKER as usize];
        for (offset, len, sample_end) in markers(l.size) {
            let out = &mut buf[..(sample_end - offset) as usize];
            self.alloc
                .copy_to_host(addr + offset, out)
                .map_err(|e| format!("read of live allocation {addr:#x}+{offset}: {e}"))?;
            let want_marker = &marker(l.id, offset)[..len as usize];
            let fill_ok = out[len as usize..].iter().all(|&b| b == fill(l.id));
            if &out[..len as usize] != want_marker || !fill_ok {
                return Err(format!(
                    "allocation {} at {addr:#x}+{} lost bytes at offset {offset}",
                    l.id, l.size
                ));
            }
        }
        Ok(())
    }

    /// Clears the faults, frees everything and checks that the device is left holding nothing.
    fn finish(&mut self) -> Result<(), String> {
        self.alloc.driver_mut().clear_faults();
        self.armed.clear();
        for addr in std::mem::take(&mut self.live).into_keys() {
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

/// The fill byte of allocation `id`.
fn fill(id: u64) -> u8 {
    (id.wrapping_mul(131) % 251) as u8
}

/// Where the markers of an allocation of `size` bytes go, one every [`MARKER_EVERY`] bytes and one at
/// the end, clear of each other: `(offset, length, end of the fill sample after it)`.
fn markers(size: u64) -> Vec<(u64, u64, u64)> {
    let mut offsets: Vec<u64> = (0..size).step_by(MARKER_EVERY as usize).collect();
    let last = size.saturating_sub(MARKER);
    if offsets.last().is_some_and(|&o| o + MARKER <= last) {
        offsets.push(last);
    }
    let ends: Vec<u64> = offsets.iter().skip(1).copied().chain([size]).collect();
    offsets
        .into_iter()
        .zip(ends)
        .map(|(offset, next)| {
            let len = (next - offset).min(MARKER);
            (offset, len, next.min(offset + 2 * MARKER))
        })
        .collect()
}

/// The marker of allocation `id` at `offset`.
fn marker(id: u64, offset: u64) -> [u8; MARKER as usize] {
    let mut out = [0u8; MARKER as usize];
    out[..8].copy_from_slice(&id.to_le_bytes());
    out[8..].copy_from_slice(&(offset ^ 0x5a5a_5a5a).to_le_bytes());
    out
}
