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

use crate::base::bit_words::{count_in, first_bit, for_each_word};
use crate::base::bits::Bits;
use crate::base::divisor::Divisor;
use crate::driver::PhysHandle;
use std::ops::Range;

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

    /// Records that `handle` was mapped at `page` (access not yet set).
    ///
    /// # Panics
    /// If the page is already mapped: the caller lost track of a mapping.
    pub fn map(&mut self, page: usize, handle: PhysHandle) {
        self.check(page);
        self.map_chunk(page..page + 1, handle);
    }

    /// Records that `handles` were mapped at the pages from `start` on, one each (access not yet set): as
    /// [`map`](Self::map) on each, with the bits of the run set a word at a time.
    ///
    /// # Panics
    /// If one of the pages is already mapped.
    pub fn map_run<I>(&mut self, start: usize, handles: I)
    where
        I: IntoIterator<Item = PhysHandle>,
        I::IntoIter: ExactSizeIterator,
    {
        let handles = handles.into_iter();
        self.map_pages(start..start + handles.len(), |slots| {
            for (slot, handle) in slots.iter_mut().zip(handles) {
                *slot = Some(handle);
            }
        });
    }

    /// Records that one multi-page `handle` (a chunk) was mapped at every page of `pages`, as
    /// [`map_run`](Self::map_run) with `handle` at each page.
    ///
    /// # Panics
    /// If one of the pages is already mapped.
    pub fn map_chunk(&mut self, pages: Range<usize>, handle: PhysHandle) {
        self.map_pages(pages, |slots| slots.fill(Some(handle)));
    }

    /// Records that the pages of `pages` were mapped, `handles` writing their handles into their slots.
    fn map_pages(&mut self, pages: Range<usize>, handles: impl FnOnce(&mut [Option<PhysHandle>])) {
        let mut mapped = self.mapped.words_mut();
        for_each_word(pages.clone(), |w, mask, _| {
            let twice = mapped.word(w) & mask;
            assert!(twice == 0, "page {} mapped twice", first_bit(w, twice));
            mapped.set(w, mask);
        });
        self.cover(pages.end);
        handles(&mut self.handles[pages.clone()]);
        self.mapped_count += pages.len();
        self.inaccessible_count += pages.len();
        // The pages no live block touches turn idle (unmapped, they were not), a word of bits at a time.
        let (users, mut idle) = (&self.users, self.idle.words_mut());
        for_each_word(pages, |w, mask, n| {
            let low = mask.trailing_zeros() as usize;
            let first = w * u64::BITS as usize + low;
            let mut unused = 0;
            for (i, &users) in users[first..first + n].iter().enumerate() {
                unused |= u64::from(users == 0) << (low + i);
            }
            idle.set(w, unused);
            self.idle_count += count_in(unused, mask, n);
        });
    }

    /// Records that access was set on every page of `pages`.
    ///
    /// # Panics
    /// If one of them is not mapped.
    pub fn set_accessible(&mut self, pages: Range<usize>) {
        let (mapped, mut accessible) = (self.mapped.words(), self.accessible.words_mut());
        for_each_word(pages, |w, mask, n| {
            let unmapped = mask & !mapped[w];
            assert!(
                unmapped == 0,
                "set_access on unmapped page {}",
                first_bit(w, unmapped)
            );
            self.inaccessible_count -= count_in(mask & !accessible.word(w), mask, n);
            accessible.set(w, mask);
        });
    }

    /// Records that `page` was unmapped, and returns the handle that was mapped there.
    ///
    /// # Panics
    /// If the page is not mapped, or a live block still touches it.
    pub fn unmap(&mut self, page: usize) -> PhysHandle {
        let users = self.users(page);
        assert!(
            users == 0,
            "unmapping page {page} that {users} live blocks touch"
        );
        let handle = self
            .handles
            .get_mut(page)
            .and_then(Option::take)
            .unwrap_or_else(|| panic!("unmapping unmapped page {page}"));
        self.mapped.set(page, false);
        if !self.accessible.replace(page, false) {
            self.inaccessible_count -= 1;
        }
        self.mapped_count -= 1;
        self.set_idle(page, false);
        handle
    }

    /// Records that every page of `pages` was unmapped, appending their handles to `out` in page order.
    ///
    /// # Panics
    /// As [`unmap`](Self::unmap), for the first page that is not mapped or that a live block touches.
    pub fn unmap_run(&mut self, pages: Range<usize>, out: &mut Vec<PhysHandle>) {
        if pages.end > self.users.len() || !self.mapped.all(pages.clone()) {
            // Some page was never mapped: unmap one by one, which panics at it.
            pages.for_each(|page| out.push(self.unmap(page)));
            return;
        }
        if let Some(i) = self.users[pages.clone()].iter().position(|&u| u > 0) {
            let page = pages.start + i;
            panic!(
                "unmapping page {page} that {} live blocks touch",
                self.users[page]
            );
        }
        self.take_run(pages, out);
    }

    /// As [`unmap_run`](Self::unmap_run), but the pages may be touched by live blocks, which keep them
    /// (their users) while unmapped: the pages of a sleeping tag.
    ///
    /// # Panics
    /// If one of the pages is not mapped.
    pub fn unmap_run_in_use(&mut self, pages: Range<usize>, out: &mut Vec<PhysHandle>) {
        assert!(
            pages.end <= self.users.len() && self.mapped.all(pages.clone()),
            "unmapping unmapped pages in {pages:?}"
        );
        self.take_run(pages, out);
    }

    /// Records that the mapped `pages` were unmapped, appending their handles to `out`.
    fn take_run(&mut self, pages: Range<usize>, out: &mut Vec<PhysHandle>) {
        out.extend(
            self.handles[pages.clone()]
                .iter_mut()
                .filter_map(Option::take),
        );
        self.mapped.fill(pages.clone(), false);
        self.inaccessible_count -= pages.len() - self.accessible.take_ones(pages.clone());
        self.idle_count -= self.idle.take_ones(pages.clone());
        self.mapped_count -= pages.len();
    }

    /// Records that a live block now touches every page of `pages`.
    ///
    /// A block's pages other than its first and last are touched by no other block: they are updated
    /// together (the idle bits a word at a time) when none has a user yet; the ends one by one.
    pub fn add_user(&mut self, pages: Range<usize>) {
        if pages.end > self.pages {
            self.check(pages.end - 1);
        }
        self.cover(pages.end);
        let Some(inner) = Self::split_ends(&pages) else {
            pages.for_each(|page| self.add_user_page(page));
            return;
        };
        self.add_user_page(pages.start);
        // One pass counts the users up and notes whether any page had one already.
        let mut had_users = 0;
        for users in &mut self.users[inner.clone()] {
            had_users |= *users;
            *users += 1;
        }
        if had_users == 0 {
            self.touched_count += inner.len();
            if self.idle_count > 0 {
                let mut idle = self.idle.words_mut();
                for_each_word(inner, |w, mask, n| {
                    self.idle_count -= count_in(idle.word(w) & mask, mask, n);
                    idle.clear(w, mask);
                });
            }
        } else {
            // Only the pages that just got their first user change state.
            for page in inner {
                if self.users[page] == 1 {
                    self.touched_count += 1;
                    if self.mapped.get(page) {
                        self.set_idle(page, false);
                    }
                }
            }
        }
        self.add_user_page(pages.end - 1);
    }

    /// Records that a live block no longer touches the pages of `pages`.
    ///
    /// As [`add_user`](Self::add_user), the pages between the first and the last together when each has one.
    ///
    /// # Panics
    /// If a page's count would go below zero.
    pub fn remove_user(&mut self, pages: Range<usize>) {
        let Some(inner) = Self::split_ends(&pages).filter(|inner| inner.end <= self.users.len())
        else {
            pages.for_each(|page| self.remove_user_page(page));
            return;
        };
        self.remove_user_page(pages.start);
        // One pass counts the users down and notes whether any page had other than exactly one.
        let mut not_one = 0;
        for users in &mut self.users[inner.clone()] {
            not_one |= *users ^ 1;
            *users = users.wrapping_sub(1);
        }
        if not_one == 0 {
            self.touched_count -= inner.len();
            // No page of `inner` was idle: each had a user. Now exactly the mapped ones are.
            let (mapped, mut idle) = (self.mapped.words(), self.idle.words_mut());
            for_each_word(inner, |w, mask, n| {
                let unused = mapped[w] & mask;
                idle.set(w, unused);
                self.idle_count += count_in(unused, mask, n);
            });
        } else {
            // Undo, then page by page (which panics at a page that had no user).
            self.users[inner.clone()]
                .iter_mut()
                .for_each(|users| *users = users.wrapping_add(1));
            inner.for_each(|page| self.remove_user_page(page));
        }
        self.remove_user_page(pages.end - 1);
    }

    /// The pages of `pages` between its first and its last, if it has at least three.
    fn split_ends(pages: &Range<usize>) -> Option<Range<usize>> {
        (pages.len() >= 3).then(|| pages.start + 1..pages.end - 1)
    }

    fn add_user_page(&mut self, page: usize) {
        let users = &mut self.users[page];
        *users += 1;
        if *users == 1 {
            self.touched_count += 1;
            // An unmapped page is not idle: clearing its bit changes nothing; nor does it with no page idle.
            if self.idle_count > 0 {
                self.set_idle(page, false);
            }
        }
    }

    fn remove_user_page(&mut self, page: usize) {
        // (`users` is no longer than the map: a page found there is a page of the map.)
        let Some(users) = self.users.get_mut(page).filter(|users| **users > 0) else {
            panic!("page {page} has no user to remove");
        };
        *users -= 1;
        if *users == 0 {
            self.touched_count -= 1;
            if self.mapped.get(page) {
                self.set_idle(page, true);
            }
        }
    }

    fn set_idle(&mut self, page: usize, idle: bool) {
        if self.idle.replace(page, idle) != idle {
            if idle {
                self.idle_count += 1;
            } else {
                self.idle_count -= 1;
            }
        }
    }

    /// Whether every page of `pages` is mapped with access set (true for an empty range).
    pub fn all_accessible(&self, pages: Range<usize>) -> bool {
        self.accessible.all(pages)
    }

    /// Number of unmapped pages inside `pages`.
    pub fn unmapped_count(&self, pages: Range<usize>) -> usize {
        pages.len() - self.mapped.count_ones(pages)
    }

    /// Maximal runs of unmapped pages inside `pages`, in address order.
    pub fn unmapped_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        self.mapped.runs(pages, false).collect()
    }

    /// Maximal runs of mapped pages inside `pages`, in address order.
    pub fn mapped_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        self.mapped_runs_lazy(pages).collect()
    }

    /// Maximal runs of mapped pages inside `pages`, in address order, each found when it is asked for.
    pub fn mapped_runs_lazy(&self, pages: Range<usize>) -> impl Iterator<Item = Range<usize>> + '_ {
        self.mapped.runs(pages, true)
    }

    /// Maximal runs of mapped pages without access inside `pages`, in address order.
    pub fn inaccessible_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        let mut out = Vec::new();
        let mut pos = pages.start;
        while let Some(run) = self.first_inaccessible_run(pos..pages.end) {
            pos = run.end;
            out.push(run);
        }
        out
    }

    /// The first page inside `pages` that is mapped.
    pub fn first_mapped(&self, pages: Range<usize>) -> Option<usize> {
        self.mapped.find(pages, true)
    }

    /// The first page inside `pages` that is not mapped.
    pub fn first_unmapped(&self, pages: Range<usize>) -> Option<usize> {
        self.mapped.find(pages, false)
    }

    /// The first maximal run of mapped pages without access inside `pages`.
    pub fn first_inaccessible_run(&self, pages: Range<usize>) -> Option<Range<usize>> {
        if self.inaccessible_count == 0 {
            return None;
        }
        self.mapped.first_run_without(&self.accessible, pages)
    }

    /// Maximal runs of mapped pages with access set inside `pages`, in address order.
    pub fn accessible_runs(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        self.accessible.runs(pages, true).collect()
    }

    /// Maximal runs of idle pages, in address order.
    pub fn idle_runs(&self) -> Vec<Range<usize>> {
        self.idle_runs_lazy().collect()
    }

    /// Maximal runs of idle pages, in address order, each found when it is asked for.
    pub fn idle_runs_lazy(&self) -> impl Iterator<Item = Range<usize>> + '_ {
        self.idle.runs(0..self.len(), true)
    }

    /// The first maximal run of idle pages inside `pages`.
    pub fn first_idle_run(&self, pages: Range<usize>) -> Option<Range<usize>> {
        let start = self.idle.find(pages.clone(), true)?;
        let end = self.idle.find(start..pages.end, false).unwrap_or(pages.end);
        Some(start..end)
    }

    /// The last maximal run of idle pages that ends at or before page `end` (cut at `end`).
    pub fn last_idle_run_before(&self, end: usize) -> Option<Range<usize>> {
        self.idle.last_run_before(end)
    }

    /// Maximal runs of idle pages inside `pages`, in address order.
    pub fn idle_runs_in(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        self.idle.runs(pages, true).collect()
    }

    /// Idle pages from the highest address down.
    pub fn idle_pages_rev(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle_runs().into_iter().rev().flat_map(Iterator::rev)
    }
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
    fn runs_cross_word_boundaries() {
        let mut map = PageMap::new(200, 1);
        for page in (60..70).chain(127..130).chain(190..200) {
            map.map(page, PhysHandle(page as u64));
        }
        assert_eq!(
            map.mapped_runs_lazy(0..200).take(2).collect::<Vec<_>>(),
            vec![60..70, 127..130]
        );
        assert_eq!(map.mapped_runs(65..195), vec![65..70, 127..130, 190..195]);
        assert_eq!(map.unmapped_runs(125..192), vec![125..127, 130..190]);
        assert_eq!(map.idle_runs_in(128..200), vec![128..130, 190..200]);
        assert_eq!(map.mapped_runs(70..127), Vec::<Range<usize>>::new());
    }

    #[test]
    fn unmap_run_takes_the_handles_in_order() {
        let mut map = PageMap::new(8, 1);
        for page in 1..6 {
            map.map(page, PhysHandle(page as u64));
        }
        map.add_user(2..3);
        let mut out = Vec::new();
        map.unmap_run(3..6, &mut out);
        assert_eq!(out, [PhysHandle(3), PhysHandle(4), PhysHandle(5)]);
        assert_eq!((map.mapped_count(), map.idle_count()), (2, 1));
        assert_eq!(map.idle_runs(), vec![1..2]);
        assert_eq!(map.unmapped_runs(0..8), vec![0..1, 3..8]);
    }

    #[test]
    #[should_panic(expected = "unmapping page 2 that 1 live blocks touch")]
    fn unmap_run_over_a_used_page_panics() {
        let mut map = PageMap::new(8, 1);
        for page in 1..6 {
            map.map(page, PhysHandle(page as u64));
        }
        map.add_user(2..3);
        map.unmap_run(1..4, &mut Vec::new());
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
