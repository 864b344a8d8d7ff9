//! cuvmm as PyTorch's CUDA allocator.
//!
//! Built as `libcuvmm_torch.so` (`cargo build --release -p cuvmm-torch`), it exports the two functions that
//! `torch.cuda.memory.CUDAPluggableAllocator` loads, `cuvmm_malloc` and `cuvmm_free`, and what PyTorch's own
//! `memory_stats`, `memory_summary`, `empty_cache` and snapshots stop offering once a pluggable allocator
//! is in place (`cuvmm_torch.h` declares them all; `python/cuvmm_torch/` calls them with ctypes), and what the
//! C++ layer (`csrc/`, built against the user's PyTorch) needs to be PyTorch's whole CUDA allocator.
//!
//! - [`registry`]: one cuvmm [`Allocator`](cuvmm::Allocator) per device, built on first use from
//!   `CUVMM_ALLOC_CONF`, on the backend `CUVMM_BACKEND` names (`cuda`, or `sim`: no GPU needed).
//! - [`ops`]: each operation in safe Rust on typed values.
//! - [`pools`]: what PyTorch's `MemPool` and cudagraph trees ask of a pool (use counts, `use_on_oom`,
//!   `no_split`, checkpoints, one pool's `empty_cache`), and the pools with an allocator of their own.
//! - [`ffi`]: the exported shells; no panic crosses them, and a failure is recorded for `cuvmm_last_error`.
//! - [`sharing`]: sharing memory with other processes (PyTorch's IPC), in PyTorch's handle layout
//!   ([`torch_handle`]) where the memory allows, over `pidfd_getfd` or [`transport`]; [`export_table`]
//!   holds one export per range shared, while an allocation shared through it lives.
//! - [`foreign`]: pools with an allocator of their own (PyTorch's `MemPool(allocator=...)`), carved as
//!   PyTorch's caching allocator carves them.
//! - [`structs`]: the C structs of statistics, an out-of-memory diagnosis and a snapshot.
//! - [`error`]: the errors, and the per-thread last error.
//! - [`transport`]: an exporting process serves its exports' file descriptors on an abstract Unix socket;
//!   an importing process fetches them (`SCM_RIGHTS`), for PyTorch's IPC of CUDA tensors.

pub mod error;
pub mod export_table;
pub mod ffi;
pub mod foreign;
pub mod ops;
pub mod pools;
pub mod registry;
pub mod sharing;
pub mod structs;
pub mod torch_handle;
pub mod transport;

pub use error::{AbiError, InitError, last_error};
pub use registry::{Backend, Registry, Settings, install};
pub use transport::TransportError;
