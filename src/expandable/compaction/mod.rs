//! Compaction policies: when growth takes the idle pages of segments rather than creating handles, in what
//! order it takes them, and which requests keep to whole pages (`docs/allocator.md`, "Compaction under
//! pressure, and handle size").
//!
//! A policy decides and the supply does: [`Policy::reclaim`] drives the supply's mechanisms (unmapping idle
//! pages, lending idle pages of chunks in use, waiting for streams) through a [`Reclaimer`]; placement asks
//! [`Policy::compares_every_fit`] and [`Policy::whole_pages`]. One file per policy, chosen from the
//! configuration in `policies.rs`:
//!
//! | policy | file | `compaction:` |
//! |---|---|---|
//! | `Pressure` | `pressure.rs` | `pressure` (the default) |
//! | `Eager` | `eager.rs` | `eager` |
//! | `Split` | `split.rs` | `split` |

pub(super) mod eager;
pub(super) mod pressure;
pub(super) mod split;

use super::compacting::Wait;
use super::segments::Segments;
use super::supply::Growth;
use crate::strategy::error::Error;
use crate::strategy::pool::Pool;
use std::fmt::Debug;

/// When growth reclaims idle pages, and how.
pub(super) trait Policy: Debug + Send + Sync {
    /// Whether a growth takes idle pages before it creates handles: the supply reclaims, and placement may
    /// borrow another stream's cached block to save pages.
    fn reclaims(&self, growth: Growth) -> bool;

    /// Whether placement compares every free block of the request's segments by the pages it would need
    /// mapped, rather than only the few best fits.
    fn compares_every_fit(&self, growth: Growth) -> bool;

    /// Whether a request of `size` bytes (rounded) in `pool` is placed in the segments of whole-page
    /// requests, apart from the others (`Segment::whole_pages`).
    fn whole_pages(&self, size: u64, pool: Pool, page_size: u64) -> bool;

    /// Puts `slots`, segments with idle pages, in the order compaction takes their pages.
    fn order(&self, slots: &mut [usize], segments: &Segments);

    /// Takes idle pages for a request's missing pages through `reclaimer`, before any is created.
    fn reclaim(&self, reclaimer: &mut dyn Reclaimer) -> Result<(), Error>;
}

/// The supply's mechanisms, as [`Policy::reclaim`] drives them for one request's missing pages.
pub(super) trait Reclaimer {
    /// Pages still missing.
    fn missing(&self) -> usize;

    /// Reserved memory against the budget, for creating the missing pages.
    fn growth(&self) -> Growth;

    /// Unmaps up to `count` idle pages (whole chunks) of segments whose stream `wait` shows done, in the
    /// policy's [`order`](Policy::order); returns the pages gained.
    fn steal(&mut self, count: usize, wait: Wait) -> Result<usize, Error>;

    /// Lends up to `count` idle pages of chunks that a live block still touches, where the driver maps
    /// parts of handles; returns the pages lent.
    fn lend(&mut self, count: usize, wait: Wait) -> Result<usize, Error>;

    /// Re-creates chunks that live blocks still touch as single pages at the same addresses, after
    /// synchronizing the device, until at least `count` of their idle pages are given back (released, which
    /// makes room to create pages); returns the pages given back.
    fn split(&mut self, count: usize) -> Result<usize, Error>;
}
