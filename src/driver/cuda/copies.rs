//! Copy jobs on a GPU ([`Driver::start_copies`](crate::driver::Driver::start_copies)): asynchronous copies
//! on a stream the driver owns, into and out of page-locked host memory, run without the driver.
//!
//! - **The copy stream** is created on the first job (non-blocking: it waits for no other stream, since a
//!   sleep has waited for the tag's streams already) and destroyed with the last job or memory that needs
//!   it, after the driver ([`CopyStream`] is shared).
//! - **Host memory** is pinned piece by piece as the job reaches it, by the plan's threads
//!   ([`HostPinning`]) working ahead of the copies, so that pinning (the host faulting in and locking pages,
//!   slower than the link) overlaps the copies already queued and runs on several cores. Each piece is
//!   registered ordinary memory or `cuMemHostAlloc`'s, as the plan says (`host.rs`). Where pinning fails, a
//!   piece is ordinary memory (CUDA then copies synchronously, through its staging).
//! - **Waiting**: an event recorded after the last copy, then `cuEventSynchronize`; if the event cannot be
//!   recorded, `cuStreamSynchronize` of the copy stream. Host memory a copy may still touch waits for the
//!   stream itself before it is read, written or freed (`host.rs`), whatever happens to the job.
//! - **The device ranges** were checked against the ledger when the job started and stay guarded until it
//!   is over: the driver refuses to unmap them ([`DriverError::UnmapWhileInUse`]).
//! - **Counters**: each step is counted, with its time, in counters shared with the driver.

use super::calls::{cuda_error, keeping_current_context};
use super::copy_stream::CopyStream;
use super::errors;
use super::host::Pinned;
use super::result;
use crate::driver::{
    CopyDirection, CopyRun, DriverCounters, DriverError, HostCopy, HostMemory, HostPinning, Op,
};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::{CudaContext, sys};
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{Receiver, channel};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Instant;

/// Calls and time of copy jobs, shared with the driver, which adds them to its counters.
#[derive(Debug, Default)]
pub(super) struct JobCounters(Mutex<DriverCounters>);

impl JobCounters {
    fn record(&self, op: Op, since: Instant) {
        let ns = since.elapsed().as_nanos().min(u64::MAX as u128) as u64;
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .record(op, ns);
    }

    /// The calls counted so far.
    pub(super) fn get(&self) -> DriverCounters {
        *self.0.lock().unwrap_or_else(PoisonError::into_inner)
    }
}

/// A job's flag, set once it is over, and its device ranges `(address, bytes)`.
type GuardedJob = (Arc<AtomicBool>, Vec<(u64, u64)>);

/// The device ranges of jobs not over yet, guarded from `unmap`.
#[derive(Debug, Default)]
pub(super) struct Guarded(Vec<GuardedJob>);

impl Guarded {
    /// Guards `ranges` until the returned flag is set.
    pub(super) fn add(&mut self, ranges: Vec<(u64, u64)>) -> Arc<AtomicBool> {
        let over = Arc::new(AtomicBool::new(false));
        self.0.push((Arc::clone(&over), ranges));
        over
    }

    /// The first address of `va .. va + size` a job not over yet copies, forgetting the jobs over.
    pub(super) fn user_of(&mut self, va: u64, size: u64) -> Option<u64> {
        if self.0.is_empty() {
            return None;
        }
        self.0.retain(|(over, _)| !over.load(Ordering::Acquire));
        let end = va.saturating_add(size);
        (self.0.iter().flat_map(|(_, ranges)| ranges))
            .filter(|&&(start, len)| start < end && va < start + len)
            .map(|&(start, _)| start.max(va))
            .min()
    }
}

/// Host pieces pinned ahead of the copies, by up to the plan's threads.
struct Pinning {
    /// The lengths to pin, in the order the job asks for them.
    lens: Vec<usize>,
    /// How, and by how many threads.
    how: HostPinning,
    /// The next one the job asks for.
    next: usize,
    results: Option<Receiver<(usize, Result<Pinned, CuError>)>>,
    arrived: HashMap<usize, Result<Pinned, CuError>>,
    stop: Arc<AtomicBool>,
    threads: Vec<JoinHandle<()>>,
}

impl Pinning {
    fn new(lens: Vec<usize>, how: HostPinning) -> Self {
        Self {
            lens,
            how,
            next: 0,
            results: None,
            arrived: HashMap::new(),
            stop: Arc::new(AtomicBool::new(false)),
            threads: Vec::new(),
        }
    }

    /// The next piece, pinned (or the error pinning it met). The threads start at the first call.
    fn take(&mut self, ctx: &Arc<CudaContext>) -> Result<Pinned, CuError> {
        let i = self.next;
        self.next += 1;
        if self.results.is_none() {
            self.start(ctx);
        }
        loop {
            if let Some(piece) = self.arrived.remove(&i) {
                return piece;
            }
            let received = self.results.as_ref().and_then(|r| r.recv().ok());
            match received {
                Some((at, piece)) => {
                    self.arrived.insert(at, piece);
                }
                // The threads ended without it: pin it here.
                None => return Pinned::pin(ctx, self.lens[i], self.how),
            }
        }
    }

    fn start(&mut self, ctx: &Arc<CudaContext>) {
        let (send, receive) = channel();
        self.results = Some(receive);
        let threads = self.how.threads.clamp(1, self.lens.len().max(1));
        for t in 0..threads {
            let (send, stop, ctx, how) = (
                send.clone(),
                Arc::clone(&self.stop),
                Arc::clone(ctx),
                self.how,
            );
            let mine: Vec<(usize, usize)> = (self.lens.iter().copied().enumerate())
                .skip(t)
                .step_by(threads)
                .collect();
            let spawned = std::thread::Builder::new()
                .name("cuvmm-pin".into())
                .spawn(move || {
                    for (i, len) in mine {
                        if stop.load(Ordering::Relaxed) {
                            break;
                        }
                        if send.send((i, Pinned::pin(&ctx, len, how))).is_err() {
                            break;
                        }
                    }
                });
            match spawned {
                Ok(handle) => self.threads.push(handle),
                Err(err) => tracing::warn!(%err, "cuvmm: no thread to pin host memory ahead"),
            }
        }
    }
}

impl Drop for Pinning {
    /// Stops the threads; what they pinned and the job did not take is freed.
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        drop(self.results.take());
        for handle in self.threads.drain(..) {
            if handle.join().is_err() {
                tracing::error!("cuvmm: a thread pinning host memory panicked");
            }
        }
    }
}

/// A job's side on a GPU.
pub(super) struct CudaCopies {
    ctx: Arc<CudaContext>,
    stream: Arc<CopyStream>,
    pinning: Pinning,
    event: Option<usize>,
    counters: Arc<JobCounters>,
    over: Arc<AtomicBool>,
}

impl CudaCopies {
    /// A job on `stream` that pins pieces of `lens` (in the order it asks for them) as `how` says,
    /// counting in `counters`, whose device ranges stay guarded until it sets `over`.
    pub(super) fn new(
        ctx: &Arc<CudaContext>,
        stream: Arc<CopyStream>,
        lens: Vec<usize>,
        how: HostPinning,
        counters: Arc<JobCounters>,
        over: Arc<AtomicBool>,
    ) -> Self {
        Self {
            ctx: Arc::clone(ctx),
            stream,
            pinning: Pinning::new(lens, how),
            event: None,
            counters,
            over,
        }
    }

    /// Runs `f` in the context, counting it as a call of `op`.
    fn call<T>(&self, op: Op, f: impl FnOnce() -> Result<T, CuError>) -> Result<T, DriverError> {
        let began = Instant::now();
        let outcome = keeping_current_context(|| {
            self.ctx.bind_to_thread()?;
            f()
        });
        self.counters.record(op, began);
        outcome.map_err(|e| cuda_error(op, &e))
    }

    fn destroy_event(&mut self) {
        if let Some(event) = self.event.take() {
            let destroyed = self.call(Op::DestroyEvent, || {
                // SAFETY: the event was created by `record` and is destroyed once, here; the wait before it
                // is over (points 1-2).
                unsafe { result::event_destroy(event as sys::CUevent) }
            });
            if let Err(err) = destroyed {
                tracing::error!(%err, "cuvmm: destroying a copy job's event failed");
            }
        }
    }
}

impl CopyRun for CudaCopies {
    /// Page-locked memory, pinned ahead by the job's threads; ordinary memory where pinning failed.
    fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError> {
        let began = Instant::now();
        let pinned = self.pinning.take(&self.ctx);
        self.counters.record(Op::HostAlloc, began);
        match pinned {
            Ok(pinned) => Ok(HostMemory::new(pinned)),
            Err(e) => {
                let (code, name) = errors::code_and_name(&e);
                tracing::warn!(code, %name, len, "cuvmm: cuMemHostAlloc failed; copying through pageable memory");
                let len = usize::try_from(len)
                    .map_err(|_| DriverError::HostOutOfMemory { bytes: len })?;
                HostMemory::pageable(len)
            }
        }
    }

    fn copy(
        &mut self,
        copy: &HostCopy,
        direction: CopyDirection,
        host: &mut HostMemory,
    ) -> Result<(), DriverError> {
        let op = direction.op();
        let bad = DriverError::CopyPlan {
            reason: "a copy lies outside its host piece",
        };
        let start = usize::try_from(copy.offset).map_err(|_| bad.clone())?;
        let len = usize::try_from(copy.len).map_err(|_| bad.clone())?;
        let range = start..start.checked_add(len).ok_or(bad.clone())?;
        let storage = host.storage_mut();
        let writes = direction == CopyDirection::ToHost;
        let ptr = match storage.as_any_mut().downcast_mut::<Pinned>() {
            Some(pinned) => pinned.dma(range.clone(), &self.stream).ok_or(bad)?,
            None => (storage.bytes_mut().get_mut(range.clone()))
                .ok_or(bad)?
                .as_mut_ptr(),
        };
        let stream = self.stream.raw();
        let enqueued = self.call(op, || match direction {
            // SAFETY: the device range was checked mapped with access when the job started and the driver
            // refuses to unmap it until the job is over (point 1); the host range lies inside the piece,
            // which is page-locked memory whose every access and drop wait for this stream, or pageable
            // memory CUDA copies into before returning (point 2); the stream is the driver's, alive while
            // this job holds it (point 3).
            CopyDirection::ToHost => unsafe {
                result::memcpy_dtoh_async(ptr, copy.va, len, stream)
            },
            // SAFETY: as above; from pageable memory CUDA stages the bytes before returning.
            CopyDirection::FromHost => unsafe {
                result::memcpy_htod_async(copy.va, ptr, len, stream)
            },
        });
        // Written only by a copy enqueued: a refused one leaves the bytes as they were.
        if enqueued.is_ok()
            && writes
            && let Some(pinned) = host.storage_mut().as_any_mut().downcast_mut::<Pinned>()
        {
            pinned.writing(range);
        }
        enqueued
    }

    fn done(&mut self, host: &mut HostMemory) {
        if let Some(pinned) = host.storage_mut().as_any_mut().downcast_mut::<Pinned>() {
            pinned.copies_done();
        }
    }

    fn record(&mut self) -> Result<(), DriverError> {
        let stream = self.stream.raw();
        let event = self.call(Op::RecordEvent, || {
            let event = result::event_create()?;
            // SAFETY: the event was just created (point 1); the stream is the driver's, alive (point 2).
            match unsafe { result::event_record(event, stream) } {
                Ok(()) => Ok(event),
                Err(e) => {
                    // SAFETY: the event was created above and nothing else knows it (points 1-2).
                    if let Err(destroyed) = unsafe { result::event_destroy(event) } {
                        let (code, name) = errors::code_and_name(&destroyed);
                        tracing::error!(code, %name, "cuvmm: destroying an event not recorded failed");
                    }
                    Err(e)
                }
            }
        })?;
        self.event = Some(event as usize);
        Ok(())
    }

    fn wait(&mut self, recorded: bool) -> Result<(), DriverError> {
        let waited = match (recorded, self.event) {
            (true, Some(event)) => self.call(Op::Synchronize, || {
                // SAFETY: the event was created and recorded by `record` and is not destroyed yet (point 1).
                unsafe { result::event_synchronize(event as sys::CUevent) }
            }),
            _ => self.call(Op::Synchronize, || self.stream.synchronize()),
        };
        self.destroy_event();
        waited
    }

    fn finish(&mut self) {
        self.over.store(true, Ordering::Release);
    }
}

impl Drop for CudaCopies {
    fn drop(&mut self) {
        self.destroy_event();
        self.over.store(true, Ordering::Release);
    }
}
