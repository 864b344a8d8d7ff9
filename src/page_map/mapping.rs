//! Mapping and unmapping: recording the outcome of the driver's `map`, `set_access` and `unmap` calls.

use super::PageMap;
use crate::base::bit_words::{count_in, first_bit, for_each_word};
use crate::driver::PhysHandle;
use std::ops::Range;

impl PageMap {
    /// Records that `handle` was mapped at `page` (access not yet set).
    ///
    /// # Panics
    /// If the page is already mapped: the caller lost track of a mapping.
    #[cfg(any(test, feature = "testing"))]
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
}
