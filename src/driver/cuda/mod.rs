//! The real CUDA backend: [`CudaDriver`] implements [`Driver`](super::Driver) on a GPU through cudarc.
//!
//! This module is the only code in cuvmm that touches `cudarc::driver::sys`, and the only code allowed
//! `unsafe`. It has cudarc's three layers (`result.rs`, the ledger and calls, the safe `driver.rs`):
//! - `result.rs`: one function per driver call, returning `Result`; a function is `unsafe` when a wrong
//!   argument could break someone else's memory, with a numbered `# Safety` list and a link to NVIDIA's
//!   documentation;
//! - `errors.rs`: what a CUDA error means (its code and name; the errors that name a stream, an event or a
//!   capture, as the `DriverError` that says so);
//! - `ledger.rs`: what this driver holds (reservations, handles, mappings, `malloc`s, events), so that each
//!   safety condition is checked before an `unsafe` call, and so that drop can give everything back;
//! - `give_back.rs`: how the ledger gives memory back and maps it, and settles a failure: a resource the
//!   driver no longer knows is forgotten and reported gone, as the `Driver` contract asks;
//! - `calls.rs`: how every call reaches the driver: in the device's primary context, given back to the
//!   calling thread's own context afterwards, measured, counted, its `CUresult` turned into a `DriverError`;
//! - `streams.rs`: which CUDA stream a `StreamId` names (the caller's, or a replay's stand-ins);
//! - `host.rs`, `host_pages.rs` and `copies.rs`: page-locked host memory (registered, or
//!   `cuMemHostAlloc`'s), and copy jobs on the driver's own copy stream (a tag's sleep and wake), which run
//!   without the driver;
//! - `open.rs`: opening a device (libcuda and its entry points, the device's virtual-memory support and
//!   granularities, the peers that may reach its memory);
//! - `driver.rs`: [`CudaDriver`], the safe type;
//! - `baseline.rs`: what cuvmm is measured against (cudarc's default allocation, cuMemAllocAsync on the
//!   device's default pool), as safe calls.
//!
//! cudarc is built with `dynamic-loading`: libcuda is opened at run time, and any `sys` call panics if it
//! cannot be. [`CudaDriver::new`] therefore checks `sys::is_culib_present()` and every entry point it
//! needs before the first call, and reports a missing library, an old driver or a missing device as
//! [`DriverError::NoDriver`](super::DriverError::NoDriver), never a panic.

#![allow(unsafe_code)]

mod baseline;
mod calls;
mod copies;
mod copy_stream;
mod driver;
mod errors;
mod give_back;
#[cfg(test)]
mod give_back_tests;
mod host;
mod host_pages;
mod ledger;
mod open;
mod result;
mod streams;

pub use baseline::{AsyncPool, cudarc_alloc};
pub use calls::keeping_current_context;
pub use driver::CudaDriver;
