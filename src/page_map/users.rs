//! The live blocks that touch each page, and with them which mapped pages are idle.

use super::PageMap;
use crate::base::bit_words::{count_in, for_each_word};
use std::ops::Range;

impl PageMap {
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

    /// Marks `page` idle or not, keeping the count.
    pub(super) fn set_idle(&mut self, page: usize, idle: bool) {
        if self.idle.replace(page, idle) != idle {
            if idle {
                self.idle_count += 1;
            } else {
                self.idle_count -= 1;
            }
        }
    }
}
