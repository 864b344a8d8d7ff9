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

use crate::base::bits::Bits;
use crate::base::divisor::Divisor;
use crate::driver::PhysHandle;
use std::ops::Range;

mod mapping;
mod runs;
#[cfg(test)]
mod tests;
mod users;

/// The state of every page of one reservation.
#[derive(Debug, Clone)]
pub struct PageMap {
    page_size: Divisor,
    mapped: Bits,
    accessible: Bits,
    idle: Bits,
    pages: usize,
    /// The handle at each page, for the pages up to the highest ever mapped or used (a reservation is much
    /// larger than what is ever touched, so these grow on demand instead of being filled up front; their
    /// room for every page is reserved at creation, as address space the host touches only as they grow,
    /// so growing never copies them).
    handles: Vec<Option<PhysHandle>>,
    /// The live blocks touching each page, as far as `handles` goes.
    users: Vec<u32>,
    mapped_count: usize,
    /// Pages mapped without access: while there are none, which is nearly always between requests, the
    /// search for them is skipped.
    inaccessible_count: usize,
    idle_count: usize,
    touched_count: usize,
}

impl PageMap {
    /// A map of `pages` unmapped pages of `page_size` bytes each.
    pub fn new(pages: usize, page_size: u64) -> Self {
        assert!(page_size > 0, "page size must be non-zero");
        Self {
            page_size: Divisor::new(page_size),
            mapped: Bits::new(pages),
            accessible: Bits::new(pages),
            idle: Bits::new(pages),
            pages,
            handles: Vec::with_capacity(pages),
            users: Vec::with_capacity(pages),
            mapped_count: 0,
            inaccessible_count: 0,
            idle_count: 0,
            touched_count: 0,
        }
    }

    /// Number of pages.
    pub fn len(&self) -> usize {
        self.pages
    }

    /// Whether the map has no pages.
    #[cfg(any(test, feature = "testing"))]
    pub fn is_empty(&self) -> bool {
        self.pages == 0
    }

    /// Bytes per page.
    pub fn page_size(&self) -> u64 {
        self.page_size.bytes()
    }

    /// Whole pages in `bytes` (rounded down).
    pub fn pages_in(&self, bytes: u64) -> u64 {
        self.page_size.quotient(bytes)
    }

    /// Whether `offset` (from the reservation's start) is on a page boundary.
    pub fn is_page_aligned(&self, offset: u64) -> bool {
        self.page_size.divides(offset)
    }

    /// The pages that bytes `offset .. offset + size` (offsets from the reservation's start) touch.
    /// Empty for `size == 0`.
    pub fn pages_touched(&self, offset: u64, size: u64) -> Range<usize> {
        if size == 0 {
            return 0..0;
        }
        let first = self.page_size.quotient(offset);
        let last = self.page_size.quotient(offset + size - 1);
        first as usize..last as usize + 1
    }

    /// Whether page `page` is mapped.
    pub fn is_mapped(&self, page: usize) -> bool {
        self.mapped.get(page)
    }

    /// Whether page `page` is mapped with access set.
    pub fn is_accessible(&self, page: usize) -> bool {
        self.accessible.get(page)
    }

    /// Whether page `page` is mapped and touched by no live block.
    pub fn is_idle(&self, page: usize) -> bool {
        self.idle.get(page)
    }

    /// The handle mapped at `page`, if any.
    pub fn handle(&self, page: usize) -> Option<PhysHandle> {
        self.check(page);
        self.handles.get(page).copied().flatten()
    }

    /// How many live blocks touch `page`.
    pub fn users(&self, page: usize) -> u32 {
        self.check(page);
        self.users.get(page).copied().unwrap_or(0)
    }

    /// Panics if `page` is not a page of the map.
    fn check(&self, page: usize) {
        assert!(page < self.pages, "page {page} out of {}", self.pages);
    }

    /// Makes `handles` and `users` cover pages below `end` (at most every page).
    fn cover(&mut self, end: usize) {
        if end > self.users.len() {
            // Within the capacity reserved up front: no copy; new pages written 256 at a time, not doubling.
            let len = end.next_multiple_of(256).min(self.pages);
            self.users.resize(len, 0);
            self.handles.resize(len, None);
        }
    }

    /// Pages mapped.
    pub fn mapped_count(&self) -> usize {
        self.mapped_count
    }

    /// Pages mapped without access set.
    pub fn inaccessible_count(&self) -> usize {
        self.inaccessible_count
    }

    /// Pages mapped and touched by no live block.
    pub fn idle_count(&self) -> usize {
        self.idle_count
    }

    /// Pages touched by at least one live block.
    pub fn touched_count(&self) -> usize {
        self.touched_count
    }
}
