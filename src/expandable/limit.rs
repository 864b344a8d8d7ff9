//! The memory limit (`per_process_memory_fraction`, [`Config::memory_limit`](crate::Config::memory_limit)):
//! PyTorch's `set_per_process_memory_fraction` for cuvmm. Growth past it is refused as a full device's would
//! be (`physical.rs`, `obtain_handles`), so a request is served from idle memory or fails with out-of-memory.

use super::Expandable;
use crate::driver::{Driver, DriverError, Op};

impl<D: Driver> Expandable<D> {
    /// How many more pages the memory limit lets the allocator reserve (all it wants without a limit).
    pub(super) fn pages_under_limit(&self) -> usize {
        match self.limit {
            None => usize::MAX,
            Some(limit) => {
                let room = limit.saturating_sub(self.counters.reserved.current) / self.page_size;
                usize::try_from(room).unwrap_or(usize::MAX)
            }
        }
    }

    /// The out-of-memory error of creating `pages` pages past the memory limit: what the driver would say of
    /// a device that small.
    pub(super) fn limit_reached(&self, pages: usize) -> DriverError {
        let limit = self.limit.unwrap_or(0);
        DriverError::OutOfMemory {
            op: Op::Create,
            requested: pages as u64 * self.page_size,
            free: limit.saturating_sub(self.counters.reserved.current),
        }
    }
}
