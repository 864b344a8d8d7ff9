//! Handles shared between processes on the simulated device: [`Driver::export_handle`]
//! (`cuMemExportToShareableHandle`) and [`Driver::import_handle`] (`cuMemImportFromShareableHandle`).
//!
//! - **An export is a real file descriptor**, one end of a new Unix socket pair, so it can be closed,
//!   duplicated and sent to another process (`SCM_RIGHTS`) like CUDA's. The device knows its exports by the
//!   descriptor's file (device and inode numbers, from `fstat`), not by its number, so a duplicate of the
//!   descriptor, or one received through a socket, names the same export. Each export makes a new
//!   descriptor, even of the same handle.
//! - **The table is the device's own.** A descriptor that no export of this device made (any other file,
//!   or an export of another `SimDriver`) is [`DriverError::NotExported`]: two simulated devices model two
//!   devices, not two processes sharing one.
//! - **An import is another handle to the same allocation** (see `handles.rs`): mapped anywhere it shows the
//!   same bytes, the device's capacity is not charged again, and the memory is freed once every handle to
//!   it is released and unmapped. Its size must be the exported handle's
//!   ([`DriverError::ImportSizeMismatch`]).
//! - **An export does not keep memory alive.** CUDA documents that the shareable handle refers to the
//!   allocation, and says nothing of an import after every handle to it is released; the simulator is
//!   conservative: an import succeeds while some handle to the allocation is live or mapped (the exported
//!   handle itself may be released), and is [`DriverError::ExportFreed`] once its memory is freed. An
//!   allocator that shares memory keeps a handle to it until the importers are done.
//! - While an allocation's memory is alive the device keeps a duplicate of each descriptor that exports it,
//!   so that the file cannot be closed everywhere and its inode number given to an unrelated file that
//!   would then pass for the export. The duplicates are closed when the memory is freed; the entry stays,
//!   so an import of the descriptor is refused as freed.
//!
//! [`Driver::export_handle`]: crate::driver::Driver::export_handle
//! [`Driver::import_handle`]: crate::driver::Driver::import_handle

use crate::driver::{DriverError, Op};
use rustc_hash::FxHashMap;
use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;

/// A file, as `fstat` names it: (device, inode).
type FileId = (u64, u64);

/// Every export the device made, by the file its descriptors refer to.
#[derive(Debug, Default)]
pub(super) struct Exports {
    by_file: FxHashMap<FileId, Export>,
}

/// One export: what a descriptor stands for.
#[derive(Debug)]
struct Export {
    /// The allocation exported (see `handles.rs`).
    alloc: u64,
    /// The exported handle's size.
    size: u64,
    /// The device's own duplicate of the descriptor while the allocation's memory is alive; `None` once it
    /// is freed.
    kept: Option<OwnedFd>,
}

impl Exports {
    /// A new descriptor that stands for allocation `alloc`, exported through a handle of `size` bytes.
    pub(super) fn export(&mut self, alloc: u64, size: u64) -> Result<OwnedFd, DriverError> {
        let refused = |err: std::io::Error| DriverError::Descriptor {
            op: Op::Export,
            reason: err.to_string(),
        };
        // The other end is closed at once: the descriptor only names the export.
        let (end, _other) = UnixStream::pair().map_err(refused)?;
        let fd = OwnedFd::from(end);
        let kept = fd.try_clone().map_err(refused)?;
        let file = file_id(&kept).map_err(refused)?;
        let export = Export {
            alloc,
            size,
            kept: Some(kept),
        };
        self.by_file.insert(file, export);
        Ok(fd)
    }

    /// The allocation and size that `fd` exports.
    pub(super) fn find(&self, fd: BorrowedFd<'_>) -> Result<(u64, u64), DriverError> {
        let file = file_id(&fd).map_err(|err| DriverError::Descriptor {
            op: Op::Import,
            reason: err.to_string(),
        })?;
        let export = self
            .by_file
            .get(&file)
            .ok_or(DriverError::NotExported { fd: fd.as_raw_fd() })?;
        Ok((export.alloc, export.size))
    }

    /// Closes the device's duplicates of the descriptors that export allocation `alloc`, whose memory was
    /// just freed.
    pub(super) fn freed(&mut self, alloc: u64) {
        if self.by_file.is_empty() {
            return;
        }
        for export in self.by_file.values_mut().filter(|e| e.alloc == alloc) {
            export.kept = None;
        }
    }
}

/// The file `fd` refers to.
fn file_id(fd: &impl std::os::fd::AsFd) -> std::io::Result<FileId> {
    let meta = File::from(fd.as_fd().try_clone_to_owned()?).metadata()?;
    Ok((meta.dev(), meta.ino()))
}
