//! Sharing cuvmm memory between processes: PyTorch's `shareIpcHandle` and `getIpcDevPtr`
//! (`torch.multiprocessing` sending a CUDA tensor).
//!
//! The exporter ([`share`]) exports the mappings under the allocation as file descriptors
//! ([`cuvmm::Allocator::share`]), keeps them in the process's table of exports under a random id, and
//! returns a *handle string*. Where the mappings are whole handles of one size (the usual case), it is in
//! PyTorch's own layout for an expandable segment (`torch_handle.rs`): the pid and the descriptor numbers,
//! which an importer takes with `pidfd_getfd`, so a process on PyTorch's allocator opens it; cuvmm's own
//! handle string follows, which PyTorch does not read. Otherwise it is cuvmm's own handle string alone.
//!
//! The importer ([`open`]) takes the descriptors with `pidfd_getfd` when the handle is in PyTorch's
//! layout, whether a cuvmm or a PyTorch process made it; where that is refused (no ptrace rights over the
//! exporter, another pid namespace) and the handle carries cuvmm's string, it fetches them from the
//! exporter's server over a Unix socket (SCM_RIGHTS, [`crate::transport`]). It maps them
//! ([`cuvmm::Allocator::open_shared`]) and closes them; [`close`] unmaps.
//!
//! An export is held while an allocation shared through it lives ([`forget`]): a reader of PyTorch's
//! layout may take the descriptors at any time, as from PyTorch's own expandable segments, which keep
//! theirs as long as the memory. An export is a range's, not an allocation's ([`crate::export_table`]):
//! allocations on the same mappings get the same handle string, each with its offset, so an importer maps
//! the range once for all of them, as for PyTorch's expandable segments. Sharing an allocation again
//! returns the same handle string; each fetch over the socket sends duplicates. The table holds nothing of
//! freed memory. The allocator exports a handle once and hands the same descriptor to every share of
//! memory on it, so a thousand small tensors on one 20 MiB handle hold one descriptor, not a thousand (as
//! PyTorch's expandable segments, which keep one per handle).
//!
//! # cuvmm's handle string (version 2, little-endian)
//! `"CUVMMIPC"`, version `u16`, the server's address (`u16` length, bytes), export id `u64`, number of
//! parts `u32`, and per part its handle size, offset in the handle and size (`u64` each). The offset of an
//! allocation in the range travels beside the handle string, as PyTorch's does. Alone, its first byte is
//! above the versions PyTorch's handles start with, so a process on PyTorch's allocator refuses it (as "a
//! future version") rather than misreading it. Version 1 carried one allocation's offset and size too.

use crate::error::AbiError;
use crate::export_table::{Candidate, ExportTable};
use crate::registry::Registry;
use crate::torch_handle::{self, TorchHandle};
use crate::transport::{self, Address};
use cuvmm::sharing::SharedPart;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::sync::{Arc, LazyLock};

const MAGIC: &[u8; 8] = b"CUVMMIPC";
const VERSION: u16 = 2;

/// A handle string, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleString {
    /// Where the exporting process serves its exports.
    pub address: Address,
    /// The export's id there.
    pub id: u64,
    /// The mappings of the range, in address order.
    pub parts: Vec<SharedPart<()>>,
}

impl HandleString {
    /// The handle string's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let address = self.address.as_bytes();
        let mut out = Vec::with_capacity(32 + address.len() + 24 * self.parts.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(address.len() as u16).to_le_bytes());
        out.extend_from_slice(address);
        out.extend_from_slice(&self.id.to_le_bytes());
        out.extend_from_slice(&(self.parts.len() as u32).to_le_bytes());
        for part in &self.parts {
            for n in [part.handle_size, part.handle_offset, part.size] {
                out.extend_from_slice(&n.to_le_bytes());
            }
        }
        out
    }

    /// Decodes `bytes`, refusing anything but a whole handle string of this version.
    pub fn decode(bytes: &[u8]) -> Result<Self, AbiError> {
        let mut r = Reader { bytes };
        if r.take(MAGIC.len())? != MAGIC {
            return Err(bad(
                "not a cuvmm handle (PyTorch's own allocator made it, or another program)",
            ));
        }
        let version = u16::from_le_bytes(r.array()?);
        if version != VERSION {
            return Err(bad(
                "a handle of another cuvmm version: share and open with the same cuvmm",
            ));
        }
        let len = usize::from(u16::from_le_bytes(r.array()?));
        let address =
            Address::from_bytes(r.take(len)?).map_err(|_| bad("its address is malformed"))?;
        let id = r.u64()?;
        let count = u32::from_le_bytes(r.array()?) as usize;
        if r.bytes.len() != count.saturating_mul(24) {
            return Err(bad("its length does not match its number of parts"));
        }
        let mut parts = Vec::with_capacity(count);
        for _ in 0..count {
            parts.push(SharedPart {
                fd: (),
                handle_size: r.u64()?,
                handle_offset: r.u64()?,
                size: r.u64()?,
            });
        }
        cuvmm::sharing::range_size(&parts).map_err(|err| bad(&err.to_string()))?;
        Ok(Self { address, id, parts })
    }
}

fn bad(why: &str) -> AbiError {
    AbiError::BadHandle {
        why: why.to_owned(),
    }
}

/// Reads a handle string from the front.
struct Reader<'a> {
    bytes: &'a [u8],
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], AbiError> {
        if self.bytes.len() < n {
            return Err(bad("it is cut short"));
        }
        let (head, rest) = self.bytes.split_at(n);
        self.bytes = rest;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], AbiError> {
        let head = self.take(N)?;
        Ok(head.try_into().unwrap_or([0; N]))
    }

    fn u64(&mut self) -> Result<u64, AbiError> {
        Ok(u64::from_le_bytes(self.array()?))
    }
}

static EXPORTS: LazyLock<Arc<ExportTable>> = LazyLock::new(Arc::default);

/// Exports the live allocation at `ptr` of `device`: returns its handle string and the allocation's offset
/// in the range the importer maps (the same as before if it was shared already and not freed since). `ptr`
/// must stay live until this returns: a [`forget`] racing it (a free of the memory being shared, a use after
/// free) may leave the export in the table (PyTorch holds the storage while sharing it).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] for an address that is not
/// the start of a live allocation, or a device whose handles cannot be exported;
/// [`AbiError::Transport`] if the process's server cannot start.
pub fn share(registry: &Registry, device: i32, ptr: u64) -> Result<(Vec<u8>, u64), AbiError> {
    let allocation = (registry.id(), device, ptr);
    if let Some(held) = EXPORTS.with(|exports| exports.held(allocation)) {
        return Ok(held);
    }
    let shared = registry.allocator(device)?.share(ptr)?;
    let table: Arc<ExportTable> = Arc::clone(&EXPORTS);
    let address = transport::serve(table)?;
    let segment_size = torch_handle::uniform_size(&shared.parts);
    if segment_size.is_some() {
        torch_handle::let_importers_take_descriptors();
    }
    // The handle string of a new export of the range, if it has none yet.
    let handle = |id| {
        let own = HandleString {
            address,
            id,
            parts: shared.parts.iter().map(|part| part.with_fd(())).collect(),
        };
        match segment_size {
            Some(size) => {
                let fds: Vec<RawFd> = shared
                    .parts
                    .iter()
                    .map(|part| part.fd.as_raw_fd())
                    .collect();
                torch_handle::for_export(size, &fds, own.encode()).encode()
            }
            None => own.encode(),
        }
    };
    let candidate = Candidate {
        allocation,
        offset: shared.offset,
        parts: &shared.parts,
    };
    let id = transport::random_u64();
    Ok(EXPORTS.with(|exports| exports.insert(candidate, id, handle)))
}

/// Maps on `device` the memory a handle string describes: one from [`share`] (in any process of this user),
/// or one PyTorch's expandable segments wrote (`torch_handle.rs`); returns the start of the range (the
/// allocation lies at the offset the exporter returned).
///
/// # Errors
/// [`AbiError::BadHandle`] for bytes that are not a handle string cuvmm reads; [`AbiError::Transport`] if
/// the exporting process cannot be reached or no longer has the export; the refusal of `pidfd_getfd` when
/// the handle has no other way; [`AbiError::Allocator`] if the memory cannot be mapped.
pub fn open(registry: &Registry, device: i32, bytes: &[u8]) -> Result<u64, AbiError> {
    if !TorchHandle::is_torch(bytes) {
        return open_own(registry, device, &HandleString::decode(bytes)?);
    }
    let handle = TorchHandle::decode(bytes)?;
    let own = match handle.rest.is_empty() {
        true => None,
        false => Some(HandleString::decode(&handle.rest)?),
    };
    let allocator = registry.allocator(device)?;
    let taken = handle.take_descriptors().map_err(|err| err.to_string());
    let mapped = taken.and_then(|fds| {
        let parts: Vec<_> = (handle.parts().iter().zip(&fds))
            .map(|(part, fd)| part.with_fd(fd.as_fd()))
            .collect();
        allocator.open_shared(&parts).map_err(|err| err.to_string())
    });
    match (mapped, own) {
        (Ok(addr), _) => Ok(addr),
        // Refused, or the descriptor numbers no longer name the export (its memory freed, the numbers
        // reused): the exporter's server says which.
        (Err(err), Some(own)) => {
            tracing::debug!(%err, "cuvmm: pidfd_getfd did not serve; fetching over the exporter's socket");
            open_own(registry, device, &own)
        }
        (Err(err), None) => Err(AbiError::BadHandle {
            why: format!(
                "the exporting process (pid {}) did not let this one take its descriptors, or they \
                 are not its memory's any more ({err}); PyTorch's expandable segments need ptrace rights over the \
                 exporter: run the exporter with cuvmm too, share from its native allocator \
                 (expandable_segments:False), or allow it (sysctl kernel.yama.ptrace_scope=0)",
                handle.pid
            ),
        }),
    }
}

/// Maps the memory of cuvmm's own handle string, fetching the descriptors over the exporter's socket.
fn open_own(registry: &Registry, device: i32, handle: &HandleString) -> Result<u64, AbiError> {
    let allocator = registry.allocator(device)?;
    let fds = transport::fetch(&handle.address, handle.id)?;
    if fds.len() != handle.parts.len() {
        return Err(bad(
            "the exporter sent another number of descriptors than it has parts",
        ));
    }
    let parts: Vec<_> = (handle.parts.iter().zip(&fds))
        .map(|(part, fd)| part.with_fd(fd.as_fd()))
        .collect();
    Ok(allocator.open_shared(&parts)?)
}

/// Unmaps shared memory that [`open`] mapped at `ptr` of `device`. The caller's work on it must be done.
///
/// # Errors
/// [`AbiError::Allocator`] for an address [`open`] did not return, or a driver failure.
pub fn close(registry: &Registry, device: i32, ptr: u64) -> Result<(), AbiError> {
    Ok(registry.allocator(device)?.close_shared(ptr)?)
}

/// Forgets the export of the allocation at `ptr` of `device`, which is being freed (call it before the
/// allocator frees it). One atomic load when there is none.
pub fn forget(registry: &Registry, device: i32, ptr: u64) {
    if EXPORTS.allocations() == 0 {
        return;
    }
    EXPORTS.with(|exports| exports.remove((registry.id(), device, ptr)));
}

/// Forgets the exports of `device` whose allocation starts in one of `ranges` (`[start, end)`): memory
/// whose pages are about to be given back (a sleep), whose descriptors would outlive them.
pub fn forget_in(registry: &Registry, device: i32, ranges: &[(u64, u64)]) {
    if EXPORTS.allocations() == 0 || ranges.is_empty() {
        return;
    }
    let id = registry.id();
    EXPORTS.with(|exports| {
        exports.remove_where(|(registry, on, ptr)| {
            registry == id && on == device && ranges.iter().any(|&(lo, hi)| lo <= ptr && ptr < hi)
        });
    });
}

/// Allocations shared and not freed since (for the tests).
pub fn pending_exports() -> usize {
    EXPORTS.allocations()
}
