//! SimDriver: a simulated device that enforces CUDA's rules, so a bug that would crash a GPU fails a test.
//!
//! - **Memory.** A capacity in bytes shared by `create` and `malloc`; [`Driver::mem_info`] reports
//!   `(capacity - used, capacity)`. Reservations are placed upward from `0x7f00_0000_0000`, aligned to the
//!   granularity with one granularity of unused space after each, below the 2^48 top of the address
//!   space; freed ranges are reused once the top is reached. `malloc` hands out addresses upward from
//!   `0x7e00_0000_0000` (1 TiB of room), 512 B aligned, 2 MiB aligned for sizes of 2 MiB or more, and holds
//!   its size rounded up to 512 B of the capacity.
//! - **Planned addresses.** [`SimDriver::plan_malloc_addresses`] gives `malloc` a list of `(size,
//!   address)` pairs, such as the `segment_alloc` entries of a PyTorch trace: each `malloc` takes the first
//!   planned pair of its size whose range is clear of live allocations and reservations, and returns that
//!   address, so an allocator whose ties break by address breaks them as it did on the GPU. A `malloc`
//!   with no usable pair is placed as usual. Without a plan (the default) nothing changes.
//! - **Rules.** Each violation of CUDA's rules is a typed [`DriverError`], and a failed call changes
//!   nothing but the counters. `release` of a mapped handle is allowed: the handle is unknown to later
//!   calls, and its memory returns to the device when its last mapping is unmapped. One handle may be
//!   mapped at several addresses.
//! - **Counters and time.** Every call, failed or not, is counted with its cost from the
//!   [`LatencyModel`]. The test controls ([`SimDriver::complete_event`], [`SimDriver::write`], queries ...)
//!   are not driver calls and are not counted.
//! - **Faults.** [`SimDriver::fail_nth`] and [`SimDriver::fail_randomly`] make chosen calls fail. The
//!   fault is decided before the arguments are checked, so the n-th call fails whatever it asks for.
//! - **Streams, work and events.** Any [`StreamId`] is a valid stream, with a FIFO queue of pending items:
//!   work launched by the test ([`SimDriver::launch`]: a simulated kernel touching some device ranges) and
//!   events. Nothing runs by itself: [`SimDriver::advance`], [`SimDriver::complete_event`] (an event and
//!   everything before it on its stream), [`SimDriver::complete_stream`] and [`Driver::synchronize`]
//!   complete work in stream order. An event recorded on a stream with nothing pending is complete at once.
//! - **Use after unmap.** `unmap` of a range that pending work on any stream touches fails with
//!   [`DriverError::UnmapWhileInUse`] and changes nothing: the simulator's stand-in for the illegal memory
//!   access (or silent corruption) a GPU would give when that kernel ran. So no read or write of pending work
//!   can ever go through a page unmapped under it, and a test that drives an allocator with work in flight
//!   proves the allocator waited for the right streams.
//! - **Bytes.** With [`SimConfig::backing_store`] on, [`SimDriver::write`] and [`SimDriver::read`] (test
//!   controls) and [`Driver::memset_d8`] and [`Driver::copy_to_host`] (driver calls, counted) go
//!   through mapped, accessible addresses to the physical memory behind them, so bytes move with a handle
//!   that is remapped elsewhere. A fill is stored as a range, not byte by byte, so filling gigabytes is cheap. A read or write may span several mappings. An access to an address that is
//!   neither mapped nor malloc'd is [`DriverError::NotMapped`] with `op: Op::Map` (the call that is
//!   missing: reads and writes are not driver calls); to a mapping without access,
//!   [`DriverError::AccessDenied`]. These checks are made whether or not the store is on; when they pass
//!   and the store is off, the result is [`DriverError::NoBackingStore`].
//! - **Stream capture** (`capture.rs`). [`SimDriver::begin_capture`] and [`SimDriver::end_capture`] (test
//!   controls, not counted) capture a stream into a graph, in a [`CaptureMode`], on the calling thread, and
//!   [`Driver::capture_status`] reports it. During a capture the simulator refuses what CUDA refuses, so an
//!   allocator that would break a capture fails a test: `synchronize` of the capturing stream and a query
//!   of an event recorded on it during the capture (every mode), and the potentially unsafe calls
//!   (`event_complete`, `synchronize`, and, stricter than CUDA may be, `unmap`, `release`,
//!   `free_reservation`, `free`) from any thread during a `Global` capture or from the capturing thread
//!   during a `ThreadLocal` one. A refused call is counted, has no effect, fails with
//!   [`DriverError::CaptureUnsupported`] and invalidates the captures that forbade it
//!   ([`SimDriver::capture_refusals`], [`SimDriver::invalidated_captures`]). Work launched and events
//!   recorded on a capturing stream are nodes of the graph: they are not queued and never complete.
//! - **Peers.** [`Driver::add_peer`] (not counted: it configures later calls) makes every later
//!   `set_access` grant the peer access too; [`SimDriver::peer_access`] says what a mapping grants. The
//!   machine has [`SimConfig::devices`] devices; this one is device 0.
//! - **Sharing** (`sharing.rs`). With [`SimConfig::exportable_handles`] on (the default),
//!   [`Driver::export_handle`] makes a real file descriptor that stands for the handle's allocation and
//!   [`Driver::import_handle`] of it makes another handle to the same allocation: same bytes, capacity
//!   charged once, memory freed once every handle to it is released and unmapped. A descriptor this device
//!   did not export is [`DriverError::NotExported`], one whose memory is freed [`DriverError::ExportFreed`].
//!   Off, both calls are counted and fail with [`DriverError::Unsupported`].
//! - **Leaks.** [`SimDriver::leak_report`] lists what is still held; dropping a device that still holds
//!   something logs the report with `tracing::warn!` (it never panics).
//!
//! [`Driver::add_peer`]: super::Driver::add_peer
//! [`Driver::capture_status`]: super::Driver::capture_status
//! [`Driver::copy_to_host`]: super::Driver::copy_to_host
//! [`Driver::export_handle`]: super::Driver::export_handle
//! [`Driver::import_handle`]: super::Driver::import_handle
//! [`Driver::mem_info`]: super::Driver::mem_info
//! [`Driver::memset_d8`]: super::Driver::memset_d8
//! [`Driver::synchronize`]: super::Driver::synchronize

mod calls;
mod capture;
mod config;
mod copies;
mod faults;
mod granules;
mod handles;
mod latency;
mod malloc;
mod mappings;
mod processes;
mod report;
mod sharing;
#[cfg(test)]
mod sharing_tests;
mod store;
mod streams;
mod va;
mod vmm;

pub use config::SimConfig;
pub use faults::FaultKind;
pub use latency::{Calibration, LATENCY_MODELS, LATENCY_SOURCES, LATENCY_UNIT_BYTES, LatencyModel};
pub use report::LeakReport;
pub use store::Owner;

use super::{
    CaptureMode, DriverCounters, DriverError, EventId, HostPinning, Op, StreamId, VaRange,
};
use crate::base::sync::{Arc, Mutex};
use capture::Captures;
use faults::Faults;
use malloc::Mallocs;
use sharing::Exports;
use std::collections::VecDeque;
use std::fmt;
use store::ByteStore;
use streams::Streams;
use vmm::Vmm;

/// A simulated device.
pub struct SimDriver {
    config: SimConfig,
    counters: DriverCounters,
    faults: Faults,
    vmm: Vmm,
    mallocs: Mallocs,
    streams: Streams,
    captures: Captures,
    /// The peers added ([`Driver::add_peer`](super::Driver::add_peer)), one bit per device ordinal.
    peers: u32,
    /// The bytes, shared with the copy jobs running without the driver (`copies.rs`).
    store: Option<Arc<Mutex<ByteStore>>>,
    /// The handles exported as file descriptors (`sharing.rs`).
    exports: Exports,
    malloc_plan: VecDeque<(u64, u64)>,
    /// The copy jobs not over yet and the device ranges they copy (`copies.rs`).
    copying: copies::Copying,
    /// The other processes on this device, when there are (`processes.rs`).
    process: Option<processes::Process>,
}

/// The stream a simulated copy job runs on, as errors name it (an `unmap` refused while it copies;
/// `copies.rs`).
pub const COPY_STREAM: StreamId = StreamId(u64::MAX);

/// A piece of a read or write that lies in one physical allocation.
struct Span {
    owner: Owner,
    offset: u64,
    len: usize,
}

impl SimDriver {
    /// A device built as `config` says. A granularity of 0 is taken as 1, and a machine of
    /// [`devices`](SimConfig::devices) outside 1 to [`SimConfig::MAX_DEVICES`] as the nearest of them.
    pub fn new(mut config: SimConfig) -> Self {
        config.granularity = config.granularity.max(1);
        config.devices = config.devices.clamp(1, SimConfig::MAX_DEVICES);
        Self {
            counters: DriverCounters::default(),
            faults: Faults::default(),
            vmm: Vmm::new(config.granularity, config.capacity, config.partial_mappings),
            mallocs: Mallocs::default(),
            streams: Streams::default(),
            captures: Captures::default(),
            peers: 0,
            store: (config.backing_store).then(|| Arc::new(Mutex::new(ByteStore::default()))),
            exports: Exports::default(),
            malloc_plan: VecDeque::new(),
            copying: copies::Copying::default(),
            process: None,
            config,
        }
    }
    /// The configuration.
    pub fn config(&self) -> &SimConfig {
        &self.config
    }
    /// Physical bytes in use (handles not yet freed, and mallocs).
    pub fn used_bytes(&self) -> u64 {
        self.vmm.physical_bytes() + self.mallocs.bytes()
    }
    /// Physical bytes still free: capacity minus [`used_bytes`](Self::used_bytes), and minus what the
    /// other processes on the device use ([`another_process`](Self::another_process)).
    pub fn free_bytes(&self) -> u64 {
        let others = self.process.as_ref().map_or(0, processes::Process::others);
        (self.config.capacity)
            .saturating_sub(self.used_bytes())
            .saturating_sub(others)
    }
    /// Handles created or imported and not released (a released handle that is still mapped is not
    /// counted; an import is a handle of its own).
    pub fn handle_count(&self) -> usize {
        self.vmm.handle_count()
    }
    /// Live mappings.
    pub fn mapping_count(&self) -> usize {
        self.vmm.mapping_count()
    }
    /// Live reservations.
    pub fn reservation_count(&self) -> usize {
        self.vmm.reservation_count()
    }
    /// Whether the device may read and write `va`: it lies in a mapping whose access was set, or in a
    /// live `malloc` allocation.
    pub fn is_accessible(&self, va: u64) -> bool {
        self.locate(va).is_ok()
    }
    /// Events recorded on `stream` that have not completed yet (destroyed ones excluded).
    pub fn pending_events(&self, stream: StreamId) -> usize {
        self.streams.pending_events(stream).len()
    }
    /// The events of [`pending_events`](Self::pending_events), in the order they will complete.
    pub fn pending_event_ids(&self, stream: StreamId) -> Vec<EventId> {
        self.streams.pending_events(stream)
    }
    /// Events recorded and not yet destroyed, complete or not (an allocator should destroy every event it
    /// records).
    pub fn live_events(&self) -> usize {
        self.streams.live_events()
    }
    /// Work items launched on `stream` that have not completed yet.
    pub fn pending_work(&self, stream: StreamId) -> usize {
        self.streams.pending_work(stream)
    }
    /// The streams whose pending work touches `range`, each once, in increasing order.
    pub fn streams_using(&self, range: VaRange) -> Vec<StreamId> {
        self.streams
            .users_of(range.start, range.size)
            .into_iter()
            .map(|(stream, _)| stream)
            .collect()
    }
    /// The physical memory behind `va`: its owner and the byte offset in it, if `va` is mapped (accessible or
    /// not) or in a live `malloc` allocation. Two addresses with the same answer are the same memory: a piece
    /// of a handle mapped twice, or a handle imported. Not a driver call: tests use it to check that memory
    /// pending work may still touch is not handed out again under another address.
    pub fn physical_at(&self, va: u64) -> Option<(Owner, u64)> {
        if let Some((start, m)) = self.vmm.mapping_at(va) {
            let owner = Owner::Allocation(self.vmm.allocation_of(m.handle));
            return Some((owner, m.offset + (va - start)));
        }
        let (start, _) = self.mallocs.containing(va)?;
        Some((Owner::Malloc(start), va - start))
    }
    /// Queues a simulated kernel on `stream` that reads and writes `ranges`; returns its number. It stays
    /// pending until the test completes it. Every byte of every range must be accessible now
    /// ([`DriverError::NotMapped`] or [`DriverError::AccessDenied`] otherwise, and nothing is queued): a
    /// kernel launched on memory that is not mapped would fault at once. Not a driver call.
    ///
    /// On a capturing stream the kernel is a node of the graph: it is checked and numbered, but not queued,
    /// and never runs.
    pub fn launch(&mut self, stream: StreamId, ranges: &[VaRange]) -> Result<u64, DriverError> {
        self.streams.alive("launch", stream)?;
        for range in ranges {
            self.spans(range.start, range.size)?;
        }
        if self.captures.is_capturing(stream) {
            self.captures.captured_launch(stream, ranges);
            return Ok(self.streams.launch_captured());
        }
        Ok(self.streams.launch(stream, ranges))
    }
    /// Replays graph `graph` (the id of a capture that ended well) on `stream`: its work is launched again
    /// as one work item touching every range its captured work touched, and refused as
    /// [`launch`](Self::launch) refuses, where any of that memory is not mapped with access: CUDA's replay
    /// of a graph whose memory was unmapped would fault. [`DriverError::UnknownGraph`] for a graph that
    /// does not exist. A test control, not counted.
    pub fn replay_graph(&mut self, graph: u64, stream: StreamId) -> Result<u64, DriverError> {
        let ranges = (self.captures.graph(graph))
            .ok_or(DriverError::UnknownGraph { graph })?
            .to_vec();
        self.launch(stream, &ranges)
    }
    /// Completes the first `n` work items queued on `stream`, and the events that thereby complete.
    /// Returns how many work items completed (fewer than `n` if the stream ran dry).
    pub fn advance(&mut self, stream: StreamId, n: usize) -> usize {
        self.streams.advance(stream, n)
    }
    /// Makes the `n`th call of `op` from now (1 = the next one) fail with `kind`. `n = 0` is taken as 1.
    /// Several faults may be planned; a second one for the same call replaces the first.
    pub fn fail_nth(&mut self, op: Op, n: u64, kind: FaultKind) {
        let call = self.counters.get(op).saturating_add(n.max(1));
        self.faults.plan(op, call, kind);
    }
    /// Makes each call of any of `ops` fail with `probability`, drawn from a generator seeded with `seed`.
    ///
    /// The failure is [`DriverError::Injected`]. The same seed and the same sequence of calls give the same
    /// failures. Replaces an earlier random plan; planned [`fail_nth`](Self::fail_nth) faults stay.
    pub fn fail_randomly(&mut self, ops: &[Op], probability: f64, seed: u64) {
        self.faults.randomly(ops, probability, seed);
    }
    /// Removes all planned faults.
    pub fn clear_faults(&mut self) {
        self.faults.clear();
    }
    /// Completes `event` and everything queued before it on its stream (stream order). An event recorded
    /// during a capture never completes: [`DriverError::CapturedEvent`].
    pub fn complete_event(&mut self, event: EventId) -> Result<(), DriverError> {
        if self.captures.is_captured_event(event) {
            return Err(DriverError::CapturedEvent { event });
        }
        self.streams.complete(event)
    }
    /// Begins capturing `stream` into a graph in `mode`, on the calling thread (`cuStreamBeginCapture`);
    /// returns the capture's id, unique on this device, from 1. Refused with
    /// [`DriverError::CaptureMisuse`] on the legacy default stream (`0` or [`StreamId::LEGACY`]) and on a
    /// stream already capturing. A test control, not counted. See the module documentation for what a
    /// capture refuses.
    pub fn begin_capture(
        &mut self,
        stream: StreamId,
        mode: CaptureMode,
    ) -> Result<u64, DriverError> {
        self.captures.begin(stream, mode)
    }
    /// Ends the capture of `stream` (`cuStreamEndCapture`): the stream stops capturing either way.
    /// [`DriverError::CaptureInvalidated`] if a refused call invalidated the capture,
    /// [`DriverError::CaptureMisuse`] if the stream was not capturing. A test control, not counted.
    pub fn end_capture(&mut self, stream: StreamId) -> Result<(), DriverError> {
        self.captures.end(stream)
    }
    /// Calls refused so far because of a capture ([`DriverError::CaptureUnsupported`] and
    /// [`DriverError::CapturedEvent`]).
    pub fn capture_refusals(&self) -> u64 {
        self.captures.refusals()
    }
    /// Captures invalidated so far by a refused call.
    pub fn invalidated_captures(&self) -> u64 {
        self.captures.invalidated()
    }
    /// Whether device `peer` may read and write the mapping at `va`: for this device (0), whether its
    /// access was set; for a peer, whether a `set_access` made after [`Driver::add_peer`](super::Driver::add_peer) of it covered
    /// the mapping. `false` where nothing is mapped (unmapping forgets the access).
    pub fn peer_access(&self, va: u64, peer: usize) -> bool {
        let Some((_, mapping)) = self.vmm.mapping_at(va) else {
            return false;
        };
        match peer {
            0 => mapping.accessible,
            p if p < 32 => mapping.accessible && mapping.peers & (1 << p) != 0,
            _ => false,
        }
    }
    /// Destroys `stream` as a program does (`cuStreamDestroy`): the work already queued on it stays queued
    /// and completes as the test says ([`advance`](Self::advance), [`complete_stream`](Self::complete_stream),
    /// [`Driver::synchronize_device`](super::Driver::synchronize_device)), but every later driver call that
    /// names the stream (an event recorded on it, its synchronization, its capture status) and every launch
    /// on it is refused with [`DriverError::StreamDestroyed`]: on a GPU such a call is undefined behaviour.
    /// Returns whether it was destroyed now: false for CUDA's default streams, which cannot be destroyed,
    /// and for a stream destroyed before. A test control, not counted.
    pub fn destroy_stream(&mut self, stream: StreamId) -> bool {
        self.streams.destroy_stream(stream)
    }
    /// Completes everything queued on `stream`.
    pub fn complete_stream(&mut self, stream: StreamId) {
        self.streams.complete_stream(stream);
    }
    /// Writes `data` at device address `va` (backing store on). Nothing is written if any byte of the range
    /// is not accessible.
    pub fn write(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        let spans = self.spans(va, data.len() as u64)?;
        let mut store = self
            .store
            .as_ref()
            .ok_or(DriverError::NoBackingStore)?
            .lock();
        let mut rest = data;
        for span in spans {
            let (head, tail) = rest.split_at(span.len);
            store.write(span.owner, span.offset, head);
            rest = tail;
        }
        Ok(())
    }
    /// Reads `len` bytes at device address `va` (backing store on). Bytes never written read as 0.
    pub fn read(&self, va: u64, len: usize) -> Result<Vec<u8>, DriverError> {
        let spans = self.spans(va, len as u64)?;
        let store = self
            .store
            .as_ref()
            .ok_or(DriverError::NoBackingStore)?
            .lock();
        let mut out = vec![0; len];
        let mut at = 0;
        for span in spans {
            store.read(span.owner, span.offset, &mut out[at..at + span.len]);
            at += span.len;
        }
        Ok(out)
    }
    /// Plans the addresses `malloc` hands out: `(size, address)` pairs, in the order they are expected
    /// (see the module documentation). Replaces an earlier plan.
    pub fn plan_malloc_addresses(&mut self, plan: impl IntoIterator<Item = (u64, u64)>) {
        self.malloc_plan = plan.into_iter().collect();
    }
    /// Planned `malloc` addresses not used yet.
    pub fn planned_malloc_addresses_left(&self) -> usize {
        self.malloc_plan.len()
    }
    /// Takes the first planned address for `size` whose range is free.
    fn planned_address(&mut self, size: u64) -> Option<u64> {
        let index = self.malloc_plan.iter().position(|&(s, addr)| {
            s == size
                && self.mallocs.is_clear(addr, size)
                && !self
                    .vmm
                    .overlaps_reservation(addr, addr.saturating_add(size))
        })?;
        self.malloc_plan.remove(index).map(|(_, addr)| addr)
    }
    /// Bytes of page-locked host memory the copy jobs allocated and that is not freed yet.
    pub fn pinned_host_bytes(&self) -> u64 {
        self.copying.pinned_bytes()
    }
    /// How the last copy job ([`Driver::start_copies`](crate::driver::Driver::start_copies)) asked its
    /// host pieces to be pinned, `None` before the first: what the configuration's `pinned_*` keys reach on
    /// a GPU.
    pub fn last_copy_pinning(&self) -> Option<HostPinning> {
        self.copying.last_pinning()
    }
    /// What the device still holds.
    pub fn leak_report(&self) -> LeakReport {
        LeakReport {
            handles: self.vmm.unreleased_handles(),
            mappings: self.vmm.mapped_ranges(),
            reservations: self.vmm.reserved_ranges(),
            allocations: self.mallocs.ranges(),
        }
    }

    /// Drops the bytes of physical memory that was just freed, and what its exports kept.
    fn forget(&mut self, owner: Owner) {
        if let Some(store) = &self.store {
            store.lock().forget(owner);
        }
        if let Owner::Allocation(alloc) = owner {
            self.exports.freed(alloc);
        }
    }

    /// The physical memory behind `addr`, the offset in it, and the bytes left in it from `addr`.
    fn locate(&self, addr: u64) -> Result<(Owner, u64, u64), DriverError> {
        if let Some((start, m)) = self.vmm.mapping_at(addr) {
            if !m.accessible {
                return Err(DriverError::AccessDenied { addr });
            }
            let offset = m.offset + (addr - start);
            let owner = Owner::Allocation(self.vmm.allocation_of(m.handle));
            return Ok((owner, offset, start + m.size - addr));
        }
        if let Some((start, size)) = self.mallocs.containing(addr) {
            return Ok((Owner::Malloc(start), addr - start, start + size - addr));
        }
        Err(DriverError::NotMapped { op: Op::Map, addr })
    }

    /// Splits `va .. va + len` into pieces of physical memory, checking that every byte is accessible.
    fn spans(&self, va: u64, len: u64) -> Result<Vec<Span>, DriverError> {
        let mut spans = Vec::new();
        let mut addr = va;
        let mut left = len;
        while left > 0 {
            let (owner, offset, available) = self.locate(addr)?;
            let n = left.min(available);
            spans.push(Span {
                owner,
                offset,
                len: n as usize,
            });
            addr += n;
            left -= n;
        }
        Ok(spans)
    }
}

impl fmt::Debug for SimDriver {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SimDriver")
            .field("config", &self.config)
            .field("used_bytes", &self.used_bytes())
            .field("handles", &self.handle_count())
            .field("mappings", &self.mapping_count())
            .field("reservations", &self.reservation_count())
            .field("counters", &self.counters)
            .finish_non_exhaustive()
    }
}

impl Drop for SimDriver {
    fn drop(&mut self) {
        let report = self.leak_report();
        if !report.is_empty() {
            tracing::warn!("SimDriver dropped while still holding device memory:\n{report}");
        }
    }
}
