//! The simulated device's physical allocations: the handles `cuMemCreate` hands out, and those
//! `cuMemImportFromShareableHandle` hands out for memory already allocated.
//!
//! Handles are numbered from 1 in creation order and kept in a vector indexed by number, so finding one is
//! an array read. A handle may be released while mapped, as CUDA allows: it is then unknown to later calls,
//! and its handle is gone once its last mapping goes.
//!
//! The memory behind a handle is an *allocation*, named by the number of the handle that created it. An
//! imported handle is another name for an existing allocation (an alias): the allocation's memory is freed,
//! and its bytes counted off, only once every handle to it is gone (released and unmapped), as CUDA
//! counts references. Allocations with aliases keep a count of their handles; the others have one handle,
//! so the common case costs no lookup.

use crate::driver::{DriverError, Op, PhysHandle};
use rustc_hash::FxHashMap;

/// A physical allocation from `create`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Handle {
    /// Bytes.
    pub(super) size: u64,
    /// Released by the caller; freed once `maps` reaches 0.
    released: bool,
    /// Mappings of this handle.
    maps: u32,
    /// The allocation behind it: the number of the handle that created it (its own number, unless imported).
    pub(super) alloc: u64,
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
    /// Bytes of allocations whose memory is not yet freed (each counted once, however many handles it has).
    bytes: u64,
    /// Handles not gone yet, by allocation, for the allocations that have imported handles (the others
    /// have exactly one: the handle that created them).
    holders: FxHashMap<u64, u32>,
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
        let id = self.slots.len() as u64 + 1;
        self.slots.push(Some(Handle {
            size,
            released: false,
            maps: 0,
            alloc: id,
        }));
        self.live += 1;
        self.bytes += size;
        PhysHandle(self.slots.len() as u64)
    }

    /// `count` new handles of `size` bytes each, appended to `out` in creation order.
    pub(super) fn create_many(&mut self, size: u64, count: usize, out: &mut Vec<PhysHandle>) {
        let first = self.slots.len() as u64 + 1;
        self.slots.extend((first..first + count as u64).map(|id| {
            Some(Handle {
                size,
                released: false,
                maps: 0,
                alloc: id,
            })
        }));
        out.extend((first..first + count as u64).map(PhysHandle));
        self.live += count;
        self.bytes += size * count as u64;
    }

    /// A new handle to allocation `alloc` (whose memory is not freed: see
    /// [`allocation_alive`](Self::allocation_alive)) of `size` bytes, its size. Its bytes are not counted
    /// again.
    pub(super) fn import(&mut self, alloc: u64, size: u64) -> PhysHandle {
        let holders = self.holders.entry(alloc).or_insert(1);
        *holders += 1;
        self.slots.push(Some(Handle {
            size,
            released: false,
            maps: 0,
            alloc,
        }));
        self.live += 1;
        PhysHandle(self.slots.len() as u64)
    }

    /// Whether the memory of allocation `alloc` is not freed yet: some handle to it is live or mapped.
    pub(super) fn allocation_alive(&self, alloc: u64) -> bool {
        self.holders.contains_key(&alloc) || self.size(alloc).is_some()
    }

    /// The allocation behind handle `id`, if the handle is not gone (released but mapped ones included).
    pub(super) fn allocation_of(&self, id: u64) -> Option<u64> {
        let index = usize::try_from(id).ok()?.checked_sub(1)?;
        self.slots.get(index)?.as_ref().map(|h| h.alloc)
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

    /// Releases a live handle. Returns its allocation if the allocation's memory was freed now (the handle
    /// was not mapped, and no other handle to the allocation is left).
    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<Option<u64>, DriverError> {
        let h = self.live(Op::Release, handle)?;
        h.released = true;
        let unmapped = h.maps == 0;
        self.live -= 1;
        Ok(if unmapped { self.free(handle.0) } else { None })
    }

    /// Counts one mapping less of handle `id`. Returns its allocation if the allocation's memory was freed
    /// now (the handle was released, this was its last mapping, and no other handle to it is left).
    pub(super) fn unmapped(&mut self, id: u64) -> Option<u64> {
        let h = self.get_mut(id)?;
        h.maps -= 1;
        if h.released && h.maps == 0 {
            self.free(id)
        } else {
            None
        }
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

    /// Forgets a released, unmapped handle, and frees its allocation's memory if it was the allocation's
    /// last handle. Returns the allocation if its memory was freed.
    fn free(&mut self, id: u64) -> Option<u64> {
        let index = usize::try_from(id).ok()?.checked_sub(1)?;
        let h = self.slots.get_mut(index)?.take()?;
        if !self.holders.is_empty() {
            if let Some(holders) = self.holders.get_mut(&h.alloc) {
                *holders -= 1;
                if *holders > 0 {
                    return None;
                }
                self.holders.remove(&h.alloc);
            }
        }
        self.bytes -= h.size;
        Some(h.alloc)
    }
}
