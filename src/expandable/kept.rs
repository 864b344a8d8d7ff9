//! A tag's host memory, and how its bytes are laid out in it: what a sleep copies to and a wake copies
//! from (`sleep.rs`), kept across cycles so that a second sleep pins nothing.
//!
//! - **Pieces.** Host memory is held in pieces of [`Config::sleep_copy`](crate::Config::sleep_copy) bytes
//!   (the last one the rest of the tag's bytes, rounded up to [`HOST_ROUND`]), page-locked on CUDA. A sleep
//!   reuses the pieces the tag holds that are long enough, pins the missing ones (a piece too short is
//!   replaced), and frees those beyond what the tag's live bytes need.
//! - **Layout.** The tag's live blocks, in address order, with adjacent blocks merged into runs, lie end to
//!   end in the pieces; a copy is a part of a run inside one piece. The layout is a function of the blocks,
//!   which do not change while the tag sleeps, so the wake finds each byte where the sleep put it.
//! - **The copies run without the allocator's lock** ([`TagCopy`](crate::strategy::tags::TagCopy)): the
//!   pieces go with them and come back. So do those of a *preparation* (`prepare_sleep`: the pieces a sleep
//!   would pin, pinned ahead of it by a job that copies nothing), while the tag stays awake.

#![deny(unsafe_code)]

use crate::base::size::round_up;
use crate::driver::{CopyDirection, CopyPlan, DriverError, HostCopy, HostMemory, HostPinning};

/// The last piece is the rest of the bytes rounded up to this (4 KiB pages, 16 at a time).
pub(super) const HOST_ROUND: u64 = 64 << 10;

/// A tag's host memory.
#[derive(Debug, Default)]
pub(super) struct Kept {
    /// The pieces, in layout order.
    pieces: Vec<HostMemory>,
    /// Whether the pieces hold the bytes of the tag's blocks (a sleep that kept them).
    contents: bool,
    /// Bytes of pieces a copy holds now.
    out: u64,
    /// Bytes of pieces a preparation holds, while one runs (`prepare_sleep`: pinning them ahead of a
    /// sleep).
    preparing: Option<u64>,
}

impl Kept {
    /// Bytes of host memory held, those a copy holds now included.
    pub(super) fn held_bytes(&self) -> u64 {
        self.pieces.iter().map(|p| p.len() as u64).sum::<u64>()
            + self.out
            + self.preparing.unwrap_or(0)
    }

    /// Whether the pieces hold the tag's bytes.
    pub(super) fn holds_contents(&self) -> bool {
        self.contents
    }

    /// Whether a copy holds the pieces now.
    pub(super) fn lent(&self) -> bool {
        self.out > 0
    }

    /// The pieces, lent to a copy (they come back with [`take_back`](Self::take_back)).
    pub(super) fn lend_pieces(&mut self) -> Vec<HostMemory> {
        let pieces = std::mem::take(&mut self.pieces);
        self.out = pieces.iter().map(|p| p.len() as u64).sum();
        pieces
    }

    /// A copy holds `bytes` of pieces (those lent, and those it pins).
    pub(super) fn note_lent_bytes(&mut self, bytes: u64) {
        self.out = bytes;
    }

    /// Whether a preparation holds the pieces now.
    pub(super) fn preparing(&self) -> bool {
        self.preparing.is_some()
    }

    /// The pieces, lent to a preparation (they come back with [`take_prepared`](Self::take_prepared)).
    pub(super) fn lend_to_prepare(&mut self) -> Vec<HostMemory> {
        let pieces = std::mem::take(&mut self.pieces);
        self.preparing = Some(pieces.iter().map(|p| p.len() as u64).sum());
        pieces
    }

    /// The preparation holds `bytes` of pieces (those lent, and those it pins).
    pub(super) fn note_preparing(&mut self, bytes: u64) {
        self.preparing = Some(bytes);
    }

    /// The pieces back from a preparation: kept, longest first (a sleep's plan takes the pieces in
    /// order, each at least as long as its place, `plan`), if `adopt` and the tag holds none meanwhile (a
    /// sleep that ran during the preparation pinned its own); else given back for the caller to free.
    pub(super) fn take_prepared(
        &mut self,
        mut pieces: Vec<HostMemory>,
        adopt: bool,
    ) -> Vec<HostMemory> {
        self.preparing = None;
        if !adopt || self.contents || self.lent() || !self.pieces.is_empty() {
            return pieces;
        }
        pieces.sort_by_key(|p| std::cmp::Reverse(p.len()));
        self.pieces = pieces;
        Vec::new()
    }

    /// The pieces back from a copy, holding the tag's bytes if `contents`.
    pub(super) fn take_back(&mut self, pieces: Vec<HostMemory>, contents: bool) {
        self.pieces = pieces;
        self.contents = contents && !self.pieces.is_empty();
        self.out = 0;
    }

    /// The bytes are not needed any more (the tag woke): the pieces stay, as buffers for the next sleep.
    pub(super) fn forget_contents(&mut self) {
        self.contents = false;
    }

    /// The pieces, let go of unless they hold the tag's bytes or a copy holds them (then none), for the
    /// caller to free.
    pub(super) fn free_buffers(&mut self) -> Vec<HostMemory> {
        if self.contents || self.lent() {
            return Vec::new();
        }
        std::mem::take(&mut self.pieces)
    }

    /// The piece lengths, for the invariants.
    pub(super) fn piece_lens(&self) -> impl Iterator<Item = u64> + '_ {
        self.pieces.iter().map(|p| p.len() as u64)
    }

    /// Copies into `out` the kept bytes from `host` on in the layout of pieces of `piece` bytes
    /// ([`host_offset`]); `false`, with `out` left as it was, when the pieces hold no bytes or end first.
    pub(super) fn read(&self, host: u64, piece: u64, out: &mut [u8]) -> bool {
        // Each piece holds the layout's `piece` bytes from its start (a piece kept from an earlier sleep
        // may be longer), the last one those left: the layout is whole up to the first short piece.
        let mut held = 0u64;
        for p in &self.pieces {
            let n = (p.len() as u64).min(piece);
            held += n;
            if n < piece {
                break;
            }
        }
        let end = host.checked_add(out.len() as u64);
        if !self.contents || end.is_none_or(|end| end > held) {
            return false;
        }
        let (mut host, mut done) = (host, 0usize);
        while done < out.len() {
            let p = self.pieces[(host / piece) as usize].as_slice();
            let offset = (host % piece) as usize;
            let n = (out.len() - done).min(piece as usize - offset);
            out[done..done + n].copy_from_slice(&p[offset..offset + n]);
            (host, done) = (host + n as u64, done + n);
        }
        true
    }
}

/// Where the bytes `[addr, addr + len)` of `blocks` (in address order) lie in their host layout: the
/// offset from its start, if the range lies inside one run of adjacent blocks.
pub(super) fn host_offset(blocks: &[(u64, u64)], addr: u64, len: u64) -> Option<u64> {
    let end = addr.checked_add(len)?;
    let mut host = 0u64;
    for (start, size) in runs(blocks) {
        if (start..start + size).contains(&addr) {
            return (end <= start + size).then_some(host + (addr - start));
        }
        host += size;
    }
    None
}

/// Adjacent blocks `(address, size)` (in address order) merged into runs.
fn runs(blocks: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(blocks.len());
    for &(addr, size) in blocks {
        match out.last_mut() {
            Some((start, len)) if *start + *len == addr => *len += size,
            _ => out.push((addr, size)),
        }
    }
    out
}

/// The pieces for `total` bytes: whole pieces of `piece` bytes, then the rest rounded up to
/// [`HOST_ROUND`] (at most a piece).
fn piece_lens(total: u64, piece: u64) -> Vec<u64> {
    let whole = total / piece;
    let mut lens = vec![piece; whole as usize];
    let rest = total % piece;
    if rest > 0 {
        lens.push(round_up(rest, HOST_ROUND).unwrap_or(piece).min(piece));
    }
    lens
}

/// The copies of `blocks` laid end to end in pieces of `piece` bytes: each run cut where a piece ends.
fn copies(blocks: &[(u64, u64)], piece: u64) -> Vec<HostCopy> {
    let mut out = Vec::new();
    let mut host = 0u64;
    for (mut va, mut len) in runs(blocks) {
        while len > 0 {
            let offset = host % piece;
            let n = len.min(piece - offset);
            out.push(HostCopy {
                va,
                len: n,
                piece: (host / piece) as usize,
                offset,
            });
            (va, len, host) = (va + n, len - n, host + n);
        }
    }
    out
}

/// A plan and the pieces to run it with.
pub(super) type Planned = (CopyPlan, Vec<Option<HostMemory>>);

/// Why a plan could not be made, and the pieces held, given back.
pub(super) type Refused = (DriverError, Vec<HostMemory>);

/// The plan of the copies of `blocks` in `direction`, with pieces of `piece` bytes pinned as `pinning`
/// says, and the pieces to run it with: those of `held` that are long enough, in order; a missing one, or one too short (put in
/// `freed`), is allocated by a copy to the host; the held pieces beyond what the blocks need go to `freed`
/// too, for the caller to free after its lock.
///
/// A copy from the host needs every piece: [`DriverError::CopyPlan`] if one is missing (the pieces held
/// are given back in the error's stead, nothing freed).
pub(super) fn plan(
    direction: CopyDirection,
    blocks: &[(u64, u64)],
    piece: u64,
    pinning: HostPinning,
    held: Vec<HostMemory>,
    freed: &mut Vec<HostMemory>,
) -> Result<Planned, Refused> {
    let total = blocks.iter().map(|b| b.1).sum();
    let lens = piece_lens(total, piece);
    if direction == CopyDirection::FromHost
        && (held.len() < lens.len() || held.iter().zip(&lens).any(|(h, &l)| (h.len() as u64) < l))
    {
        let reason = "a wake's bytes are missing from the tag's host memory";
        return Err((DriverError::CopyPlan { reason }, held));
    }
    let mut held = held.into_iter();
    let mut pieces: Vec<Option<HostMemory>> = Vec::with_capacity(lens.len());
    for &len in &lens {
        pieces.push(match held.next() {
            Some(h) if (h.len() as u64) < len => {
                freed.push(h);
                None
            }
            h => h,
        });
    }
    freed.extend(held);
    let plan = CopyPlan {
        direction,
        allocate: pieces.iter().map(Option::is_none).collect(),
        pieces: lens,
        copies: copies(blocks, piece),
        pinning,
    };
    Ok((plan, pieces))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn runs_merge_adjacent_blocks_and_copies_cut_at_piece_ends() {
        let blocks = [(0x1000, 0x200), (0x1200, 0x100), (0x4000, 0x300)];
        assert_eq!(runs(&blocks), [(0x1000, 0x300), (0x4000, 0x300)]);
        let c = copies(&blocks, 0x400);
        assert_eq!(
            c,
            [
                HostCopy {
                    va: 0x1000,
                    len: 0x300,
                    piece: 0,
                    offset: 0
                },
                HostCopy {
                    va: 0x4000,
                    len: 0x100,
                    piece: 0,
                    offset: 0x300
                },
                HostCopy {
                    va: 0x4100,
                    len: 0x200,
                    piece: 1,
                    offset: 0
                },
            ]
        );
        assert_eq!(piece_lens(0x600, 0x400), [0x400, 0x400]);
        assert_eq!(
            piece_lens(3 * HOST_ROUND, 2 * HOST_ROUND),
            [2 * HOST_ROUND, HOST_ROUND]
        );
        assert_eq!(piece_lens(1, 1 << 20), [HOST_ROUND]);
        assert!(piece_lens(0, 1 << 20).is_empty());
    }

    #[test]
    fn a_plan_reuses_the_pieces_long_enough_and_frees_the_rest() {
        let piece = 2 * HOST_ROUND;
        let blocks = [(0x10_0000, 5 * HOST_ROUND)];
        let held = vec![
            HostMemory::pageable(piece as usize).unwrap(),
            HostMemory::pageable(HOST_ROUND as usize).unwrap(),
            HostMemory::pageable(piece as usize).unwrap(),
            HostMemory::pageable(piece as usize).unwrap(),
        ];
        let mut freed = Vec::new();
        let (plan, pieces) = plan(
            CopyDirection::ToHost,
            &blocks,
            piece,
            HostPinning::default(),
            held,
            &mut freed,
        )
        .unwrap();
        plan.validate().unwrap();
        assert_eq!(plan.pieces, [piece, piece, HOST_ROUND]);
        assert_eq!(
            plan.allocate,
            [false, true, false],
            "the short piece is replaced"
        );
        assert_eq!(pieces.len(), 3, "the piece beyond is let go of");
        let freed_lens: Vec<u64> = freed.iter().map(|h| h.len() as u64).collect();
        assert_eq!(
            freed_lens,
            [HOST_ROUND, piece],
            "the short piece and the one beyond, for the caller to free"
        );
        assert_eq!(plan.bytes(), 5 * HOST_ROUND);
        let short = vec![HostMemory::pageable(piece as usize).unwrap()];
        let mut freed = Vec::new();
        let (err, back) = super::plan(
            CopyDirection::FromHost,
            &blocks,
            piece,
            HostPinning::default(),
            short,
            &mut freed,
        )
        .unwrap_err();
        assert!(matches!(err, DriverError::CopyPlan { .. }));
        assert_eq!((back.len(), freed.len()), (1, 0), "nothing freed");
    }
}
