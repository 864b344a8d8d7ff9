//! Lending the idle pages of a chunk that a live block still touches.
//!
//! A chunk (a multi-page handle, see `physical.rs`) is mapped at a group of pages in one `map` call, and a
//! mapping can only be unmapped whole. So while one live block touches a page of the group, the chunk's
//! other pages cannot be unmapped: their memory is stranded. Under memory pressure, rather than failing or
//! creating past the budget, such an idle page is *lent*: its memory is mapped a second time where a request
//! needs a page (`Driver::map_from`, `cuMemMap` from the page's offset in the chunk), and its own addresses
//! become a [`Lent`](crate::expandable::blocks::BlockState::Lent) block, never allocated, until the page comes back.
//!
//! A lent page comes back ("home") when its second mapping is unmapped and not mapped again at once (a
//! release of the cache, a failed request): its lent block is freed and the page is idle again at home, so
//! the chunk can be unmapped and released once all of its pages are idle. A chunk with pages lent is never
//! unmapped (its lent pages are not idle) nor released.
//!
//! Lending makes no driver call of its own: the page is already mapped and its stream is known done with it
//! (as for any page taken by a compaction). Mapping it elsewhere costs one `map` per page, as a single page
//! does. Physical memory is counted once, at home: the second mapping adds nothing to `mapped_bytes` or
//! `reserved_bytes`.
//!
//! A part that owns its state ([`Lending`]): which chunks lend pages, and where each lent page is mapped a
//! second time. The rest of the supply (`reclaim.rs`) chooses the pages, changes their blocks and maps them.

use crate::driver::{PhysHandle, PhysPage};
use crate::expandable::blocks::BlockState;
use crate::expandable::segment::Segment;
use crate::expandable::segments::Segments;
use crate::strategy::error::InvariantViolation as V;
use rustc_hash::{FxHashMap, FxHashSet};
use std::collections::HashMap;
use std::ops::Range;

/// A chunk with pages lent: where it is mapped at home, and how many of its pages are lent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Lender {
    /// The segment of the chunk's home mapping.
    slot: usize,
    /// The first page of the chunk's group there.
    group: usize,
    /// Pages lent: mapped elsewhere, or on their way to a mapping.
    lent: usize,
}

/// The chunks that lend pages and the second mappings of those pages.
#[derive(Debug)]
pub(crate) struct Lending {
    /// The chunks with pages lent, and where each is mapped at home.
    lenders: FxHashMap<PhysHandle, Lender>,
    /// Lent pages mapped a second time, by address: the piece of its chunk each maps.
    aliases: FxHashMap<u64, PhysPage>,
    /// Whether idle pages of chunks in use may be lent: false once the driver has said it cannot map part
    /// of a handle.
    enabled: bool,
}

impl Lending {
    /// Nothing lent; lending allowed if `enabled`.
    pub(crate) fn allowed(enabled: bool) -> Self {
        Self {
            lenders: FxHashMap::default(),
            aliases: FxHashMap::default(),
            enabled,
        }
    }

    /// Whether idle pages of chunks in use may be lent.
    pub(crate) fn enabled(&self) -> bool {
        self.enabled
    }

    /// The driver cannot map part of a handle: lend no more.
    pub(crate) fn disable(&mut self) {
        self.enabled = false;
    }

    /// Whether the page at `addr` holds a lent page (a second mapping of a chunk's page).
    #[inline]
    pub(crate) fn is_alias(&self, addr: u64) -> bool {
        !self.aliases.is_empty() && self.aliases.contains_key(&addr)
    }

    /// Lends `page` of segment `slot`, in the chunk `handle` mapped at home at the group from `group`:
    /// returns its piece of the chunk.
    pub(crate) fn lend_piece(
        &mut self,
        handle: PhysHandle,
        (slot, group, page): (usize, usize, usize),
        page_size: u64,
    ) -> PhysPage {
        self.lenders
            .entry(handle)
            .or_insert(Lender {
                slot,
                group,
                lent: 0,
            })
            .lent += 1;
        PhysPage {
            handle,
            offset: (page - group) as u64 * page_size,
        }
    }

    /// Takes a lent piece, mapped nowhere else now, back: returns the slot and page of its home.
    pub(crate) fn return_piece(&mut self, piece: PhysPage, page_size: u64) -> (usize, usize) {
        let lender = self
            .lenders
            .get_mut(&piece.handle)
            .expect("a lent piece has a lender");
        lender.lent -= 1;
        let (slot, group) = (lender.slot, lender.group);
        if lender.lent == 0 {
            self.lenders.remove(&piece.handle);
        }
        (slot, group + (piece.offset / page_size) as usize)
    }

    /// Pages of the segments `slots` lent elsewhere.
    pub(crate) fn lent_from(&self, slots: &[usize]) -> usize {
        (self.lenders.values())
            .filter(|l| slots.contains(&l.slot))
            .map(|l| l.lent)
            .sum()
    }

    /// Records that `pages` (pieces, one per page) were mapped at the pages from `start` of `seg`: the lent
    /// ones (pieces of `chunks`) as second mappings. Returns how many were lent.
    pub(crate) fn note_mapped(
        &mut self,
        chunks: &FxHashSet<PhysHandle>,
        seg: &Segment,
        start: usize,
        pages: &[PhysPage],
    ) -> usize {
        if self.lenders.is_empty() {
            return 0;
        }
        let mut lent = 0;
        for (i, page) in pages.iter().enumerate() {
            if chunks.contains(&page.handle) {
                let addr = seg.page_addr(start + i);
                self.aliases.insert(addr, *page);
                lent += 1;
            }
        }
        lent
    }

    /// Records that the pages `run` of `seg` were unmapped, their handles `handles` (in page order, as the
    /// page map gave them): appends single pages and lent pieces to `out`, appends each chunk unmapped at home
    /// once to `unmapped_chunks`. Returns how many were lent pieces.
    pub(crate) fn note_unmapped(
        &mut self,
        chunks: &FxHashSet<PhysHandle>,
        seg: &Segment,
        (run, handles): (Range<usize>, &[PhysHandle]),
        out: &mut Vec<PhysPage>,
        unmapped_chunks: &mut Vec<PhysHandle>,
    ) -> usize {
        if chunks.is_empty() {
            out.extend(handles.iter().copied().map(PhysPage::from));
            return 0;
        }
        let mut lent = 0;
        for (page, &handle) in run.zip(handles) {
            if !chunks.contains(&handle) {
                out.push(PhysPage::from(handle));
            } else if let Some(piece) = (!self.aliases.is_empty())
                .then(|| self.aliases.remove(&seg.page_addr(page)))
                .flatten()
            {
                out.push(piece);
                lent += 1;
            } else if unmapped_chunks.last() != Some(&handle) {
                unmapped_chunks.push(handle);
            }
        }
        lent
    }

    /// Forgets every lent page (teardown).
    pub(crate) fn forget_all(&mut self) {
        self.aliases.clear();
        self.lenders.clear();
    }

    /// The lent piece mapped at `addr`, if any.
    pub(crate) fn alias_at(&self, addr: u64) -> Option<&PhysPage> {
        self.aliases.get(&addr)
    }

    /// A lent page mapped at `addr`: the page map holds its chunk, and its chunk lends the page.
    pub(crate) fn check_alias(
        &self,
        segments: &Segments,
        (page_size, chunk_pages): (u64, usize),
        (piece, handle, addr): (&PhysPage, PhysHandle, u64),
    ) -> Result<(), V> {
        let lends = self.lenders.get(&piece.handle).is_some_and(|lender| {
            let page = lender.group + (piece.offset / page_size) as usize;
            piece.offset % page_size == 0
                && piece.offset < (chunk_pages as u64) * page_size
                && segments.try_at(lender.slot).is_some_and(|home| {
                    home.block_at(home.page_addr(page)).map(|b| b.state) == Some(BlockState::Lent)
                })
        });
        if piece.handle != handle || !lends {
            return Err(V::LentPage { addr });
        }
        Ok(())
    }

    /// The lenders against the lent blocks: each chunk with lent blocks has a lender at their group, counting
    /// them, and as many second mappings of it; per pool, the lent page counts match.
    pub(crate) fn check_lenders(
        &self,
        segments: &Segments,
        chunk_pages: usize,
        lent_blocks: &HashMap<u64, Vec<(usize, usize)>>,
        lent_per_pool: [usize; 2],
        lent_pages: [usize; 2],
    ) -> Result<(), V> {
        let mut aliases_per_chunk: HashMap<u64, usize> = HashMap::new();
        for piece in self.aliases.values() {
            *aliases_per_chunk.entry(piece.handle.0).or_default() += 1;
        }
        for (handle, lender) in &self.lenders {
            let blocks = lent_blocks.get(&handle.0).map_or(&[][..], Vec::as_slice);
            let at_home = blocks.iter().all(|&(slot, page)| {
                slot == lender.slot && page - page % chunk_pages == lender.group
            });
            let addr = segments.at(lender.slot).page_addr(lender.group);
            if !at_home
                || blocks.len() != lender.lent
                || aliases_per_chunk.get(&handle.0) != Some(&lender.lent)
            {
                return Err(V::LentPage { addr });
            }
        }
        if lent_blocks.len() != self.lenders.len()
            || aliases_per_chunk.len() != self.lenders.len()
            || lent_per_pool != lent_pages
        {
            let addr = self.aliases.keys().min().copied().unwrap_or(0);
            return Err(V::LentPage { addr });
        }
        Ok(())
    }
}
