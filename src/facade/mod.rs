//! Layer 5, what a program holds: the thread-safe [`Allocator`](allocator::Allocator), buffers that free on
//! drop (and the per-thread handles they hold), the per-thread stream caches in front of the lock, and
//! `memory_summary()`.

pub mod allocator;
#[cfg(feature = "cuda")]
pub mod cuda_buffer;
pub(crate) mod device_buffer;
mod pools;
mod raw_book;
mod sharing;
mod stream_cache;
pub mod summary;
mod tags;
mod thread_handles;
