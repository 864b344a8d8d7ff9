//! Chunks, the default: PyTorch's expandable segments map 20 MiB handles in the large pool, because map and
//! unmap cost grows with the number of handles. New chunks are created while reserved memory stays
//! `large_handle_headroom` of the budget under it (default 0: up to the budget); past that, single pages,
//! which a job near its limit can move where they are needed.

use super::Policy;
use crate::expandable::supply::Growth;

/// Chunks of `pages` pages up to `(1 - headroom)` of the budget.
#[derive(Debug)]
pub(crate) struct Chunks {
    /// Pages per chunk (`large_handle_mb` in whole pages), at least 2.
    pub pages: usize,
    /// The fraction of the budget kept free of new chunks (`large_handle_headroom`).
    pub headroom: f64,
}

impl Policy for Chunks {
    fn chunk_pages(&self) -> usize {
        self.pages
    }

    fn new_chunk(&self, growth: Growth) -> bool {
        let headroom = (growth.budget as f64 * self.headroom) as u64;
        !Growth {
            extra: growth.extra.saturating_add(headroom),
            ..growth
        }
        .over_budget()
    }
}
