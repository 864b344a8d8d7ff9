//! The driver operations by name: what counters, latencies, fault injection and error messages refer to.

use serde::Serialize;
use std::fmt;

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
    /// `cuMemcpyHtoD`: copies host memory to the device (restoring a tag's contents at a wake).
    CopyFromHost,
    /// `cuStreamGetCaptureInfo`: whether a stream is being captured into a CUDA graph.
    CaptureInfo,
    /// `cuMemExportToShareableHandle`: a handle as a file descriptor another process can import.
    Export,
    /// `cuMemImportFromShareableHandle`: a handle to memory another process exported.
    Import,
    /// Page-locked host memory that a sleeping tag's bytes are copied to: ordinary memory faulted in and
    /// registered (`cuMemHostRegister`), or `cuMemHostAlloc` (pinning it is the host's work, not the
    /// device's, but it is what a sleep's first copies wait for).
    HostAlloc,
}

impl Op {
    /// Every operation, in declaration order.
    pub const ALL: [Op; 21] = [
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
        Op::CopyFromHost,
        Op::CaptureInfo,
        Op::Export,
        Op::Import,
        Op::HostAlloc,
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
            Op::CopyFromHost => "copy_from_host",
            Op::CaptureInfo => "capture_info",
            Op::Export => "export",
            Op::Import => "import",
            Op::HostAlloc => "host_alloc",
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}
