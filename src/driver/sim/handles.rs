//! The simulated device's physical allocations: the handles `cuMemCreate` hands out.
//!
//! Handles are numbered from 1 in creation order and kept in a vector indexed by number, so finding one is
//! an array read. A handle may be released while mapped, as CUDA allows: it is then unknown to later calls,
//! and its memory is freed when its last mapping goes.

use crate::driver::{DriverError, Op, PhysHandle};

/// A physical allocation from `create`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Handle {
    /// Bytes.
    pub(super) size: u64,
    /// Released by the caller; freed once `maps` reaches 0.
    released: bool,
    /// Mappings of this handle.
    maps: u32,
}

impl Handle {
    /// Counts one more mapping of the handle.
    pub(super) fn mapped(&mut self) {
        self.maps += 1;
    }
}

/// Every handle whose memory is not freed yet.
#[derive(Debug, Clone, Default)]
pub(super) struct Handles {
    /// Handle number `n` at index `n - 1`; `None` once its memory is freed.
    slots: Vec<Option<Handle>>,
    /// Handles created and not released.
    live: usize,
    /// Bytes of handles whose memory is not yet freed (released but still mapped ones included).
    bytes: u64,
}

impl Handles {
    /// No handles, with room for `count` before the table grows.
    pub(super) fn with_capacity(count: usize) -> Self {
        Self {
            slots: Vec::with_capacity(count),
            ..Self::default()
        }
    }

    /// A new handle of `size` bytes.
    pub(super) fn create(&mut self, size: u64) -> PhysHandle {
        self.slots.push(Some(Handle {
            size,
            released: false,
            maps: 0,
        }));
        self.live += 1;
        self.bytes += size;
        PhysHandle(self.slots.len() as u64)
    }

    /// `count` new handles of `size` bytes each, appended to `out` in creation order.
    pub(super) fn create_many(&mut self, size: u64, count: usize, out: &mut Vec<PhysHandle>) {
        let first = self.slots.len() as u64 + 1;
        self.slots.extend((0..count).map(|_| {
            Some(Handle {
                size,
                released: false,
                maps: 0,
            })
        }));
        out.extend((first..first + count as u64).map(PhysHandle));
        self.live += count;
        self.bytes += size * count as u64;
    }

    /// Whether `handle` is live and exactly `size` bytes long.
    pub(super) fn is_whole(&self, handle: PhysHandle, size: u64) -> bool {
        usize::try_from(handle.0)
            .ok()
            .and_then(|id| id.checked_sub(1))
            .and_then(|index| self.slots.get(index))
            .and_then(Option::as_ref)
            .is_some_and(|h| !h.released && h.size == size)
    }

    /// Whether `handle` is known, not released, and holds `size` bytes from `offset`: what `map` asks of it.
    pub(super) fn is_live_with(&self, handle: PhysHandle, offset: u64, size: u64) -> bool {
        usize::try_from(handle.0)
            .ok()
            .and_then(|id| id.checked_sub(1))
            .and_then(|index| self.slots.get(index))
            .and_then(Option::as_ref)
            .is_some_and(|h| {
                !h.released && offset.checked_add(size).is_some_and(|end| end <= h.size)
            })
    }

    /// Counts one more mapping of `handle`, which [`is_live_with`](Self::is_live_with) found.
    pub(super) fn mapped(&mut self, handle: PhysHandle) {
        if let Some(h) = self.get_mut(handle.0) {
            h.mapped();
        }
    }

    /// A handle that is known and not released, for a call of `op`.
    pub(super) fn live(&mut self, op: Op, handle: PhysHandle) -> Result<&mut Handle, DriverError> {
        self.get_mut(handle.0)
            .filter(|h| !h.released)
            .ok_or(DriverError::UnknownHandle { op, handle })
    }

    /// Releases a live handle. Returns its number if its memory was freed now (it was not mapped).
    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<Option<u64>, DriverError> {
        let h = self.live(Op::Release, handle)?;
        h.released = true;
        let unmapped = h.maps == 0;
        self.live -= 1;
        Ok(unmapped.then(|| self.free(handle.0)))
    }

    /// Counts one mapping less of handle `id`. Returns its number if its memory was freed now (it was
    /// released and this was its last mapping).
    pub(super) fn unmapped(&mut self, id: u64) -> Option<u64> {
        let h = self.get_mut(id)?;
        h.maps -= 1;
        (h.released && h.maps == 0).then(|| self.free(id))
    }

    /// The size of handle `id`, if its memory is not freed yet (released but mapped ones included).
    pub(super) fn size(&self, id: u64) -> Option<u64> {
        let index = usize::try_from(id).ok()?.checked_sub(1)?;
        self.slots.get(index)?.as_ref().map(|h| h.size)
    }

    /// Handles created and not released.
    pub(super) fn live_count(&self) -> usize {
        self.live
    }

    /// Bytes of physical memory held by handles.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Handles not released, with their sizes, in creation order.
    pub(super) fn unreleased(&self) -> Vec<(PhysHandle, u64)> {
        (1..)
            .zip(&self.slots)
            .filter_map(|(id, h)| h.filter(|h| !h.released).map(|h| (PhysHandle(id), h.size)))
            .collect()
    }

    /// Handle number `id`, if its memory is not freed yet.
    fn get_mut(&mut self, id: u64) -> Option<&mut Handle> {
        let index = usize::try_from(id).ok()?.checked_sub(1)?;
        self.slots.get_mut(index)?.as_mut()
    }

    /// Frees a released, unmapped handle's memory. Returns its number.
    fn free(&mut self, id: u64) -> u64 {
        let index = usize::try_from(id).ok().and_then(|i| i.checked_sub(1));
        if let Some(h) = index
            .and_then(|i| self.slots.get_mut(i))
            .and_then(Option::take)
        {
            self.bytes -= h.size;
        }
        id
    }
}
