//! Searches over a range of pages: the runs (maximal ranges) of mapped, unmapped, inaccessible and idle
//! pages, and the first of each.

use super::PageMap;
use std::ops::Range;

impl PageMap {
    /// Whether every page of `pages` is mapped with access set (true for an empty range).
    pub fn all_accessible(&self, pages: Range<usize>) -> bool {
        self.accessible.all(pages)
    }

    /// Number of unmapped pages inside `pages`.
    pub fn unmapped_count(&self, pages: Range<usize>) -> usize {
        pages.len() - self.mapped.count_ones(pages)
    }

    /// Maximal runs of unmapped pages inside `pages`, in address order.
    #[cfg(any(test, feature = "testing"))]
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
    #[cfg(any(test, feature = "testing"))]
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
    #[cfg(any(test, feature = "testing"))]
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
    #[cfg(any(test, feature = "testing"))]
    pub fn idle_runs_in(&self, pages: Range<usize>) -> Vec<Range<usize>> {
        self.idle.runs(pages, true).collect()
    }

    /// Idle pages from the highest address down.
    #[cfg(any(test, feature = "testing"))]
    pub fn idle_pages_rev(&self) -> impl Iterator<Item = usize> + '_ {
        self.idle_runs().into_iter().rev().flat_map(Iterator::rev)
    }
}
