//! [`Calls`]: the way every `CudaDriver` operation reaches the driver. It enters the device's primary
//! context for the call and gives the calling thread back the context it had, measures the call, counts the
//! operation, and turns a `CUresult` into a [`DriverError`].

use super::errors;
use super::give_back::GiveBackCalls;
use super::ledger::EventCalls;
use super::result;
use crate::driver::{DriverCounters, DriverError, Op};
use cudarc::driver::CudaContext;
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys;
use std::mem::ManuallyDrop;
use std::sync::Arc;
use std::time::Instant;

/// The context, the counters and the errors found outside any call.
#[derive(Debug)]
pub(super) struct Calls {
    /// The device's primary context. Dropped by `CudaDriver`'s drop itself ([`Calls::drop_context`]),
    /// so that the thread's context can be given back after cudarc's drop of it has bound it.
    pub(super) ctx: ManuallyDrop<Arc<CudaContext>>,
    pub(super) counters: DriverCounters,
    /// Nanoseconds spent in driver calls by the operation being counted.
    pub(super) spent_ns: u64,
    /// Errors found where no call could return them: recorded by cudarc in the context (a stand-in stream
    /// dropped), or from giving the calling thread its context back.
    pub(super) deferred: Vec<DriverError>,
    /// Whether to collect the errors cudarc records in `ctx`: only while this driver owns cudarc objects
    /// that record there (stand-in streams). Otherwise they belong to the program's own cudarc objects,
    /// which may share the context, and cudarc returns them at the program's next call.
    pub(super) harvests: bool,
}

/// The context the calling thread had before [`Calls::enter`], to give back in [`Calls::leave`]. `None`
/// when the device's context was already current, so nothing changed.
pub(super) struct Entered(Option<sys::CUcontext>);

impl Calls {
    pub(super) fn new(ctx: Arc<CudaContext>) -> Self {
        Self {
            ctx: ManuallyDrop::new(ctx),
            counters: DriverCounters::default(),
            spent_ns: 0,
            deferred: Vec::new(),
            harvests: false,
        }
    }

    /// Makes the device's context current on this thread, remembering the one it replaces.
    pub(super) fn enter(&mut self) -> Result<Entered, CuError> {
        self.harvest("outside a call");
        let current = result::ctx_get_current()?;
        if current == self.ctx.cu_ctx() {
            return Ok(Entered(None));
        }
        // SAFETY: the context is the device's primary context, retained by `self.ctx` for as long as this
        // driver lives (point 1); `leave` makes the caller's context current again before the call returns.
        unsafe { result::ctx_set_current(self.ctx.cu_ctx()) }?;
        Ok(Entered(Some(current)))
    }

    /// Gives the calling thread back the context it had before [`enter`](Self::enter). A failure is logged
    /// and kept for [`take_deferred_errors`](super::CudaDriver::take_deferred_errors): the call itself
    /// already took effect.
    pub(super) fn leave(&mut self, entered: Entered) {
        let Entered(Some(previous)) = entered else {
            return;
        };
        // SAFETY: `previous` was this thread's current context when the call began (or null); no call of
        // this driver destroys a context, and the thread's owner keeps its context alive while it is
        // current (point 1).
        if let Err(e) = unsafe { result::ctx_set_current(previous) } {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, "cuvmm: could not give the calling thread its CUDA context back");
            self.deferred.push(DriverError::CudaSetup {
                call: "cuCtxSetCurrent",
                code,
                name,
            });
        }
    }

    /// Drops this driver's reference to the context (the last one releases the primary context, and cudarc
    /// binds it to the thread first), then gives the thread back the context it had before `entered`.
    ///
    /// # Safety
    /// 1. Called once, from the driver's drop, after every other use of `ctx`: nothing uses it afterwards.
    pub(super) unsafe fn drop_context(&mut self, entered: Entered) {
        // SAFETY: the caller guarantees this is the last use of `ctx` (point 1), and `Calls` has no drop of
        // its own, so the `Arc` is dropped exactly once.
        unsafe { ManuallyDrop::drop(&mut self.ctx) };
        // With `Entered(None)` the thread had this context current, and cudarc's drop binds that same one.
        self.leave(entered);
    }

    /// Moves an error cudarc recorded in the context into `deferred`, logging it. cudarc records errors
    /// only from its `Drop` implementations: here, a stand-in stream's.
    pub(super) fn harvest(&mut self, during: &str) {
        if !self.harvests {
            return;
        }
        if let Err(e) = self.ctx.check_err() {
            let (code, name) = errors::code_and_name(&e);
            tracing::error!(code, %name, "cuvmm: CUDA error recorded by cudarc {during}");
            self.deferred.push(DriverError::CudaSetup {
                call: "cudarc drop",
                code,
                name,
            });
        }
    }

    /// Runs `f` (driver calls) in the device's context, adding its time to the operation's. An error
    /// becomes [`DriverError::OutOfMemory`], [`DriverError::VaExhausted`] or [`DriverError::Cuda`] for `op`.
    pub(super) fn call<T>(
        &mut self,
        op: Op,
        requested: u64,
        f: impl FnOnce() -> Result<T, CuError>,
    ) -> Result<T, DriverError> {
        let entered = self.enter().map_err(|e| cuda_error(op, &e))?;
        let start = Instant::now();
        let outcome = f();
        self.spent_ns = self.spent_ns.saturating_add(elapsed_ns(start));
        let outcome = outcome.map_err(|e| self.failure(op, requested, &e));
        self.leave(entered);
        outcome
    }

    /// The error for a failed call of `op` asking for `requested` bytes. Runs in the device's context.
    fn failure(&mut self, op: Op, requested: u64, err: &CuError) -> DriverError {
        if !errors::is_out_of_memory(err) {
            return cuda_error(op, err);
        }
        if op == Op::Reserve {
            return DriverError::VaExhausted { op, requested };
        }
        let start = Instant::now();
        let info = result::mem_get_info();
        self.counters.record(Op::MemInfo, elapsed_ns(start));
        DriverError::OutOfMemory {
            op,
            requested,
            free: info.map_or(0, |(free, _)| free as u64),
        }
    }
}

/// The raw event calls, each in the device's context: what the ledger's event operations are made of.
impl EventCalls for Calls {
    fn create(&mut self) -> Result<u64, DriverError> {
        self.call(Op::RecordEvent, 0, result::event_create)
            .map(|event| event as usize as u64)
    }

    fn record(&mut self, event: u64, stream: u64) -> Result<(), DriverError> {
        self.call(Op::RecordEvent, 0, || {
            // SAFETY: the ledger gives only events it created and has not destroyed (point 1); the stream is
            // one of CUDA's default streams, one this driver created, or the caller's, whose `StreamId`
            // contract is that it is alive (2).
            unsafe { result::event_record(raw_event(event), raw_stream(stream)) }
        })
    }

    fn query(&mut self, event: u64) -> Result<bool, DriverError> {
        self.call(Op::QueryEvent, 0, || {
            // SAFETY: the ledger gives only events it created and has not destroyed (point 1).
            unsafe { result::event_query(raw_event(event)) }
        })
    }

    fn destroy(&mut self, event: u64) -> Result<(), DriverError> {
        self.call(Op::DestroyEvent, 0, || {
            // SAFETY: the ledger gives only events it created and has not destroyed (point 1), and forgets
            // the event once this succeeds, so it is never used again (2).
            unsafe { result::event_destroy(raw_event(event)) }
        })
    }
}

/// The raw calls that give memory back or map it, each in the device's context. The ledger passes only
/// what it holds: a handle this driver created and has not seen released, a range inside one of its
/// reservations, one of its reservations with nothing mapped in it, one of its `malloc` pointers. After a
/// failure it keeps a resource only while the driver has not said it is gone (`give_back.rs`).
impl GiveBackCalls for Calls {
    fn release(&mut self, handle: u64) -> Result<(), DriverError> {
        self.call(Op::Release, 0, || {
            // SAFETY: the ledger gives only a handle this driver created and has not seen released (point
            // 1), and forgets it once the call succeeds or the driver says it is gone (2).
            unsafe { result::release(handle) }
        })
    }

    fn map(&mut self, va: u64, size: u64, offset: u64, handle: u64) -> Result<(), DriverError> {
        self.call(Op::Map, size, || {
            // SAFETY: the ledger gives only a live handle (point 1) and a range inside one of this driver's
            // reservations (2).
            unsafe { result::map(va, bytes(size), bytes(offset), handle) }
        })
    }

    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.call(Op::Unmap, size, || {
            // SAFETY: the ledger gives only a range inside one of this driver's reservations (point 1).
            // Point 2 is the trait's contract with its caller (unmap only pages whose streams are done); a
            // caller that breaks it makes a kernel fault on the device, not host memory unsafe.
            unsafe { result::unmap(va, bytes(size)) }
        })
    }

    fn address_free(&mut self, start: u64, size: u64) -> Result<(), DriverError> {
        self.call(Op::FreeReservation, 0, || {
            // SAFETY: the ledger gives only a range that is exactly one of this driver's reservations
            // (point 1) with nothing mapped in it (2); the trait's caller gives it up with this call (3).
            unsafe { result::address_free(start, bytes(size)) }
        })
    }

    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        self.call(Op::Free, 0, || {
            // SAFETY: the ledger gives only a live pointer from `alloc` (point 1); the trait's caller gives
            // the memory up with this call (2).
            unsafe { result::free(ptr) }
        })
    }

    fn handle_live(&mut self, handle: u64) -> Result<bool, DriverError> {
        self.call(Op::Release, 0, || result::handle_live(handle))
    }

    fn mapped(&mut self, va: u64) -> Result<bool, DriverError> {
        self.call(Op::Unmap, 0, || result::pointer_mapped(va))
    }
}

/// Runs `f`, then gives the calling thread back the context it had before, whatever `f` left current.
/// For cuvmm code that calls cudarc's safe API (which makes its context current and leaves it so) on the
/// program's behalf, as `CudaBuffer`'s drop does. libcuda must be loaded: call it only where a cudarc
/// object exists.
pub fn keeping_current_context<T>(f: impl FnOnce() -> T) -> T {
    let before = result::ctx_get_current();
    let out = f();
    if let Ok(before) = before {
        if result::ctx_get_current().is_ok_and(|now| now != before) {
            // SAFETY: `before` was this thread's current context when `f` began (or null); cudarc's safe
            // calls destroy no context that is current on a thread, and the thread's owner keeps its
            // context alive while it is current (point 1).
            if let Err(e) = unsafe { result::ctx_set_current(before) } {
                let (code, name) = errors::code_and_name(&e);
                tracing::error!(code, %name, "cuvmm: could not give the calling thread its CUDA context back");
            }
        }
    }
    out
}

/// A `CUevent` kept as an integer in the ledger.
fn raw_event(event: u64) -> sys::CUevent {
    event as usize as sys::CUevent
}

/// A `CUstream` from its integer value (a [`StreamId`](crate::StreamId)'s).
pub(super) fn raw_stream(stream: u64) -> sys::CUstream {
    stream as usize as sys::CUstream
}

/// A failed call of `op`.
pub(super) fn cuda_error(op: Op, err: &CuError) -> DriverError {
    let (code, name) = errors::code_and_name(err);
    DriverError::Cuda { op, code, name }
}

/// Nanoseconds since `start`.
pub(super) fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}

/// A byte count as the driver takes it. Sizes beyond `usize` (none on 64-bit hosts) saturate, and the
/// driver rejects them.
pub(super) fn bytes(size: u64) -> usize {
    usize::try_from(size).unwrap_or(usize::MAX)
}
