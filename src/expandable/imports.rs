//! Memory other processes shared, mapped here: a part that owns its state ([`Imports`]). Each range is a
//! reservation of its own, outside every segment, with its imported handles; it counts in no statistic (the
//! memory is the exporter's, as PyTorch counts it too). An import that fails part way undoes what it did;
//! a close gives everything back even if one call fails, and reports the first failure. `sharing.rs` says
//! what is shared.

use super::settle::{free_reservation_settled, release_settled, undo_failed_map, unmap_settled};
use crate::driver::{Driver, DriverError, PhysHandle, PhysPage, VaRange};
use crate::strategy::error::Error;
use crate::strategy::sharing::{self, SharedPart, SharingError};
use rustc_hash::FxHashMap;
use std::os::fd::BorrowedFd;

/// Shared memory mapped here: its reservation and the handles imported into it.
#[derive(Debug)]
struct Import {
    range: VaRange,
    handles: Vec<PhysHandle>,
}

/// The ranges [`Imports::open`] mapped, by start address.
#[derive(Debug, Default)]
pub(super) struct Imports {
    open: FxHashMap<u64, Import>,
}

impl Imports {
    /// Reserves a range for `parts`, imports and maps each back to back, and sets access on it all; returns
    /// its start. On a failure, what was done is undone and the failure returned.
    pub(super) fn open<D: Driver>(
        &mut self,
        driver: &mut D,
        parts: &[SharedPart<BorrowedFd<'_>>],
    ) -> Result<u64, Error> {
        let size = sharing::range_size(parts)?;
        let range = driver.reserve(size)?;
        let mut import = Import {
            range,
            handles: Vec::with_capacity(parts.len()),
        };
        match map_parts(driver, &mut import, parts) {
            Ok(()) => {
                self.open.insert(range.start, import);
                Ok(range.start)
            }
            Err((mapped, err)) => {
                // Best effort: the import's own error is the one to report.
                if let Err(undo) = give_back(driver, &import, mapped) {
                    tracing::warn!(%undo, "cuvmm: undoing a failed import of shared memory failed");
                }
                Err(err.into())
            }
        }
    }

    /// Unmaps the range `open` mapped at `addr`, releases its handles and frees it.
    pub(super) fn close<D: Driver>(&mut self, driver: &mut D, addr: u64) -> Result<(), Error> {
        let import = (self.open.remove(&addr)).ok_or(SharingError::NotOpen { addr })?;
        Ok(give_back(driver, &import, import.range.size)?)
    }

    /// Closes every range (the allocator's drop); returns the first failure.
    pub(super) fn close_all<D: Driver>(&mut self, driver: &mut D) -> Result<(), Error> {
        let mut first = Ok(());
        for (_, import) in self.open.drain() {
            if let Err(err) = give_back(driver, &import, import.range.size) {
                first = first.and(Err(err.into()));
            }
        }
        first
    }
}

/// Imports and maps each of `parts` back to back in `import.range`, then sets access on the whole range. On
/// a failure, returns the bytes mapped so far with it; the handles imported are in `import.handles`.
fn map_parts<D: Driver>(
    driver: &mut D,
    import: &mut Import,
    parts: &[SharedPart<BorrowedFd<'_>>],
) -> Result<(), (u64, DriverError)> {
    let mut at = import.range.start;
    for part in parts {
        let mapped = at - import.range.start;
        let handle = (driver.import_handle(part.fd, part.handle_size)).map_err(|e| (mapped, e))?;
        import.handles.push(handle);
        let page = PhysPage {
            handle,
            offset: part.handle_offset,
        };
        if let Err(err) = driver.map_from(at, part.size, page) {
            undo_failed_map(driver, at, part.size);
            return Err((mapped, err));
        }
        at += part.size;
    }
    let size = import.range.size;
    (driver.set_access(import.range.start, size)).map_err(|e| (size, e))
}

/// Unmaps the first `mapped` bytes of `import`'s range, releases its handles and frees the range. Goes on
/// after a failure and returns the first.
fn give_back<D: Driver>(driver: &mut D, import: &Import, mapped: u64) -> Result<(), DriverError> {
    let mut first = Ok(());
    if mapped > 0 {
        first = first.and(unmap_settled(driver, import.range.start, mapped));
    }
    for &handle in &import.handles {
        first = first.and(release_settled(driver, handle));
    }
    // A range with mappings left cannot be freed: it is kept (leaked) rather than freed under them.
    if first.is_ok() {
        first = free_reservation_settled(driver, import.range);
    }
    first
}
