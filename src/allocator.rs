//! The thread-safe facade (in progress).

/// Placeholder.
pub struct Allocator;
/// Placeholder.
pub struct DeviceBuffer;
