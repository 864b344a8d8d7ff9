//! Handles that can be shared with other processes: `cuMemCreate` asking for an exportable handle type,
//! `cuMemExportToShareableHandle` and `cuMemImportFromShareableHandle` with POSIX file descriptors.
//!
//! At open, [`CudaDriver`] asks for exportable handles where the device supports POSIX file descriptor
//! handles (`CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED`) and `CUVMM_IPC_HANDLES`
//! does not turn them off. Some containers refuse them at the first `cuMemCreate`
//! (`CUDA_ERROR_NOT_PERMITTED` or `CUDA_ERROR_NOT_SUPPORTED`); that create is made again without the
//! handle type, and from then on every handle is created so: [`exports_handles`](crate::driver::Driver::exports_handles)
//! says no, and an export is [`DriverError::Unsupported`]. PyTorch's expandable segments fall back the
//! same way.

use super::CudaDriver;
use crate::driver::cuda::calls::bytes;
use crate::driver::cuda::result;
use crate::driver::{DriverError, Op, PhysHandle};
use std::os::fd::{BorrowedFd, FromRawFd, OwnedFd};

/// `CUDA_ERROR_NOT_PERMITTED`.
const NOT_PERMITTED: u32 = 800;
/// `CUDA_ERROR_NOT_SUPPORTED`.
const NOT_SUPPORTED: u32 = 801;

impl CudaDriver {
    /// `cuMemCreate` of `size` bytes, exportable while the driver creates exportable handles; once counted
    /// by the caller. A refusal of the exportable type turns it off for good and creates the handle without.
    pub(super) fn create_handle(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        let device = self.calls.ctx.cu_device();
        let exportable = self.exportable;
        let created = (self.calls).call(Op::Create, size, || {
            result::create(device, bytes(size), exportable)
        });
        let handle = match created {
            Err(err) if exportable && refuses_exportable(&err) => {
                self.exportable = false;
                tracing::warn!(%err, "cuvmm: the driver refuses exportable memory handles; creating handles that cannot be shared with other processes");
                (self.calls).call(Op::Create, size, || {
                    result::create(device, bytes(size), false)
                })?
            }
            created => created?,
        };
        let handle = PhysHandle(handle);
        self.ledger.created(handle, size);
        Ok(handle)
    }

    /// [`Driver::export_handle`](crate::driver::Driver::export_handle), once counted by the caller.
    pub(super) fn export(&mut self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        self.ledger.handle_size(Op::Export, handle)?;
        if !self.exportable {
            return Err(DriverError::Unsupported { op: Op::Export });
        }
        let fd = (self.calls).call(Op::Export, 0, || {
            // SAFETY: the ledger holds only handles this driver created (exportable, checked above) or
            // imported, and has not seen released (point 1).
            unsafe { result::export_fd(handle.0) }
        })?;
        if fd < 0 {
            // Never seen: a driver that said success must have written a descriptor.
            return Err(DriverError::Descriptor {
                op: Op::Export,
                reason: format!("the driver returned descriptor {fd}"),
            });
        }
        // SAFETY: the driver just made this descriptor for the caller, open and not -1 (checked above), and
        // nothing else owns it: the `OwnedFd` is its only owner and closes it once.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// [`Driver::import_handle`](crate::driver::Driver::import_handle), once counted by the caller: the new handle is held in the ledger with
    /// `size`, so it is mapped, released and given back on drop like a created one.
    pub(super) fn import(
        &mut self,
        fd: BorrowedFd<'_>,
        size: u64,
    ) -> Result<PhysHandle, DriverError> {
        let handle = (self.calls).call(Op::Import, size, || result::import_fd(fd))?;
        let handle = PhysHandle(handle);
        self.ledger.created(handle, size);
        Ok(handle)
    }
}

/// Whether a failed `cuMemCreate` refused the exportable handle type (`CUDA_ERROR_NOT_PERMITTED` or
/// `CUDA_ERROR_NOT_SUPPORTED`), so the same create without it may succeed.
fn refuses_exportable(err: &DriverError) -> bool {
    matches!(
        err,
        DriverError::Cuda {
            code: NOT_PERMITTED | NOT_SUPPORTED,
            ..
        }
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::cuda::open::ipc_handles_wanted;

    #[test]
    fn only_a_refusal_of_the_handle_type_turns_exportable_handles_off() {
        let cuda = |code| DriverError::Cuda {
            op: Op::Create,
            code,
            name: String::new(),
        };
        assert!(refuses_exportable(&cuda(NOT_PERMITTED)));
        assert!(refuses_exportable(&cuda(NOT_SUPPORTED)));
        assert!(!refuses_exportable(&cuda(2)), "out of memory");
        assert!(!refuses_exportable(&DriverError::OutOfMemory {
            op: Op::Create,
            requested: 1,
            free: 0
        }));
    }

    #[test]
    fn the_environment_turns_exportable_handles_off_only_when_it_says_so() {
        assert!(ipc_handles_wanted(None));
        assert!(ipc_handles_wanted(Some("1")));
        assert!(ipc_handles_wanted(Some("")));
        for off in ["0", "false", " OFF ", "No"] {
            assert!(!ipc_handles_wanted(Some(off)), "{off}");
        }
    }
}
