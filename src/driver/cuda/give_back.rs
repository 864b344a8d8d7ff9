//! Giving memory back through the ledger (`release`, `unmap`, `free_reservation`, `free`) and mapping it,
//! with a failure settled as the [`Driver`](crate::driver::Driver) contract asks: *a failed call has no
//! effect, or reports the resource gone*.
//!
//! A CUDA call can do its work and then fail (it reports the errors of earlier asynchronous work), and a
//! call made again on a resource that is gone would reach the driver with a name it no longer knows. So
//! after a failure the ledger decides, from what it knows, the `CUresult` and one side-effect-free query
//! where CUDA has one, whether the resource is still there:
//!
//! | failed call | the driver says "unknown" (`CUDA_ERROR_INVALID_VALUE`, `_INVALID_HANDLE`) | any other error |
//! |---|---|---|
//! | `release` | the handle is gone (an earlier release that failed had worked): forgotten, `UnknownHandle` | `cuMemGetAllocationPropertiesFromHandle`: a handle it no longer knows is forgotten; the error is returned. (An H100 with driver 580 still answers the properties of a released handle, so there the handle is kept and the repeat's "invalid" settles it.) |
//! | `unmap` (CUDA accepts an unmap where nothing is mapped, so "unknown" is rare) | each of the ledger's mappings in the range is asked `CU_POINTER_ATTRIBUTE_MAPPED`; those no longer mapped are forgotten (when a query fails: all of them, if the ledger's mappings tile the range exactly, so the error cannot be about a partial unmap); if none is left, `NotMapped`, else CUDA's own error | the same query; the error is returned |
//! | `free_reservation` | the reservation is gone: forgotten, `UnknownReservation` | kept (CUDA has no query for a reservation): the repeat's answer decides |
//! | `free` | the allocation is gone: forgotten, `UnknownPointer` | `CU_POINTER_ATTRIBUTE_MAPPED` on the pointer; an unmapped one is forgotten |
//! | `map` | rejected, no effect | `CU_POINTER_ATTRIBUTE_MAPPED`: a mapping that is there (or that cannot be told) is recorded, so the caller's undo (`unmap`) reaches it |
//!
//! A query that fails itself tells nothing, and the resource is kept: the failure had no effect as far as
//! anyone can tell, the caller's repeat makes the call again, and drop gives back whatever is left. A
//! resource the ledger no longer holds is answered "gone" without a driver call (`UnknownHandle`,
//! `NotMapped`, `UnknownReservation`, `UnknownPointer`). So the allocator's settle (`src/expandable/
//! settle.rs`: one repeat, success or "gone" is done) ends after two calls (and their queries) in every
//! case, and its books follow the device's. Events follow the same rule in `ledger.rs`.

use super::errors::says_unknown;
use super::ledger::Ledger;
use crate::driver::{DriverError, Op, PhysHandle, VaRange};

/// Whether `held` (mappings in address order) covers `va .. va + size` exactly, without a gap.
fn tiles(held: &[(u64, u64)], va: u64, size: u64) -> bool {
    let mut cursor = va;
    for &(start, len) in held {
        if start != cursor {
            return false;
        }
        cursor = start.saturating_add(len);
    }
    cursor == va.saturating_add(size)
}

/// The raw calls that give memory back or map it, and the queries that tell whether a resource is still
/// there, on integers: the driver's `Calls` on a GPU, a fake in tests.
pub(super) trait GiveBackCalls {
    /// `cuMemRelease(handle)`.
    fn release(&mut self, handle: u64) -> Result<(), DriverError>;
    /// `cuMemMap(va, size, offset, handle, 0)`.
    fn map(&mut self, va: u64, size: u64, offset: u64, handle: u64) -> Result<(), DriverError>;
    /// `cuMemUnmap(va, size)`.
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError>;
    /// `cuMemAddressFree(start, size)`.
    fn address_free(&mut self, start: u64, size: u64) -> Result<(), DriverError>;
    /// `cuMemFree(ptr)`.
    fn free(&mut self, ptr: u64) -> Result<(), DriverError>;
    /// Whether the driver still knows `handle` (`cuMemGetAllocationPropertiesFromHandle`); an error when
    /// the query itself failed.
    fn handle_live(&mut self, handle: u64) -> Result<bool, DriverError>;
    /// Whether `va` is mapped to memory (`CU_POINTER_ATTRIBUTE_MAPPED`); an error when the query itself
    /// failed.
    fn mapped(&mut self, va: u64) -> Result<bool, DriverError>;
}

impl Ledger {
    /// Releases `handle`, settling a failure (see the module's table).
    pub(super) fn release(
        &mut self,
        calls: &mut impl GiveBackCalls,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        self.handle_size(Op::Release, handle)?;
        let Err(err) = calls.release(handle.0) else {
            self.released(handle);
            return Ok(());
        };
        if says_unknown(&err) {
            self.released(handle);
            return Err(DriverError::UnknownHandle {
                op: Op::Release,
                handle,
            });
        }
        if calls.handle_live(handle.0) == Ok(false) {
            tracing::warn!(%err, %handle, "cuvmm: cuMemRelease failed after releasing the handle");
            self.released(handle);
        }
        Err(err)
    }

    /// Maps `size` bytes of `handle` (live) from byte `offset` at `va` (inside a reservation); after a
    /// failure other than a rejection, records the mapping unless the driver says `va` is not mapped.
    pub(super) fn map(
        &mut self,
        calls: &mut impl GiveBackCalls,
        va: u64,
        size: u64,
        handle: PhysHandle,
        offset: u64,
    ) -> Result<(), DriverError> {
        let Err(err) = calls.map(va, size, offset, handle.0) else {
            self.mapped(va, size);
            return Ok(());
        };
        if !says_unknown(&err) && !self.has_mapping_at(va) && calls.mapped(va) != Ok(false) {
            tracing::warn!(%err, va, "cuvmm: cuMemMap failed, and the range is (or may be) mapped");
            self.mapped(va, size);
        }
        Err(err)
    }

    /// Unmaps `va .. va + size`, settling a failure (see the module's table). A range in which the ledger
    /// holds no mapping is [`DriverError::NotMapped`] without a driver call.
    pub(super) fn unmap(
        &mut self,
        calls: &mut impl GiveBackCalls,
        va: u64,
        size: u64,
    ) -> Result<(), DriverError> {
        let held = self.mappings_overlapping(va, size);
        if held.is_empty() {
            return Err(DriverError::NotMapped {
                op: Op::Unmap,
                addr: va,
            });
        }
        let Err(err) = calls.unmap(va, size) else {
            self.unmapped(va, size);
            return Ok(());
        };
        // Where the ledger's mappings tile the range, CUDA's "invalid" cannot be about a partial unmap: it
        // says nothing is mapped there, which stands in for a query that failed.
        let tiles = tiles(&held, va, size);
        let mut left = 0;
        for (start, _) in held {
            match calls.mapped(start) {
                Ok(false) => self.forget_mapping(start),
                Err(_) if tiles && says_unknown(&err) => self.forget_mapping(start),
                Ok(true) | Err(_) => left += 1,
            }
        }
        if left == 0 && says_unknown(&err) {
            return Err(DriverError::NotMapped {
                op: Op::Unmap,
                addr: va,
            });
        }
        if left == 0 {
            tracing::warn!(%err, va, size, "cuvmm: cuMemUnmap failed after unmapping the range");
        }
        Err(err)
    }

    /// Frees the reservation `range` (exactly one of this driver's, with nothing mapped), settling a
    /// failure (see the module's table).
    pub(super) fn free_reservation(
        &mut self,
        calls: &mut impl GiveBackCalls,
        range: VaRange,
    ) -> Result<(), DriverError> {
        self.check_free_reservation(range)?;
        match calls.address_free(range.start, range.size) {
            Ok(()) => {
                self.reservation_freed(range);
                Ok(())
            }
            Err(err) if says_unknown(&err) => {
                self.reservation_freed(range);
                Err(DriverError::UnknownReservation {
                    op: Op::FreeReservation,
                    start: range.start,
                })
            }
            Err(err) => Err(err),
        }
    }

    /// Frees the `malloc` allocation at `ptr`, settling a failure (see the module's table).
    pub(super) fn free(
        &mut self,
        calls: &mut impl GiveBackCalls,
        ptr: u64,
    ) -> Result<(), DriverError> {
        self.check_malloc(ptr)?;
        let Err(err) = calls.free(ptr) else {
            self.freed(ptr);
            return Ok(());
        };
        if says_unknown(&err) {
            self.freed(ptr);
            return Err(DriverError::UnknownPointer {
                op: Op::Free,
                addr: ptr,
            });
        }
        if calls.mapped(ptr) == Ok(false) {
            tracing::warn!(%err, ptr, "cuvmm: cuMemFree failed after freeing the allocation");
            self.freed(ptr);
        }
        Err(err)
    }
}
