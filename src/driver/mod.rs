//! The driver seam: everything the strategies need from a device, as one trait.
//!
//! [`Driver`] mirrors the CUDA driver API that cuvmm uses: the virtual-memory calls
//! (`cuMemAddressReserve`, `cuMemCreate`, `cuMemMap`, `cuMemSetAccess`, `cuMemUnmap`, `cuMemRelease`),
//! the classic `cuMemAlloc`/`cuMemFree` pair for the split allocator, and the stream and event calls
//! needed to know when freed memory is no longer in use.
//!
//! [`sim::SimDriver`] is the default backend: it enforces CUDA's rules so that a bug that would crash a GPU
//! fails a test instead. The real CUDA backend, `cuda::CudaDriver`, lives in `driver/cuda/` behind the
//! `cuda` feature; [`device`] picks one of them from a `--backend sim|cuda[:N]` string.

#[cfg(any(test, feature = "testing"))]
pub mod after_effect;
mod capture_probe;
mod copies;
mod counters;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
mod error;
mod forward;
mod host_memory;
mod op;
pub mod sim;
mod types;

use forward::driver_trait;
use std::os::fd::{BorrowedFd, OwnedFd};

pub use capture_probe::CaptureProbe;
pub use copies::{CopyDirection, CopyJob, CopyOutcome, CopyPlan, CopyRun, HostCopy};
pub use counters::DriverCounters;
pub use error::DriverError;
pub use host_memory::{HostBytes, HostMemory, HostPinning};
pub use op::Op;
pub use types::{
    CaptureMisuse, CaptureMode, CaptureStatus, EventId, MemInfo, PhysHandle, PhysPage, StreamId,
    VaRange,
};

// The trait, and with it `Forward` and the blanket impl that make a wrapper of any driver
// (`driver/forward.rs`): one definition, so a new method is one edit. Each method is
// `fn name(&self or &mut self, arg: Type, ..) -> Ret` followed by `;` or a default body.
driver_trait! {
    /// A device as cuvmm's strategies see it.
    ///
    /// # What callers must guarantee
    /// - Sizes and addresses passed to `create`, `map`, `set_access` and `unmap` are multiples of
    ///   [`granularity`](Driver::granularity); ranges lie inside one reservation.
    /// - A page is unmapped only after every stream that touched it has finished with it (see
    ///   [`synchronize`](Driver::synchronize) and [`event_complete`](Driver::event_complete)).
    ///
    /// # What implementors must guarantee
    /// - A failed call has no effect, or reports the resource gone. A call that makes a resource (`reserve`,
    ///   `create`, `malloc`, `record_event`, `export_handle`, `import_handle`) and fails leaves nothing behind: if it made the resource before
    ///   finding the error, it gives it back before returning. A call on a resource the caller names
    ///   (`free_reservation`, `release`, `free`, `destroy_event`, `unmap`, `map`, `set_access`) may have
    ///   taken effect before it failed (CUDA reports earlier asynchronous errors from any call); then the same
    ///   call made again reports the resource gone ([`DriverError::UnknownReservation`],
    ///   [`DriverError::UnknownHandle`], [`DriverError::UnknownPointer`], [`DriverError::UnknownEvent`],
    ///   [`DriverError::NotMapped`]), and after a `map` that failed, unmapping its range succeeds.
    ///   `after_effect::AfterEffect` (feature `testing`) injects such failures; `docs/reliability.md` says how cuvmm settles them.
    /// - Out-of-memory is reported as [`DriverError::OutOfMemory`] and nothing else, so callers can reclaim and retry.
    /// - [`counters`](Driver::counters) counts every call, failed ones included.
    pub trait Driver {
        /// The allocation granularity in bytes (2 MiB on NVIDIA GPUs): sizes of physical allocations and of
        /// mappings are multiples of it.
        fn granularity(&self) -> u64;

        /// Reserves `size` bytes of virtual address space (`cuMemAddressReserve`). Nothing is mapped yet.
        fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError>;

        /// Frees a reservation (`cuMemAddressFree`). Everything in it must be unmapped first.
        fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError>;

        /// Creates a physical allocation of `size` bytes (`cuMemCreate`).
        fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError>;

        /// Releases a physical allocation (`cuMemRelease`). Its memory returns to the device once it is unmapped.
        fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError>;

        /// Maps the whole of `handle` at `va` (`cuMemMap`). The pages are not accessible until
        /// [`set_access`](Driver::set_access).
        fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError>;

        /// Maps `size` bytes of `page.handle` from byte `page.offset` at `va` (`cuMemMap` with an offset: `va`,
        /// `size` and the offset multiples of the granularity, offset + `size` at most the handle's size, as
        /// CUDA 12's documentation says; older CUDA and HIP require offset 0). One handle may be mapped at several places
        /// at once; its memory is freed once it is released and every mapping of it is gone. Counted as a
        /// [`map`](Driver::map) call.
        ///
        /// The default maps the whole handle when the offset is 0 (a mapping of the handle's size) and returns
        /// [`DriverError::Unsupported`] otherwise, so a driver without partial mappings need not implement it;
        /// cuvmm then never maps part of a handle.
        fn map_from(&mut self, va: u64, size: u64, page: PhysPage) -> Result<(), DriverError> {
            if page.offset == 0 {
                return self.map(va, size, page.handle);
            }
            Err(DriverError::Unsupported { op: Op::Map })
        }

        /// Creates `count` physical allocations of `size` bytes each and appends them to `out`: `count` calls of
        /// [`create`](Driver::create), each counted. Stops at the first failure and returns it; the handles
        /// created before it are in `out`.
        ///
        /// The default makes the calls one by one ([`create_each_by_calls`]). A driver may do the same work
        /// in one pass, as the simulator does, provided every outcome (handles, counters, state, error) is what
        /// the calls one by one give.
        fn create_each(
            &mut self,
            size: u64,
            count: usize,
            out: &mut Vec<PhysHandle>,
        ) -> Result<(), DriverError> {
            create_each_by_calls(self, size, count, out)
        }

        /// Maps each of `pages` (`size` bytes of its handle from its offset) at consecutive addresses `size`
        /// bytes apart from `va`: one [`map_from`](Driver::map_from) call per page, each counted. Stops at the
        /// first failure and returns it with the number of pages mapped before it, which stay mapped.
        ///
        /// The default makes the calls one by one ([`map_each_by_calls`]); the same rule as for
        /// [`create_each`](Driver::create_each) holds for a driver that does it in one pass.
        fn map_each(
            &mut self,
            va: u64,
            size: u64,
            pages: &[PhysPage],
        ) -> Result<(), (usize, DriverError)> {
            map_each_by_calls(self, va, size, pages)
        }

        /// Makes `va .. va + size`, which must consist of whole mappings, readable and writable by the device
        /// (`cuMemSetAccess`).
        fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError>;

        /// Unmaps `va .. va + size`, which must consist of whole mappings (`cuMemUnmap`).
        fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError>;

        /// Free and total device memory (`cuMemGetInfo`).
        fn mem_info(&mut self) -> Result<MemInfo, DriverError>;

        /// Allocates `size` bytes of mapped, accessible device memory in one call (`cuMemAlloc`).
        fn malloc(&mut self, size: u64) -> Result<u64, DriverError>;

        /// Frees memory returned by [`malloc`](Driver::malloc) (`cuMemFree`).
        fn free(&mut self, ptr: u64) -> Result<(), DriverError>;

        /// Records an event at the current end of `stream`'s work (`cuEventRecord`).
        fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError>;

        /// Whether all work recorded before `event` has finished (`cuEventQuery`).
        fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError>;

        /// Destroys an event (`cuEventDestroy`).
        fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError>;

        /// Waits until all work queued on `stream` has finished (`cuStreamSynchronize`).
        fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError>;

        /// Waits until all work queued on the device has finished, every stream's (`cuCtxSynchronize`). It
        /// names no stream, so it is safe where a stream may have been destroyed since cuvmm last heard of
        /// it (the allocator's teardown). Counted as a [`synchronize`](Driver::synchronize).
        fn synchronize_device(&mut self) -> Result<(), DriverError>;

        /// Calls made so far and the driver time they cost.
        fn counters(&self) -> DriverCounters;

        /// The device's ordinal (`GPU N` in out-of-memory messages). The default is 0, the simulator's.
        fn ordinal(&self) -> usize {
            0
        }

        /// Whether [`map_from`](Driver::map_from) can map part of a handle (a nonzero offset, or fewer bytes
        /// than the handle holds). The default, and CUDA's answer, is no: `cuMemMap`'s offset "must be zero",
        /// and an H100 with driver 580 answers an offset with `CUDA_ERROR_NOT_SUPPORTED`. cuvmm lends pages of
        /// a chunk (`lend_chunk_pages`) only on a driver that says yes.
        fn maps_parts_of_handles(&self) -> bool {
            false
        }

        /// Whether `stream` is being captured into a CUDA graph, and by which capture
        /// (`cuStreamGetCaptureInfo`). Never refused during a capture, and never breaks one.
        ///
        /// The default, for a driver without graphs, is [`CaptureStatus::None`].
        fn capture_status(&mut self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
            let _ = stream;
            Ok(CaptureStatus::None)
        }

        /// [`capture_status`](Driver::capture_status) as a function any thread may call while another holds
        /// the driver, for callers that serve requests without it (the facade's stream caches). `None` where
        /// no stream this driver is given can be captured without it knowing: a driver without graphs (the
        /// default), or CUDA with stand-in streams.
        fn capture_probe(&self) -> Option<CaptureProbe> {
            None
        }

        /// Lets device `peer` reach this device's memory: every later [`set_access`](Driver::set_access)
        /// grants `peer` read and write access too (CUDA's `cuMemSetAccess` with one descriptor per device).
        /// Ranges that already have access keep only what they had: the caller sets access on them again
        /// (cuvmm's `add_peer` does). Adding the device itself, or a peer already added, does nothing.
        /// [`DriverError::PeerAccess`] if `peer` cannot reach this device's memory.
        ///
        /// The default returns [`DriverError::Unsupported`].
        fn add_peer(&mut self, peer: usize) -> Result<(), DriverError> {
            let _ = peer;
            Err(DriverError::Unsupported { op: Op::SetAccess })
        }

        /// Sets `size` bytes from `va` to `value` (`cuMemsetD8`), and returns once they are written. The range
        /// must be mapped with access set (or lie inside one `malloc` allocation); it may span several mappings.
        ///
        /// A test and diagnosis tool (`cuvmm compare --touch`), not a fast path. The default implementation
        /// returns [`DriverError::Unsupported`], so a driver that cannot touch bytes need not implement it.
        fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
            let _ = (va, size, value);
            Err(DriverError::Unsupported { op: Op::Memset })
        }

        /// Host memory for `len` bytes copied from and to the device ([`copy_to_host`](Driver::copy_to_host),
        /// [`copy_from_host`](Driver::copy_from_host)): page-locked where the backend can (CUDA's
        /// `cuMemHostAlloc`), which copies reach at the link's speed; else ordinary memory (the default).
        /// [`DriverError::HostOutOfMemory`] if the host has neither. Not counted: no device call.
        fn alloc_host(&mut self, len: usize) -> Result<HostMemory, DriverError> {
            HostMemory::pageable(len)
        }

        /// Copies `out.len()` bytes from device address `va` to `out` (`cuMemcpyDtoH`), after all earlier
        /// [`memset_d8`](Driver::memset_d8) calls. The same rules as `memset_d8` apply to the range.
        ///
        /// The default implementation returns [`DriverError::Unsupported`].
        fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
            let _ = (va, out);
            Err(DriverError::Unsupported { op: Op::CopyToHost })
        }

        /// Copies `data` to device address `va` (`cuMemcpyHtoD`), and returns once the bytes are written. The
        /// same rules as [`memset_d8`](Driver::memset_d8) apply to the range. Used by a wake to put back the
        /// contents a sleep kept.
        ///
        /// The default implementation returns [`DriverError::Unsupported`].
        fn copy_from_host(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
            let _ = (va, data);
            Err(DriverError::Unsupported {
                op: Op::CopyFromHost,
            })
        }

        /// Checks `plan` (every device range mapped with access set, the copies inside their host pieces)
        /// and returns a job that runs its copies without this driver ([`CopyJob::run`]), on a stream of the
        /// driver's own, asynchronously into and out of page-locked host memory, so that the caller can let
        /// go of the lock it holds the driver under while bytes move (a tag's sleep and wake,
        /// `driver/copies.rs`). Until the job is over, an `unmap` of one of its device ranges fails with
        /// [`DriverError::UnmapWhileInUse`] and changes nothing. The calls the job makes are counted as
        /// [`Op::HostAlloc`], [`Op::CopyToHost`] or [`Op::CopyFromHost`], [`Op::RecordEvent`] and
        /// [`Op::Synchronize`].
        ///
        /// The default implementation returns [`DriverError::Unsupported`].
        fn start_copies(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
            let _ = plan;
            Err(DriverError::Unsupported { op: Op::CopyToHost })
        }

        /// Whether [`export_handle`](Driver::export_handle) can export the handles this driver creates: CUDA
        /// exports only handles created with an exportable type, which `CudaDriver` asks for where the device
        /// supports POSIX file descriptors. The default is no.
        fn exports_handles(&self) -> bool {
            false
        }

        /// Exports `handle` as a file descriptor that this or another process can import with
        /// [`import_handle`](Driver::import_handle) (`cuMemExportToShareableHandle`, handle type
        /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`). The caller owns the descriptor: closing it neither
        /// releases the handle nor frees its memory.
        ///
        /// The default implementation returns [`DriverError::Unsupported`].
        fn export_handle(&mut self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
            let _ = handle;
            Err(DriverError::Unsupported { op: Op::Export })
        }

        /// A new handle to the memory behind `fd`, a descriptor from [`export_handle`](Driver::export_handle)
        /// in this or another process, of `size` bytes, the exported handle's size, which the exporter tells
        /// (`cuMemImportFromShareableHandle`). It is mapped, given access and released like a handle from
        /// [`create`](Driver::create); the memory is freed once every handle to it, in every process, is
        /// released and unmapped. The descriptor stays the caller's.
        ///
        /// The default implementation returns [`DriverError::Unsupported`].
        fn import_handle(&mut self, fd: BorrowedFd<'_>, size: u64) -> Result<PhysHandle, DriverError> {
            let _ = (fd, size);
            Err(DriverError::Unsupported { op: Op::Import })
        }
    }
}

/// A borrowed driver is a driver, so a test can build an allocator on `&mut SimDriver` and inspect the
/// device after the allocator is dropped (its leak report, its pending work).
impl<D: Driver + ?Sized> Forward for &mut D {
    type Inner = D;
    fn inner(&self) -> &D {
        self
    }
    fn inner_mut(&mut self) -> &mut D {
        self
    }
}

/// [`Driver::create_each`] as `count` calls of [`Driver::create`].
pub fn create_each_by_calls<D: Driver + ?Sized>(
    driver: &mut D,
    size: u64,
    count: usize,
    out: &mut Vec<PhysHandle>,
) -> Result<(), DriverError> {
    out.reserve(count);
    for _ in 0..count {
        out.push(driver.create(size)?);
    }
    Ok(())
}

/// [`Driver::map_each`] as one call of [`Driver::map_from`] per page.
pub fn map_each_by_calls<D: Driver + ?Sized>(
    driver: &mut D,
    va: u64,
    size: u64,
    pages: &[PhysPage],
) -> Result<(), (usize, DriverError)> {
    for (i, page) in pages.iter().enumerate() {
        // Saturating: past the top of the address space is no reservation, and the driver says so.
        let at = va.saturating_add(size.saturating_mul(i as u64));
        (driver.map_from(at, size, *page)).map_err(|err| (i, err))?;
    }
    Ok(())
}
