//! [`CudaDriver`]: the [`Driver`] trait on a real GPU.

use super::calls::{Calls, bytes, cuda_error, raw_stream};
use super::copies::{CudaCopies, Guarded, JobCounters};
use super::copy_stream::CopyStream;
use super::errors;
use super::host::Pinned;
use super::ledger::Ledger;
use super::open::{self, load_driver, peer_device, setup};
use super::result;
use super::streams::Streams;
use crate::driver::sim::LeakReport;
use crate::driver::{
    CaptureProbe, CaptureStatus, CopyJob, CopyPlan, Driver, DriverCounters, DriverError, EventId,
    HostMemory, MemInfo, Op, PhysHandle, PhysPage, StreamId, VaRange,
};
use cudarc::driver::CudaContext;
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys::{self, CUdevice};
use std::os::fd::{BorrowedFd, OwnedFd};
use std::sync::Arc;

mod capture;
mod sharing;

/// A CUDA device, driven through the virtual-memory API.
///
/// - **Context.** The device's primary context (`cuDevicePrimaryCtxRetain`, through cudarc's
///   [`CudaContext`]), the one the CUDA runtime, cudarc's `CudaContext::new` and PyTorch use, so memory
///   from this driver is usable by them. Every call makes it current for its own duration and gives the
///   calling thread back the context it had (`cuCtxGetCurrent` / `cuCtxSetCurrent`), so a multi-GPU
///   program's next call still goes to its own device; the driver may move between threads, and memory
///   allocated on one thread may be freed on another.
/// - **Streams.** By default a [`StreamId`] is the caller's raw `CUstream` ([`StreamId::from_cuda`],
///   [`StreamId::from_raw`]; `0`, [`StreamId::LEGACY`] and [`StreamId::PER_THREAD`] are CUDA's default
///   streams): events are recorded on it and it is synchronized, and the driver never creates a stream for
///   the caller's work. A stream given must belong to this device's primary context and stay alive while
///   the allocator may still name it ([`StreamId`] says how long); the allocator's drop names none (it
///   synchronizes the device, [`synchronize_device`](Driver::synchronize_device)).
///   Replays of recorded traces, whose stream numbers name no stream of this process, use
///   [`with_stand_in_streams`](CudaDriver::with_stand_in_streams) instead.
/// - **Granularity.** [`granularity`](Driver::granularity) is the *minimum* granularity
///   (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`): it is the rule the driver enforces on sizes and addresses, which
///   is what the trait promises. The recommended one is available from
///   [`recommended_granularity`](CudaDriver::recommended_granularity); on current NVIDIA GPUs both are 2 MiB.
/// - **Access.** [`set_access`](Driver::set_access) grants read-write access to the device itself and to
///   the peers given to [`with_peers`](CudaDriver::with_peers) or added since with
///   [`add_peer`](Driver::add_peer) (none by default), in one `cuMemSetAccess`.
/// - **Capture.** [`capture_status`](Driver::capture_status) is `cuStreamGetCaptureInfo` (the mode is
///   reported as `None`: CUDA does not say it). For the GPU tests, [`begin_capture`](CudaDriver::begin_capture)
///   and [`end_capture`](CudaDriver::end_capture) capture a stream and throw the graph away. A call on a
///   named stream that CUDA refuses during a capture is [`DriverError::CaptureUnsupported`] (or
///   [`DriverError::CaptureInvalidated`]); a refused event query, which names no stream, stays
///   [`DriverError::Cuda`] with `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`, and one of an event recorded
///   during a capture that has ended is [`DriverError::CapturedEvent`].
/// - **Events** are raw `CUevent`s without timing, kept in the ledger: an event is forgotten only once
///   `cuEventDestroy` succeeded (or answered that the event is gone), so no event is lost track of.
/// - **Failures** follow the [`Driver`] contract: a failed call had no effect, or the repeat reports the
///   resource gone. A failure of `release`, `unmap`, `free_reservation`, `free` or `map` is settled in the
///   ledger from CUDA's error and one side-effect-free query (`give_back.rs`): CUDA answering "invalid"
///   for a resource the ledger holds, or the query saying it is gone, makes the ledger forget it, and the
///   repeat is [`DriverError::UnknownHandle`], [`DriverError::NotMapped`],
///   [`DriverError::UnknownReservation`] or [`DriverError::UnknownPointer`].
/// - **What it checks itself.** A handle is passed to the driver only if this driver created it and did
///   not release it ([`DriverError::UnknownHandle`]); a range only if it lies inside one of its own
///   reservations ([`DriverError::OutsideReservation`]); a reservation is freed only if nothing is mapped
///   in it ([`DriverError::ReservationInUse`]); `free` only takes its own `malloc` pointers; an event only if
///   it recorded it and did not destroy it ([`DriverError::UnknownEvent`]); `map` maps a whole handle
///   ([`DriverError::SizeMismatch`], the trait's rule); bytes are touched only through mappings with access
///   set. Every other rule is CUDA's own, and its violation comes back as [`DriverError::Cuda`] with the
///   operation and the `CUresult`.
/// - **Sharing** (`driver/sharing.rs`). Where the device supports POSIX file descriptor handles (and
///   `CUVMM_IPC_HANDLES=0` does not turn them off), handles are created exportable, and
///   [`export_handle`](Driver::export_handle) / [`import_handle`](Driver::import_handle) are
///   `cuMemExportToShareableHandle` / `cuMemImportFromShareableHandle`. If `cuMemCreate` refuses the
///   exportable type (some containers), that create is made again without it and every later handle is
///   created so: [`exports_handles`](Driver::exports_handles) then says no and an export is
///   [`DriverError::Unsupported`]. An imported handle is held like a created one, with the size the caller
///   named. An import is always passed to CUDA, which refuses what it cannot import.
/// - **Out of memory.** `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemCreate` or `cuMemAlloc` is
///   [`DriverError::OutOfMemory`], so the allocator releases its cache and retries.
/// - **Counters.** Every call is counted, failed ones included, with its time measured by
///   [`Instant`](std::time::Instant) around the driver call(s) it makes (a call rejected before reaching
///   the driver costs 0).
/// - **Drop.** Whatever is still held is logged with `tracing::warn!` and given back (unmap, release, free,
///   destroy); each failure on the way is logged with `tracing::error!`, never dropped silently. The
///   calling thread keeps its context.
#[derive(Debug)]
pub struct CudaDriver {
    calls: Calls,
    ordinal: usize,
    name: String,
    granularity: u64,
    recommended_granularity: u64,
    peers: Vec<usize>,
    /// The device and its peers, as `CUdevice`s, for `cuMemSetAccess`.
    access: Vec<CUdevice>,
    ledger: Ledger,
    streams: Streams,
    /// Whether `cuMemCreate` asks for handles exportable as POSIX file descriptors (`driver/sharing.rs`).
    exportable: bool,
    /// The stream copy jobs run on, made by the first (`copies.rs`).
    copy_stream: Option<Arc<CopyStream>>,
    /// The calls copy jobs made, counted while they run without the driver.
    copy_counters: Arc<JobCounters>,
    /// The device ranges of copy jobs not over yet: never unmapped under them.
    copying: Guarded,
}

impl CudaDriver {
    /// Opens CUDA device `ordinal` (its primary context), with the caller's streams.
    ///
    /// Fails with [`DriverError::NoDriver`] when libcuda cannot be loaded, lacks an entry point cuvmm needs,
    /// `cuInit` fails (no device, driver mismatch, ...), there is no device `ordinal`, or the device does
    /// not support the virtual-memory API; with [`DriverError::CudaSetup`] when a setup call fails. The
    /// calling thread's current context is left as it was.
    pub fn new(ordinal: usize) -> Result<Self, DriverError> {
        Self::with_peers(ordinal, &[])
    }

    /// Like [`new`](Self::new), and [`set_access`](Driver::set_access) also grants access to each device in
    /// `peers` (the device itself is ignored there). Fails with [`DriverError::PeerAccess`] if a peer
    /// cannot access this device's memory.
    pub fn with_peers(ordinal: usize, peers: &[usize]) -> Result<Self, DriverError> {
        load_driver()?;
        let previous = result::ctx_get_current().map_err(|e| setup("cuCtxGetCurrent", &e))?;
        // cudarc's `CudaContext::new` makes the context current, and dropping it on a failure binds it
        // again: the caller's context is given back whatever happens.
        let opened = Self::open(ordinal, peers);
        // SAFETY: `previous` was this thread's current context a moment ago (or null), and opening a device
        // destroys no context, so it is still alive (point 1).
        let restored = unsafe { result::ctx_set_current(previous) };
        let driver = opened?;
        restored.map_err(|e| setup("cuCtxSetCurrent", &e))?;
        Ok(driver)
    }

    /// Opens the device; leaves its context current.
    fn open(ordinal: usize, peers: &[usize]) -> Result<Self, DriverError> {
        let device = open::open_device(ordinal, peers)?;
        Ok(Self {
            calls: Calls::new(device.ctx),
            ordinal,
            name: device.name,
            granularity: device.granularity,
            recommended_granularity: device.recommended_granularity,
            peers: device.peers,
            access: device.access,
            ledger: Ledger::default(),
            streams: Streams::Caller,
            exportable: device.exportable,
            copy_stream: None,
            copy_counters: Arc::default(),
            copying: Guarded::default(),
        })
    }

    /// Makes every non-zero [`StreamId`] name a non-blocking stream that this driver creates on first use
    /// (and destroys on drop), instead of the caller's `CUstream`. For replaying a recorded trace, whose
    /// stream numbers are names from another process; a program that queues its own work uses the caller's
    /// streams (the default).
    pub fn with_stand_in_streams(mut self) -> Self {
        self.calls.harvests = true;
        self.streams = Streams::StandIn {
            ctx: Arc::clone(&self.calls.ctx),
            created: Default::default(),
        };
        self
    }

    /// The device's ordinal.
    pub fn ordinal(&self) -> usize {
        self.ordinal
    }

    /// The device's name (`cuDeviceGetName`), e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The granularity the driver recommends for performance (`CU_MEM_ALLOC_GRANULARITY_RECOMMENDED`).
    pub fn recommended_granularity(&self) -> u64 {
        self.recommended_granularity
    }

    /// The peers that [`set_access`](Driver::set_access) also grants access to.
    pub fn peers(&self) -> &[usize] {
        &self.peers
    }

    /// The primary context this driver runs in (for creating the streams, modules and buffers that work
    /// alongside cuvmm's memory: it is the same `CUcontext` as cudarc's `CudaContext::new(ordinal)`).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.calls.ctx
    }

    /// What this driver still holds on the device.
    pub fn leak_report(&self) -> LeakReport {
        self.ledger.report()
    }

    /// How many events this driver holds: recorded and not destroyed yet, or kept after a failure to be
    /// destroyed on drop.
    pub fn events_held(&self) -> usize {
        self.ledger.events_held()
    }

    /// Errors found outside any call that could return them: one cudarc recorded in the context (a
    /// stand-in stream that failed to be destroyed), or a failure to give the calling thread its context
    /// back. Each was logged with `tracing::error!` when found.
    pub fn take_deferred_errors(&mut self) -> Vec<DriverError> {
        std::mem::take(&mut self.calls.deferred)
    }

    /// Runs one operation, counting it once with the driver time its calls took.
    fn counted<T>(
        &mut self,
        op: Op,
        body: impl FnOnce(&mut Self) -> Result<T, DriverError>,
    ) -> Result<T, DriverError> {
        self.calls.spent_ns = 0;
        let outcome = body(self);
        let spent = self.calls.spent_ns;
        self.calls.counters.record(op, spent);
        outcome
    }

    /// The raw stream `id` names, for a call of `op`.
    fn stream(&mut self, op: Op, id: StreamId) -> Result<u64, DriverError> {
        if self.streams.creates() {
            let streams = &mut self.streams;
            self.calls.call(op, 0, || streams.resolve(id))
        } else {
            self.streams.resolve(id).map_err(|e| cuda_error(op, &e))
        }
    }

    /// Gives back everything the ledger still holds, logging each failure. Used on drop, with the device's
    /// context current.
    fn give_back(&mut self) {
        let report = self.ledger.report();
        let events = self.ledger.events_held();
        if report.is_empty() && events == 0 {
            return;
        }
        if !report.is_empty() {
            tracing::warn!(
                "cuvmm: CudaDriver dropped while still holding device memory:\n{report}"
            );
        }
        if let Err(e) = cudarc::driver::result::ctx::synchronize() {
            log_drop_error(Op::Synchronize, &e);
        }
        let held = self.ledger.drain();
        for (va, size) in held.mappings {
            // SAFETY: the ledger recorded this mapping inside one of this driver's reservations (point 1);
            // the context was synchronized above and the driver is being dropped, so nothing uses it (2).
            let outcome = unsafe { result::unmap(va, bytes(size)) };
            if let Err(e) = outcome {
                log_drop_error(Op::Unmap, &e);
            }
        }
        for handle in held.handles {
            // SAFETY: the ledger holds only handles this driver created and did not release (point 1); the
            // driver is being dropped, so no one uses the handle again (2).
            if let Err(e) = unsafe { result::release(handle) } {
                log_drop_error(Op::Release, &e);
            }
        }
        for range in held.reservations {
            // SAFETY: the range is exactly one of this driver's reservations (point 1); its mappings were
            // unmapped above (2); the driver is being dropped, so no one uses it again (3).
            if let Err(e) = unsafe { result::address_free(range.start, bytes(range.size)) } {
                log_drop_error(Op::FreeReservation, &e);
            }
        }
        for ptr in held.mallocs {
            // SAFETY: the ledger holds only live pointers from `alloc` (point 1); the driver is being
            // dropped, so no one uses the memory again (2).
            if let Err(e) = unsafe { result::free(ptr) } {
                log_drop_error(Op::Free, &e);
            }
        }
        for event in held.events {
            // SAFETY: the ledger holds only events this driver created and did not destroy (point 1); the
            // driver is being dropped, so no one uses them again (2).
            if let Err(e) = unsafe { result::event_destroy(event as usize as sys::CUevent) } {
                log_drop_error(Op::DestroyEvent, &e);
            }
        }
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        let entered = match self.calls.enter() {
            Ok(entered) => entered,
            Err(e) => {
                log_drop_error(Op::Synchronize, &e);
                return;
            }
        };
        self.streams.clear();
        self.calls.harvest("while destroying the stand-in streams");
        self.give_back();
        self.calls.harvest("while giving device memory back");
        // The stand-ins' reference to the context goes first, so that the driver's is the last one here.
        self.streams = Streams::Caller;
        // SAFETY: the driver is being dropped and uses the context no more (point 1).
        unsafe { self.calls.drop_context(entered) };
        for err in std::mem::take(&mut self.calls.deferred) {
            tracing::error!(%err, "cuvmm: CudaDriver dropped with an error nobody collected");
        }
    }
}

impl Driver for CudaDriver {
    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        self.counted(Op::Reserve, |d| {
            let start =
                (d.calls).call(Op::Reserve, size, || result::address_reserve(bytes(size)))?;
            let range = VaRange::new(start, size);
            d.ledger.reserved(range);
            Ok(range)
        })
    }

    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        self.counted(Op::FreeReservation, |d| {
            d.ledger.free_reservation(&mut d.calls, range)
        })
    }

    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        self.counted(Op::Create, |d| d.create_handle(size))
    }

    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        self.counted(Op::Release, |d| d.ledger.release(&mut d.calls, handle))
    }

    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        self.counted(Op::Map, |d| {
            let handle_size = d.ledger.handle_size(Op::Map, handle)?;
            if handle_size != size {
                return Err(DriverError::SizeMismatch {
                    handle,
                    handle_size,
                    size,
                });
            }
            d.ledger.check_reserved(Op::Map, va, size)?;
            d.ledger.map(&mut d.calls, va, size, handle, 0)
        })
    }

    fn map_from(&mut self, va: u64, size: u64, page: PhysPage) -> Result<(), DriverError> {
        self.counted(Op::Map, |d| {
            let PhysPage { handle, offset } = page;
            let handle_size = d.ledger.handle_size(Op::Map, handle)?;
            DriverError::check_inside_handle(handle, handle_size, offset, size)?;
            d.ledger.check_reserved(Op::Map, va, size)?;
            d.ledger.map(&mut d.calls, va, size, handle, offset)
        })
    }

    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.counted(Op::SetAccess, |d| {
            d.ledger.check_reserved(Op::SetAccess, va, size)?;
            let access = &d.access;
            d.calls.call(Op::SetAccess, size, || {
                // SAFETY: the ledger says the range lies inside one of this driver's reservations (point 1).
                unsafe { result::set_access(va, bytes(size), access) }
            })?;
            d.ledger.access_set(va, size);
            Ok(())
        })
    }

    /// Refused while a copy job not over yet copies part of the range ([`DriverError::UnmapWhileInUse`]).
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.counted(Op::Unmap, |d| {
            d.ledger.check_reserved(Op::Unmap, va, size)?;
            if let Some(va) = d.copying.user_of(va, size) {
                let stream = d.copy_stream.as_ref().map_or(StreamId(0), |s| s.id());
                return Err(DriverError::UnmapWhileInUse { va, stream });
            }
            d.ledger.unmap(&mut d.calls, va, size)
        })
    }

    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        self.counted(Op::MemInfo, |d| {
            let (free, total) = d.calls.call(Op::MemInfo, 0, result::mem_get_info)?;
            Ok(MemInfo {
                free: free as u64,
                total: total as u64,
            })
        })
    }

    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        self.counted(Op::Malloc, |d| {
            let ptr = d
                .calls
                .call(Op::Malloc, size, || result::alloc(bytes(size)))?;
            d.ledger.malloced(ptr, size);
            Ok(ptr)
        })
    }

    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        self.counted(Op::Free, |d| d.ledger.free(&mut d.calls, ptr))
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        self.counted(Op::RecordEvent, |d| {
            let raw = d.stream(Op::RecordEvent, stream)?;
            (d.ledger.record_event(&mut d.calls, raw)).map_err(|e| errors::on_stream(e, stream))
        })
    }

    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        self.counted(Op::QueryEvent, |d| {
            (d.ledger.event_complete(&mut d.calls, event)).map_err(|e| errors::on_event(e, event))
        })
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        self.counted(Op::DestroyEvent, |d| {
            d.ledger.destroy_event(&mut d.calls, event)
        })
    }

    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        self.counted(Op::Synchronize, |d| {
            let raw = d.stream(Op::Synchronize, stream)?;
            let synchronized = d.calls.call(Op::Synchronize, 0, || {
                // SAFETY: the stream is one of CUDA's default streams, a stand-in this driver created, or the
                // caller's, whose `StreamId` contract is that it is alive (point 1).
                unsafe { result::stream_synchronize(raw_stream(raw)) }
            });
            synchronized.map_err(|e| errors::on_stream(e, stream))
        })
    }

    fn synchronize_device(&mut self) -> Result<(), DriverError> {
        self.counted(Op::Synchronize, |d| {
            d.calls.call(Op::Synchronize, 0, result::ctx_synchronize)
        })
    }

    /// The driver's calls and those of its copy jobs.
    fn counters(&self) -> DriverCounters {
        let mut counters = self.calls.counters;
        counters.add(&self.copy_counters.get());
        counters
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn capture_status(&mut self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
        self.counted(Op::CaptureInfo, |d| d.capture_info(stream))
    }

    /// `cuStreamGetCaptureInfo` on the caller's stream, from any thread (`driver/capture.rs`). `None` with
    /// stand-in streams, which only this driver queues work on.
    fn capture_probe(&self) -> Option<CaptureProbe> {
        self.probe()
    }

    /// Checks `cuDeviceCanAccessPeer` ([`DriverError::PeerAccess`] if the peer cannot reach this device's
    /// memory, or there is no such device), then adds the peer to the devices every later `set_access`
    /// grants access to, as [`with_peers`](CudaDriver::with_peers) does. Not counted: it maps nothing.
    fn add_peer(&mut self, peer: usize) -> Result<(), DriverError> {
        if peer == self.ordinal || self.peers.contains(&peer) {
            return Ok(());
        }
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| setup("cuDeviceGetCount", &e))?;
        if peer >= usize::try_from(count).unwrap_or(0) {
            return Err(DriverError::PeerAccess {
                device: self.ordinal,
                peer,
            });
        }
        let peer_device = peer_device(self.ordinal, self.calls.ctx.cu_device(), peer)?;
        if !self.access.contains(&peer_device) {
            self.access.push(peer_device);
            self.peers.push(peer);
        }
        Ok(())
    }

    fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
        self.counted(Op::Memset, |d| {
            d.ledger.check_touchable(Op::Memset, va, size)?;
            d.calls.call(Op::Memset, size, || {
                // SAFETY: the ledger says every byte of the range is this driver's memory with access set
                // (point 1); the legacy stream is synchronized before returning, so the write is complete
                // before anything else can touch the range (2).
                unsafe { result::memset_d8(va, value, bytes(size)) }?;
                // SAFETY: the null stream, the legacy default stream, always exists (point 1).
                unsafe { result::stream_synchronize(std::ptr::null_mut()) }
            })
        })
    }

    /// Page-locked memory (`cuMemHostAlloc`); where the driver refuses it (too much to lock), ordinary
    /// memory, with a warning.
    fn alloc_host(&mut self, len: usize) -> Result<HostMemory, DriverError> {
        if len == 0 {
            return HostMemory::pageable(0);
        }
        match Pinned::new(&self.calls.ctx, len) {
            Ok(pinned) => Ok(HostMemory::new(pinned)),
            Err(e) => {
                let (code, name) = errors::code_and_name(&e);
                tracing::warn!(code, %name, len, "cuvmm: cuMemHostAlloc failed; keeping the bytes in pageable memory");
                HostMemory::pageable(len)
            }
        }
    }

    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let len = out.len() as u64;
        self.counted(Op::CopyToHost, |d| {
            d.ledger.check_touchable(Op::CopyToHost, va, len)?;
            d.calls.call(Op::CopyToHost, len, || {
                // SAFETY: the ledger says every byte of the range is this driver's memory with access set
                // (point 1).
                unsafe { result::memcpy_dtoh(out, va) }
            })
        })
    }

    fn copy_from_host(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        let len = data.len() as u64;
        self.counted(Op::CopyFromHost, |d| {
            d.ledger.check_touchable(Op::CopyFromHost, va, len)?;
            d.calls.call(Op::CopyFromHost, len, || {
                // SAFETY: the ledger says every byte of the range is this driver's memory with access set
                // (point 1).
                unsafe { result::memcpy_htod(va, data) }
            })
        })
    }

    /// Every device range checked against the ledger (mapped with access set), the copy stream made on
    /// the first job (`copies.rs`).
    fn start_copies(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
        plan.validate()?;
        let op = plan.direction.op();
        for c in &plan.copies {
            self.ledger.check_touchable(op, c.va, c.len)?;
        }
        let stream = match &self.copy_stream {
            Some(stream) => Arc::clone(stream),
            None => {
                let stream = CopyStream::new(&self.calls.ctx).map_err(|e| cuda_error(op, &e))?;
                self.copy_stream = Some(Arc::clone(&stream));
                stream
            }
        };
        let lens = (plan.pieces.iter().zip(&plan.allocate))
            .filter(|(_, allocate)| **allocate)
            .map(|(&len, _)| bytes(len))
            .collect();
        let over = self
            .copying
            .add(plan.copies.iter().map(|c| (c.va, c.len)).collect());
        let counters = Arc::clone(&self.copy_counters);
        let how = plan.pinning;
        let run = CudaCopies::new(&self.calls.ctx, stream, lens, how, counters, over);
        Ok(CopyJob::new(plan, Box::new(run)))
    }

    fn exports_handles(&self) -> bool {
        self.exportable
    }

    fn export_handle(&mut self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        self.counted(Op::Export, |d| d.export(handle))
    }

    fn import_handle(&mut self, fd: BorrowedFd<'_>, size: u64) -> Result<PhysHandle, DriverError> {
        self.counted(Op::Import, |d| d.import(fd, size))
    }
}

/// Logs a call that failed while the driver was being dropped.
fn log_drop_error(op: Op, err: &CuError) {
    let (code, name) = errors::code_and_name(err);
    tracing::error!(%op, code, %name, "cuvmm: CUDA call failed while dropping CudaDriver");
}

#[cfg(test)]
mod tests;
