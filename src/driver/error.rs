//! What can go wrong in a driver call: [`DriverError`], one kind per CUDA rule.

use super::Op;
use super::types::{CaptureMisuse, EventId, PhysHandle, StreamId};

/// What can go wrong in a driver call. Each CUDA rule that [`sim::SimDriver`](super::sim::SimDriver) enforces has its own kind.
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
    /// A mapping of part of a handle that reaches past the handle's end.
    #[error(
        "map: {size:#x} bytes from offset {offset:#x} of {handle}, which holds {handle_size:#x} bytes"
    )]
    OutsideHandle {
        /// The handle.
        handle: PhysHandle,
        /// The handle's size.
        handle_size: u64,
        /// Where the mapping was to start in the handle.
        offset: u64,
        /// The size asked for.
        size: u64,
    },
    /// A range that is not a reservation made by [`Driver::reserve`](super::Driver::reserve).
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
    /// silently corrupt another allocation). [`sim::SimDriver`](super::sim::SimDriver) refuses it, changing nothing, so the bug
    /// fails a test instead.
    #[error("unmap: {va:#x} is still used by pending work on {stream}")]
    UnmapWhileInUse {
        /// The first address of the range that pending work touches.
        va: u64,
        /// A stream whose pending work touches it.
        stream: StreamId,
    },
    /// A call named a stream that was destroyed. On a GPU this is undefined behaviour (the H100 crashed in
    /// `cuStreamSynchronize`); [`sim::SimDriver`](super::sim::SimDriver) refuses it (streams destroyed with
    /// [`SimDriver::destroy_stream`](super::sim::SimDriver::destroy_stream)), changing nothing, so the bug
    /// fails a test instead.
    #[error("{call}: {stream} was destroyed")]
    StreamDestroyed {
        /// The call that failed: a driver operation's name ([`Op::name`]), or `launch`.
        call: &'static str,
        /// The destroyed stream it named.
        stream: StreamId,
    },
    /// The host could not give memory for a copy of device memory (a sleeping tag's bytes).
    #[error("host out of memory: {bytes} bytes of host memory could not be allocated")]
    HostOutOfMemory {
        /// Bytes asked for.
        bytes: u64,
    },
    /// No virtual address range of that size is left.
    #[error("{op}: virtual address space exhausted ({requested} bytes requested)")]
    VaExhausted {
        /// The call that failed.
        op: Op,
        /// Bytes asked for.
        requested: u64,
    },
    /// A failure injected on purpose by a test ([`sim::SimDriver`](super::sim::SimDriver)'s fault injection).
    #[error("{op}: injected fault on call {call}")]
    Injected {
        /// The call that failed.
        op: Op,
        /// Which call of that operation failed (1-based).
        call: u64,
    },
    /// A byte read or write on a [`sim::SimDriver`](super::sim::SimDriver) built without a backing store
    /// ([`sim::SimConfig::backing_store`](super::sim::SimConfig::backing_store)). Not a CUDA error: a test asked for bytes the device does not keep.
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
    /// The driver does not offer this operation (a [`Driver`](super::Driver) that keeps the default
    /// [`memset_d8`](super::Driver::memset_d8) or [`copy_to_host`](super::Driver::copy_to_host)).
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
    /// A call CUDA refuses while a stream is being captured into a graph
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`): a synchronization or event query of the capturing stream,
    /// or, in global mode, any such call from any thread. CUDA invalidates the capture as well.
    #[error(
        "{op}: not permitted while {stream} is capturing a CUDA graph (the capture is invalidated)"
    )]
    CaptureUnsupported {
        /// The call refused.
        op: Op,
        /// The capturing stream whose capture the call broke.
        stream: StreamId,
    },
    /// A capture that an earlier refused call invalidated cannot be ended into a graph
    /// (`CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`).
    #[error("the capture on {stream} was invalidated by a call CUDA refuses during capture")]
    CaptureInvalidated {
        /// The stream whose capture was invalidated.
        stream: StreamId,
    },
    /// A capture begun or ended where CUDA does not allow it: begun on a stream already capturing or on
    /// the legacy default stream, or ended on a stream that is not capturing. Nothing changes.
    #[error("{stream}: {misuse}")]
    CaptureMisuse {
        /// The stream named.
        stream: StreamId,
        /// What was wrong.
        misuse: CaptureMisuse,
    },
    /// A query of an event whose last record was made while its stream was capturing
    /// (`CUDA_ERROR_CAPTURED_EVENT`): the record is a node of the graph, not work that runs, so the event
    /// never completes in the eager sense. While that capture is under way the query is
    /// [`DriverError::CaptureUnsupported`] instead (and invalidates it).
    #[error("event {} was last recorded on a capturing stream: it cannot be queried", event.0)]
    CapturedEvent {
        /// The event.
        event: EventId,
    },
    /// [`import_handle`](super::Driver::import_handle) of a descriptor that is not a handle this device
    /// exported with [`export_handle`](super::Driver::export_handle) (another file, or an export of another
    /// device). Nothing is imported.
    #[error("import: file descriptor {fd} is not a memory handle this device exported")]
    NotExported {
        /// The descriptor given.
        fd: i32,
    },
    /// [`import_handle`](super::Driver::import_handle) of a descriptor whose memory is already freed: every
    /// handle to it was released and unmapped before the import. Nothing is imported.
    #[error(
        "import: the memory behind file descriptor {fd} was freed (every handle to it released and unmapped)"
    )]
    ExportFreed {
        /// The descriptor given.
        fd: i32,
    },
    /// [`import_handle`](super::Driver::import_handle) with a size other than the exported handle's.
    /// Nothing is imported.
    #[error("import: file descriptor {fd} holds {exported:#x} bytes, not the {size:#x} named")]
    ImportSizeMismatch {
        /// The descriptor given.
        fd: i32,
        /// The exported handle's size.
        exported: u64,
        /// The size named.
        size: u64,
    },
    /// The operating system refused a file descriptor operation that a call needs (no descriptor left to
    /// export a handle as, or one that cannot be examined). Nothing was made.
    #[error("{op}: file descriptor: {reason}")]
    Descriptor {
        /// The call that failed.
        op: Op,
        /// What the operating system said.
        reason: String,
    },
    /// A graph the simulator does not know (never captured, or its capture was invalidated or is under way).
    #[error("no graph {graph}")]
    UnknownGraph {
        /// The capture id named.
        graph: u64,
    },
    /// A copy job's plan the job cannot run (a copy outside its host piece, a piece given that the plan
    /// allocates or missing where it does not): a bug of the caller. Nothing was copied.
    #[error("copies: {reason}")]
    CopyPlan {
        /// What is wrong.
        reason: &'static str,
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
    /// `Ok` if `size` bytes from `offset` lie inside a handle of `handle_size` bytes (`map_from`'s rule),
    /// else [`DriverError::OutsideHandle`].
    pub fn check_inside_handle(
        handle: PhysHandle,
        handle_size: u64,
        offset: u64,
        size: u64,
    ) -> Result<(), DriverError> {
        if offset.checked_add(size).is_none_or(|end| end > handle_size) {
            return Err(DriverError::OutsideHandle {
                handle,
                handle_size,
                offset,
                size,
            });
        }
        Ok(())
    }

    /// Whether this is the device running out of memory (retryable after reclaiming).
    pub fn is_out_of_memory(&self) -> bool {
        matches!(self, DriverError::OutOfMemory { .. })
    }
}
