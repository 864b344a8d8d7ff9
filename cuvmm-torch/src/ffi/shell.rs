//! What every exported function is wrapped in: the body run under [`std::panic::catch_unwind`], a failure
//! recorded for `cuvmm_last_error` and logged, and the raw values C hands over read as typed ones.

use crate::error::{self, AbiError};
use std::ffi::{CString, c_char, c_void};
use std::panic::{self, AssertUnwindSafe};

/// Runs `body` for the exported function `operation`: clears this thread's last error, catches a panic,
/// records and logs a failure, and returns `on_error` then.
pub fn shell<T: Copy>(
    operation: &'static str,
    on_error: T,
    body: impl FnOnce() -> Result<T, AbiError>,
) -> T {
    let run = || {
        error::clear_last_error();
        let outcome = panic::catch_unwind(AssertUnwindSafe(body)).unwrap_or_else(|payload| {
            Err(AbiError::Panic {
                message: panic_message(payload.as_ref()),
            })
        });
        outcome.unwrap_or_else(|e| {
            error::record(operation, &e);
            on_error
        })
    };
    // Recording the error formats and logs; a panic there (a host's tracing subscriber, say) stops here too.
    panic::catch_unwind(AssertUnwindSafe(run)).unwrap_or(on_error)
}

fn panic_message(payload: &(dyn std::any::Any + Send)) -> String {
    payload
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| payload.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic with no message".to_string())
}

/// A C string handed to the caller, who frees it with `cuvmm_string_free`.
pub fn to_c(text: String) -> Result<*mut c_char, AbiError> {
    Ok(CString::new(text)?.into_raw())
}

/// The address a pointer from C holds.
pub fn address(ptr: *mut c_void) -> u64 {
    ptr.expose_provenance() as u64
}

/// The stream a `cudaStream_t` from C names.
pub fn stream_id(stream: *mut c_void) -> u64 {
    stream.expose_provenance() as u64
}
