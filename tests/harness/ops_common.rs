//! What the two allocator-operation harnesses (`split_ops`, `expandable_ops`) share: the bytes that arm a
//! driver fault, the faults armed and whether they fired, the model of the live allocations, the bytes
//! written into every allocation and read back, and the report of a property that did not hold.
//!
//! Shared by the fuzz targets and `tests/fuzz_corpus.rs`, like the harnesses themselves.

use crate::input::Input;
use cuvmm::driver::sim::{FaultKind, SimDriver};
use cuvmm::driver::{DriverCounters, Op};
use cuvmm::strategy::DeviceBytes;
use cuvmm::{Error, Strategy};
use std::collections::BTreeMap;
use std::fmt;

/// The opcode byte [`encode_fault`] writes (the decoders read 14 and 15 as "arm a fault").
const FAULT_OPCODE: u8 = 14;
/// Addresses remembered after a free, for frees of addresses that are no longer live.
const FREED_KEPT: usize = 16;

/// An allocator on the simulated device, as the harnesses drive it: its strategy calls and its device
/// (implemented beside each harness: `expandable_ops.rs`, `split_ops.rs`).
pub trait OnSim: Strategy + DeviceBytes {
    /// The simulated device, to arm faults and write bytes.
    fn sim_mut(&mut self) -> &mut SimDriver;
}

/// Decodes the two bytes after a fault opcode: the driver call (`ops[b & 0x7f % len]`), how it fails (bit
/// 7 of the same byte: out of memory), and which call from now (`1 + next % 4`).
pub fn decode_fault(input: &mut Input<'_>, ops: &[Op]) -> (Op, u64, FaultKind) {
    let b = input.byte();
    let op = ops[usize::from(b & 0x7f) % ops.len()];
    let n = 1 + u64::from(input.below(4));
    let kind = if b & 0x80 == 0 {
        FaultKind::Error
    } else {
        FaultKind::OutOfMemory
    };
    (op, n, kind)
}

/// The opcode and two bytes that [`decode_fault`] turns into `(op, n, kind)`.
///
/// # Panics
/// If `op` is not one of `ops` or `n` is not 1 to 4.
#[allow(dead_code)] // Used by tests/fuzz_corpus.rs to write seeds; the fuzz targets only decode.
pub fn encode_fault(op: Op, n: u64, kind: FaultKind, ops: &[Op]) -> [u8; 3] {
    assert!((1..=4).contains(&n), "a fault on the 1st to 4th call");
    let index = ops.iter().position(|&o| o == op).expect("a fault op") as u8;
    let oom = if kind == FaultKind::OutOfMemory {
        0x80
    } else {
        0
    };
    [FAULT_OPCODE, index | oom, (n - 1) as u8]
}

/// The faults armed and not fired yet, and what the faults did so far.
#[derive(Debug, Default)]
pub struct Faults {
    /// Armed faults as (operation, absolute call number).
    armed: Vec<(Op, u64)>,
    /// Armed faults that fired.
    pub fired: usize,
    /// Operations that failed because of a fault.
    pub failed: usize,
}

impl Faults {
    /// Makes the `n`th next call of `op` fail with `kind`.
    pub fn arm(&mut self, alloc: &mut impl OnSim, op: Op, n: u64, kind: FaultKind) {
        let call = alloc.driver_counters().get(op) + n.max(1);
        alloc.sim_mut().fail_nth(op, n, kind);
        self.armed.push((op, call));
    }

    /// Whether an armed fault fired since the last call, given the driver's counters now; forgets the
    /// faults that fired.
    pub fn fired_since(&mut self, counters: &DriverCounters) -> bool {
        let before = self.armed.len();
        self.armed.retain(|&(op, call)| counters.get(op) < call);
        let fired = before - self.armed.len();
        self.fired += fired;
        fired > 0
    }

    /// Accepts an error only from an operation during which a fault fired, and only a typed driver or
    /// out-of-memory error.
    pub fn accept(&mut self, what: &str, err: Error, fired: bool) -> Result<(), String> {
        if fired && (matches!(err, Error::Driver(_)) || err.is_out_of_memory()) {
            self.failed += 1;
            Ok(())
        } else {
            Err(format!("{what} failed (fault fired: {fired}): {err:?}"))
        }
    }

    /// Disarms every fault.
    pub fn clear(&mut self, alloc: &mut impl OnSim) {
        alloc.sim_mut().clear_faults();
        self.armed.clear();
    }
}

/// A live allocation of the model: its size and the id its bytes are made from.
#[derive(Debug, Clone, Copy)]
pub struct Live {
    /// Bytes asked for.
    pub size: u64,
    /// Numbers the allocations in the order they were handed out, from 1.
    pub id: u64,
}

/// The live allocations the model expects, by address, and the addresses freed lately.
#[derive(Debug, Default)]
pub struct LiveSet {
    /// Live allocations by address.
    pub map: BTreeMap<u64, Live>,
    /// Addresses freed lately (at most [`FREED_KEPT`]), oldest first.
    freed: Vec<u64>,
    next_id: u64,
}

impl LiveSet {
    /// Checks a new allocation of `size` bytes at `addr` against the live ones: `align`ed, and its
    /// `span(size)` bytes overlapping no live allocation's span.
    pub fn check_new(
        &self,
        addr: u64,
        size: u64,
        align: u64,
        span: impl Fn(u64) -> u64,
    ) -> Result<(), String> {
        if addr % align != 0 {
            return Err(format!("alloc({size}) returned misaligned {addr:#x}"));
        }
        if let Some((&prev, l)) = self.map.range(..=addr).next_back()
            && prev + span(l.size) > addr
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {prev:#x}"));
        }
        if let Some((&next, _)) = self.map.range(addr..).next()
            && next < addr + span(size)
        {
            return Err(format!("alloc({size}) at {addr:#x} overlaps {next:#x}"));
        }
        Ok(())
    }

    /// Records a new allocation and returns it.
    pub fn insert(&mut self, addr: u64, size: u64) -> Live {
        self.next_id += 1;
        let live = Live {
            size,
            id: self.next_id,
        };
        self.map.insert(addr, live);
        self.freed.retain(|&a| a != addr);
        live
    }

    /// The address of the live allocation `pick` chooses (modulo their number), if there is one.
    pub fn pick(&self, pick: u16) -> Option<u64> {
        let n = self.map.len().max(1);
        self.map.keys().nth(usize::from(pick) % n).copied()
    }

    /// Forgets a freed allocation and remembers its address.
    pub fn remove(&mut self, addr: u64) {
        self.map.remove(&addr);
        self.freed.push(addr);
        if self.freed.len() > FREED_KEPT {
            self.freed.remove(0);
        }
    }

    /// An address that is not live: one freed lately, or one never handed out if none was.
    pub fn non_live(&self, pick: u16) -> u64 {
        match self.freed.len() {
            0 => 0x1000 + u64::from(pick),
            n => self.freed[usize::from(pick) % n],
        }
    }

    /// The live allocations in address order.
    pub fn iter(&self) -> impl Iterator<Item = (u64, Live)> + '_ {
        self.map.iter().map(|(&a, &l)| (a, l))
    }

    /// Number of live allocations.
    pub fn len(&self) -> usize {
        self.map.len()
    }
}

/// Frees `addr`, which is not live, and checks that it is refused with `DoubleFree` or `UnknownAddress`
/// without a driver call.
pub fn check_bad_free(alloc: &mut impl Strategy, addr: u64) -> Result<(), String> {
    let calls = alloc.driver_counters().total();
    match alloc.free(addr) {
        Err(Error::DoubleFree { .. } | Error::UnknownAddress { .. }) => {}
        other => return Err(format!("free of non-live {addr:#x} gave {other:?}")),
    }
    if alloc.driver_counters().total() != calls {
        return Err(format!("refused free of {addr:#x} made a driver call"));
    }
    Ok(())
}

/// Bytes of one marker: the allocation's id and the marker's offset.
const MARKER: u64 = 16;

/// What every live allocation holds: its fill byte ([`fill`]) set through `DeviceBytes::memset`, with a
/// marker (its id and the offset, [`marker`]) written every `every` bytes and one at its end; read back
/// through `DeviceBytes::copy_to_host`, every marker and `sample` bytes from it (the fill after it).
///
/// A marker every so often tells one allocation's pages from another's and from other pages of the same
/// allocation; reading whole stretches (`sample` at least `every`) checks every byte.
#[derive(Debug, Clone, Copy)]
pub struct Content {
    /// Spacing of the markers.
    pub every: u64,
    /// Bytes read from each marker on (the marker included), at most up to the next one.
    pub sample: u64,
}

impl Content {
    /// Fills the allocation `l` at `addr` and writes its markers.
    pub fn write(&self, alloc: &mut impl OnSim, addr: u64, l: Live) -> Result<(), String> {
        alloc
            .memset(addr, l.size, fill(l.id))
            .map_err(|e| format!("memset of new allocation {addr:#x}+{}: {e}", l.size))?;
        for (offset, len, _) in self.markers(l.size) {
            alloc
                .sim_mut()
                .write(addr + offset, &marker(l.id, offset)[..len as usize])
                .map_err(|e| format!("marker write into {addr:#x}+{offset}: {e}"))?;
        }
        Ok(())
    }

    /// Reads back every marker of the live allocation `l` at `addr`, and the fill after each.
    pub fn verify(&self, alloc: &mut impl OnSim, addr: u64, l: Live) -> Result<(), String> {
        let mut buf = Vec::new();
        for (offset, len, sample_end) in self.markers(l.size) {
            buf.resize((sample_end - offset) as usize, 0);
            alloc
                .copy_to_host(addr + offset, &mut buf)
                .map_err(|e| format!("read of live allocation {addr:#x}+{offset}: {e}"))?;
            let want_marker = &marker(l.id, offset)[..len as usize];
            let fill_ok = buf[len as usize..].iter().all(|&b| b == fill(l.id));
            if &buf[..len as usize] != want_marker || !fill_ok {
                return Err(format!(
                    "allocation {} at {addr:#x}+{} lost bytes at offset {offset}",
                    l.id, l.size
                ));
            }
        }
        Ok(())
    }

    /// Where the markers of an allocation of `size` bytes go, one every [`every`](Content::every) bytes
    /// and one at the end, clear of each other: `(offset, length, end of the bytes read from it)`.
    fn markers(&self, size: u64) -> Vec<(u64, u64, u64)> {
        let mut offsets: Vec<u64> = (0..size).step_by(self.every as usize).collect();
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
                (
                    offset,
                    len,
                    next.min(offset.saturating_add(self.sample.max(len))),
                )
            })
            .collect()
    }
}

/// The fill byte of allocation `id`.
fn fill(id: u64) -> u8 {
    (id.wrapping_mul(131) % 251) as u8
}

/// The marker of allocation `id` at `offset`.
fn marker(id: u64, offset: u64) -> [u8; MARKER as usize] {
    let mut out = [0u8; MARKER as usize];
    out[..8].copy_from_slice(&id.to_le_bytes());
    out[8..].copy_from_slice(&(offset ^ 0x5a5a_5a5a).to_le_bytes());
    out
}

/// A property that did not hold, with the setup and the operations that led there.
#[derive(Debug, Clone)]
pub struct Failure<S, A> {
    /// The setup decoded from the input.
    pub setup: S,
    /// The operations applied, the failing one last (all of them if the final cleanup failed).
    pub actions: Vec<A>,
    /// What went wrong.
    pub message: String,
}

impl<S: fmt::Debug, A: fmt::Debug> fmt::Display for Failure<S, A> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "{}", self.message)?;
        writeln!(f, "setup: {:?}", self.setup)?;
        for (i, action) in self.actions.iter().enumerate() {
            writeln!(f, "  {i:3}: {action:?}")?;
        }
        Ok(())
    }
}

/// What a harness's model does: apply one operation and check what it returned, check the properties
/// that hold after every operation, and clean up at the end.
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
    /// Whether a model of PyTorch's allocator ran in its `expandable_segments` mode (false for cuvmm's).
    pub expandable: bool,
}

pub trait Model {
    /// The operations the model applies.
    type Action: Clone;
    /// What the operations applied so far exercised (all but `actions`, which the caller counts).
    fn summary(&self) -> Summary;
    /// Applies one operation and checks what it returned.
    fn apply(&mut self, action: &Self::Action) -> Result<(), String>;
    /// The properties that hold after every operation.
    fn check(&mut self) -> Result<(), String>;
    /// Clears the faults, frees everything and checks that the device is left holding nothing.
    fn finish(&mut self) -> Result<(), String>;
}

/// Applies `actions` to `model`, checking the properties after each, then cleans up. On a failure, reports
/// the setup, the operations up to the failing one (all of them if the cleanup failed) and what went wrong.
pub fn run_model<S, M: Model>(
    model: &mut M,
    setup: S,
    actions: Vec<M::Action>,
) -> Result<(), Failure<S, M::Action>> {
    for (step, action) in actions.iter().enumerate() {
        if let Err(message) = model.apply(action).and_then(|()| model.check()) {
            return Err(Failure {
                setup,
                actions: actions[..=step].to_vec(),
                message: format!("step {step}: {message}"),
            });
        }
    }
    model.finish().map_err(|message| Failure {
        setup,
        actions,
        message: format!("cleanup: {message}"),
    })
}
