//! Stream capture on CUDA: whether a stream is being captured (`cuStreamGetCaptureInfo`), asked by the
//! allocator or, through a [`CaptureProbe`], from any thread; and beginning and ending captures, for the GPU
//! tests.

use super::super::calls::{cuda_error, keeping_current_context, raw_stream};
use super::super::errors;
use super::CudaDriver;
use crate::driver::{CaptureMode, CaptureProbe, CaptureStatus, DriverError, Op, StreamId};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys;
use std::mem::MaybeUninit;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

impl CudaDriver {
    /// Begins capturing `stream` into a graph in `mode` (`cuStreamBeginCapture`) and returns the capture's
    /// id (`cuStreamGetCaptureInfo`). For tests: cuvmm itself never captures. Not counted. Refused with
    /// [`DriverError::CaptureMisuse`] on the legacy default stream and on a stream already capturing.
    pub fn begin_capture(
        &mut self,
        stream: StreamId,
        mode: CaptureMode,
    ) -> Result<u64, DriverError> {
        let raw = self.stream(Op::CaptureInfo, stream)?;
        let began = self.calls.call(Op::CaptureInfo, 0, || {
            // SAFETY: the stream is one of CUDA's default streams, a stand-in this driver created, or the
            // caller's, whose `StreamId` contract is that it is alive (point 1); CUDA refuses the legacy one.
            unsafe { stream_begin_capture(raw_stream(raw), mode) }?;
            // SAFETY: as above (point 1).
            unsafe { stream_capture_info(raw_stream(raw)) }.map(|(_, id)| id)
        });
        began.map_err(|e| errors::on_capture(e, stream, false))
    }

    /// Ends the capture of `stream` (`cuStreamEndCapture`) and destroys the graph it made. For tests. Not
    /// counted. [`DriverError::CaptureInvalidated`] if a call CUDA refused invalidated the capture (the
    /// stream has stopped capturing either way), [`DriverError::CaptureMisuse`] if it was not capturing.
    pub fn end_capture(&mut self, stream: StreamId) -> Result<(), DriverError> {
        let raw = self.stream(Op::CaptureInfo, stream)?;
        let ended = self.calls.call(Op::CaptureInfo, 0, || {
            // SAFETY: the stream is one of CUDA's default streams, a stand-in this driver created, or the
            // caller's, whose `StreamId` contract is that it is alive (point 1).
            let graph = unsafe { stream_end_capture(raw_stream(raw)) }?;
            // SAFETY: the graph was just made by the capture's end and nothing else holds it (points 1-2).
            unsafe { graph_destroy(graph) }
        });
        ended.map_err(|e| errors::on_capture(e, stream, true))
    }

    /// [`Driver::capture_status`](crate::driver::Driver::capture_status), not counted (the caller counts it).
    pub(super) fn capture_info(&mut self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
        let raw = self.stream(Op::CaptureInfo, stream)?;
        let info = self.calls.call(Op::CaptureInfo, 0, || {
            // SAFETY: the stream is one of CUDA's default streams, a stand-in this driver created, or the
            // caller's, whose `StreamId` contract is that it is alive (point 1).
            unsafe { stream_capture_info(raw_stream(raw)) }
        });
        Ok(capture_status_of(
            info.map_err(|e| errors::on_stream(e, stream))?,
        ))
    }

    /// A [`CaptureProbe`], or `None` with stand-in streams. A stream the program made is asked directly,
    /// with no context made current, unless the driver once refused that; a default stream (whose meaning
    /// depends on the current context), or any stream after such a refusal, is asked with the device's
    /// context made current and the thread's own given back. It holds the context weakly: once the driver
    /// is dropped, such a call answers [`DriverError::NoDriver`].
    pub(super) fn probe(&self) -> Option<CaptureProbe> {
        if self.streams.creates() {
            return None;
        }
        let context = Arc::downgrade(&self.calls.ctx);
        // Whether a stream the program made may be asked without making the context current: until the
        // driver refuses such a call that succeeds with the context current.
        let direct = Arc::new(AtomicBool::new(true));
        Some(CaptureProbe::new(move |stream| {
            // The hot path (every request a stream cache could serve): a stream the program made names its
            // context, so the query needs none current, and touches nothing other threads write (not even
            // the context's reference count, which upgrading `context` would).
            let made = stream.0 > StreamId::PER_THREAD.0;
            if made && direct.load(Ordering::Relaxed) {
                // SAFETY: the stream is the caller's, whose `StreamId` contract is that it is alive (point 1),
                // and so is the context that owns it; a driver that wants that context current fails the
                // call, which is then made again below with it current.
                if let Ok(info) = unsafe { stream_capture_info(raw_stream(stream.0)) } {
                    return Ok(capture_status_of(info));
                }
            }
            // The context is held only inside: should this be its last holder (the driver dropped meanwhile),
            // cudarc's release makes it current, and the thread gets its own back.
            let info = keeping_current_context(|| {
                let ctx = context.upgrade()?;
                let info = ctx.bind_to_thread().and_then(|()| {
                    // SAFETY: the stream is the caller's, whose `StreamId` contract is that it is alive
                    // (point 1), or one of CUDA's default streams; the context that owns it is current.
                    unsafe { stream_capture_info(raw_stream(stream.0)) }
                });
                Some(info)
            });
            let Some(info) = info else {
                return Err(DriverError::NoDriver {
                    reason: "the CUDA driver the capture probe asks was dropped".to_string(),
                });
            };
            if made && info.is_ok() && direct.swap(false, Ordering::Relaxed) {
                tracing::debug!(
                    "cuvmm: CUDA answers capture queries only with the context current"
                );
            }
            let info = info.map_err(|e| errors::on_stream(cuda_error(Op::CaptureInfo, &e), stream));
            Ok(capture_status_of(info?))
        }))
    }
}

/// A capture status from what `cuStreamGetCaptureInfo` answered.
fn capture_status_of((status, id): (sys::CUstreamCaptureStatus, u64)) -> CaptureStatus {
    use sys::CUstreamCaptureStatus as Status;
    match status {
        Status::CU_STREAM_CAPTURE_STATUS_NONE => CaptureStatus::None,
        Status::CU_STREAM_CAPTURE_STATUS_ACTIVE => CaptureStatus::Active { id, mode: None },
        Status::CU_STREAM_CAPTURE_STATUS_INVALIDATED => CaptureStatus::Invalidated { id },
    }
}

/// Whether `stream` is being captured into a graph, and the capture's id (meaningful when capturing).
///
/// See [cuStreamGetCaptureInfo() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
///
/// # Safety
/// 1. `stream` is null, `CU_STREAM_LEGACY`, `CU_STREAM_PER_THREAD`, or a stream that is alive.
unsafe fn stream_capture_info(
    stream: sys::CUstream,
) -> Result<(sys::CUstreamCaptureStatus, u64), CuError> {
    let mut status = MaybeUninit::uninit();
    let mut id = MaybeUninit::uninit();
    // SAFETY: the stream is alive (point 1); `status` and `id` are valid for the call and the driver writes
    // both before returning success; the graph, dependencies and count outputs are optional and left null.
    unsafe {
        sys::cuStreamGetCaptureInfo_v2(
            stream,
            status.as_mut_ptr(),
            id.as_mut_ptr(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
        )
        .result()?;
        Ok((status.assume_init(), id.assume_init()))
    }
}

/// Begins capturing `stream` into a new graph, in `mode`.
///
/// See [cuStreamBeginCapture() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
///
/// # Safety
/// 1. `stream` is `CU_STREAM_PER_THREAD` or a stream that is alive.
unsafe fn stream_begin_capture(stream: sys::CUstream, mode: CaptureMode) -> Result<(), CuError> {
    let mode = match mode {
        CaptureMode::Global => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL,
        CaptureMode::ThreadLocal => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        CaptureMode::Relaxed => sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_RELAXED,
    };
    // SAFETY: the stream is alive (point 1); the driver refuses the legacy stream itself.
    unsafe { sys::cuStreamBeginCapture_v2(stream, mode).result() }
}

/// Ends the capture of `stream` and returns its graph, which the caller must destroy.
///
/// See [cuStreamEndCapture() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__STREAM.html)
///
/// # Safety
/// 1. `stream` is `CU_STREAM_PER_THREAD` or a stream that is alive.
unsafe fn stream_end_capture(stream: sys::CUstream) -> Result<sys::CUgraph, CuError> {
    let mut graph = MaybeUninit::uninit();
    // SAFETY: the stream is alive (point 1); `graph` is valid for the call and written before success.
    unsafe {
        sys::cuStreamEndCapture(stream, graph.as_mut_ptr()).result()?;
        Ok(graph.assume_init())
    }
}

/// Destroys a graph from [`stream_end_capture`].
///
/// See [cuGraphDestroy() docs](https://docs.nvidia.com/cuda/cuda-driver-api/group__CUDA__GRAPH.html)
///
/// # Safety
/// 1. `graph` was returned by [`stream_end_capture`] and has not been destroyed.
/// 2. No one will use `graph` afterwards.
unsafe fn graph_destroy(graph: sys::CUgraph) -> Result<(), CuError> {
    // SAFETY: the graph is alive and not used again (points 1-2).
    unsafe { sys::cuGraphDestroy(graph).result() }
}
