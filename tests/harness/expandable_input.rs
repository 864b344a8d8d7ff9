//! The input format of the `expandable_ops` harness ([`crate::expandable_ops`]): fuzzer bytes decoded into a
//! setup and allocator operations for `Expandable<SimDriver>`, and the encoder that writes the seed corpus.
//!
//! Input layout: byte 0 sets the device's size (32 to 64 pages of 4 KiB); byte 1 the idle limit
//! (bits 0-1: unlimited, 0, 2 or 8 pages) and the small-pool limit (bit 2: 1 KiB or 8 KiB); then one
//! operation per opcode byte and its arguments (see [`decode`]), at most [`MAX_ACTIONS`] of them.
//! The committed corpus (`fuzz/corpus/expandable_ops/`) is read this way: change it only with the corpus.

use crate::input::Input;
use crate::ops_common::{decode_fault, encode_fault};
use cuvmm::driver::Op;
use cuvmm::driver::sim::FaultKind;

/// Bytes per page of the simulated device (its granularity).
pub const PAGE: u64 = 4096;
/// Operations decoded from one input at most, so every input runs in milliseconds.
pub const MAX_ACTIONS: usize = 160;
/// The largest ordinary request: 12 pages.
const MAX_SIZE: u64 = 12 * PAGE;
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
    /// Pages per large-pool handle: 1, or 4 (chunks, whose idle pages are lent under pressure where the
    /// device can map part of a handle).
    pub chunk_pages: u64,
    /// Whether the simulated device maps parts of handles (`SimConfig::partial_mappings`, which lending
    /// needs; CUDA does not).
    pub partial_mappings: bool,
    /// Whether the allocator runs `compaction:split` (chunks that live blocks touch re-created as single
    /// pages under pressure) rather than the default `pressure`.
    pub split: bool,
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
    /// `release_stranded()`.
    ReleaseStranded,
    /// `share()` of the live allocation picked by `pick` (modulo their number), twice; nothing if there is
    /// none.
    Share {
        /// Picks the allocation (0 to 7).
        pick: u8,
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
/// 11 bad free, 12 empty_cache, 13 trim (or, with a next byte of 248 or more, release_stranded, and of
/// 240 to 247, share), 14-15 arm a fault).
pub fn decode(data: &[u8]) -> (Setup, Vec<Action>) {
    let mut input = Input::new(data);
    let pages = 32 + u64::from(input.below(33));
    let flags = input.byte();
    let setup = Setup {
        pages,
        max_idle_bytes: [u64::MAX, 0, 2 * PAGE, 8 * PAGE][usize::from(flags & 3)],
        small_size: if flags & 4 == 0 { 1024 } else { 8192 },
        chunk_pages: if flags & 8 == 0 { 1 } else { 4 },
        partial_mappings: flags & 16 != 0,
        split: flags & 32 != 0,
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
            13 => match input.byte() {
                // Added after the corpus was written: bytes that decoded to a trim before mostly still do.
                248.. => Action::ReleaseStranded,
                b @ 240..=247 => Action::Share { pick: b - 240 },
                b => Action::Trim {
                    pages: u64::from(b % 8),
                },
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
    let chunks = match setup.chunk_pages {
        1 => 0,
        4 => 8,
        other => panic!("chunk_pages {other} is not one decode() produces"),
    };
    assert!((32..=64).contains(&setup.pages), "32 to 64 pages");
    let partial = if setup.partial_mappings { 16 } else { 0 };
    let split = if setup.split { 32 } else { 0 };
    let mut out = vec![
        (setup.pages - 32) as u8,
        idle | small | chunks | partial | split,
    ];
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
            Action::ReleaseStranded => out.extend([13, 255]),
            Action::Share { pick } => out.extend([13, 240 + pick % 8]),
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
