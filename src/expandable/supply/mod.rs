//! The supply of physical pages: the one part that creates, reuses, reclaims, lends and releases handles.
//! It answers "back this block with pages" ([`Supply::back_block`]) and "give this much idle memory back"
//! ([`Supply::release_idle`], [`Supply::release_cache`]); no other part creates, maps, unmaps or releases a
//! handle.
//!
//! Its own state is the handles held (`physical.rs`: the pool, the chunks, the budget and the memory limit)
//! and the pages of chunks lent elsewhere (`lending.rs`). The rest of the allocator that a call needs (the
//! driver, the segments and their page maps, the books, the stream waits, the graph pools, the tags, the
//! policies) is lent to it for the call as [`Parts`]. The decisions are the policies' (`compaction/`,
//! `handle_size/`) and the request's (`request.rs`: whether to release the cache and retry, [`Shortage`]);
//! the supply carries them out:
//! - `back.rs`: backing a block: chunks at unmapped aligned groups, then the missing pages, then access;
//! - `obtain.rs`: N pages for missing pages: pooled handles, then the compaction policy's reclaim, then new
//!   handles (and, once if the request allows, the cache released and creation retried);
//! - `reclaim.rs`: taking idle pages: unmapping them, lending pieces of chunks in use, putting pages back;
//! - `release.rs`: giving memory back to the driver: idle memory, the whole cache, everything on drop;
//! - `split.rs`: re-creating chunks that live blocks still touch as single pages, under pressure;
//! - `exports.rs`: the descriptor of each exported handle, made once and kept until the handle's release.

mod back;
mod exports;
mod lending;
mod obtain;
mod physical;
mod reclaim;
mod release;
mod split;

pub(super) use lending::Lending;
pub(super) use physical::{Growth, Physical, Setup};

use super::accounting::Books;
use super::graphs::Graphs;
use super::policies::Policies;
use super::segments::Segments;
use super::streams::StreamWaits;
use super::tags::Tags;
use crate::driver::{Driver, DriverError, PhysHandle};
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// The physical pages: the handles held and the pages lent.
#[derive(Debug)]
pub(super) struct Supply {
    physical: Physical,
    lending: Lending,
    page_size: u64,
}

/// The rest of the allocator, lent to the supply (or to the frees, `parked.rs`) for one call: what they
/// share is passed, never reached for.
pub(super) struct Parts<'a, D> {
    pub driver: &'a mut D,
    pub segments: &'a mut Segments,
    pub books: &'a mut Books,
    pub waits: &'a mut StreamWaits,
    pub graphs: &'a mut Graphs,
    pub tags: &'a Tags,
    pub policies: &'a Policies,
}

/// What a request lets the supply do when the driver runs out of memory creating pages, and what the
/// supply did: the request decides (`request.rs`), the supply does.
#[derive(Debug)]
pub(super) struct Shortage {
    /// Whether the supply may release the cache and create again, once.
    may_release: bool,
    /// Whether it did.
    released: bool,
    /// Whether a chunk could not be created, so that single pages were tried instead.
    fell_back: bool,
    /// Whether new pages must leave the device margin free
    /// ([`Config::device_margin`](crate::Config::device_margin)): a request's do, a wake's (which maps what
    /// its tag had) and a pool's checkpoint's do not.
    keeps_margin: bool,
}

impl Shortage {
    /// A request's allowance: one release of the cache and retry if `may_release`.
    pub(super) fn allowing(may_release: bool) -> Self {
        Self {
            may_release,
            released: false,
            fell_back: false,
            keeps_margin: false,
        }
    }

    /// This allowance, for a request whose new pages leave the device margin free.
    pub(super) fn keeping_margin(mut self) -> Self {
        self.keeps_margin = true;
        self
    }

    /// Whether the cache was released for the request.
    pub(super) fn released(&self) -> bool {
        self.released
    }

    /// Whether a chunk ran out of memory and single pages were tried.
    pub(super) fn fell_back(&self) -> bool {
        self.fell_back
    }

    /// Uses the allowance: whether to release the cache and retry now (once).
    fn take_release(&mut self) -> bool {
        let take = self.may_release && !self.released;
        self.released |= take;
        take
    }
}

impl Supply {
    /// No handle held yet; lending allowed if `lending`.
    pub(super) fn set_up(setup: Setup, lending: bool) -> Self {
        Self {
            page_size: setup.page_size,
            physical: Physical::set_up(setup),
            lending: Lending::allowed(lending),
        }
    }

    /// The handles held, the budget and the limit (read: statistics, invariants, sharing).
    pub(super) fn physical(&self) -> &Physical {
        &self.physical
    }

    /// The descriptor that exports the held `handle` (sharing): made at its first share, the same one at
    /// every later share, closed by cuvmm at its release.
    pub(super) fn export<D: Driver>(
        &mut self,
        driver: &mut D,
        handle: PhysHandle,
    ) -> Result<Arc<OwnedFd>, DriverError> {
        self.physical.export(driver, handle)
    }

    /// The pages lent (read: invariants, sharing).
    pub(super) fn lending(&self) -> &Lending {
        &self.lending
    }

    /// Sets the memory limit and the budget under it, with `reserved` bytes reserved now, which stay if
    /// above the limit.
    pub(super) fn set_limit(&mut self, limit: u64, budget: u64, reserved: u64) {
        self.physical.set_limit(limit, budget, reserved);
    }

    /// Sets the bytes of the device a request's growth leaves free.
    pub(super) fn set_margin(&mut self, bytes: u64) {
        self.physical.set_margin(bytes);
    }

    /// The bytes free on the device, where the device margin applies to `shortage`'s request (a margin is
    /// set, and it is a request); `None`, without asking the driver, where it does not.
    fn free_under_margin<D: Driver>(
        &self,
        driver: &mut D,
        shortage: &Shortage,
    ) -> Result<Option<u64>, DriverError> {
        if self.physical.margin() == 0 || !shortage.keeps_margin {
            return Ok(None);
        }
        Ok(Some(driver.mem_info()?.free))
    }

    /// Reserved memory against the budget for a growth of `extra` bytes, with `reserved` reserved now.
    pub(super) fn growth(&self, reserved: u64, extra: u64) -> Growth {
        self.physical.growth(reserved, extra)
    }

    /// Physical bytes held by no live block: idle mapped pages plus pooled handles.
    pub(super) fn idle_bytes(&self, books: &Books) -> u64 {
        (books.idle_pages() + self.physical.pooled_pages()) as u64 * self.page_size
    }

    /// Pages of the segments `slots` lent elsewhere.
    pub(super) fn lent_from(&self, slots: &[usize]) -> usize {
        self.lending.lent_from(slots)
    }
}
