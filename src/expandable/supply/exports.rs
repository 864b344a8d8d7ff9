//! The descriptors of exported handles: one per handle, kept while the handle is held.
//!
//! Sharing a block exports the handles under it (`sharing.rs`). Many blocks lie on one 20 MiB chunk, and a
//! program that sends a model's tensors to another process shares each of them: a descriptor per export
//! would hold one per tensor per handle, and a few thousand tensors exhaust a process's descriptors
//! (`ulimit -n` is 1024 on many systems). So a handle is exported once, and every later share of it hands
//! out the same descriptor, as PyTorch's expandable segments keep one `shareable_handle` per handle.
//!
//! The descriptor is dropped here when the handle is released ([`Physical::release_handle`]), never before:
//! a handle's number may be reused by the driver for a new allocation after its release, and the old
//! descriptor must not pass for the new one's. A caller that still holds the [`Arc`] keeps the descriptor
//! open; the memory it exports is then the released handle's, as with a descriptor CUDA handed out.
//!
//! [`Physical::release_handle`]: super::Physical::release_handle

use crate::driver::{Driver, DriverError, PhysHandle};
use rustc_hash::FxHashMap;
use std::os::fd::OwnedFd;
use std::sync::Arc;

/// The handles exported, each with its descriptor.
#[derive(Debug, Default)]
pub(crate) struct Exports {
    by_handle: FxHashMap<PhysHandle, Arc<OwnedFd>>,
}

impl Exports {
    /// The descriptor that exports `handle`: the one made before, or a new one from the driver.
    pub(crate) fn descriptor<D: Driver>(
        &mut self,
        driver: &mut D,
        handle: PhysHandle,
    ) -> Result<Arc<OwnedFd>, DriverError> {
        if let Some(fd) = self.by_handle.get(&handle) {
            return Ok(Arc::clone(fd));
        }
        let fd = Arc::new(driver.export_handle(handle)?);
        self.by_handle.insert(handle, Arc::clone(&fd));
        Ok(fd)
    }

    /// Forgets the descriptor of `handle`, which has been released.
    pub(crate) fn forget(&mut self, handle: PhysHandle) {
        if !self.by_handle.is_empty() {
            self.by_handle.remove(&handle);
        }
    }

    /// The handles exported (for the invariants).
    pub(crate) fn handles(&self) -> impl Iterator<Item = PhysHandle> + '_ {
        self.by_handle.keys().copied()
    }
}
