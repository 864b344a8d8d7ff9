//! Asking whether a stream is being captured from any thread, without the driver: what the facade's stream
//! caches need, since they serve requests without the strategy's lock (and so without its driver).

use super::error::DriverError;
use super::types::{CaptureStatus, StreamId};
use std::fmt;
use std::sync::Arc;

/// `cuStreamGetCaptureInfo` as a shareable function: whether a stream is being captured into a CUDA graph,
/// asked from any thread while another holds the driver. [`Driver::capture_probe`](super::Driver::capture_probe)
/// gives one. Not counted among the driver's calls.
#[derive(Clone)]
pub struct CaptureProbe(Arc<dyn Fn(StreamId) -> Result<CaptureStatus, DriverError> + Send + Sync>);

impl CaptureProbe {
    /// A probe that answers with `status`.
    pub fn new(
        status: impl Fn(StreamId) -> Result<CaptureStatus, DriverError> + Send + Sync + 'static,
    ) -> Self {
        Self(Arc::new(status))
    }

    /// Whether `stream` is being captured, and by which capture.
    pub fn status(&self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
        (self.0)(stream)
    }
}

impl fmt::Debug for CaptureProbe {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CaptureProbe")
    }
}
