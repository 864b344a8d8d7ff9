//! `compaction:split`: `compaction:pressure` while memory is plentiful (the same calls, no synchronization),
//! and, past the budget, once no idle page can be unmapped or lent, the chunks that live blocks still touch
//! are re-created as single pages at the same addresses (`supply/split.rs`, after one device
//! synchronization), so that no idle page stays stranded in a 20 MiB handle; then the idle pages of the
//! split chunks' neighbours are taken as under `pressure`. The program says by choosing it that while an
//! allocation is served no other thread launches work on cuvmm memory (the live pages move under it).

use super::pressure::Pressure;
use super::{Policy, Reclaimer};
use crate::expandable::compacting::Wait;
use crate::expandable::segments::Segments;
use crate::expandable::supply::Growth;
use crate::strategy::error::Error;
use crate::strategy::pool::Pool;

/// Compaction under pressure, splitting stranded chunks last.
#[derive(Debug)]
pub(crate) struct Split;

impl Policy for Split {
    fn reclaims(&self, growth: Growth) -> bool {
        Pressure.reclaims(growth)
    }

    fn compares_every_fit(&self, growth: Growth) -> bool {
        Pressure.compares_every_fit(growth)
    }

    fn whole_pages(&self, size: u64, pool: Pool, page_size: u64) -> bool {
        Pressure.whole_pages(size, pool, page_size)
    }

    fn order(&self, slots: &mut [usize], segments: &Segments) {
        Pressure.order(slots, segments);
    }

    fn reclaim(&self, r: &mut dyn Reclaimer) -> Result<(), Error> {
        Pressure.reclaim(r)?;
        while r.missing() > 0 && r.growth().over_budget() {
            let over = r.growth().reserved + r.growth().extra - r.growth().budget;
            let page = r.growth().extra / r.missing() as u64;
            if r.split(over.div_ceil(page.max(1)) as usize)? == 0 {
                break;
            }
            // The pages the split left idle elsewhere in those segments (the device is synchronized).
            while r.missing() > 0 && r.growth().over_budget() {
                if r.steal(r.missing(), Wait::Block)? == 0 {
                    break;
                }
            }
        }
        Ok(())
    }
}
