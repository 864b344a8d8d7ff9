//! The `expandable_ops` harness: fuzzer bytes decoded into allocator operations, some with a driver fault
//! armed, applied to an `Expandable<SimDriver>` with the backing store on, and checked against a model of
//! the live allocations. The fuzz target and `tests/fuzz_corpus.rs` both run [`run`].
//!
//! Properties checked after every operation:
//! - `check_invariants()` holds;
//! - live allocations are 512 B aligned and never overlap; the `allocated`, `requested` and `allocation`
//!   statistics equal the model's sums; `reserved_bytes` equals the physical bytes the driver holds and
//!   never exceeds the device;
//! - every live allocation reads back the pattern written into it when it was handed out;
//! - an operation during which no planned fault fired succeeds, except an allocation refused for the
//!   reason it earns: size 0 (`ZeroSize`), larger than the device (`TooLarge`), or out of memory when the
//!   pages the live blocks could touch do not fit the device (idle pages are always found and reused);
//! - an operation during which a fault fired either succeeds or fails with a typed driver or
//!   out-of-memory error (never a panic), and the allocator keeps working afterwards; a `free` that fails
//!   in the driver has still freed its block (the error comes from giving idle memory back);
//! - `free` of an address that is not live is refused with `DoubleFree` or `UnknownAddress` and makes no
//!   driver call;
//! - a successful `empty_cache` leaves nothing idle; `trim` gives back what was asked, within what was idle;
//! - at the end, with faults cleared: every free succeeds, `empty_cache` leaves nothing reserved and no
//!   segment, and the simulated driver reports no leak.
//!
//! Input layout: byte 0 sets the device's size (32 to 64 pages of 4 KiB); byte 1 the idle limit
//! (bits 0-1: unlimited, 0, 2 or 8 pages) and the small-pool limit (bit 2: 1 KiB or 8 KiB); then one
//! operation per opcode byte and its arguments (see [`decode`]), at most [`MAX_ACTIONS`] of them.

use crate::input::Input;
use cuvmm::driver::Op;
use cuvmm::driver::sim::{FaultKind, SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Config, Error, Strategy as _, StreamId};
use std::collections::BTreeMap;
use std::fmt;

/// Bytes per page of the simulated device (its granularity).
pub const PAGE: u64 = 4096;
/// Operations decoded from one input at most, so every input runs in milliseconds.
pub const MAX_ACTIONS: usize = 160;
/// The largest ordinary request: 12 pages.
const MAX_SIZE: u64 = 12 * PAGE;
/// Every request is rounded up to this many bytes.
const ROUND: u64 = 512;
/// The driver calls a fault may be armed on: every call the expandable allocator makes after it is built.
const FAULT_OPS: [Op; 9] = [
    Op::Map,
    Op::SetAccess,
    Op::Unmap,
    Op::Create,
    Op::Release,
    Op::Reserve,
    Op::FreeReservation,
    Op::Synchronize,
    Op::MemInfo,
];

/// The device and allocator an input asks for.
#[derive(Debug, Clone, PartialEq)]
pub struct Setup {
    /// Pages of [`PAGE`] bytes on the device.
    pub pages: u64,
    /// The allocator's `max_idle_bytes`.
    pub max_idle_bytes: u64,
    /// The allocator's `small_size`.
    pub small_size: u64,
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
    /// `trim(pages * PAGE)`.
    Trim {
        /// Pages to give back.
        pages: u64,
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
    let pages = 32 + u64::from(input.below(33));
    let flags = input.byte();
    let setup = Setup {
        pages,
        max_idle_bytes: [u64::MAX, 0, 2 * PAGE, 8 * PAGE][usize::from(flags & 3)],
        small_size: if flags & 4 == 0 { 1024 } else { 8192 },
    };
    let mut actions = Vec::new();
    while !input.is_empty() && actions.len() < MAX_ACTIONS {
        let action = match input.below(16) {
            0..=6 => Action::Alloc {
                size: decode_size(&mut input, pages * PAGE),
                stream: u64::from(input.below(3)),
            },
            7..=10 => Action::Free { pick: input.u16() },
            11 => Action::BadFree { pick: input.u16() },
            12 => Action::EmptyCache,
            13 => Action::Trim {
                pages: u64::from(input.below(8)),
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
    let capacity = setup.pages * PAGE;
    let idle = [u64::MAX, 0, 2 * PAGE, 8 * PAGE]
        .iter()
        .position(|&b| b == setup.max_idle_bytes)
        .expect("an idle limit decode() can produce") as u8;
    let small = match setup.small_size {
        1024 => 0,
        8192 => 4,
        other => panic!("small_size {other} is not one decode() produces"),
    };
    assert!((32..=64).contains(&setup.pages), "32 to 64 pages");
    let mut out = vec![(setup.pages - 32) as u8, idle | small];
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
            Action::Trim { pages } => out.extend([13, pages as u8]),
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
    if size % PAGE == 0 && (1..=12).contains(&(size / PAGE)) {
        return bytes(240, size / PAGE - 1);
    }
    for b in 0..17u8 {
        for frac in 0..=u64::from(u16::MAX) {
            if (((MAX_SIZE >> b).max(1) * (frac + 1)) >> 16).max(1) == size {
                return bytes(b, frac);
            }
        }
    }
    panic!("no size bytes decode to {size}");
}

/// A request size: mostly log-uniform from 1 byte to [`MAX_SIZE`], sometimes a whole number of pages,
/// 0, or more than the device holds.
fn decode_size(input: &mut Input<'_>, capacity: u64) -> u64 {
    let b = input.byte();
    let frac = u64::from(input.u16());
    match b {
        255 => 0,
        254 => capacity + 1 + frac,
        240..=253 => (1 + frac % 12) * PAGE,
        _ => (((MAX_SIZE >> (b % 17)).max(1) * (frac + 1)) >> 16).max(1),
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
    alloc: Expandable<SimDriver>,
    capacity: u64,
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
        let capacity = setup.pages * PAGE;
        let sim = SimDriver::new(
            SimConfig::default()
                .with_capacity(capacity)
                .with_granularity(PAGE)
                .with_backing_store(true),
        );
        let config = Config {
            small_size: setup.small_size,
            ..Config::default()
        }
        .with_max_idle_bytes(setup.max_idle_bytes);
        Self {
            alloc: Expandable::new(sim, config).expect("a valid configuration"),
            capacity,
            live: BTreeMap::new(),
            freed: Vec::new(),
            armed: Vec::new(),
            next_id: 0,
            summary: Summary::default(),
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
            Action::BadFree { pick } => self.bad_free(pick),
            Action::EmptyCache => {
                let result = self.alloc.empty_cache();
                match (result, self.faults_fired()) {
                    (Ok(()), _) => {
                        let stats = self.alloc.stats();
                        if stats.idle_mapped_bytes + stats.idle_handle_bytes != 0 {
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
                    (Ok(released), false) if released < (pages * PAGE).min(idle) => Err(format!(
                        "trim({}) released only {released} of {idle} idle bytes",
                        pages * PAGE
                    )),
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
                // Each live block touches at most its own pages plus one partial page at each end.
                let bound: u64 = self
                    .live
                    .values()
                    .map(|l| l.size)
                    .chain([size])
                    .map(|s| s.next_multiple_of(ROUND).div_ceil(PAGE) + 2)
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

    /// Checks a new allocation against the live ones, writes its pattern and records it.
    fn record_alloc(&mut self, addr: u64, size: u64) -> Result<(), String> {
        let end = addr + size.next_multiple_of(ROUND);
        if addr % ROUND != 0 {
            return Err(format!("alloc({size}) returned misaligned {addr:#x}"));
        }
        if let Some((&prev, l)) = self.live.range(..=addr).next_back()
            && prev + l.size.next_multiple_of(ROUND) > addr
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {prev:#x}"));
        }
        if let Some((&next, _)) = self.live.range(addr..).next()
            && next < end
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {next:#x}"));
        }
        self.next_id += 1;
        let id = self.next_id;
        self.alloc
            .driver_mut()
            .write(addr, &pattern(id, size))
            .map_err(|e| format!("write into new allocation {addr:#x}+{size}: {e}"))?;
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
    fn check(&self) -> Result<(), String> {
        self.alloc
            .check_invariants()
            .map_err(|v| format!("invariant broken: {v}"))?;
        let stats = self.alloc.stats();
        let rounded: u64 = self
            .live
            .values()
            .map(|l| l.size.next_multiple_of(ROUND))
            .sum();
        let requested: u64 = self.live.values().map(|l| l.size).sum();
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
        for (&addr, l) in &self.live {
            let bytes = self
                .alloc
                .driver()
                .read(addr, l.size as usize)
                .map_err(|e| format!("read of live allocation {addr:#x}+{}: {e}", l.size))?;
            if bytes != pattern(l.id, l.size) {
                return Err(format!(
                    "allocation {} at {addr:#x}+{} lost bytes",
                    l.id, l.size
                ));
            }
        }
        Ok(())
    }

    /// Clears the faults, frees everything and checks that the device is left holding nothing.
    fn finish(&mut self) -> Result<(), String> {
        self.alloc.driver_mut().clear_faults();
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

/// A byte pattern that differs between allocations and along each allocation.
fn pattern(id: u64, len: u64) -> Vec<u8> {
    (0..len)
        .map(|i| (id.wrapping_mul(131).wrapping_add(i * 7) % 251) as u8)
        .collect()
}
