//! The values the driver calls take and return: address ranges, physical handles, streams, events and the
//! device's free and total memory.

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

/// A physical memory allocation made by [`Driver::create`](super::Driver::create) (`CUmemGenericAllocationHandle`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub struct PhysHandle(pub u64);

impl fmt::Display for PhysHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "handle#{}", self.0)
    }
}

/// A piece of a physical allocation, as one mapping maps it: `handle`'s bytes from byte `offset`
/// (`cuMemMap`'s handle and offset). Offset 0 with the handle's size is the whole handle.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PhysPage {
    /// The allocation.
    pub handle: PhysHandle,
    /// Bytes from the allocation's start, a multiple of the granularity.
    pub offset: u64,
}

impl From<PhysHandle> for PhysPage {
    /// The piece of `handle` from its start.
    fn from(handle: PhysHandle) -> Self {
        Self { handle, offset: 0 }
    }
}

/// A stream: an ordered queue of device work, as an integer; 0 is the default stream.
///
/// What the number means is the driver's: on the simulator it is an identity; on the CUDA backend
/// (`driver::cuda::CudaDriver`) it is the caller's raw `CUstream` value, made with
/// [`from_cuda`](StreamId::from_cuda) from a cudarc stream or [`from_raw`](StreamId::from_raw) from a
/// `CUstream` / `cudaStream_t` handed over by C, and cuvmm records its events on that very stream and
/// synchronizes it. See docs/driver.md, "Streams and contexts".
///
/// # How long a stream must live
/// A call naming a destroyed stream is undefined behaviour on a GPU (a crash in the driver), so a stream
/// given to the allocator must stay alive while it may be named: while memory allocated on it or recorded
/// on it (`record_stream`) is live, and after that until the next `empty_cache()`, since its freed memory
/// stays cached for it and is taken back only after waiting for the stream; a stream captured into a graph
/// with no pool begun for it, also until the allocator's first allocation after the capture ended (which
/// asks the stream whether its capture is over). `empty_cache()` and dropping the allocator name no stream:
/// destroy streams before either. PyTorch's streams live as long as the process.
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

/// A point in a stream's work, recorded by [`Driver::record_event`](super::Driver::record_event) (`CUevent`).
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

/// How a stream capture restricts the calls of other threads (`CUstreamCaptureMode`).
///
/// During a capture CUDA refuses the "potentially unsafe" calls (an event query, a stream or context
/// synchronization, ...) and invalidates the capture: in `Global` mode from every thread, in `ThreadLocal`
/// mode from the capturing thread, in `Relaxed` mode from none. Synchronizing or querying the capturing
/// stream itself, or an event recorded on it during the capture, is refused in every mode.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptureMode {
    /// `CU_STREAM_CAPTURE_MODE_GLOBAL` (PyTorch's default).
    Global,
    /// `CU_STREAM_CAPTURE_MODE_THREAD_LOCAL`.
    ThreadLocal,
    /// `CU_STREAM_CAPTURE_MODE_RELAXED`.
    Relaxed,
}

/// Whether a stream is being captured into a CUDA graph (`cuStreamGetCaptureInfo`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptureStatus {
    /// Not capturing: work queued on the stream runs.
    None,
    /// Capturing: work queued on the stream is recorded into a graph, not run.
    Active {
        /// The capture's id, unique in the process (what PyTorch's pool filters compare).
        id: u64,
        /// The capture's mode, where the driver can tell (the simulator); `None` on CUDA, which does not
        /// report it. A caller that must not break the capture assumes `Global`, the strictest.
        mode: Option<CaptureMode>,
    },
    /// The capture was invalidated by a call CUDA refuses during capture; ending it will fail.
    Invalidated {
        /// The capture's id.
        id: u64,
    },
}

impl CaptureStatus {
    /// Whether work queued on the stream is being captured rather than run (active or invalidated).
    pub fn is_capturing(self) -> bool {
        !matches!(self, CaptureStatus::None)
    }

    /// The capture's id, if the stream is capturing.
    pub fn id(self) -> Option<u64> {
        match self {
            CaptureStatus::None => None,
            CaptureStatus::Active { id, .. } | CaptureStatus::Invalidated { id } => Some(id),
        }
    }
}

/// Why beginning or ending a capture was refused ([`DriverError::CaptureMisuse`](super::DriverError::CaptureMisuse)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum CaptureMisuse {
    /// A capture begun on a stream that is already capturing (`CUDA_ERROR_ILLEGAL_STATE`).
    AlreadyCapturing,
    /// A capture begun on the legacy default stream, `0` or [`StreamId::LEGACY`], which CUDA cannot capture
    /// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`).
    DefaultStream,
    /// A capture ended on a stream that is not capturing (`CUDA_ERROR_ILLEGAL_STATE`).
    NotCapturing,
}

impl fmt::Display for CaptureMisuse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            CaptureMisuse::AlreadyCapturing => "a capture was begun on a stream already capturing",
            CaptureMisuse::DefaultStream => "the legacy default stream cannot be captured",
            CaptureMisuse::NotCapturing => "a capture was ended on a stream that is not capturing",
        })
    }
}
