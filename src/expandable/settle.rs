//! Settling a driver call that failed: did it take effect or not?
//!
//! A failed call either had no effect or reports the resource gone (the contract of [`Driver`]): a real
//! driver may do the work and then return an error, such as one left by earlier asynchronous work. cuvmm must
//! know which before it goes on, because its page map and counters must say what the device holds: a page
//! believed mapped that is not would be handed out unbacked, and a handle believed pooled that was released
//! would stay in `reserved_bytes` and fail every map it is given to. So a failed call on a resource cuvmm
//! holds is settled at once, with one more call made only when the first failed:
//! - `unmap`, `release`, `free_reservation` are made again. Success, or the resource reported gone
//!   (`NotMapped`, `UnknownHandle`, `UnknownReservation`), means the resource is now where the first call
//!   was to put it, and it is booked so. Any other error means neither call had an effect, and the first
//!   error is returned with the resource kept as it was.
//! - A `map` that failed is undone: its page is unmapped. Success means the map had taken effect and is now
//!   undone, `NotMapped` that it had not; the handle goes back to the pool either way and the map's error is
//!   returned. Should the unmap fail too, the page may stay mapped: the next `map` there fails with
//!   `AlreadyMapped` and is undone the same way.
//! - An event whose `destroy_event` failed is kept and destroyed again at the next poll (nothing counts
//!   events and nothing queries that one again, so it can wait); `UnknownEvent` then means the first
//!   destroy had worked ([`StreamWaits::destroy_undestroyed`](super::streams::StreamWaits::destroy_undestroyed)).
//! - `set_access`, `synchronize`, `event_complete` need nothing: repeating them is harmless (the next block
//!   that touches a page without its `accessible` bit sets access again). A creating call (`reserve`,
//!   `create`, `record_event`) that fails leaves nothing behind, by the contract.

use crate::driver::{Driver, DriverError, EventId, PhysHandle, VaRange};

/// `unmap(va, size)`, settled: `Ok` once the range is unmapped, whichever call did it.
pub(super) fn unmap_settled<D: Driver>(
    driver: &mut D,
    va: u64,
    size: u64,
) -> Result<(), DriverError> {
    let Err(first) = driver.unmap(va, size) else {
        return Ok(());
    };
    match driver.unmap(va, size) {
        Ok(()) | Err(DriverError::NotMapped { .. }) => {
            tracing::warn!(%first, va, size, "cuvmm: unmap failed; made again, the range is unmapped");
            Ok(())
        }
        Err(_) => Err(first),
    }
}

/// `release(handle)`, settled: `Ok` once the handle is released, whichever call did it.
pub(super) fn release_settled<D: Driver>(
    driver: &mut D,
    handle: PhysHandle,
) -> Result<(), DriverError> {
    let Err(first) = driver.release(handle) else {
        return Ok(());
    };
    match driver.release(handle) {
        Ok(()) | Err(DriverError::UnknownHandle { .. }) => {
            tracing::warn!(%first, %handle, "cuvmm: release failed; made again, the handle is released");
            Ok(())
        }
        Err(_) => Err(first),
    }
}

/// `free_reservation(va)`, settled: `Ok` once the reservation is freed, whichever call did it.
pub(super) fn free_reservation_settled<D: Driver>(
    driver: &mut D,
    va: VaRange,
) -> Result<(), DriverError> {
    let Err(first) = driver.free_reservation(va) else {
        return Ok(());
    };
    match driver.free_reservation(va) {
        Ok(()) | Err(DriverError::UnknownReservation { .. }) => {
            tracing::warn!(%first, start = va.start, "cuvmm: free_reservation failed; made again, the reservation is freed");
            Ok(())
        }
        Err(_) => Err(first),
    }
}

/// Undoes a `map` of `size` bytes at `va` (a page, or a chunk) that failed, in case it had mapped them anyway.
pub(super) fn undo_failed_map<D: Driver>(driver: &mut D, va: u64, size: u64) {
    match driver.unmap(va, size) {
        // The usual case: the failed map had no effect.
        Err(DriverError::NotMapped { .. }) => {}
        Ok(()) => tracing::warn!(va, "cuvmm: a map that failed had mapped its page; unmapped"),
        Err(err) => tracing::warn!(
            %err,
            va,
            "cuvmm: undoing a failed map failed; a later map there will undo it again"
        ),
    }
}

/// Destroys `event` on the way out (drop), where there is no later poll: a failure is retried at once,
/// and `UnknownEvent` on the retry means the first call had destroyed it.
pub(super) fn destroy_event_settled<D: Driver>(
    driver: &mut D,
    event: EventId,
) -> Result<(), DriverError> {
    let Err(first) = driver.destroy_event(event) else {
        return Ok(());
    };
    match driver.destroy_event(event) {
        Ok(()) | Err(DriverError::UnknownEvent { .. }) => Ok(()),
        Err(_) => Err(first),
    }
}
