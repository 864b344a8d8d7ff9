//! `compaction:eager`, the footprint mode: every growth first takes idle pages from every segment, in slot
//! order, synchronizing their streams, so reserved memory stays at the pages live blocks touch, at the cost
//! of remapping and synchronizing on every run. Large-pool requests of whole pages go to segments of their
//! own (`docs/allocator.md`, "Whole pages apart"), and every handle is one page (`handle_size/`), so any idle
//! page can move.

use super::{Policy, Reclaimer};
use crate::expandable::compacting::Wait;
use crate::expandable::segments::Segments;
use crate::expandable::supply::Growth;
use crate::strategy::error::Error;
use crate::strategy::pool::Pool;

/// Eager compaction.
#[derive(Debug)]
pub(crate) struct Eager;

impl Policy for Eager {
    fn reclaims(&self, _growth: Growth) -> bool {
        true
    }

    fn compares_every_fit(&self, _growth: Growth) -> bool {
        false
    }

    /// Placed among their own kind, or on whole pages of the others' free blocks, such blocks start and end
    /// on page boundaries, so none of them keeps a page that another block freed.
    fn whole_pages(&self, size: u64, pool: Pool, page_size: u64) -> bool {
        pool == Pool::Large && size % page_size == 0
    }

    fn order(&self, _slots: &mut [usize], _segments: &Segments) {}

    fn reclaim(&self, r: &mut dyn Reclaimer) -> Result<(), Error> {
        r.steal(r.missing(), Wait::Block).map(drop)
    }
}
