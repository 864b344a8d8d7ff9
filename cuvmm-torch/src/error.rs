//! What a call through the C ABI can fail with, and the per-thread record that `cuvmm_last_error` reads.
//!
//! Every exported function clears this thread's record when it starts and sets it when it fails, so
//! `cuvmm_last_error()` describes the latest cuvmm call made on the calling thread (null if it succeeded),
//! and `cuvmm_last_oom()` gives the numbers of that error when it was out-of-memory.

use crate::structs::COomInfo;
use crate::transport::TransportError;
use cuvmm::ConfigError;
use cuvmm::driver::device::DeviceError;
use std::cell::{Cell, RefCell};
use std::ffi::CString;
use std::sync::Arc;

/// Why a device's allocator could not be built. Kept (cloned into every later call's error) because it is
/// built once: a bad `CUVMM_ALLOC_CONF` or a missing driver does not fix itself.
#[derive(Debug, Clone, thiserror::Error)]
pub enum InitError {
    /// An environment variable holds a value it does not accept.
    #[error("{var}={value:?}: expected {expected}")]
    BadEnv {
        /// The variable.
        var: &'static str,
        /// Its value.
        value: String,
        /// What it accepts.
        expected: &'static str,
    },
    /// `CUVMM_ALLOC_CONF` does not parse.
    #[error("CUVMM_ALLOC_CONF: {0}")]
    Config(#[from] ConfigError),
    /// The device could not be opened (no CUDA driver, no such device, a failed setup call).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// The allocator refused the device or the configuration.
    #[error(transparent)]
    Allocator(Arc<cuvmm::Error>),
}

/// An error of one call through the C ABI.
#[derive(Debug, thiserror::Error)]
pub enum AbiError {
    /// The library or the device's allocator could not be set up.
    #[error("cuvmm setup failed: {0}")]
    Init(#[from] InitError),
    /// A request of zero or a negative number of bytes.
    #[error("invalid size {size}: a request must be at least 1 byte")]
    BadSize {
        /// The size given.
        size: isize,
    },
    /// A device number that is negative or not below the number of devices.
    #[error("device {device} out of range: this process has {count} device(s)")]
    DeviceOutOfRange {
        /// The device given.
        device: i32,
        /// The number of devices the backend offers.
        count: usize,
    },
    /// A negative peer device number.
    #[error("invalid peer device {peer}")]
    BadPeer {
        /// The peer given.
        peer: i32,
    },
    /// A null pointer where a string was required.
    #[error("a null {what} was passed")]
    NullArgument {
        /// The argument.
        what: &'static str,
    },
    /// A segment from a pool's own allocator that overlaps one cuvmm already holds.
    #[error("the segment of {size} bytes at {ptr:#x} overlaps a segment already given to cuvmm")]
    SegmentOverlap {
        /// Its start.
        ptr: u64,
        /// Its size.
        size: u64,
    },
    /// A path that is not UTF-8.
    #[error("the path is not valid UTF-8")]
    PathNotUtf8,
    /// A tag that is not UTF-8.
    #[error("the tag is not valid UTF-8")]
    TagNotUtf8,
    /// The allocator refused the operation (out of memory, unknown address, double free, ...).
    #[error(transparent)]
    Allocator(#[from] cuvmm::Error),
    /// A request larger than the device ([`cuvmm::Error::TooLarge`]). PyTorch's allocators report it as
    /// out-of-memory, so the C ABI does, with the numbers of one ([`cuvmm_last_oom`](crate::ffi)).
    #[error("out of memory: {error}")]
    NeverFits {
        /// The allocator's error.
        error: cuvmm::Error,
        /// Its numbers, as an out-of-memory's.
        info: COomInfo,
    },
    /// Bytes given as a handle string of shared memory that are not one (`sharing.rs`).
    #[error("not a handle of cuvmm shared memory: {why}")]
    BadHandle {
        /// What is wrong with it.
        why: String,
    },
    /// The descriptors of shared memory could not be fetched from the exporting process.
    #[error(transparent)]
    Transport(#[from] TransportError),
    /// The snapshot could not be written.
    #[error(transparent)]
    Snapshot(#[from] cuvmm::snapshot::pickle::WriteError),
    /// The statistics could not be serialized.
    #[error("cannot serialize the statistics: {0}")]
    Json(#[from] serde_json::Error),
    /// A string to hand to C holds a NUL byte.
    #[error("the result holds a NUL byte")]
    Nul(#[from] std::ffi::NulError),
    /// cuvmm panicked: a bug, caught before it crossed the C boundary.
    #[error("internal error (panic): {message}")]
    Panic {
        /// The panic's message.
        message: String,
    },
}

impl AbiError {
    /// Whether this is what a caller may do routinely (PyTorch asks for 0 bytes for an empty tensor), logged
    /// at debug level rather than as a warning.
    pub fn is_routine(&self) -> bool {
        matches!(self, AbiError::BadSize { size: 0 })
    }

    /// The numbers of an out-of-memory failure, when this is one (a request larger than the device
    /// included, as PyTorch counts it).
    pub fn out_of_memory(&self) -> Option<COomInfo> {
        match self {
            AbiError::Allocator(cuvmm::Error::OutOfMemory(oom)) => Some(COomInfo::from(&**oom)),
            AbiError::NeverFits { info, .. } => Some(*info),
            _ => None,
        }
    }
}

thread_local! {
    static LAST_ERROR: RefCell<Option<CString>> = const { RefCell::new(None) };
    static LAST_OOM: Cell<Option<COomInfo>> = const { Cell::new(None) };
}

/// Forgets this thread's last error (at the start of every exported call).
pub fn clear_last_error() {
    LAST_ERROR.with(|last| last.borrow_mut().take());
    LAST_OOM.set(None);
}

/// Records `error` of `operation` as this thread's last error and logs it.
pub fn record(operation: &'static str, error: &AbiError) {
    let message = format!("{operation}: {error}");
    if error.is_routine() {
        tracing::debug!(%message, "cuvmm-torch");
    } else {
        tracing::warn!(%message, "cuvmm-torch");
    }
    // The message comes from Display impls; a NUL in it (say, from a path) is replaced, not lost.
    let text = CString::new(message.replace('\0', "\\0")).unwrap_or_default();
    LAST_ERROR.with(|last| *last.borrow_mut() = Some(text));
    LAST_OOM.set(error.out_of_memory());
}

/// The numbers of this thread's last error if it was out-of-memory; `None` if it succeeded or failed
/// otherwise.
pub fn last_oom() -> Option<COomInfo> {
    LAST_OOM.get()
}

/// This thread's last error: a pointer into thread-local storage, valid until the next cuvmm call on this
/// thread; null if the last call succeeded.
pub fn last_error_ptr() -> *const std::ffi::c_char {
    LAST_ERROR.with(|last| {
        last.borrow()
            .as_ref()
            .map_or(std::ptr::null(), |text| text.as_ptr())
    })
}

/// This thread's last error as text (for the Rust tests).
pub fn last_error() -> Option<String> {
    LAST_ERROR.with(|last| {
        last.borrow()
            .as_ref()
            .map(|text| text.to_string_lossy().into_owned())
    })
}
