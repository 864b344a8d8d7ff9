//! The input format of the `split_ops` harness ([`crate::split_ops`]): fuzzer bytes decoded into a setup and
//! allocator operations for the model of PyTorch's allocator, and the encoder that writes the seed corpus.
//!
//! Input layout: byte 0 sets the device's size (24 to 88 units of 2 MiB); byte 1 the configuration (bit 0:
//! expandable segments; bits 1-2: `max_split_size_mb` none, 20, 40, none; bit 3:
//! `roundup_power2_divisions:4`; bit 4: `garbage_collection_threshold:0.6` with a memory fraction of 0.9);
//! then one operation per opcode byte and its arguments (see [`decode`]), at most [`MAX_ACTIONS`] of them.
//! The committed corpus (`fuzz/corpus/split_ops/`) is read this way: change it only with the corpus.

use crate::input::Input;
use crate::ops_common::{decode_fault, encode_fault};
use cuvmm::driver::Op;
use cuvmm::driver::sim::FaultKind;

/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// The simulated device's granularity: PyTorch's small page, so both modes run on it.
pub const GRANULE: u64 = 2 * MIB;
/// Operations decoded from one input at most, so every input runs in milliseconds.
pub const MAX_ACTIONS: usize = 120;
/// The largest ordinary request.
const MAX_SIZE: u64 = 48 * MIB;
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
    /// `garbage_collection_threshold:0.6` and a memory fraction of 0.9.
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
                let (op, n, kind) = decode_fault(&mut input, &FAULT_OPS);
                Action::Fault { op, n, kind }
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
            Action::Fault { op, n, kind } => out.extend(encode_fault(op, n, kind, &FAULT_OPS)),
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
