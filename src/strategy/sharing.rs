//! Sharing an allocation with another process: what the exporter hands over and the importer maps.
//!
//! CUDA shares memory made with `cuMemCreate` by its physical handles, exported as file descriptors
//! ([`Driver::export_handle`](crate::Driver::export_handle)); an importer maps them in its own address
//! space ([`Driver::import_handle`](crate::Driver::import_handle)). Mappings are whole handles (CUDA maps no
//! part of one), so what is shared is the run of mappings that covers the allocation, which may hold
//! neighbouring allocations' bytes too: the importer sees the allocation at
//! [`SharedMemory::offset`] from the start of its mapping. PyTorch's expandable segments share the same way.
//!
//! How the descriptors travel between processes is the caller's (cuvmm-torch passes them over a Unix
//! socket); this module is the allocator's side only.

use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::sync::Arc;

/// One mapping of a shared range: `size` bytes of a handle of `handle_size` bytes, from byte
/// `handle_offset` of it. `F` is the handle: an exported descriptor (an [`Arc`] of an [`OwnedFd`] at the
/// exporter, [`BorrowedFd`] at the importer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SharedPart<F> {
    /// The exported handle.
    pub fd: F,
    /// Bytes of the whole handle (the importer must name it; CUDA does not tell).
    pub handle_size: u64,
    /// First byte of the handle mapped (0 on CUDA, which maps whole handles only).
    pub handle_offset: u64,
    /// Bytes mapped.
    pub size: u64,
}

impl<F> SharedPart<F> {
    /// The same part with `fd` as its handle: `part.with_fd(())` is what a handle string carries, and
    /// [`borrowed`](SharedPart::borrowed) what [`Allocator::open_shared`](crate::Allocator::open_shared) takes.
    pub fn with_fd<G>(&self, fd: G) -> SharedPart<G> {
        SharedPart {
            fd,
            handle_size: self.handle_size,
            handle_offset: self.handle_offset,
            size: self.size,
        }
    }
}

impl<F: AsFd> SharedPart<F> {
    /// The part with its descriptor borrowed.
    pub fn borrowed(&self) -> SharedPart<BorrowedFd<'_>> {
        self.with_fd(self.fd.as_fd())
    }
}

/// A live allocation's memory, exported: mapped back to back from the first part, the parts cover the
/// allocation, which starts `offset` bytes in.
///
/// A handle is exported once: every share of memory on it, and every part of it, carries the same
/// descriptor, which the allocator keeps until it releases the handle (PyTorch keeps one per handle too).
/// So sharing many allocations of one handle holds one descriptor, and two parts with the same descriptor
/// are pieces of one handle. Hold the [`Arc`] for as long as an importer may still need the descriptor.
#[derive(Debug)]
pub struct SharedMemory {
    /// The mappings in address order.
    pub parts: Vec<SharedPart<Arc<OwnedFd>>>,
    /// Bytes from the start of the first part to the allocation.
    pub offset: u64,
    /// Bytes of the allocation (its block, rounded as the allocator rounds).
    pub size: u64,
}

impl SharedMemory {
    /// Bytes of all the parts: the address space an importer reserves.
    pub fn range_size(&self) -> u64 {
        self.parts.iter().map(|part| part.size).sum()
    }
}

/// Why shared memory cannot be opened: the parts given do not describe a range.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SharingError {
    /// No parts, or a part of 0 bytes.
    #[error("shared memory: no parts, or a part of 0 bytes")]
    Empty,
    /// A part that lies outside its handle, or that overflows.
    #[error(
        "shared memory: a part of {size} bytes from byte {handle_offset} of a handle of {handle_size} bytes"
    )]
    OutsideHandle {
        /// Bytes mapped.
        size: u64,
        /// First byte of the handle mapped.
        handle_offset: u64,
        /// Bytes of the handle.
        handle_size: u64,
    },
    /// `close_shared` of an address `open_shared` did not return, or already closed.
    #[error("close of shared memory at {addr:#x}, which is not open")]
    NotOpen {
        /// The address given.
        addr: u64,
    },
}

/// Checks that `parts` describe a range: at least one part, none empty, each inside its handle. Returns
/// the range's size.
pub fn range_size<F>(parts: &[SharedPart<F>]) -> Result<u64, SharingError> {
    if parts.is_empty() {
        return Err(SharingError::Empty);
    }
    let mut total = 0u64;
    for part in parts {
        if part.size == 0 {
            return Err(SharingError::Empty);
        }
        let inside = part
            .handle_offset
            .checked_add(part.size)
            .is_some_and(|end| end <= part.handle_size);
        total = match total.checked_add(part.size) {
            Some(total) if inside => total,
            _ => {
                return Err(SharingError::OutsideHandle {
                    size: part.size,
                    handle_offset: part.handle_offset,
                    handle_size: part.handle_size,
                });
            }
        };
    }
    Ok(total)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn part(handle_size: u64, handle_offset: u64, size: u64) -> SharedPart<()> {
        SharedPart {
            fd: (),
            handle_size,
            handle_offset,
            size,
        }
    }

    #[test]
    fn a_range_is_the_sum_of_parts_that_lie_inside_their_handles() {
        assert_eq!(range_size(&[part(4, 0, 4), part(8, 2, 2)]), Ok(6));
        assert_eq!(range_size::<()>(&[]), Err(SharingError::Empty));
        assert_eq!(range_size(&[part(4, 0, 0)]), Err(SharingError::Empty));
        assert!(matches!(
            range_size(&[part(4, 2, 4)]),
            Err(SharingError::OutsideHandle { .. })
        ));
        assert!(matches!(
            range_size(&[part(u64::MAX, u64::MAX, 1)]),
            Err(SharingError::OutsideHandle { .. })
        ));
        assert!(matches!(
            range_size(&[part(u64::MAX, 0, u64::MAX), part(4, 0, 4)]),
            Err(SharingError::OutsideHandle { .. })
        ));
    }
}
