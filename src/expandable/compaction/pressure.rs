//! `compaction:pressure`, the default: compaction is paid only under pressure. Growth creates handles while
//! reserved memory stays under the budget; past it, it takes the idle pages of segments whose stream an
//! event query shows done, those freed longest ago first, then (where the driver maps parts of handles)
//! lends idle pages of chunks in use; then the same after synchronizing each remaining stream once; and only
//! then creates past the budget. No synchronization while memory is plentiful.

use super::{Policy, Reclaimer};
use crate::expandable::compacting::Wait;
use crate::expandable::segments::Segments;
use crate::expandable::supply::Growth;
use crate::strategy::error::Error;
use crate::strategy::pool::Pool;

/// Compaction under pressure.
#[derive(Debug)]
pub(crate) struct Pressure;

impl Policy for Pressure {
    fn reclaims(&self, growth: Growth) -> bool {
        growth.over_budget()
    }

    fn compares_every_fit(&self, growth: Growth) -> bool {
        growth.over_budget()
    }

    fn whole_pages(&self, _size: u64, _pool: Pool, _page_size: u64) -> bool {
        false
    }

    fn order(&self, slots: &mut [usize], segments: &Segments) {
        slots.sort_by_key(|&slot| segments.at(slot).last_free);
    }

    fn reclaim(&self, r: &mut dyn Reclaimer) -> Result<(), Error> {
        for wait in [Wait::Query, Wait::Block] {
            while r.missing() > 0 && r.growth().over_budget() {
                if r.steal(r.missing(), wait)? == 0 {
                    break;
                }
            }
            if r.missing() > 0 && r.growth().over_budget() {
                r.lend(r.missing(), wait)?;
            }
        }
        Ok(())
    }
}
