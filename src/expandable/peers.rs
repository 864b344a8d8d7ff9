//! Peer access (PyTorch's `enablePeerAccess` for expandable segments): another device may read and write
//! every range mapped now, and, through the driver, every one mapped later.

use super::Expandable;
use crate::driver::Driver;
use crate::strategy::error::Error;

impl<D: Driver> Expandable<D> {
    /// Lets device `peer` reach every range mapped now and every one mapped later.
    pub(super) fn grant_peer(&mut self, peer: usize) -> Result<(), Error> {
        self.driver.add_peer(peer)?;
        let mut runs = Vec::new();
        for seg in self.segments.live() {
            for run in seg.pages.accessible_runs(0..seg.pages.len()) {
                runs.push((seg.page_addr(run.start), run.len() as u64 * self.page_size));
            }
        }
        for (va, size) in runs {
            self.driver.set_access(va, size)?;
        }
        tracing::info!(peer, "cuvmm: peer device given access");
        Ok(())
    }
}
