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

pub mod after_effect;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod device;
pub mod sim;

use serde::Serialize;
use std::fmt;

/// A range of device virtual addresses: `start .. start + size`, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct VaRange {
    /// First byte of the range.
    pub start: u64,
    /// Length of the range in bytes.
    pub size: u64,
}

impl VaRange {
    /// A range from `start` of `size` bytes.
    pub const fn new(start: u64, size: u64) -> Self {
        Self { start, size }
    }

    /// One past the last byte. Saturates rather than wrapping for ranges at the top of the space.
    pub const fn end(&self) -> u64 {
        self.start.saturating_add(self.size)
    }

    /// Whether `addr` lies inside the range.
    pub const fn contains(&self, addr: u64) -> bool {
        addr >= self.start && addr < self.end()
    }

    /// Whether `start .. start + size` lies entirely inside the range.
    pub fn contains_range(&self, start: u64, size: u64) -> bool {
        start >= self.start && start.checked_add(size).is_some_and(|end| end <= self.end())
    }
}

/// A physical memory allocation made by [`Driver::create`] (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PhysHandle(pub u64);

impl fmt::Display for PhysHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handle#{}", self.0)
    }
}

/// A stream: an ordered queue of device work, as an integer; 0 is the default stream.
///
/// What the number means is the driver's: on the simulator it is an identity; on the CUDA backend
/// (`driver::cuda::CudaDriver`) it is the caller's raw `CUstream` value, made with
/// [`from_cuda`](StreamId::from_cuda) from a cudarc stream or [`from_raw`](StreamId::from_raw) from a
/// `CUstream` / `cudaStream_t` handed over by C, and cuvmm records its events on that very stream and
/// synchronizes it. See docs/DESIGN.md, "Streams and contexts".
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct StreamId(pub u64);

impl StreamId {
    /// The default (legacy, null) stream.
    pub const DEFAULT: StreamId = StreamId(0);
    /// CUDA's `CU_STREAM_LEGACY` handle (`0x1`): the legacy default stream, named explicitly.
    pub const LEGACY: StreamId = StreamId(1);
    /// CUDA's `CU_STREAM_PER_THREAD` handle (`0x2`): the per-thread default stream of the thread that
    /// uses it, so a different stream on every thread. Use it for memory used and freed on one thread.
    pub const PER_THREAD: StreamId = StreamId(2);

    /// The id of a cudarc stream: its raw `CUstream`.
    #[cfg(feature = "cuda")]
    pub fn from_cuda(stream: &cudarc::driver::CudaStream) -> StreamId {
        Self::from_raw(stream.cu_stream())
    }

    /// The id of a raw `CUstream` (a `cudaStream_t` from C or C++ is the same pointer).
    #[cfg(feature = "cuda")]
    pub fn from_raw(stream: cudarc::driver::sys::CUstream) -> StreamId {
        StreamId(stream as usize as u64)
    }
}

impl fmt::Display for StreamId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "stream {:#x}", self.0)
    }
}

/// A point in a stream's work, recorded by [`Driver::record_event`] (`CUevent`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct EventId(pub u64);

/// Free and total device memory, as `cuMemGetInfo` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct MemInfo {
    /// Bytes the device can still hand out.
    pub free: u64,
    /// Bytes of device memory in all.
    pub total: u64,
}

/// The driver operations, for counters, latencies, fault injection and error messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// `cuMemAddressReserve`.
    Reserve,
    /// `cuMemAddressFree`.
    FreeReservation,
    /// `cuMemCreate`.
    Create,
    /// `cuMemRelease`.
    Release,
    /// `cuMemMap`.
    Map,
    /// `cuMemSetAccess`.
    SetAccess,
    /// `cuMemUnmap`.
    Unmap,
    /// `cuMemGetInfo`.
    MemInfo,
    /// `cuMemAlloc`.
    Malloc,
    /// `cuMemFree`.
    Free,
    /// `cuEventRecord`.
    RecordEvent,
    /// `cuEventQuery`.
    QueryEvent,
    /// `cuEventDestroy`.
    DestroyEvent,
    /// `cuStreamSynchronize`.
    Synchronize,
    /// `cuMemsetD8`: fills device memory with a byte (for `--touch` and tests).
    Memset,
    /// `cuMemcpyDtoH`: copies device memory to the host (for `--touch` and tests).
    CopyToHost,
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: [Op; 16] = [
        Op::Reserve,
        Op::FreeReservation,
        Op::Create,
        Op::Release,
        Op::Map,
        Op::SetAccess,
        Op::Unmap,
        Op::MemInfo,
        Op::Malloc,
        Op::Free,
        Op::RecordEvent,
        Op::QueryEvent,
        Op::DestroyEvent,
        Op::Synchronize,
        Op::Memset,
        Op::CopyToHost,
    ];

    /// The operation's name in cuvmm's verbs (`reserve`, `create`, `map`, ...).
    pub const fn name(self) -> &'static str {
        match self {
            Op::Reserve => "reserve",
            Op::FreeReservation => "free_reservation",
            Op::Create => "create",
            Op::Release => "release",
            Op::Map => "map",
            Op::SetAccess => "set_access",
            Op::Unmap => "unmap",
            Op::MemInfo => "mem_info",
            Op::Malloc => "malloc",
            Op::Free => "free",
            Op::RecordEvent => "record_event",
            Op::QueryEvent => "query_event",
            Op::DestroyEvent => "destroy_event",
            Op::Synchronize => "synchronize",
            Op::Memset => "memset",
            Op::CopyToHost => "copy_to_host",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// How many times each driver operation was called, and the driver time they cost.
///
/// On [`sim::SimDriver`] the time is estimated from its latency model; on a real device it is measured.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverCounters {
    /// Calls per operation, indexed like [`Op::ALL`].
    pub calls: [u64; Op::ALL.len()],
    /// Driver time spent (or estimated) in all calls, in nanoseconds.
    pub time_ns: u64,
    /// Per operation, the 2 MiB units its calls covered (each call at least one; see
    /// `sim::LatencyModel::units`), so the time can be estimated again under another calibration. The
    /// simulator fills it; other backends leave it 0.
    pub units: [u64; Op::ALL.len()],
}

impl DriverCounters {
    /// Calls of one operation.
    pub fn get(&self, op: Op) -> u64 {
        self.calls[op as usize]
    }

    /// Counts one call of `op` that cost `ns` nanoseconds.
    pub fn record(&mut self, op: Op, ns: u64) {
        self.calls[op as usize] += 1;
        self.time_ns += ns;
    }

    /// Counts `calls` calls of `op` that cost `ns` nanoseconds each.
    pub fn record_many(&mut self, op: Op, calls: u64, ns: u64) {
        self.calls[op as usize] += calls;
        self.time_ns += calls * ns;
    }

    /// Counts `calls` calls of `op` covering `units` 2 MiB units each.
    pub fn record_units(&mut self, op: Op, calls: u64, units: u64) {
        self.units[op as usize] += calls * units;
    }

    /// Calls of all operations together.
    pub fn total(&self) -> u64 {
        self.calls.iter().sum()
    }

    /// Driver time in microseconds.
    pub fn time_us(&self) -> f64 {
        self.time_ns as f64 / 1_000.0
    }
}

/// What can go wrong in a driver call. Each CUDA rule that [`sim::SimDriver`] enforces has its own kind.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DriverError {
    /// The device has no physical memory left for the request (`CUDA_ERROR_OUT_OF_MEMORY`).
    /// Retryable once the caller has given memory back.
    #[error("{op}: out of device memory ({requested} bytes requested, {free} bytes free)")]
    OutOfMemory {
        /// The call that failed.
        op: Op,
        /// Bytes asked for.
        requested: u64,
        /// Bytes the device had free.
        free: u64,
    },
    /// A size or address is not a multiple of the allocation granularity.
    #[error("{op}: {what} {value:#x} is not a multiple of the granularity {granularity:#x}")]
    NotAligned {
        /// The call that failed.
        op: Op,
        /// Which argument: "size" or "address".
        what: &'static str,
        /// The offending value.
        value: u64,
        /// The granularity it must be a multiple of.
        granularity: u64,
    },
    /// A size of zero was passed.
    #[error("{op}: size 0 is not allowed")]
    ZeroSize {
        /// The call that failed.
        op: Op,
    },
    /// A mapping would lie (partly) outside every reservation.
    #[error("{op}: range {start:#x}+{size:#x} is not inside one reservation")]
    OutsideReservation {
        /// The call that failed.
        op: Op,
        /// Start of the range.
        start: u64,
        /// Size of the range.
        size: u64,
    },
    /// A mapping would overlap an existing one.
    #[error("map: range {start:#x}+{size:#x} overlaps the mapping at {existing:#x}")]
    AlreadyMapped {
        /// Start of the range.
        start: u64,
        /// Size of the range.
        size: u64,
        /// Start of the mapping it overlaps.
        existing: u64,
    },
    /// A range covers part of a mapping; CUDA only unmaps or sets access on whole mappings.
    #[error(
        "{op}: range {start:#x}+{size:#x} covers only part of the mapping at {mapping:#x}+{mapping_size:#x}"
    )]
    PartialMapping {
        /// The call that failed.
        op: Op,
        /// Start of the range.
        start: u64,
        /// Size of the range.
        size: u64,
        /// Start of the mapping cut in two.
        mapping: u64,
        /// Size of that mapping.
        mapping_size: u64,
    },
    /// An address that must be mapped is not.
    #[error("{op}: address {addr:#x} is not mapped")]
    NotMapped {
        /// The call that failed.
        op: Op,
        /// The first unmapped address found.
        addr: u64,
    },
    /// A handle that was never created, or was already released.
    #[error("{op}: unknown {handle}")]
    UnknownHandle {
        /// The call that failed.
        op: Op,
        /// The handle.
        handle: PhysHandle,
    },
    /// A mapping whose size differs from its handle's size.
    #[error("map: {handle} holds {handle_size:#x} bytes but the mapping is {size:#x} bytes")]
    SizeMismatch {
        /// The handle.
        handle: PhysHandle,
        /// The handle's size.
        handle_size: u64,
        /// The size asked for.
        size: u64,
    },
    /// A range that is not a reservation made by [`Driver::reserve`].
    #[error("{op}: {start:#x} is not the start of a reservation of that size")]
    UnknownReservation {
        /// The call that failed.
        op: Op,
        /// The address given.
        start: u64,
    },
    /// A reservation freed while pages are still mapped in it.
    #[error("free_reservation: {mapped} mappings are still inside the reservation at {start:#x}")]
    ReservationInUse {
        /// Start of the reservation.
        start: u64,
        /// Mappings still inside it.
        mapped: usize,
    },
    /// A read or write through a mapping whose access was never set.
    #[error("access to {addr:#x} before set_access")]
    AccessDenied {
        /// The address accessed.
        addr: u64,
    },
    /// `free` of a pointer that `malloc` did not return, or returned and was already freed.
    #[error("{op}: {addr:#x} is not a live allocation")]
    UnknownPointer {
        /// The call that failed.
        op: Op,
        /// The pointer.
        addr: u64,
    },
    /// An event that was never recorded, or was destroyed.
    #[error("unknown event {}", event.0)]
    UnknownEvent {
        /// The event.
        event: EventId,
    },
    /// `cuMemUnmap` of a range that work still pending on `stream` reads or writes. A GPU would not refuse
    /// the call: the kernel would hit an illegal memory access (or, once the page is mapped elsewhere,
    /// silently corrupt another allocation). [`sim::SimDriver`] refuses it, changing nothing, so the bug
    /// fails a test instead.
    #[error("unmap: {va:#x} is still used by pending work on {stream}")]
    UnmapWhileInUse {
        /// The first address of the range that pending work touches.
        va: u64,
        /// A stream whose pending work touches it.
        stream: StreamId,
    },
    /// No virtual address range of that size is left.
    #[error("{op}: virtual address space exhausted ({requested} bytes requested)")]
    VaExhausted {
        /// The call that failed.
        op: Op,
        /// Bytes asked for.
        requested: u64,
    },
    /// A failure injected on purpose by a test ([`sim::SimDriver`]'s fault injection).
    #[error("{op}: injected fault on call {call}")]
    Injected {
        /// The call that failed.
        op: Op,
        /// Which call of that operation failed (1-based).
        call: u64,
    },
    /// A byte read or write on a [`sim::SimDriver`] built without a backing store
    /// ([`sim::SimConfig::backing_store`]). Not a CUDA error: a test asked for bytes the device does not keep.
    #[error(
        "read/write of device bytes needs a backing store (SimConfig::with_backing_store(true))"
    )]
    NoBackingStore,
    /// No CUDA driver library or no device was found.
    #[error("no CUDA driver found: {reason}")]
    NoDriver {
        /// What was missing.
        reason: String,
    },
    /// The driver does not offer this operation (a [`Driver`] that keeps the default
    /// [`memset_d8`](Driver::memset_d8) or [`copy_to_host`](Driver::copy_to_host)).
    #[error("{op}: not supported by this driver")]
    Unsupported {
        /// The operation asked for.
        op: Op,
    },
    /// A CUDA call made while opening a device (creating its context, querying it) failed.
    #[error("opening the CUDA device: {call} failed with CUDA error {code} ({name})")]
    CudaSetup {
        /// The driver function that failed (`cuDevicePrimaryCtxRetain`, ...).
        call: &'static str,
        /// The `CUresult` value.
        code: u32,
        /// The `CUresult` name.
        name: String,
    },
    /// A peer device that was asked to get access to this device's memory cannot access it
    /// (`cuDeviceCanAccessPeer` says no).
    #[error("CUDA device {peer} cannot access the memory of device {device}")]
    PeerAccess {
        /// The device whose memory is mapped.
        device: usize,
        /// The peer that cannot reach it.
        peer: usize,
    },
    /// A real driver call failed.
    #[error("{op}: CUDA error {code} ({name})")]
    Cuda {
        /// The call that failed.
        op: Op,
        /// The `CUresult` value.
        code: u32,
        /// The `CUresult` name.
        name: String,
    },
}

impl DriverError {
    /// Whether this is the device running out of memory (retryable after reclaiming).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, DriverError::OutOfMemory { .. })
    }
}

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
///   `create`, `malloc`, `record_event`) and fails leaves nothing behind: if it made the resource before
///   finding the error, it gives it back before returning. A call on a resource the caller names
///   (`free_reservation`, `release`, `free`, `destroy_event`, `unmap`, `map`, `set_access`) may have
///   taken effect before it failed (CUDA reports earlier asynchronous errors from any call); then the same
///   call made again reports the resource gone ([`DriverError::UnknownReservation`],
///   [`DriverError::UnknownHandle`], [`DriverError::UnknownPointer`], [`DriverError::UnknownEvent`],
///   [`DriverError::NotMapped`]), and after a `map` that failed, unmapping its range succeeds.
///   [`after_effect::AfterEffect`] injects such failures; `docs/reliability.md` says how cuvmm settles them.
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

    /// Maps each of `handles`, whole, at consecutive addresses `size` bytes apart from `va`: one
    /// [`map`](Driver::map) call per handle, each counted. Stops at the first failure and returns it with
    /// the number of handles mapped before it, which stay mapped.
    ///
    /// The default makes the calls one by one ([`map_each_by_calls`]); the same rule as for
    /// [`create_each`](Driver::create_each) holds for a driver that does it in one pass.
    fn map_each(
        &mut self,
        va: u64,
        size: u64,
        handles: &[PhysHandle],
    ) -> Result<(), (usize, DriverError)> {
        map_each_by_calls(self, va, size, handles)
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

    /// Calls made so far and the driver time they cost.
    fn counters(&self) -> DriverCounters;

    /// The device's ordinal (`GPU N` in out-of-memory messages). The default is 0, the simulator's.
    fn ordinal(&self) -> usize {
        0
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

    /// Copies `out.len()` bytes from device address `va` to `out` (`cuMemcpyDtoH`), after all earlier
    /// [`memset_d8`](Driver::memset_d8) calls. The same rules as `memset_d8` apply to the range.
    ///
    /// The default implementation returns [`DriverError::Unsupported`].
    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let _ = (va, out);
        Err(DriverError::Unsupported { op: Op::CopyToHost })
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

/// [`Driver::map_each`] as one call of [`Driver::map`] per handle.
pub fn map_each_by_calls<D: Driver + ?Sized>(
    driver: &mut D,
    va: u64,
    size: u64,
    handles: &[PhysHandle],
) -> Result<(), (usize, DriverError)> {
    for (i, &handle) in handles.iter().enumerate() {
        // Saturating: past the top of the address space is no reservation, and the driver says so.
        let at = va.saturating_add(size.saturating_mul(i as u64));
        driver.map(at, size, handle).map_err(|err| (i, err))?;
    }
    Ok(())
}

/// A borrowed driver is a driver, so a test can build an allocator on `&mut SimDriver` and inspect the
/// device after the allocator is dropped (its leak report, its pending work).
impl<D: Driver + ?Sized> Driver for &mut D {
    fn granularity(&self) -> u64 {
        (**self).granularity()
    }
    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        (**self).reserve(size)
    }
    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        (**self).free_reservation(range)
    }
    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        (**self).create(size)
    }
    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        (**self).release(handle)
    }
    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        (**self).map(va, size, handle)
    }
    fn create_each(
        &mut self,
        size: u64,
        count: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        (**self).create_each(size, count, out)
    }
    fn map_each(
        &mut self,
        va: u64,
        size: u64,
        handles: &[PhysHandle],
    ) -> Result<(), (usize, DriverError)> {
        (**self).map_each(va, size, handles)
    }
    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        (**self).set_access(va, size)
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        (**self).unmap(va, size)
    }
    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        (**self).mem_info()
    }
    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        (**self).malloc(size)
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        (**self).free(ptr)
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        (**self).record_event(stream)
    }
    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        (**self).event_complete(event)
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        (**self).destroy_event(event)
    }
    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        (**self).synchronize(stream)
    }
    fn counters(&self) -> DriverCounters {
        (**self).counters()
    }
    fn ordinal(&self) -> usize {
        (**self).ordinal()
    }
}
