//! Which CUDA stream a [`StreamId`] names on a `CudaDriver`.
//!
//! - **The caller's** (the default). A `StreamId` is the caller's raw `CUstream` value
//!   ([`StreamId::from_cuda`], [`StreamId::from_raw`]): events are recorded on that stream and that stream
//!   is synchronized, so "wait before unmapping" and stream-ordered reuse wait for the work that really uses
//!   the memory. `0` is the legacy default stream (the null stream), `1` is `CU_STREAM_LEGACY` (the same
//!   stream) and `2` is `CU_STREAM_PER_THREAD`, the calling thread's per-thread default stream, as CUDA
//!   defines them. The driver creates no stream.
//! - **Stand-ins**, for replaying a recorded trace (the CLI's `--backend cuda`): a trace's stream numbers
//!   are names from another process, not streams of this one, so each non-zero number gets a non-blocking
//!   stream this driver creates on first use and destroys on drop; `0` is the legacy default stream.

use cudarc::driver::DriverError as CuError;
use cudarc::driver::{CudaContext, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

use crate::driver::StreamId;

/// How a `CudaDriver` maps stream ids to CUDA streams.
#[derive(Debug)]
pub(super) enum Streams {
    /// A `StreamId` is the caller's `CUstream`.
    Caller,
    /// A `StreamId` names a stream this driver creates.
    StandIn {
        /// The context the stand-ins are created in.
        ctx: Arc<CudaContext>,
        /// The stand-ins created so far.
        created: HashMap<StreamId, Arc<CudaStream>>,
    },
}

impl Streams {
    /// Whether `resolve` may create a stream, and so must run as a driver call in the device's context.
    pub(super) fn creates(&self) -> bool {
        matches!(self, Streams::StandIn { .. })
    }

    /// The raw `CUstream` value that `id` names. With stand-ins, creates the stream on first use; the
    /// device's context must then be current.
    pub(super) fn resolve(&mut self, id: StreamId) -> Result<u64, CuError> {
        match self {
            Streams::Caller => Ok(id.0),
            Streams::StandIn { .. } if id == StreamId::DEFAULT => Ok(0),
            Streams::StandIn { ctx, created } => {
                if let Some(stream) = created.get(&id) {
                    return Ok(stream.cu_stream() as usize as u64);
                }
                let stream = ctx.new_stream()?;
                let raw = stream.cu_stream() as usize as u64;
                created.insert(id, stream);
                Ok(raw)
            }
        }
    }

    /// Destroys the stand-ins (cudarc records a failure in the context, where the driver collects it).
    /// The device's context must be current.
    pub(super) fn clear(&mut self) {
        if let Streams::StandIn { created, .. } = self {
            created.clear();
        }
    }
}
