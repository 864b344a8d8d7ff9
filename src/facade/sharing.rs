//! Sharing allocations with other processes through the [`Allocator`]: the locked entry points of
//! [`Sharing::share`], [`Sharing::open_shared`] and [`Sharing::close_shared`] (see
//! [`crate::strategy::sharing`]).

use crate::facade::allocator::Allocator;
use crate::strategy::Strategy;
use crate::strategy::capabilities::Sharing;
use crate::strategy::error::Error;
use crate::strategy::sharing::{SharedMemory, SharedPart};
use std::os::fd::BorrowedFd;

impl<S: Strategy + Sharing> Allocator<S> {
    /// Exports the memory of the live allocation at `ptr` for another process to map with
    /// [`open_shared`](Self::open_shared): the whole mappings that cover it, each physical handle as a
    /// file descriptor. The allocation must stay live while the other process uses it. Memory allocated
    /// under a tag is shared too: a sleep gives this process's pages back, while an importer's mapping
    /// keeps the memory, with the bytes it had, until the importer closes it (open it again after the
    /// wake to see the woken memory).
    pub fn share(&self, ptr: u64) -> Result<SharedMemory, Error> {
        // A buffer freed into a stream cache is free: once the caches are drained, the strategy says so.
        self.drain_caches_deferring();
        self.with_strategy(|strategy| strategy.share(ptr))
    }

    /// Maps memory another process exported with [`share`](Self::share): `parts` back to back in a new
    /// range, readable and writable from this device; returns its start (the allocation lies
    /// [`SharedMemory::offset`] bytes in). The descriptors stay the caller's.
    pub fn open_shared(&self, parts: &[SharedPart<BorrowedFd<'_>>]) -> Result<u64, Error> {
        self.with_strategy(|strategy| strategy.open_shared(parts))
    }

    /// Unmaps shared memory that [`open_shared`](Self::open_shared) mapped at `ptr`, and gives its handles
    /// and addresses back. All work on it must have finished: the allocator knows no stream that used it.
    pub fn close_shared(&self, ptr: u64) -> Result<(), Error> {
        self.with_strategy(|strategy| strategy.close_shared(ptr))
    }
}
