//! What a CUDA error means to cuvmm: its code and name, and the errors that name a stream, an event or a
//! capture turned into the [`DriverError`] that says so (the calls themselves are in `result.rs`).

use crate::driver::{CaptureMisuse, DriverError, EventId, StreamId};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys;

/// The `CUresult` of an error, as a number and as its name (`CUDA_ERROR_OUT_OF_MEMORY`).
pub(super) fn code_and_name(err: &CuError) -> (u32, String) {
    (err.0 as u32, format!("{:?}", err.0))
}

/// Whether an error is `CUDA_ERROR_OUT_OF_MEMORY`.
pub(super) fn is_out_of_memory(err: &CuError) -> bool {
    err.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY
}

/// Whether an error is `CUDA_ERROR_NO_DEVICE`.
pub(super) fn is_no_device(err: &CuError) -> bool {
    err.0 == sys::CUresult::CUDA_ERROR_NO_DEVICE
}

/// `CUDA_ERROR_INVALID_VALUE`.
const INVALID_VALUE: u32 = 1;
/// `CUDA_ERROR_INVALID_HANDLE`.
const INVALID_HANDLE: u32 = 400;

/// `CUDA_ERROR_ILLEGAL_STATE`.
const ILLEGAL_STATE: u32 = 401;
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`.
const CAPTURE_UNSUPPORTED: u32 = 900;
/// `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`.
const CAPTURE_INVALIDATED: u32 = 901;
/// `CUDA_ERROR_CAPTURED_EVENT`.
const CAPTURED_EVENT: u32 = 907;

/// The error of a call that names `stream`: `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` is
/// [`DriverError::CaptureUnsupported`] and `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`
/// [`DriverError::CaptureInvalidated`] for that stream; anything else is unchanged. (A call that names no
/// stream, such as an event query refused in global mode, cannot say which stream is capturing, and keeps
/// [`DriverError::Cuda`].)
pub(super) fn on_stream(err: DriverError, stream: StreamId) -> DriverError {
    match err {
        DriverError::Cuda {
            op,
            code: CAPTURE_UNSUPPORTED,
            ..
        } => DriverError::CaptureUnsupported { op, stream },
        DriverError::Cuda {
            code: CAPTURE_INVALIDATED,
            ..
        } => DriverError::CaptureInvalidated { stream },
        err => err,
    }
}

/// The error of a query of `event`: `CUDA_ERROR_CAPTURED_EVENT` is [`DriverError::CapturedEvent`].
pub(super) fn on_event(err: DriverError, event: EventId) -> DriverError {
    match err {
        DriverError::Cuda {
            code: CAPTURED_EVENT,
            ..
        } => DriverError::CapturedEvent { event },
        err => err,
    }
}

/// The error of beginning (`ending` false) or ending a capture of `stream`: `CUDA_ERROR_ILLEGAL_STATE` is
/// [`DriverError::CaptureMisuse`] (already capturing, or not capturing), and so is
/// `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` for a capture begun on the legacy default stream; otherwise as
/// [`on_stream`].
pub(super) fn on_capture(err: DriverError, stream: StreamId, ending: bool) -> DriverError {
    let misuse = |misuse| DriverError::CaptureMisuse { stream, misuse };
    let legacy = stream == StreamId::DEFAULT || stream == StreamId::LEGACY;
    match err {
        DriverError::Cuda {
            code: ILLEGAL_STATE,
            ..
        } if ending => misuse(CaptureMisuse::NotCapturing),
        DriverError::Cuda {
            code: ILLEGAL_STATE,
            ..
        } => misuse(CaptureMisuse::AlreadyCapturing),
        DriverError::Cuda {
            code: CAPTURE_UNSUPPORTED,
            ..
        } if legacy && !ending => misuse(CaptureMisuse::DefaultStream),
        err => on_stream(err, stream),
    }
}

/// Whether a failed call's error is the driver saying it does not know the resource it was given
/// (`CUDA_ERROR_INVALID_VALUE` or `CUDA_ERROR_INVALID_HANDLE`). Such an error is a rejection: the call had no
/// effect.
pub(super) fn says_unknown(err: &DriverError) -> bool {
    matches!(
        err,
        DriverError::Cuda {
            code: INVALID_VALUE | INVALID_HANDLE,
            ..
        }
    )
}
