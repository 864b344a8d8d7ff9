//! Lending the allocator's parts to one call: the supply (`supply/`) and the frees that wait (`parked.rs`)
//! are handed the parts they share as [`Parts`], borrowed apart from the orchestrator's own fields.

use super::Expandable;
use super::supply::{Parts, Supply};
use crate::driver::Driver;

impl<D: Driver> Expandable<D> {
    /// The supply, and the other parts lent to one of its calls.
    pub(super) fn supply_and_parts(&mut self) -> (&mut Supply, Parts<'_, D>) {
        let parts = Parts {
            driver: &mut self.driver,
            segments: &mut self.segments,
            books: &mut self.books,
            waits: &mut self.waits,
            graphs: &mut self.graphs,
            tags: &self.tags,
            policies: &self.policies,
        };
        (&mut self.supply, parts)
    }

    /// The parts lent to one call of the frees that wait (`parked.rs`).
    pub(super) fn parts(&mut self) -> Parts<'_, D> {
        self.supply_and_parts().1
    }
}

impl<D> Parts<'_, D> {
    /// Whether segment `slot` belongs to a live pool (its pages stay mapped where they are and its blocks
    /// stay the pool's) or to a sleeping tag (`sleep.rs`: nothing of it is taken or placed).
    pub(super) fn pinned(&self, slot: usize) -> bool {
        (self.segments.at(slot).graph).is_some_and(|pool| self.graphs.pool_is_live(pool))
            || self.tags.sleeps(self.segments.at(slot).tag)
    }
}
