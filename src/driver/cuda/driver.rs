//! [`CudaDriver`]: the [`Driver`] trait on a real GPU.

use super::ledger::Ledger;
use super::result::{self, Granularity};
use crate::driver::sim::LeakReport;
use crate::driver::{
    Driver, DriverCounters, DriverError, EventId, MemInfo, Op, PhysHandle, StreamId, VaRange,
};
use cudarc::driver::DriverError as CuError;
use cudarc::driver::sys::{CUdevice, CUdevice_attribute};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

/// A CUDA device, driven through the virtual-memory API.
///
/// - **Context.** The device's primary context (`cuDevicePrimaryCtxRetain`, through cudarc's
///   [`CudaContext`]), the one the CUDA runtime and PyTorch use, so memory from this driver is usable by
///   them. It is made current on the calling thread before every call, so the driver may move between
///   threads.
/// - **Granularity.** [`granularity`](Driver::granularity) is the *minimum* granularity
///   (`CU_MEM_ALLOC_GRANULARITY_MINIMUM`): it is the rule the driver enforces on sizes and addresses, which
///   is what the trait promises. The recommended one is available from
///   [`recommended_granularity`](CudaDriver::recommended_granularity); on current NVIDIA GPUs both are 2 MiB.
/// - **Access.** [`set_access`](Driver::set_access) grants read-write access to the device itself and to
///   the peers given to [`with_peers`](CudaDriver::with_peers) (none by default), in one `cuMemSetAccess`.
/// - **Streams and events.** `StreamId(0)` is the legacy default stream; any other id names a
///   non-blocking stream this driver creates on first use (cudarc's [`CudaStream`]); get it with
///   [`stream`](CudaDriver::stream) to queue work on it. Events are cudarc's [`CudaEvent`]s.
/// - **What it checks itself.** A handle is passed to the driver only if this driver created it and did
///   not release it ([`DriverError::UnknownHandle`]); a range only if it lies inside one of its own
///   reservations ([`DriverError::OutsideReservation`]); a reservation is freed only if nothing is mapped
///   in it ([`DriverError::ReservationInUse`]); `free` only takes its own `malloc` pointers; `map` maps a
///   whole handle ([`DriverError::SizeMismatch`], the trait's rule); bytes are touched only through mappings
///   with access set. Every other rule is CUDA's own, and its violation comes back as
///   [`DriverError::Cuda`] with the operation and the `CUresult`.
/// - **Out of memory.** `CUDA_ERROR_OUT_OF_MEMORY` from `cuMemCreate` or `cuMemAlloc` is
///   [`DriverError::OutOfMemory`], so the allocator releases its cache and retries.
/// - **Counters.** Every call is counted, failed ones included, with its time measured by
///   [`Instant`] around the driver call(s) it makes (a call rejected before reaching the driver costs 0).
/// - **Drop.** Whatever is still held is logged with `tracing::warn!` and given back (unmap, release, free);
///   each failure on the way is logged with `tracing::error!`, never dropped silently.
#[derive(Debug)]
pub struct CudaDriver {
    ctx: Arc<CudaContext>,
    ordinal: usize,
    name: String,
    granularity: u64,
    recommended_granularity: u64,
    peers: Vec<usize>,
    /// The device and its peers, as `CUdevice`s, for `cuMemSetAccess`.
    access: Vec<CUdevice>,
    ledger: Ledger,
    streams: HashMap<StreamId, Arc<CudaStream>>,
    events: HashMap<EventId, CudaEvent>,
    next_event: u64,
    counters: DriverCounters,
    /// Nanoseconds spent in driver calls by the operation being counted.
    spent_ns: u64,
    /// Errors cudarc recorded in the context outside any call of ours (a stream or event dropped).
    deferred: Vec<DriverError>,
}

impl CudaDriver {
    /// Opens CUDA device `ordinal` (its primary context).
    ///
    /// Fails with [`DriverError::NoDriver`] when libcuda cannot be loaded, lacks an entry point cuvmm needs,
    /// `cuInit` fails (no device, driver mismatch, ...), there is no device `ordinal`, or the device does
    /// not support the virtual-memory API; with [`DriverError::CudaSetup`] when a setup call fails.
    pub fn new(ordinal: usize) -> Result<Self, DriverError> {
        Self::with_peers(ordinal, &[])
    }

    /// Like [`new`](Self::new), and [`set_access`](Driver::set_access) also grants access to each device in
    /// `peers` (the device itself is ignored there). Fails with [`DriverError::PeerAccess`] if a peer
    /// cannot access this device's memory.
    pub fn with_peers(ordinal: usize, peers: &[usize]) -> Result<Self, DriverError> {
        load_driver()?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| setup("cuDeviceGetCount", &e))?;
        let count = usize::try_from(count).unwrap_or(0);
        for &wanted in std::iter::once(&ordinal).chain(peers) {
            if wanted >= count {
                return Err(DriverError::NoDriver {
                    reason: format!("there is no CUDA device {wanted}: {count} device(s) found"),
                });
            }
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| setup("cuDevicePrimaryCtxRetain", &e))?;
        let name = ctx.name().map_err(|e| setup("cuDeviceGetName", &e))?;
        // Attribute 102: CUDA calls it VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED; cudarc keeps its older alias.
        let vmm = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED)
            .map_err(|e| setup("cuDeviceGetAttribute", &e))?;
        if vmm == 0 {
            return Err(DriverError::NoDriver {
                reason: format!(
                    "CUDA device {ordinal} ({name}) does not support the virtual memory management API"
                ),
            });
        }
        let device = ctx.cu_device();
        let minimum = result::granularity(device, Granularity::Minimum)
            .map_err(|e| setup("cuMemGetAllocationGranularity", &e))?;
        let recommended = result::granularity(device, Granularity::Recommended)
            .map_err(|e| setup("cuMemGetAllocationGranularity", &e))?;
        let mut access = vec![device];
        let mut peer_list = Vec::new();
        for &peer in peers.iter().filter(|&&p| p != ordinal) {
            let peer_device = cudarc::driver::result::device::get(peer as i32)
                .map_err(|e| setup("cuDeviceGet", &e))?;
            let can = result::can_access_peer(peer_device, device)
                .map_err(|e| setup("cuDeviceCanAccessPeer", &e))?;
            if !can {
                return Err(DriverError::PeerAccess {
                    device: ordinal,
                    peer,
                });
            }
            if !access.contains(&peer_device) {
                access.push(peer_device);
                peer_list.push(peer);
            }
        }
        Ok(Self {
            ctx,
            ordinal,
            name,
            granularity: minimum as u64,
            recommended_granularity: recommended as u64,
            peers: peer_list,
            access,
            ledger: Ledger::default(),
            streams: HashMap::new(),
            events: HashMap::new(),
            next_event: 0,
            counters: DriverCounters::default(),
            spent_ns: 0,
            deferred: Vec::new(),
        })
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

    /// The primary context this driver runs in.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The CUDA stream behind `id` (created on first use; `StreamId(0)` is the legacy default stream), to
    /// queue work on the stream the allocator was told about.
    pub fn stream(&mut self, id: StreamId) -> Result<Arc<CudaStream>, DriverError> {
        self.bind().map_err(|e| setup("cuCtxSetCurrent", &e))?;
        self.stream_or_new(id)
            .map_err(|e| setup("cuStreamCreate", &e))
    }

    /// What this driver still holds on the device.
    pub fn leak_report(&self) -> LeakReport {
        self.ledger.report()
    }

    /// Errors that cudarc recorded in the context outside any call of this driver (an event or stream it
    /// dropped failed to be destroyed), as [`DriverError::Cuda`] with [`Op::DestroyEvent`]. Each was logged
    /// with `tracing::error!` when found.
    pub fn take_deferred_errors(&mut self) -> Vec<DriverError> {
        std::mem::take(&mut self.deferred)
    }

    /// Moves any error cudarc recorded in the context into `deferred`, logging it. cudarc records errors
    /// only from its `Drop` implementations; the driver drops streams only in its own drop, so what is found
    /// here during operation comes from destroying an event.
    fn harvest(&mut self, during: &str) {
        if let Err(e) = self.ctx.check_err() {
            let (code, name) = result::code_and_name(&e);
            tracing::error!(code, %name, "cuvmm: CUDA error recorded while {during}");
            self.deferred.push(cuda_error(Op::DestroyEvent, &e));
        }
    }

    /// Makes the context current on this thread, after collecting any error recorded in it.
    fn bind(&mut self) -> Result<(), CuError> {
        self.harvest("dropping a stream or an event");
        self.ctx.bind_to_thread()
    }

    /// The stream behind `id`, created if new.
    fn stream_or_new(&mut self, id: StreamId) -> Result<Arc<CudaStream>, CuError> {
        if id == StreamId::DEFAULT {
            return Ok(self.ctx.default_stream());
        }
        if let Some(stream) = self.streams.get(&id) {
            return Ok(stream.clone());
        }
        let stream = self.ctx.new_stream()?;
        self.streams.insert(id, stream.clone());
        Ok(stream)
    }

    /// Runs one operation, counting it once with the driver time its calls took.
    fn counted<T>(
        &mut self,
        op: Op,
        body: impl FnOnce(&mut Self) -> Result<T, DriverError>,
    ) -> Result<T, DriverError> {
        self.spent_ns = 0;
        let outcome = body(self);
        self.counters.record(op, self.spent_ns);
        outcome
    }

    /// Makes the context current and runs `f` (driver calls), adding their time to the operation's.
    /// An error becomes [`DriverError::OutOfMemory`] or [`DriverError::Cuda`] for `op`.
    fn call<T>(
        &mut self,
        op: Op,
        requested: u64,
        f: impl FnOnce(&mut Self) -> Result<T, CuError>,
    ) -> Result<T, DriverError> {
        if let Err(e) = self.bind() {
            return Err(cuda_error(op, &e));
        }
        let start = Instant::now();
        let outcome = f(self);
        self.spent_ns = self.spent_ns.saturating_add(elapsed_ns(start));
        outcome.map_err(|e| self.failure(op, requested, &e))
    }

    /// The error for a failed call of `op` asking for `requested` bytes.
    fn failure(&mut self, op: Op, requested: u64, err: &CuError) -> DriverError {
        if !result::is_out_of_memory(err) {
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

    /// Gives back everything the ledger still holds, logging each failure. Used on drop.
    fn give_back(&mut self) {
        let report = self.ledger.report();
        if report.is_empty() {
            return;
        }
        tracing::warn!("cuvmm: CudaDriver dropped while still holding device memory:\n{report}");
        if let Err(e) = self.ctx.bind_to_thread() {
            log_drop_error(Op::Synchronize, &e);
            return;
        }
        if let Err(e) = self.ctx.synchronize() {
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
    }
}

impl Drop for CudaDriver {
    fn drop(&mut self) {
        self.events.clear();
        self.streams.clear();
        self.harvest("dropping the driver's streams and events");
        self.give_back();
        self.harvest("giving device memory back");
    }
}

impl Driver for CudaDriver {
    fn granularity(&self) -> u64 {
        self.granularity
    }

    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        self.counted(Op::Reserve, |d| {
            let start = d.call(Op::Reserve, size, |_| result::address_reserve(bytes(size)))?;
            let range = VaRange::new(start, size);
            d.ledger.reserved(range);
            Ok(range)
        })
    }

    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        self.counted(Op::FreeReservation, |d| {
            d.ledger.check_free_reservation(range)?;
            d.call(Op::FreeReservation, 0, |_| {
                // SAFETY: the ledger says the range is exactly one of this driver's reservations (point 1)
                // with nothing mapped in it (2); the trait's caller gives it up with this call (3).
                unsafe { result::address_free(range.start, bytes(range.size)) }
            })?;
            d.ledger.reservation_freed(range);
            Ok(())
        })
    }

    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        self.counted(Op::Create, |d| {
            let device = d.ctx.cu_device();
            let handle = d.call(Op::Create, size, |_| result::create(device, bytes(size)))?;
            let handle = PhysHandle(handle);
            d.ledger.created(handle, size);
            Ok(handle)
        })
    }

    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        self.counted(Op::Release, |d| {
            d.ledger.handle_size(Op::Release, handle)?;
            d.call(Op::Release, 0, |_| {
                // SAFETY: the ledger says this driver created the handle and has not released it (point 1);
                // it forgets the handle below, so it is never passed to the driver again (2).
                unsafe { result::release(handle.0) }
            })?;
            d.ledger.released(handle);
            Ok(())
        })
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
            d.call(Op::Map, size, |_| {
                // SAFETY: the ledger says the handle is live (point 1) and the range lies inside one of this
                // driver's reservations (2).
                unsafe { result::map(va, bytes(size), handle.0) }
            })?;
            d.ledger.mapped(va, size);
            Ok(())
        })
    }

    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.counted(Op::SetAccess, |d| {
            d.ledger.check_reserved(Op::SetAccess, va, size)?;
            d.call(Op::SetAccess, size, |d| {
                // SAFETY: the ledger says the range lies inside one of this driver's reservations (point 1).
                unsafe { result::set_access(va, bytes(size), &d.access) }
            })?;
            d.ledger.access_set(va, size);
            Ok(())
        })
    }

    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.counted(Op::Unmap, |d| {
            d.ledger.check_reserved(Op::Unmap, va, size)?;
            d.call(Op::Unmap, size, |_| {
                // SAFETY: the ledger says the range lies inside one of this driver's reservations (point 1).
                // Point 2 is the trait's contract with its caller (unmap only pages whose streams are done);
                // a caller that breaks it makes a kernel fault on the device, not host memory unsafe.
                unsafe { result::unmap(va, bytes(size)) }
            })?;
            d.ledger.unmapped(va, size);
            Ok(())
        })
    }

    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        self.counted(Op::MemInfo, |d| {
            let (free, total) = d.call(Op::MemInfo, 0, |_| result::mem_get_info())?;
            Ok(MemInfo {
                free: free as u64,
                total: total as u64,
            })
        })
    }

    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        self.counted(Op::Malloc, |d| {
            let ptr = d.call(Op::Malloc, size, |_| result::alloc(bytes(size)))?;
            d.ledger.malloced(ptr, size);
            Ok(ptr)
        })
    }

    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        self.counted(Op::Free, |d| {
            d.ledger.check_malloc(ptr)?;
            d.call(Op::Free, 0, |_| {
                // SAFETY: the ledger says `ptr` is a live allocation from `alloc` (point 1); it forgets it
                // below, and the trait's caller gives the memory up with this call (2).
                unsafe { result::free(ptr) }
            })?;
            d.ledger.freed(ptr);
            Ok(())
        })
    }

    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        self.counted(Op::RecordEvent, |d| {
            let event = d.call(Op::RecordEvent, 0, |d| {
                d.stream_or_new(stream)?.record_event(None)
            })?;
            d.next_event += 1;
            let id = EventId(d.next_event);
            d.events.insert(id, event);
            Ok(id)
        })
    }

    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        self.counted(Op::QueryEvent, |d| {
            if !d.events.contains_key(&event) {
                return Err(DriverError::UnknownEvent { event });
            }
            d.call(Op::QueryEvent, 0, |d| match d.events.get(&event) {
                Some(e) => e.try_is_complete(),
                None => Ok(true),
            })
        })
    }

    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        self.counted(Op::DestroyEvent, |d| {
            let e = d
                .events
                .remove(&event)
                .ok_or(DriverError::UnknownEvent { event })?;
            d.call(Op::DestroyEvent, 0, |d| {
                // cudarc destroys the event on drop and records any error in the context: collect it here,
                // as this call's error.
                drop(e);
                d.ctx.check_err()
            })
        })
    }

    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        self.counted(Op::Synchronize, |d| {
            d.call(Op::Synchronize, 0, |d| {
                d.stream_or_new(stream)?.synchronize()
            })
        })
    }

    fn counters(&self) -> DriverCounters {
        self.counters
    }

    fn ordinal(&self) -> usize {
        self.ordinal
    }

    fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
        self.counted(Op::Memset, |d| {
            d.ledger.check_touchable(Op::Memset, va, size)?;
            d.call(Op::Memset, size, |d| {
                // SAFETY: the ledger says every byte of the range is this driver's memory with access set
                // (point 1); the legacy stream is synchronized before returning, so the write is complete
                // before anything else can touch the range (2).
                unsafe { result::memset_d8(va, value, bytes(size)) }?;
                d.ctx.default_stream().synchronize()
            })
        })
    }

    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let len = out.len() as u64;
        self.counted(Op::CopyToHost, |d| {
            d.ledger.check_touchable(Op::CopyToHost, va, len)?;
            d.call(Op::CopyToHost, len, |_| {
                // SAFETY: the ledger says every byte of the range is this driver's memory with access set
                // (point 1).
                unsafe { result::memcpy_dtoh(out, va) }
            })
        })
    }
}

/// Opens libcuda and checks that it exports every entry point cuvmm uses, then initialises the driver.
/// Until this succeeds no `sys` call may be made: cudarc panics on a library or symbol it cannot load.
fn load_driver() -> Result<(), DriverError> {
    if !result::culib_present() {
        return Err(DriverError::NoDriver {
            reason:
                "libcuda could not be loaded (is the NVIDIA driver installed, and libcuda.so.1 on \
                     the library path?)"
                    .to_string(),
        });
    }
    let missing = result::missing_symbols();
    if !missing.is_empty() {
        return Err(DriverError::NoDriver {
            reason: format!(
                "libcuda is too old: it lacks {} (a driver for CUDA 12.2 or later is needed)",
                missing.join(", ")
            ),
        });
    }
    cudarc::driver::result::init().map_err(|e| {
        let (code, name) = result::code_and_name(&e);
        let what = if result::is_no_device(&e) {
            "no CUDA-capable device is present"
        } else {
            "the driver could not be initialised"
        };
        DriverError::NoDriver {
            reason: format!("cuInit failed: {what} (CUDA error {code}, {name})"),
        }
    })
}

/// A failed setup call.
fn setup(call: &'static str, err: &CuError) -> DriverError {
    let (code, name) = result::code_and_name(err);
    DriverError::CudaSetup { call, code, name }
}

/// A failed call of `op`.
fn cuda_error(op: Op, err: &CuError) -> DriverError {
    let (code, name) = result::code_and_name(err);
    DriverError::Cuda { op, code, name }
}

/// Logs a call that failed while the driver was being dropped.
fn log_drop_error(op: Op, err: &CuError) {
    let (code, name) = result::code_and_name(err);
    tracing::error!(%op, code, %name, "cuvmm: CUDA call failed while dropping CudaDriver");
}

/// A byte count as the driver takes it. Sizes beyond `usize` (none on 64-bit hosts) saturate, and the
/// driver rejects them.
fn bytes(size: u64) -> usize {
    usize::try_from(size).unwrap_or(usize::MAX)
}

/// Nanoseconds since `start`.
fn elapsed_ns(start: Instant) -> u64 {
    u64::try_from(start.elapsed().as_nanos()).unwrap_or(u64::MAX)
}
