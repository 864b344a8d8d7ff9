//! Sharing cuvmm memory between processes: PyTorch's `shareIpcHandle` and `getIpcDevPtr`
//! (`torch.multiprocessing` sending a CUDA tensor).
//!
//! The exporter ([`share`]) exports the mappings under the allocation as file descriptors
//! ([`cuvmm::Allocator::share`]), keeps them in the process's table of exports under a random id, and
//! returns a *handle string*: where its server listens ([`crate::transport`]), the id, and the layout of the
//! parts. The importer ([`open`]) fetches the descriptors from that server over a Unix socket (SCM_RIGHTS),
//! maps them ([`cuvmm::Allocator::open_shared`]) and closes them; [`close`] unmaps. A Unix socket, rather
//! than the `pidfd_getfd` PyTorch's expandable segments use, works where ptrace is restricted (Yama's
//! `ptrace_scope=1` refuses a child reading its parent's descriptors).
//!
//! An export is fetched once: its descriptors are sent and closed, and its id forgotten. An export not yet
//! fetched when its allocation is freed is forgotten then ([`forget`]), so the table holds nothing of freed
//! memory. PyTorch shares a storage anew (a new handle string) each time it sends it.
//!
//! # The handle string (version 1, little-endian)
//! `"CUVMMIPC"`, version `u16`, the server's address (`u16` length, bytes), export id `u64`, offset of the
//! allocation in the range `u64`, allocation size `u64`, number of parts `u32`, and per part its handle
//! size, offset in the handle and size (`u64` each). Its first byte is above the version PyTorch's own
//! handles start with, so a process on PyTorch's allocator given one refuses it (as "a future version")
//! rather than misreading it.

use crate::error::AbiError;
use crate::registry::Registry;
use crate::transport::{self, Address};
use cuvmm::sharing::SharedPart;
use std::collections::HashMap;
use std::os::fd::{AsFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex};

const MAGIC: &[u8; 8] = b"CUVMMIPC";
const VERSION: u16 = 1;

/// A handle string, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HandleString {
    /// Where the exporting process serves its exports.
    pub address: Address,
    /// The export's id there.
    pub id: u64,
    /// Bytes from the range's start to the allocation.
    pub offset: u64,
    /// Bytes of the allocation.
    pub size: u64,
    /// The mappings of the range, in address order.
    pub parts: Vec<SharedPart<()>>,
}

impl HandleString {
    /// The handle string's bytes.
    pub fn encode(&self) -> Vec<u8> {
        let address = self.address.as_bytes();
        let mut out = Vec::with_capacity(48 + address.len() + 24 * self.parts.len());
        out.extend_from_slice(MAGIC);
        out.extend_from_slice(&VERSION.to_le_bytes());
        out.extend_from_slice(&(address.len() as u16).to_le_bytes());
        out.extend_from_slice(address);
        for n in [self.id, self.offset, self.size] {
            out.extend_from_slice(&n.to_le_bytes());
        }
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
        let [id, offset, size] = [r.u64()?, r.u64()?, r.u64()?];
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
        let range = cuvmm::sharing::range_size(&parts).map_err(cuvmm::Error::from)?;
        if offset.checked_add(size).is_none_or(|end| end > range) || size == 0 {
            return Err(bad("its allocation lies outside its range"));
        }
        Ok(Self {
            address,
            id,
            offset,
            size,
            parts,
        })
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

/// An export waiting for its importer: the descriptors, and the allocation they share (to forget it when
/// that is freed).
#[derive(Debug)]
struct Export {
    /// Which registry's allocator (tests build several registries in one process).
    registry: u64,
    device: i32,
    ptr: u64,
    fds: Vec<OwnedFd>,
}

/// The process's exports not yet fetched, by id.
#[derive(Debug, Default)]
struct ExportTable {
    exports: Mutex<HashMap<u64, Export>>,
    /// `exports.len()`, read without the lock at every free.
    len: AtomicUsize,
}

impl ExportTable {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Export>> {
        // A panic while the table was locked left it whole (every change is one insert or remove).
        self.exports
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn insert(&self, id: u64, export: Export) {
        let mut exports = self.lock();
        exports.insert(id, export);
        self.len.store(exports.len(), Ordering::Release);
    }
}

impl transport::Exports for ExportTable {
    fn descriptors(&self, id: u64) -> Result<Vec<OwnedFd>, String> {
        let mut exports = self.lock();
        let export = exports.remove(&id);
        self.len.store(exports.len(), Ordering::Release);
        export.map(|export| export.fds).ok_or_else(|| {
            "no such export: it was opened already, or the exporting process freed that memory"
                .to_owned()
        })
    }
}

static EXPORTS: LazyLock<Arc<ExportTable>> = LazyLock::new(Arc::default);

/// Exports the live allocation at `ptr` of `device`: returns its handle string and the allocation's offset
/// in the range the importer maps. `ptr` must stay live until this returns: a [`forget`] racing it (a free
/// of the memory being shared, a use after free) may leave the export in the table (PyTorch holds the
/// storage while sharing it).
///
/// # Errors
/// [`AbiError::DeviceOutOfRange`]; [`AbiError::Init`]; [`AbiError::Allocator`] for an address that is not
/// the start of a live allocation, tagged memory, or a device whose handles cannot be exported;
/// [`AbiError::Transport`] if the process's server cannot start.
pub fn share(registry: &Registry, device: i32, ptr: u64) -> Result<(Vec<u8>, u64), AbiError> {
    let shared = registry.allocator(device)?.share(ptr)?;
    let table: Arc<ExportTable> = Arc::clone(&EXPORTS);
    let address = transport::serve(table)?;
    let id = transport::random_u64();
    let handle = HandleString {
        address,
        id,
        offset: shared.offset,
        size: shared.size,
        parts: shared.parts.iter().map(|part| part.with_fd(())).collect(),
    };
    let fds = shared.parts.into_iter().map(|part| part.fd).collect();
    EXPORTS.insert(
        id,
        Export {
            registry: registry.id(),
            device,
            ptr,
            fds,
        },
    );
    Ok((handle.encode(), handle.offset))
}

/// Maps on `device` the memory a handle string from [`share`] (in any process of this user) describes;
/// returns the start of the range (the allocation lies at the offset [`share`] returned).
///
/// # Errors
/// [`AbiError::BadHandle`] for bytes that are not a handle string; [`AbiError::Transport`] if the exporting
/// process cannot be reached or no longer has the export; [`AbiError::Allocator`] if the memory cannot be
/// mapped.
pub fn open(registry: &Registry, device: i32, bytes: &[u8]) -> Result<u64, AbiError> {
    let handle = HandleString::decode(bytes)?;
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

/// Forgets the exports not yet fetched of the allocation at `ptr` of `device`, which is being freed,
/// closing their descriptors. One atomic load when there are none.
pub fn forget(registry: &Registry, device: i32, ptr: u64) {
    if EXPORTS.len.load(Ordering::Acquire) == 0 {
        return;
    }
    let mut exports = EXPORTS.lock();
    let id = registry.id();
    exports.retain(|_, e| !(e.registry == id && e.device == device && e.ptr == ptr));
    EXPORTS.len.store(exports.len(), Ordering::Release);
}

/// Exports not yet fetched (for the tests).
pub fn pending_exports() -> usize {
    EXPORTS.len.load(Ordering::Acquire)
}
