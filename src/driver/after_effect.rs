//! A driver whose chosen calls fail *after* they took effect, as a real driver's can.
//!
//! CUDA reports the errors of earlier asynchronous work from whatever call comes next, and some calls do
//! their work before they find an error to report: `cuEventDestroy` through cudarc destroys the event, then
//! returns the context's error. [`sim::SimDriver`](super::sim::SimDriver)'s own faults never have an effect
//! (the call fails before it checks its arguments), so they cannot show an allocator that loses track of a
//! resource when a call that worked says it failed. [`AfterEffect`] wraps any [`Driver`] and makes chosen
//! calls do their work and then return [`DriverError::Injected`]:
//!
//! | call | after-effect failure |
//! |---|---|
//! | `free_reservation`, `release`, `free`, `destroy_event`, `unmap` | the resource is given back; repeating the call reports it gone (`UnknownReservation`, `UnknownHandle`, `UnknownPointer`, `UnknownEvent`, `NotMapped`) |
//! | `map` | the handle is mapped; a second `map` there is `AlreadyMapped`, an `unmap` of the page succeeds |
//! | `set_access`, `synchronize`, `event_complete`, `mem_info`, `memset_d8`, `copy_to_host`, `copy_from_host` | done (each is harmless to repeat) |
//! | `reserve`, `create`, `malloc`, `record_event`, `import_handle` | made, then given back before the error: a creating call that fails leaves nothing behind (the caller has no name for it), as [`Driver`] asks of every driver |
//! | `export_handle` | the descriptor is made, then closed before the error (closing it gives nothing else back: the handle stays the caller's) |
//! | a copy job's steps (`start_copies`) | a host allocation is made, then freed before the error; a copy, the event and the wait are done |
//!
//! The undo of a creating call is a real call of the wrapped driver and is counted there (closing an
//! exported descriptor is no driver call). `create_each`
//! and `map_each` are made call by call while a failure is planned, so each call can fail.

use super::{
    CopyDirection, CopyJob, CopyPlan, CopyRun, Driver, DriverError, EventId, HostCopy, HostMemory,
    MemInfo, Op, PhysHandle, PhysPage, StreamId, VaRange, create_each_by_calls, map_each_by_calls,
};
use std::os::fd::{BorrowedFd, OwnedFd};

/// A [`Driver`] that passes every call to `D` and fails the planned ones after they took effect.
#[derive(Debug)]
pub struct AfterEffect<D> {
    inner: D,
    /// Planned failures: (operation, absolute 1-based call number of that operation on `inner`).
    planned: Vec<(Op, u64)>,
}

impl<D: Driver> AfterEffect<D> {
    /// Wraps `inner`, with no failure planned (every call is passed through unchanged).
    pub fn new(inner: D) -> Self {
        Self {
            inner,
            planned: Vec::new(),
        }
    }

    /// The wrapped driver.
    pub fn inner(&self) -> &D {
        &self.inner
    }

    /// The wrapped driver, for test controls (the simulator's faults, streams, bytes and leak report).
    pub fn inner_mut(&mut self) -> &mut D {
        &mut self.inner
    }

    /// Unwraps the driver.
    pub fn into_inner(self) -> D {
        self.inner
    }

    /// Makes the `n`th call of `op` from now (1-based, as the wrapped driver counts them) take effect and
    /// then fail with [`DriverError::Injected`].
    pub fn fail_nth_after_effect(&mut self, op: Op, n: u64) {
        self.planned.push((op, self.inner.counters().get(op) + n));
    }

    /// Removes every planned failure.
    pub fn clear(&mut self) {
        self.planned.clear();
    }

    /// Whether the call of `op` just made is a planned failure: its error, once.
    fn hit(&mut self, op: Op) -> Option<DriverError> {
        let call = self.inner.counters().get(op);
        let i = self.planned.iter().position(|&p| p == (op, call))?;
        self.planned.swap_remove(i);
        Some(DriverError::Injected { op, call })
    }

    /// `result` of a call of `op` that changes or gives back a resource: a planned failure after success.
    fn after<T>(&mut self, op: Op, result: Result<T, DriverError>) -> Result<T, DriverError> {
        let value = result?;
        match self.hit(op) {
            Some(err) => Err(err),
            None => Ok(value),
        }
    }

    /// `result` of a creating call of `op`: on a planned failure, `undo` gives the new resource back first.
    fn after_create<T: Copy>(
        &mut self,
        op: Op,
        result: Result<T, DriverError>,
        undo: impl FnOnce(&mut D, T) -> Result<(), DriverError>,
    ) -> Result<T, DriverError> {
        let value = result?;
        match self.hit(op) {
            Some(err) => {
                if let Err(undo_err) = undo(&mut self.inner, value) {
                    tracing::warn!(%undo_err, %op, "AfterEffect: giving back what a failed call made failed");
                }
                Err(err)
            }
            None => Ok(value),
        }
    }
}

/// Every call passes to `D`; those that can fail after their effect are overridden (the rest, such as
/// `granularity`, `counters` or `capture_status`, are [`Forward`](super::Forward)'s defaults).
impl<D: Driver> super::Forward for AfterEffect<D> {
    type Inner = D;
    fn inner(&self) -> &D {
        &self.inner
    }
    fn inner_mut(&mut self) -> &mut D {
        &mut self.inner
    }
    fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        let result = self.inner.reserve(size);
        self.after_create(Op::Reserve, result, |d, va| d.free_reservation(va))
    }
    fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        let result = self.inner.free_reservation(range);
        self.after(Op::FreeReservation, result)
    }
    fn create(&mut self, size: u64) -> Result<PhysHandle, DriverError> {
        let result = self.inner.create(size);
        self.after_create(Op::Create, result, |d, handle| d.release(handle))
    }
    fn release(&mut self, handle: PhysHandle) -> Result<(), DriverError> {
        let result = self.inner.release(handle);
        self.after(Op::Release, result)
    }
    fn map(&mut self, va: u64, size: u64, handle: PhysHandle) -> Result<(), DriverError> {
        let result = self.inner.map(va, size, handle);
        self.after(Op::Map, result)
    }
    fn map_from(&mut self, va: u64, size: u64, page: PhysPage) -> Result<(), DriverError> {
        let result = self.inner.map_from(va, size, page);
        self.after(Op::Map, result)
    }
    fn create_each(
        &mut self,
        size: u64,
        count: usize,
        out: &mut Vec<PhysHandle>,
    ) -> Result<(), DriverError> {
        if self.planned.is_empty() {
            return self.inner.create_each(size, count, out);
        }
        create_each_by_calls(self, size, count, out)
    }
    fn map_each(
        &mut self,
        va: u64,
        size: u64,
        pages: &[PhysPage],
    ) -> Result<(), (usize, DriverError)> {
        if self.planned.is_empty() {
            return self.inner.map_each(va, size, pages);
        }
        map_each_by_calls(self, va, size, pages)
    }
    fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        let result = self.inner.set_access(va, size);
        self.after(Op::SetAccess, result)
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        let result = self.inner.unmap(va, size);
        self.after(Op::Unmap, result)
    }
    fn mem_info(&mut self) -> Result<MemInfo, DriverError> {
        let result = self.inner.mem_info();
        self.after(Op::MemInfo, result)
    }
    fn malloc(&mut self, size: u64) -> Result<u64, DriverError> {
        let result = self.inner.malloc(size);
        self.after_create(Op::Malloc, result, |d, ptr| d.free(ptr))
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        let result = self.inner.free(ptr);
        self.after(Op::Free, result)
    }
    fn record_event(&mut self, stream: StreamId) -> Result<EventId, DriverError> {
        let result = self.inner.record_event(stream);
        self.after_create(Op::RecordEvent, result, |d, event| d.destroy_event(event))
    }
    fn event_complete(&mut self, event: EventId) -> Result<bool, DriverError> {
        let result = self.inner.event_complete(event);
        self.after(Op::QueryEvent, result)
    }
    fn destroy_event(&mut self, event: EventId) -> Result<(), DriverError> {
        let result = self.inner.destroy_event(event);
        self.after(Op::DestroyEvent, result)
    }
    fn synchronize(&mut self, stream: StreamId) -> Result<(), DriverError> {
        let result = self.inner.synchronize(stream);
        self.after(Op::Synchronize, result)
    }
    fn synchronize_device(&mut self) -> Result<(), DriverError> {
        let result = self.inner.synchronize_device();
        self.after(Op::Synchronize, result)
    }
    fn memset_d8(&mut self, va: u64, size: u64, value: u8) -> Result<(), DriverError> {
        let result = self.inner.memset_d8(va, size, value);
        self.after(Op::Memset, result)
    }
    fn copy_to_host(&mut self, va: u64, out: &mut [u8]) -> Result<(), DriverError> {
        let result = self.inner.copy_to_host(va, out);
        self.after(Op::CopyToHost, result)
    }
    fn copy_from_host(&mut self, va: u64, data: &[u8]) -> Result<(), DriverError> {
        let result = self.inner.copy_from_host(va, data);
        self.after(Op::CopyFromHost, result)
    }
    /// On a planned failure the new descriptor is dropped (closed) before the error.
    fn export_handle(&mut self, handle: PhysHandle) -> Result<OwnedFd, DriverError> {
        let fd = self.inner.export_handle(handle)?;
        match self.hit(Op::Export) {
            Some(err) => {
                drop(fd);
                Err(err)
            }
            None => Ok(fd),
        }
    }
    fn import_handle(&mut self, fd: BorrowedFd<'_>, size: u64) -> Result<PhysHandle, DriverError> {
        let result = self.inner.import_handle(fd, size);
        self.after_create(Op::Import, result, |d, handle| d.release(handle))
    }
    /// The job's steps the inner driver counted at its start that are planned to fail fail after their
    /// effect when the job runs them.
    fn start_copies(&mut self, plan: CopyPlan) -> Result<CopyJob, DriverError> {
        let before = self.inner.counters();
        let job = self.inner.start_copies(plan)?;
        let after = self.inner.counters();
        let mut fail = Vec::new();
        self.planned.retain(|&(op, call)| {
            let ours = before.get(op) < call && call <= after.get(op);
            if ours {
                fail.push((op, call - before.get(op), call));
            }
            !ours
        });
        if fail.is_empty() {
            return Ok(job);
        }
        Ok(job.wrap(|inner| {
            Box::new(AfterEffectRun {
                inner,
                fail,
                seen: Vec::new(),
            })
        }))
    }
}

/// A copy job's steps, some of which fail after their effect.
struct AfterEffectRun {
    inner: Box<dyn CopyRun>,
    /// (operation, its step among the job's steps of that operation from 1, the call's number).
    fail: Vec<(Op, u64, u64)>,
    /// The job's steps of each operation so far.
    seen: Vec<(Op, u64)>,
}

impl AfterEffectRun {
    /// Counts a step of `op` that succeeded: its planned failure, if it has one.
    fn hit(&mut self, op: Op) -> Option<DriverError> {
        let n = match self.seen.iter_mut().find(|(o, _)| *o == op) {
            Some((_, n)) => {
                *n += 1;
                *n
            }
            None => {
                self.seen.push((op, 1));
                1
            }
        };
        let i = self.fail.iter().position(|&(o, k, _)| o == op && k == n)?;
        let (_, _, call) = self.fail.swap_remove(i);
        Some(DriverError::Injected { op, call })
    }

    fn after(&mut self, op: Op, result: Result<(), DriverError>) -> Result<(), DriverError> {
        result?;
        self.hit(op).map_or(Ok(()), Err)
    }
}

impl CopyRun for AfterEffectRun {
    /// On a planned failure the memory is freed before the error.
    fn alloc(&mut self, len: u64) -> Result<HostMemory, DriverError> {
        let host = self.inner.alloc(len)?;
        match self.hit(Op::HostAlloc) {
            Some(err) => {
                drop(host);
                Err(err)
            }
            None => Ok(host),
        }
    }
    fn copy(
        &mut self,
        copy: &HostCopy,
        direction: CopyDirection,
        host: &mut HostMemory,
    ) -> Result<(), DriverError> {
        let result = self.inner.copy(copy, direction, host);
        self.after(direction.op(), result)
    }
    fn record(&mut self) -> Result<(), DriverError> {
        let result = self.inner.record();
        self.after(Op::RecordEvent, result)
    }
    fn wait(&mut self, recorded: bool) -> Result<(), DriverError> {
        let result = self.inner.wait(recorded);
        self.after(Op::Synchronize, result)
    }
    fn done(&mut self, host: &mut HostMemory) {
        self.inner.done(host);
    }
    fn finish(&mut self) {
        self.inner.finish();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::driver::sim::{SimConfig, SimDriver};

    const PAGE: u64 = 2 << 20;

    fn driver() -> AfterEffect<SimDriver> {
        AfterEffect::new(SimDriver::new(SimConfig::default().with_capacity(8 * PAGE)))
    }

    #[test]
    fn a_release_that_fails_after_effect_released_the_handle() {
        let mut d = driver();
        let handle = d.create(PAGE).unwrap();
        d.fail_nth_after_effect(Op::Release, 1);
        assert!(matches!(
            d.release(handle),
            Err(DriverError::Injected {
                op: Op::Release,
                call: 1
            })
        ));
        assert_eq!(d.inner().used_bytes(), 0, "the handle was released");
        assert!(matches!(
            d.release(handle),
            Err(DriverError::UnknownHandle { .. })
        ));
    }

    #[test]
    fn a_map_that_fails_after_effect_left_the_page_mapped() {
        let mut d = driver();
        let va = d.reserve(4 * PAGE).unwrap();
        let handle = d.create(PAGE).unwrap();
        d.fail_nth_after_effect(Op::Map, 1);
        assert!(d.map(va.start, PAGE, handle).is_err());
        assert_eq!(d.inner().mapping_count(), 1);
        assert!(matches!(
            d.map(va.start, PAGE, handle),
            Err(DriverError::AlreadyMapped { .. })
        ));
        d.unmap(va.start, PAGE).unwrap();
        d.release(handle).unwrap();
        d.free_reservation(va).unwrap();
        assert!(d.inner().leak_report().is_empty());
    }

    #[test]
    fn a_creating_call_that_fails_after_effect_leaves_nothing() {
        let mut d = driver();
        d.fail_nth_after_effect(Op::Create, 1);
        d.fail_nth_after_effect(Op::Reserve, 1);
        d.fail_nth_after_effect(Op::RecordEvent, 1);
        d.fail_nth_after_effect(Op::Malloc, 1);
        assert!(d.create(PAGE).is_err());
        assert!(d.reserve(PAGE).is_err());
        assert!(d.record_event(StreamId(1)).is_err());
        assert!(d.malloc(PAGE).is_err());
        assert_eq!(
            d.counters().get(Op::Release),
            1,
            "the undo is a counted call"
        );
        assert_eq!(d.inner().live_events(), 0);
        assert!(d.inner().leak_report().is_empty());
        // The next calls go through.
        let handle = d.create(PAGE).unwrap();
        d.release(handle).unwrap();
    }

    #[test]
    fn an_export_or_import_that_fails_after_effect_leaves_nothing() {
        use std::os::fd::AsFd;
        let mut d = driver();
        let handle = d.create(PAGE).unwrap();
        d.fail_nth_after_effect(Op::Export, 1);
        assert!(matches!(
            d.export_handle(handle),
            Err(DriverError::Injected { op: Op::Export, .. })
        ));
        let fd = d.export_handle(handle).unwrap();
        d.fail_nth_after_effect(Op::Import, 1);
        assert!(matches!(
            d.import_handle(fd.as_fd(), PAGE),
            Err(DriverError::Injected { op: Op::Import, .. })
        ));
        assert_eq!(d.inner().handle_count(), 1, "the import was released");
        assert_eq!(
            d.counters().get(Op::Release),
            1,
            "the undo is a counted call"
        );
        let import = d.import_handle(fd.as_fd(), PAGE).unwrap();
        d.release(import).unwrap();
        d.release(handle).unwrap();
        assert!(d.inner().leak_report().is_empty());
    }

    #[test]
    fn a_destroy_that_fails_after_effect_destroyed_the_event() {
        let mut d = driver();
        let event = d.record_event(StreamId(1)).unwrap();
        d.fail_nth_after_effect(Op::DestroyEvent, 1);
        assert!(d.destroy_event(event).is_err());
        assert_eq!(d.inner().live_events(), 0);
        assert!(matches!(
            d.destroy_event(event),
            Err(DriverError::UnknownEvent { .. })
        ));
    }

    #[test]
    fn map_each_fails_at_the_planned_page_after_mapping_it() {
        let mut d = driver();
        let va = d.reserve(4 * PAGE).unwrap();
        let mut handles = Vec::new();
        d.create_each(PAGE, 3, &mut handles).unwrap();
        d.fail_nth_after_effect(Op::Map, 2);
        let pages: Vec<PhysPage> = handles.into_iter().map(PhysPage::from).collect();
        let (done, err) = d.map_each(va.start, PAGE, &pages).unwrap_err();
        assert_eq!(done, 1);
        assert!(matches!(err, DriverError::Injected { op: Op::Map, .. }));
        assert_eq!(d.inner().mapping_count(), 2, "the failing map took effect");
    }
}
