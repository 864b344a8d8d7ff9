//! The expandable-segment allocator (in progress).
