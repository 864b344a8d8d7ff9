//! The driver calls: what every call pays before its work (its modelled latency, a planned fault, a
//! refusal during a capture that forbids it), and the [`Driver`] implementation that does the work in the
//! part that owns the state (`vmm`, `mallocs`, `streams`, `captures`, `store`).

use super::latency::wait_out;
use super::store::Owner;
use super::{FaultKind, LatencyModel, SimDriver};
use crate::driver::{
    CaptureProbe, CaptureStatus, CopyJob, CopyPlan, Driver, DriverCounters, DriverError, EventId,
    MemInfo, Op, PhysHandle, PhysPage, StreamId, VaRange,
};
use std::os::fd::{AsRawFd, BorrowedFd, OwnedFd};

impl SimDriver {
    /// Waits `ns` nanoseconds of modelled latency when [`SimConfig::sleep_latency`] is on
    /// ([`wait_out`]).
    #[cold]
    pub(super) fn sleep(&self, ns: u64) {
        if self.config.sleep_latency {
            wait_out(ns);
        }
    }

    /// Counts a call of `op` covering `bytes` as [`begin`](Self::begin) does, without waiting out its
    /// latency: a step of a copy job, which waits it out while it runs, without the driver. Returns the
    /// call's modelled nanoseconds, or the fault planned for it (a host allocation's out-of-memory is the
    /// host's, [`DriverError::HostOutOfMemory`]).
    pub(super) fn charge(&mut self, op: Op, bytes: u64) -> Result<u64, DriverError> {
        let (cost, units) = self.config.latency.charge(op, bytes);
        self.counters.record(op, cost);
        self.counters.record_units(op, 1, units);
        if !self.faults.none_planned() {
            self.inject(op, bytes).map_err(|err| match err {
                DriverError::OutOfMemory { .. } if op == Op::HostAlloc => {
                    DriverError::HostOutOfMemory { bytes }
                }
                other => other,
            })?;
        }
        Ok(cost)
    }

    /// Charges the mappings a call of `op` covered beyond the first (`begin` charged one): the fixed part
    /// of `set_access` and `unmap` is paid per mapping.
    pub(super) fn more_mappings(&mut self, op: Op, covered: u64) {
        let extra = covered.saturating_sub(1);
        if extra == 0 {
            return;
        }
        self.counters.record_extra_mappings(op, extra);
        let cost = self.config.latency.fixed(op).saturating_mul(extra);
        self.counters.time_ns = self.counters.time_ns.saturating_add(cost);
        if self.config.sleep_latency {
            self.sleep(cost);
        }
    }

    /// Counts a call of `op` covering `bytes`, and fails it if a fault is planned for it.
    // Always inlined: every driver call passes a constant `op`, so the latency model's choice of formula
    // folds away and what is left is three additions and two tests (callgrind: 69 instructions a call
    // when it was a function of `op`).
    #[inline(always)]
    pub(super) fn begin(&mut self, op: Op, bytes: u64) -> Result<(), DriverError> {
        let (cost, units) = self.config.latency.charge(op, bytes);
        self.counters.record(op, cost);
        self.counters.record_units(op, 1, units);
        if self.config.sleep_latency {
            self.sleep(cost);
        }
        if self.faults.none_planned() {
            return Ok(());
        }
        self.inject(op, bytes)
    }

    /// Refuses a potentially unsafe call of `op` during a capture that forbids it (`own`: the stream whose
    /// work the call waits for). Free when no capture is under way.
    #[inline(always)]
    pub(super) fn refuse_in_capture(
        &mut self,
        op: Op,
        own: Option<StreamId>,
    ) -> Result<(), DriverError> {
        if self.captures.idle() {
            return Ok(());
        }
        self.captures.check(op, own)
    }

    /// The fault planned for the call of `op` just counted, if any.
    #[inline(never)]
    pub(super) fn inject(&mut self, op: Op, bytes: u64) -> Result<(), DriverError> {
        let call = self.counters.get(op);
        match self.faults.check(op, call) {
            None => Ok(()),
            Some(FaultKind::Error) => Err(DriverError::Injected { op, call }),
            Some(FaultKind::OutOfMemory) => Err(DriverError::OutOfMemory {
                op,
                requested: bytes,
                free: self.free_bytes(),
            }),
        }
    }
}

impl Driver for SimDriver {
    fn granularity(&self) -> u64 {
        self.config.granularity
    }
    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        self.begin(Op::Reserve, size)?;
        self.vmm.reserve(size)
    }
    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        self.begin(Op::FreeReservation, range.size)?;
        self.refuse_in_capture(Op::FreeReservation, None)?;
        self.vmm.free_reservation(range)
    }
    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        self.begin(Op::Create, size)?;
        let free = self.free_bytes();
        let created = self.vmm.create(size, free);
        self.publish();
        created
    }
    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        self.begin(Op::Release, self.vmm.handle_size(handle).unwrap_or(0))?;
        self.refuse_in_capture(Op::Release, None)?;
        if let Some(freed) = self.vmm.release(handle)? {
            self.forget(Owner::Allocation(freed));
        }
        self.publish();
        Ok(())
    }
    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        self.begin(Op::Map, size)?;
        self.vmm.map(va, size, handle, None)
    }
    fn map_from(&mut self, va: u64, size: u64, page: PhysPage) -> Result<(), DriverError> {
        self.begin(Op::Map, size)?;
        self.vmm.map(va, size, page.handle, Some(page.offset))
    }
    /// In one pass when no fault is planned and every call would succeed; one by one otherwise, so the
    /// calls fail exactly as they would.
    fn create_each(
        &mut self,
        size: u64,
        count: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        if self.faults.none_planned() {
            let free = self.free_bytes();
            if self.vmm.create_all(size, count, free, out) {
                let cost = self.config.latency.cost_ns(Op::Create, size);
                self.counters.record_many(Op::Create, count as u64, cost);
                self.sleep(cost * count as u64);
                let units = LatencyModel::units(Op::Create, size);
                self.counters.record_units(Op::Create, count as u64, units);
                self.publish();
                return Ok(());
            }
        }
        crate::driver::create_each_by_calls(self, size, count, out)
    }
    /// In one pass when no fault is planned and every call would succeed, as
    /// [`create_each`](Driver::create_each).
    fn map_each(
        &mut self,
        va: u64,
        size: u64,
        pages: &[PhysPage],
    ) -> Result<(), (usize, DriverError)> {
        if self.faults.none_planned() && self.vmm.map_all(va, size, pages) {
            let cost = self.config.latency.cost_ns(Op::Map, size);
            self.counters.record_many(Op::Map, pages.len() as u64, cost);
            self.sleep(cost * pages.len() as u64);
            let units = LatencyModel::units(Op::Map, size);
            self.counters
                .record_units(Op::Map, pages.len() as u64, units);
            return Ok(());
        }
        crate::driver::map_each_by_calls(self, va, size, pages)
    }
    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.begin(Op::SetAccess, size)?;
        let covered = self.vmm.set_access(va, size, self.peers)?;
        self.more_mappings(Op::SetAccess, covered);
        Ok(())
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.begin(Op::Unmap, size)?;
        self.refuse_in_capture(Op::Unmap, None)?;
        if let Some(&(stream, va)) = self.streams.users_of(va, size).first() {
            return Err(DriverError::UnmapWhileInUse { va, stream });
        }
        if let Some(va) = self.copying.user_of(va, size) {
            let stream = super::COPY_STREAM;
            return Err(DriverError::UnmapWhileInUse { va, stream });
        }
        let (freed, covered) = self.vmm.unmap(va, size)?;
        for alloc in freed {
            self.forget(Owner::Allocation(alloc));
        }
        self.more_mappings(Op::Unmap, covered);
        self.publish();
        Ok(())
    }
    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        self.begin(Op::MemInfo, 0)?;
        Ok(MemInfo {
            free: self.free_bytes(),
            total: self.config.capacity,
        })
    }
    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        self.begin(Op::Malloc, size)?;
        let free = self.free_bytes();
        let fits = size > 0
            && size
                .checked_next_multiple_of(512)
                .is_some_and(|held| held <= free);
        let at = if self.malloc_plan.is_empty() || !fits {
            None
        } else {
            self.planned_address(size)
        };
        let allocated = self.mallocs.malloc(size, free, at);
        self.publish();
        allocated
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        self.begin(Op::Free, self.mallocs.size(ptr).unwrap_or(0))?;
        self.refuse_in_capture(Op::Free, None)?;
        self.mallocs.free(ptr)?;
        self.forget(Owner::Malloc(ptr));
        self.publish();
        Ok(())
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        self.begin(Op::RecordEvent, 0)?;
        self.streams.alive(Op::RecordEvent.name(), stream)?;
        if self.captures.is_capturing(stream) {
            let event = self.streams.record_captured(stream);
            self.captures.recorded(event, stream);
            return Ok(event);
        }
        Ok(self.streams.record(stream))
    }
    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        self.begin(Op::QueryEvent, 0)?;
        if !self.captures.idle() {
            self.captures.check_query(event)?;
        }
        self.streams.is_complete(event)
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        self.begin(Op::DestroyEvent, 0)?;
        self.streams.destroy(event)?;
        self.captures.destroyed(event);
        Ok(())
    }
    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        self.begin(Op::Synchronize, 0)?;
        self.streams.alive(Op::Synchronize.name(), stream)?;
        self.refuse_in_capture(Op::Synchronize, Some(stream))?;
        self.streams.complete_stream(stream);
        Ok(())
    }
    /// Refused while any stream captures (it would wait for a capturing stream), which invalidates every
    /// capture underway.
    fn synchronize_device(&mut self) -> Result<(), DriverError> {
        self.begin(Op::Synchronize, 0)?;
        if !self.captures.idle() {
            self.captures.check_device(Op::Synchronize)?;
        }
        self.streams.complete_all();
        Ok(())
    }
    fn counters(&self) -> DriverCounters {
        self.counters
    }
    fn maps_parts_of_handles(&self) -> bool {
        self.config.partial_mappings
    }
    fn capture_status(&mut self, stream: StreamId) -> Result<CaptureStatus, DriverError> {
        self.begin(Op::CaptureInfo, 0)?;
        self.streams.alive(Op::CaptureInfo.name(), stream)?;
        Ok(self.captures.status(stream))
    }
    /// Answers as [`capture_status`](Driver::capture_status) does, for any thread; not counted, never
    /// faulted.
    fn capture_probe(&self) -> Option<CaptureProbe> {
        Some(self.captures.probe())
    }
    /// Device 0 (this one) is a no-op; a device outside the machine ([`SimConfig::devices`](super::SimConfig::devices)) is
    /// [`DriverError::PeerAccess`]. Not counted: it makes no driver call, it configures later
    /// `set_access` calls.
    fn add_peer(&mut self, peer: usize) -> Result<(), DriverError> {
        if peer == 0 {
            return Ok(());
        }
        if peer >= self.config.devices {
            return Err(DriverError::PeerAccess { device: 0, peer });
        }
        self.peers |= 1 << peer;
        Ok(())
    }
    fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
        self.begin(Op::Memset, size)?;
        let spans = self.spans(va, size)?;
        let mut store = self
            .store
            .as_ref()
            .ok_or(DriverError::NoBackingStore)?
            .lock();
        for span in spans {
            store.fill(span.owner, span.offset, span.len as u64, value);
        }
        Ok(())
    }
    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        self.begin(Op::CopyToHost, out.len() as u64)?;
        let bytes = self.read(va, out.len())?;
        out.copy_from_slice(&bytes);
        Ok(())
    }
    fn copy_from_host(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        self.begin(Op::CopyFromHost, data.len() as u64)?;
        self.write(va, data)
    }
    /// Checks the plan and its device ranges now, counts every step the job will make and decides its
    /// faults now (`copies.rs`), so that a job fails as deterministically as a call.
    fn start_copies(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
        self.start_copy_job(plan)
    }
    fn exports_handles(&self) -> bool {
        self.config.exportable_handles
    }
    fn export_handle(&mut self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        self.begin(Op::Export, self.vmm.handle_size(handle).unwrap_or(0))?;
        if !self.config.exportable_handles {
            return Err(DriverError::Unsupported { op: Op::Export });
        }
        // `handle` must be live ([`DriverError::UnknownHandle`] otherwise).
        let (alloc, size) = self.vmm.exportable(handle)?;
        self.exports.export(alloc, size)
    }
    fn import_handle(&mut self, fd: BorrowedFd<'_>, size: u64) -> Result<PhysHandle, DriverError> {
        self.begin(Op::Import, size)?;
        if !self.config.exportable_handles {
            return Err(DriverError::Unsupported { op: Op::Import });
        }
        // `fd` must be an export of this device whose memory is alive, of `size` bytes.
        let (alloc, exported) = self.exports.find(fd)?;
        if !self.vmm.allocation_alive(alloc) {
            return Err(DriverError::ExportFreed { fd: fd.as_raw_fd() });
        }
        if size != exported {
            return Err(DriverError::ImportSizeMismatch {
                fd: fd.as_raw_fd(),
                exported,
                size,
            });
        }
        let imported = self.vmm.import(alloc, size);
        self.publish();
        Ok(imported)
    }
}
