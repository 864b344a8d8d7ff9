//! Which pages of a segment's reservation are mapped, by which handle, and how many live blocks touch each.
//!
//! The page map knows nothing of the driver: the expandable strategy makes the driver calls and then records
//! their outcome here. Page indices are `usize` offsets from the start of the reservation, never byte
//! addresses; [`PageMap::pages_touched`] converts a byte range into the pages it touches.
//!
//! A page is **idle** when it is mapped and no live block touches it: its handle can be unmapped and
//! mapped wherever a request needs it. The idle set is kept as its own bit vector, so finding idle pages
//! costs a scan of words, not of blocks.

#![deny(unsafe_code)]

use crate::driver::PhysHandle;
use bitvec::prelude::*;
use std::ops::Range;

/// The state of every page of one reservation.
#[derive(Debug, Clone)]
pub struct PageMap {
    page_size: u64,
    mapped: BitVec,
    accessible: BitVec,
    idle: BitVec,
    handles: Vec<Option<PhysHandle>>,
    users: Vec<u32>,
    mapped_count: usize,
    idle_count: usize,
    touched_count: usize,
}

impl PageMap {
    /// A map of `pages` unmapped pages of `page_size` bytes each.
    pub fn new(pages: usize, page_size: u64) -> Self {
        assert!(page_size > 0, "page size must be non-zero");
        Self {
            page_size,
            mapped: bitvec![0; pages],
            accessible: bitvec![0; pages],
            idle: bitvec![0; pages],
            handles: vec![None; pages],
            users: vec![0; pages],
            mapped_count: 0,
            idle_count: 0,
            touched_count: 0,
        }
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.users.len()
    }

    /// Whether the map has no pages.
    pub fn is_empty(&self) -> bool {
        self.users.is_empty()
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.page_size
    }

    /// The pages that bytes `offset .. offset + size` (offsets from the reservation's start) touch.
    /// Empty for `size == 0`.
    pub fn pages_touched(&self, offset: u64, size: u64) -> Range<usize> {
        if size == 0 {
            return 0..0;
        }
        let first = offset / self.page_size;
        let last = (offset + size - 1) / self.page_size;
        first as usize..last as usize + 1
    }

    /// Whether page `page` is mapped.
    pub fn is_mapped(&self, page: usize) -> bool {
        self.mapped[page]
    }

    /// Whether page `page` is mapped with access set.
    pub fn is_accessible(&self, page: usize) -> bool {
        self.accessible[page]
    }

    /// Whether page `page` is mapped and touched by no live block.
    pub fn is_idle(&self, page: usize) -> bool {
        self.idle[page]
    }

    /// The handle mapped at `page`, if any.
    pub fn handle(&self, page: usize) -> Option<PhysHandle> {
        self.handles[page]
    }

    /// How many live blocks touch `page`.
    pub fn users(&self, page: usize) -> u32 {
        self.users[page]
    }

    /// Pages mapped.
    pub fn mapped_count(&self) -> usize {
        self.mapped_count
    }

    /// Pages mapped and touched by no live block.
    pub fn idle_count(&self) -> usize {
        self.idle_count
    }

    /// Pages touched by at least one live block.
    pub fn touched_count(&self) -> usize {
        self.touched_count
    }

    /// Records that `handle` was mapped at `page` (access not yet set).
    ///
    /// # Panics
    /// If the page is already mapped: the caller lost track of a mapping.
    pub fn map(&mut self, page: usize, handle: PhysHandle) {
        assert!(!self.mapped[page], "page {page} mapped twice");
        self.mapped.set(page, true);
        self.handles[page] = Some(handle);
        self.mapped_count += 1;
        if self.users[page] == 0 {
            self.set_idle(page, true);
        }
    }

    /// Records that access was set on every page of `pages`.
    ///
    /// # Panics
    /// If one of them is not mapped.
    pub fn set_accessible(&mut self, pages: Range<usize>) {
        for page in pages.clone() {
            assert!(self.mapped[page], "set_access on unmapped page {page}");
        }
        self.accessible[pages].fill(true);
    }

    /// Records that `page` was unmapped, and returns the handle that was mapped there.
    ///
    /// # Panics
    /// If the page is not mapped, or a live block still touches it.
    pub fn unmap(&mut self, page: usize) -> PhysHandle {
        assert!(
            self.users[page] == 0,
            "unmapping page {page} that {} live blocks touch",
            self.users[page]
        );
        let handle = self.handles[page]
            .take()
            .unwrap_or_else(|| panic!("unmapping unmapped page {page}"));
        self.mapped.set(page, false);
        self.accessible.set(page, false);
        self.mapped_count -= 1;
        self.set_idle(page, false);
        handle
    }

    /// Records that a live block now touches every page of `pages`.
    pub fn add_user(&mut self, pages: Range<usize>) {
        for page in pages {
            self.users[page] += 1;
            if self.users[page] == 1 {
                self.touched_count += 1;
                if self.mapped[page] {
                    self.set_idle(page, false);
                }
            }
        }
    }

    /// Records that a live block no longer touches the pages of `pages`.
    ///
    /// # Panics
    /// If a page's count would go below zero.
    pub fn remove_user(&mut self, pages: Range<usize>) {
        for page in pages {
            assert!(self.users[page] > 0, "page {page} has no user to remove");
            self.users[page] -= 1;
            if self.users[page] == 0 {
                self.touched_count -= 1;
                if self.mapped[page] {
                    self.set_idle(page, true);
                }
            }
        }
    }

    fn set_idle(&mut self, page: usize, idle: bool) {
        if self.idle[page] != idle {
            self.idle.set(page, idle);
            if idle {
                self.idle_count += 1;
            } else {
                self.idle_count -= 1;
            }
        }
    }

    /// Whether every page of `pages` is mapped with access set (true for an empty range).
    pub fn all_accessible(&self, pages: Range<usize>) -> bool {
        self.accessible[pages].all()
    }

    /// Number of unmapped pages inside `pages`.
    pub fn unmapped_count(&self, pages: Range<usize>) -> usize {
        self.mapped[pages].count_zeros()
    }

    /// Maximal runs of unmapped pages inside `pages`, in address order.
    pub fn unmapped_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        runs(&self.mapped[pages.clone()], false, pages.start)
    }

    /// Maximal runs of mapped pages inside `pages`, in address order.
    pub fn mapped_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        runs(&self.mapped[pages.clone()], true, pages.start)
    }

    /// The first `limit` maximal runs of mapped pages inside `pages`, in address order.
    pub fn mapped_runs_limited(&self, pages: Range<usize>, limit: usize) -> Vec<Range<usize>> {
        runs_limited(&self.mapped[pages.clone()], true, pages.start, limit)
    }

    /// Maximal runs of mapped pages without access inside `pages`, in address order.
    pub fn inaccessible_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        for run in runs(&self.accessible[pages.clone()], false, pages.start) {
            out.extend(runs(&self.mapped[run.clone()], true, run.start));
        }
        out
    }

    /// Maximal runs of mapped pages with access set inside `pages`, in address order.
    pub fn accessible_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        runs(&self.accessible[pages.clone()], true, pages.start)
    }

    /// Maximal runs of idle pages, in address order.
    pub fn idle_runs(&self) -> Vec<Range<usize>> {
        runs(&self.idle, true, 0)
    }

    /// Maximal runs of idle pages inside `pages`, in address order.
    pub fn idle_runs_in(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        runs(&self.idle[pages.clone()], true, pages.start)
    }

    /// Idle pages from the highest address down.
    pub fn idle_pages_rev(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle.iter_ones().rev()
    }
}

/// Maximal runs of bits equal to `value` in `bits`, as page ranges offset by `base`.
fn runs(bits: &BitSlice, value: bool, base: usize) -> Vec<Range<usize>> {
    runs_limited(bits, value, base, usize::MAX)
}

/// The first `limit` maximal runs of bits equal to `value` in `bits`, as page ranges offset by `base`.
fn runs_limited(bits: &BitSlice, value: bool, base: usize, limit: usize) -> Vec<Range<usize>> {
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < bits.len() && out.len() < limit {
        let start = if value {
            bits[pos..].first_one()
        } else {
            bits[pos..].first_zero()
        };
        let Some(start) = start.map(|s| s + pos) else {
            break;
        };
        let len = if value {
            bits[start..].leading_ones()
        } else {
            bits[start..].leading_zeros()
        };
        out.push(base + start..base + start + len);
        pos = start + len;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_touched_covers_partial_pages() {
        let map = PageMap::new(8, 100);
        assert_eq!(map.pages_touched(0, 100), 0..1);
        assert_eq!(map.pages_touched(50, 100), 0..2);
        assert_eq!(map.pages_touched(100, 1), 1..2);
        assert_eq!(map.pages_touched(199, 2), 1..3);
        assert_eq!(map.pages_touched(10, 0), 0..0);
    }

    #[test]
    fn idle_follows_users_and_mapping() {
        let mut map = PageMap::new(4, 1);
        map.add_user(1..3);
        map.map(1, PhysHandle(7));
        map.map(3, PhysHandle(8));
        assert!(!map.is_idle(1));
        assert!(map.is_idle(3));
        assert_eq!(map.idle_count(), 1);
        assert_eq!(map.touched_count(), 2);
        map.remove_user(1..3);
        assert_eq!(map.touched_count(), 0);
        assert!(map.is_idle(1));
        assert_eq!(map.idle_runs(), vec![1..2, 3..4]);
        assert_eq!(map.unmapped_runs(0..4), vec![0..1, 2..3]);
        assert_eq!(map.unmap(1), PhysHandle(7));
        assert_eq!(map.idle_count(), 1);
        assert_eq!(map.mapped_count(), 1);
    }

    #[test]
    fn inaccessible_runs_skip_unmapped_and_accessible_pages() {
        let mut map = PageMap::new(6, 1);
        for page in [0, 1, 2, 4, 5] {
            map.map(page, PhysHandle(page as u64));
        }
        map.set_accessible(1..2);
        assert_eq!(map.inaccessible_runs(0..6), vec![0..1, 2..3, 4..6]);
        assert_eq!(map.accessible_runs(0..6), vec![1..2]);
    }

    #[test]
    #[should_panic(expected = "live blocks touch")]
    fn unmapping_a_used_page_panics() {
        let mut map = PageMap::new(2, 1);
        map.map(0, PhysHandle(1));
        map.add_user(0..1);
        map.unmap(0);
    }
}
