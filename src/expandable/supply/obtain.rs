//! N pages for a request's missing pages: pooled handles first; then what the compaction policy reclaims
//! (idle pages unmapped from wherever they are, or lent); then new handles from the driver, within the
//! memory limit and, for a request, the device margin. On out-of-memory the cache is released and creation
//! retried, once, if the request allows it ([`Shortage`]).
//!
//! The policy reclaims past the budget, which comes from the device's memory when the allocator started.
//! The device can be full before that, when other processes took memory since (or a ballast, as `cuvmm
//! capacity --backend cuda` places one): the driver's out-of-memory says so. Then the budget is, for that
//! request, what is reserved at the failure, and the policy reclaims against it after the cache is released:
//! under `compaction:split`, stranded chunks are split, as they are past the budget.

use super::{Growth, Parts, Shortage, Supply};
use crate::driver::{Driver, PhysPage};
use crate::expandable::compacting::{Compacting, Wait};
use crate::expandable::compaction::Reclaimer;
use crate::strategy::error::Error;

impl Supply {
    /// Appends `count` pages for missing pages to `out`: pooled handles first; then, as the compaction policy
    /// says, idle pages unmapped from wherever they are, or lent; then new handles from the driver; in `out`
    /// the new ones come first. Returns how many already existed (pooled, unmapped or lent). On driver
    /// out-of-memory the cache is released and creation retried, once, if `shortage` allows it. On failure
    /// every page obtained so far is put back and `out` is as it was.
    pub(super) fn obtain<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        count: usize,
        out: &mut Vec<PhysPage>,
        shortage: &mut Shortage,
    ) -> Result<usize, Error> {
        let base = out.len();
        out.reserve(count);
        let from_pool = self.physical.take_pooled(count, out);
        // Compaction waits for streams and unmaps: never during a capture.
        if from_pool < count
            && !p.graphs.capturing()
            && let Err(err) = self.reclaim(p, count - from_pool, out, None)
        {
            let obtained: Vec<PhysPage> = out.drain(base..).collect();
            self.put_back(p, obtained);
            return Err(err);
        }
        let mut reused = out.len() - base;
        let mut fresh_handles = Vec::new();
        while out.len() - base < count {
            fresh_handles.clear();
            let wanted = count - (out.len() - base);
            // Past the memory limit, or the device margin, the device is as full as if it were that small.
            let reserved = p.books.counters.reserved.current;
            let under_limit = self.physical.pages_under_limit(reserved);
            let (free, mut created) = match self.free_under_margin(p.driver, shortage) {
                Ok(free) => (free, Ok(())),
                Err(err) => (None, Err(err)),
            };
            let under_margin = free.map_or(usize::MAX, |free| {
                let room = free.saturating_sub(self.physical.margin()) / self.page_size;
                usize::try_from(room).unwrap_or(usize::MAX)
            });
            let allowed = under_limit.min(under_margin).min(wanted);
            if created.is_ok() && allowed > 0 {
                created = p
                    .driver
                    .create_each(self.page_size, allowed, &mut fresh_handles);
            }
            if created.is_ok() && allowed < wanted {
                let missing = wanted - allowed;
                created = Err(match free {
                    Some(free) if under_margin < under_limit => {
                        self.physical.margin_reached(free, missing)
                    }
                    _ => self.physical.limit_reached(reserved, missing),
                });
            }
            out.extend(fresh_handles.iter().copied().map(PhysPage::from));
            let fresh = fresh_handles.len() as u64;
            p.books.counters.created += fresh;
            p.books.counters.reserved.add(fresh * self.page_size);
            match created.map_err(Error::from) {
                Ok(()) => {}
                Err(err) if err.is_out_of_memory() && shortage.take_release() => {
                    tracing::info!(
                        pages = count,
                        created = out.len() - base - reused,
                        "cuvmm: out of memory creating a page; releasing the cache and retrying once"
                    );
                    // The device is full with this much reserved: the budget for what is still missing.
                    let full_at = p.books.counters.reserved.current;
                    let before = out.len();
                    let missing = count - (out.len() - base);
                    let released = self.release_cache(p).and_then(|_| {
                        if p.graphs.capturing() {
                            return Ok(());
                        }
                        self.reclaim(p, missing, out, Some(full_at))
                    });
                    if let Err(err) = released {
                        let obtained: Vec<PhysPage> = out.drain(base..).collect();
                        self.put_back(p, obtained);
                        return Err(err);
                    }
                    // Pages reclaimed now existed already: before the new ones.
                    let late = out.len() - before;
                    out[base + reused..].rotate_right(late);
                    reused += late;
                }
                Err(err) => {
                    let obtained: Vec<PhysPage> = out.drain(base..).collect();
                    self.put_back(p, obtained);
                    return Err(err);
                }
            }
        }
        out[base..].rotate_left(reused);
        Ok(reused)
    }

    /// Reclaims idle pages for `count` missing pages as the compaction policy says ([`Policy::reclaim`](
    /// crate::expandable::compaction::Policy::reclaim)), against the budget, or `full_at` where that is
    /// less (the reserved bytes at which the driver ran out of memory). Single-page handles and lent pages
    /// are appended to `out`; chunks are released, which makes room to create single pages.
    fn reclaim<D: Driver>(
        &mut self,
        p: &mut Parts<'_, D>,
        count: usize,
        out: &mut Vec<PhysPage>,
        full_at: Option<u64>,
    ) -> Result<(), Error> {
        let base = out.len();
        let policies = p.policies;
        let mut reclaiming = Reclaiming {
            supply: self,
            parts: p,
            out,
            target: base + count,
            full_at,
            compacting: Compacting::default(),
        };
        let result = policies.compaction.reclaim(&mut reclaiming);
        let stolen = (reclaiming.out.len() - base) as u64;
        p.books.counters.compacted += stolen;
        if stolen > 0 {
            tracing::debug!(
                pages = stolen,
                "cuvmm: compaction: idle pages unmapped for reuse"
            );
        }
        result
    }
}

/// One request's reclaim, as the compaction policy drives it: the supply's mechanisms on the request's
/// buffer of pages, with what this compaction has learnt about streams.
struct Reclaiming<'s, 'p, 'a, D> {
    supply: &'s mut Supply,
    parts: &'p mut Parts<'a, D>,
    out: &'s mut Vec<PhysPage>,
    /// `out`'s length once every missing page is there.
    target: usize,
    /// The reserved bytes at which the driver ran out of memory, if it did: the budget where less.
    full_at: Option<u64>,
    compacting: Compacting,
}

impl<D: Driver> Reclaimer for Reclaiming<'_, '_, '_, D> {
    fn missing(&self) -> usize {
        self.target - self.out.len()
    }

    fn growth(&self) -> Growth {
        let reserved = self.parts.books.counters.reserved.current;
        let mut growth =
            (self.supply.physical).growth(reserved, self.missing() as u64 * self.supply.page_size);
        if let Some(full_at) = self.full_at {
            growth.budget = growth.budget.min(full_at);
        }
        growth
    }

    fn steal(&mut self, count: usize, wait: Wait) -> Result<usize, Error> {
        (self.supply).steal_idle(self.parts, count, self.out, wait, &mut self.compacting)
    }

    fn lend(&mut self, count: usize, wait: Wait) -> Result<usize, Error> {
        (self.supply).lend_stranded(self.parts, count, self.out, wait, &mut self.compacting)
    }

    fn split(&mut self, count: usize) -> Result<usize, Error> {
        (self.supply).split_stranded(self.parts, count, &mut self.compacting)
    }
}
