//! What a `CudaDriver` holds on the device: its reservations, live handles, mappings, `malloc`s and events.
//!
//! The ledger exists so that every `unsafe` call's `# Safety` list can be checked before the call: a handle
//! is passed to the driver only if this driver created it and has not released it; an address range only
//! if it lies inside one of this driver's own reservations (or `malloc` allocations); bytes are touched
//! only through mappings whose access was set. Everything else (alignment, overlapping maps, partial
//! unmaps, out of memory, ...) is left for the real driver to reject, so that the conformance suite
//! tests CUDA's rules and not a copy of them. The ledger changes only after a call succeeded: a failed call
//! leaves everything it held known, so nothing is lost track of and drop can still give it back.
//!
//! Events are recorded, queried and destroyed through the ledger itself ([`Ledger::record_event`],
//! [`Ledger::destroy_event`]), given the raw calls as an [`EventCalls`], so that the order of "call, then
//! forget" is tested here without a GPU. Memory is given back the same way (`give_back.rs`), where a
//! failure is settled: a resource the driver no longer knows is forgotten and reported gone.

use super::errors::says_unknown;
use crate::driver::sim::LeakReport;
use crate::driver::{DriverError, EventId, Op, PhysHandle, VaRange};
use std::collections::{BTreeMap, HashMap};

/// The raw event calls (`cuEventCreate`, `cuEventRecord`, `cuEventQuery`, `cuEventDestroy`) that the
/// ledger's event operations make, events and streams as integers: the driver's `Calls` on a GPU, a fake
/// in tests.
pub(super) trait EventCalls {
    /// Creates an event.
    fn create(&mut self) -> Result<u64, DriverError>;
    /// Records `event` on `stream`.
    fn record(&mut self, event: u64, stream: u64) -> Result<(), DriverError>;
    /// Whether `event` has completed.
    fn query(&mut self, event: u64) -> Result<bool, DriverError>;
    /// Destroys `event`.
    fn destroy(&mut self, event: u64) -> Result<(), DriverError>;
}

/// One successful `cuMemMap`.
#[derive(Clone, Copy, Debug)]
struct Mapping {
    size: u64,
    accessible: bool,
}

/// Reservations, handles, mappings and allocations held by one driver.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    reservations: BTreeMap<u64, u64>,
    handles: HashMap<u64, u64>,
    mappings: BTreeMap<u64, Mapping>,
    mallocs: BTreeMap<u64, u64>,
    /// Live events: the allocator's id -> the raw `CUevent`.
    events: HashMap<u64, u64>,
    /// The last event id handed out.
    last_event: u64,
    /// Events created for a record that failed and whose destroy failed too: no one has an id for them,
    /// and drop destroys them.
    orphans: Vec<u64>,
}

impl Ledger {
    /// Creates an event and records it on `stream`. If recording fails, the new event is destroyed; if
    /// that fails too (other than with the driver saying it has no such event) it is kept as an orphan for
    /// drop, so a failed record leaves nothing behind and no event is lost track of.
    pub(super) fn record_event(
        &mut self,
        calls: &mut impl EventCalls,
        stream: u64,
    ) -> Result<EventId, DriverError> {
        let raw = calls.create()?;
        if let Err(err) = calls.record(raw, stream) {
            match calls.destroy(raw) {
                Ok(()) => {}
                // Gone: the destroy had worked before it failed.
                Err(destroy_err) if says_unknown(&destroy_err) => {}
                Err(destroy_err) => {
                    tracing::warn!(%destroy_err, "cuvmm: destroying an event whose record failed; destroyed on drop");
                    self.orphans.push(raw);
                }
            }
            return Err(err);
        }
        self.last_event += 1;
        self.events.insert(self.last_event, raw);
        Ok(EventId(self.last_event))
    }

    /// Whether the work before `event` has completed, or [`DriverError::UnknownEvent`].
    pub(super) fn event_complete(
        &self,
        calls: &mut impl EventCalls,
        event: EventId,
    ) -> Result<bool, DriverError> {
        let raw = self.raw_event(event)?;
        calls.query(raw)
    }

    /// Destroys `event`, forgetting it only once the driver has destroyed it: after a failure the event is
    /// still known (queryable, destroyed again by a later call or on drop), so a failed destroy has no
    /// effect. If the driver answers that it has no such event (`CUDA_ERROR_INVALID_HANDLE` or
    /// `_INVALID_VALUE`) for one the ledger holds, an earlier destroy that failed had destroyed it: it is
    /// forgotten and reported gone ([`DriverError::UnknownEvent`]).
    pub(super) fn destroy_event(
        &mut self,
        calls: &mut impl EventCalls,
        event: EventId,
    ) -> Result<(), DriverError> {
        let raw = self.raw_event(event)?;
        match calls.destroy(raw) {
            Ok(()) => {}
            Err(err) if says_unknown(&err) => {
                self.events.remove(&event.0);
                return Err(DriverError::UnknownEvent { event });
            }
            Err(err) => return Err(err),
        }
        self.events.remove(&event.0);
        Ok(())
    }

    /// The raw event behind `event`, or [`DriverError::UnknownEvent`].
    fn raw_event(&self, event: EventId) -> Result<u64, DriverError> {
        self.events
            .get(&event.0)
            .copied()
            .ok_or(DriverError::UnknownEvent { event })
    }

    /// How many events are live or orphaned.
    pub(super) fn events_held(&self) -> usize {
        self.events.len() + self.orphans.len()
    }

    /// The size of a live handle, or [`DriverError::UnknownHandle`].
    pub(super) fn handle_size(&self, op: Op, handle: PhysHandle) -> Result<u64, DriverError> {
        self.handles
            .get(&handle.0)
            .copied()
            .ok_or(DriverError::UnknownHandle { op, handle })
    }

    /// Checks that `va .. va + size` lies inside one of this driver's reservations.
    pub(super) fn check_reserved(&self, op: Op, va: u64, size: u64) -> Result<(), DriverError> {
        let inside = self
            .reservations
            .range(..=va)
            .next_back()
            .is_some_and(|(&start, &len)| VaRange::new(start, len).contains_range(va, size));
        if inside {
            Ok(())
        } else {
            Err(DriverError::OutsideReservation {
                op,
                start: va,
                size,
            })
        }
    }

    /// Checks that `range` is exactly one of this driver's reservations, with nothing mapped in it.
    pub(super) fn check_free_reservation(&self, range: VaRange) -> Result<(), DriverError> {
        if self.reservations.get(&range.start) != Some(&range.size) {
            return Err(DriverError::UnknownReservation {
                op: Op::FreeReservation,
                start: range.start,
            });
        }
        let mapped = self.mappings.range(range.start..range.end()).count();
        if mapped > 0 {
            return Err(DriverError::ReservationInUse {
                start: range.start,
                mapped,
            });
        }
        Ok(())
    }

    /// Checks that `va .. va + len` is memory this driver may touch: covered without a gap by mappings
    /// whose access was set, or inside one `malloc` allocation.
    pub(super) fn check_touchable(&self, op: Op, va: u64, len: u64) -> Result<(), DriverError> {
        let end = va
            .checked_add(len)
            .ok_or(DriverError::NotMapped { op, addr: va })?;
        if let Some((&start, &size)) = self.mallocs.range(..=va).next_back() {
            if VaRange::new(start, size).contains_range(va, len) {
                return Ok(());
            }
        }
        let mut cursor = va;
        while cursor < end {
            let (start, m) = match self.mappings.range(..=cursor).next_back() {
                Some((&start, m)) if cursor < start + m.size => (start, m),
                _ => return Err(DriverError::NotMapped { op, addr: cursor }),
            };
            if !m.accessible {
                return Err(DriverError::AccessDenied { addr: cursor });
            }
            cursor = start + m.size;
        }
        Ok(())
    }

    /// Whether `ptr` is a live `malloc` allocation.
    pub(super) fn check_malloc(&self, ptr: u64) -> Result<(), DriverError> {
        if self.mallocs.contains_key(&ptr) {
            Ok(())
        } else {
            Err(DriverError::UnknownPointer {
                op: Op::Free,
                addr: ptr,
            })
        }
    }

    /// Records a new reservation.
    pub(super) fn reserved(&mut self, range: VaRange) {
        self.reservations.insert(range.start, range.size);
    }

    /// Forgets a freed reservation.
    pub(super) fn reservation_freed(&mut self, range: VaRange) {
        self.reservations.remove(&range.start);
    }

    /// Records a new handle.
    pub(super) fn created(&mut self, handle: PhysHandle, size: u64) {
        self.handles.insert(handle.0, size);
    }

    /// Forgets a released handle (its mappings stay until they are unmapped, as in CUDA).
    pub(super) fn released(&mut self, handle: PhysHandle) {
        self.handles.remove(&handle.0);
    }

    /// Records a new mapping, without access.
    pub(super) fn mapped(&mut self, va: u64, size: u64) {
        self.mappings.insert(
            va,
            Mapping {
                size,
                accessible: false,
            },
        );
    }

    /// Marks the mappings that start inside `va .. va + size` accessible.
    pub(super) fn access_set(&mut self, va: u64, size: u64) {
        for (_, m) in self.mappings.range_mut(va..va.saturating_add(size)) {
            m.accessible = true;
        }
    }

    /// The mappings (start, size) that overlap `va .. va + size`, in address order.
    pub(super) fn mappings_overlapping(&self, va: u64, size: u64) -> Vec<(u64, u64)> {
        let end = va.saturating_add(size);
        let before = self
            .mappings
            .range(..va)
            .next_back()
            .filter(|&(&s, m)| s + m.size > va);
        before
            .into_iter()
            .chain(self.mappings.range(va..end))
            .map(|(&s, m)| (s, m.size))
            .collect()
    }

    /// Whether a mapping starts at `va`.
    pub(super) fn has_mapping_at(&self, va: u64) -> bool {
        self.mappings.contains_key(&va)
    }

    /// Forgets the mapping that starts at `va`.
    pub(super) fn forget_mapping(&mut self, va: u64) {
        self.mappings.remove(&va);
    }

    /// Forgets the mappings that start inside `va .. va + size`.
    pub(super) fn unmapped(&mut self, va: u64, size: u64) {
        let starts: Vec<u64> = self
            .mappings
            .range(va..va.saturating_add(size))
            .map(|(&s, _)| s)
            .collect();
        for start in starts {
            self.mappings.remove(&start);
        }
    }

    /// Records a new `malloc` allocation.
    pub(super) fn malloced(&mut self, ptr: u64, size: u64) {
        self.mallocs.insert(ptr, size);
    }

    /// Forgets a freed `malloc` allocation.
    pub(super) fn freed(&mut self, ptr: u64) {
        self.mallocs.remove(&ptr);
    }

    /// What is still held, in the simulator's report format.
    pub(super) fn report(&self) -> LeakReport {
        let mut handles: Vec<(PhysHandle, u64)> = self
            .handles
            .iter()
            .map(|(&h, &size)| (PhysHandle(h), size))
            .collect();
        handles.sort_unstable();
        LeakReport {
            handles,
            mappings: self
                .mappings
                .iter()
                .map(|(&s, m)| VaRange::new(s, m.size))
                .collect(),
            reservations: self
                .reservations
                .iter()
                .map(|(&s, &size)| VaRange::new(s, size))
                .collect(),
            allocations: self
                .mallocs
                .iter()
                .map(|(&s, &size)| VaRange::new(s, size))
                .collect(),
        }
    }

    /// Takes everything out of the ledger, for the driver's drop to give back: mappings (start, size),
    /// live handles, reservations and `malloc` pointers.
    pub(super) fn drain(&mut self) -> Drained {
        Drained {
            mappings: std::mem::take(&mut self.mappings)
                .into_iter()
                .map(|(s, m)| (s, m.size))
                .collect(),
            handles: std::mem::take(&mut self.handles).into_keys().collect(),
            reservations: std::mem::take(&mut self.reservations)
                .into_iter()
                .map(|(s, size)| VaRange::new(s, size))
                .collect(),
            mallocs: std::mem::take(&mut self.mallocs).into_keys().collect(),
            events: std::mem::take(&mut self.events)
                .into_values()
                .chain(std::mem::take(&mut self.orphans))
                .collect(),
        }
    }
}

/// Everything a ledger held, taken out by [`Ledger::drain`].
#[derive(Debug, Default)]
pub(super) struct Drained {
    /// Mappings as (start, size), in address order.
    pub(super) mappings: Vec<(u64, u64)>,
    /// Live handles.
    pub(super) handles: Vec<u64>,
    /// Reservations.
    pub(super) reservations: Vec<VaRange>,
    /// `malloc` pointers.
    pub(super) mallocs: Vec<u64>,
    /// Raw events, live and orphaned.
    pub(super) events: Vec<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn guards_handles_ranges_and_touches() {
        let mut l = Ledger::default();
        let r = VaRange::new(0x1000, 0x4000);
        l.reserved(r);
        assert!(l.check_reserved(Op::Map, 0x1000, 0x4000).is_ok());
        assert!(matches!(
            l.check_reserved(Op::Map, 0x4000, 0x2000),
            Err(DriverError::OutsideReservation { .. })
        ));
        assert!(matches!(
            l.check_reserved(Op::Map, 0x0, 0x1000),
            Err(DriverError::OutsideReservation { .. })
        ));
        let h = PhysHandle(77);
        assert!(matches!(
            l.handle_size(Op::Map, h),
            Err(DriverError::UnknownHandle { .. })
        ));
        l.created(h, 0x1000);
        assert_eq!(l.handle_size(Op::Map, h), Ok(0x1000));
        l.mapped(0x1000, 0x1000);
        l.created(PhysHandle(78), 0x1000);
        l.mapped(0x2000, 0x1000);
        assert_eq!(
            l.check_touchable(Op::Memset, 0x1800, 0x10),
            Err(DriverError::AccessDenied { addr: 0x1800 })
        );
        l.access_set(0x1000, 0x2000);
        assert!(l.check_touchable(Op::Memset, 0x1800, 0x1000).is_ok());
        assert_eq!(
            l.check_touchable(Op::Memset, 0x2800, 0x1000),
            Err(DriverError::NotMapped {
                op: Op::Memset,
                addr: 0x3000
            })
        );
        assert!(matches!(
            l.check_free_reservation(r),
            Err(DriverError::ReservationInUse { mapped: 2, .. })
        ));
        l.released(h);
        l.unmapped(0x1000, 0x2000);
        l.released(PhysHandle(78));
        assert!(l.check_free_reservation(r).is_ok());
        l.reservation_freed(r);
        assert!(l.report().is_empty());
        l.malloced(0x9000, 100);
        assert!(l.check_touchable(Op::CopyToHost, 0x9010, 50).is_ok());
        assert!(l.check_touchable(Op::CopyToHost, 0x9010, 100).is_err());
        assert!(l.check_malloc(0x9000).is_ok());
        assert!(l.check_malloc(0x9001).is_err());
        let drained = l.drain();
        assert_eq!(drained.mallocs, vec![0x9000]);
        assert!(l.report().is_empty());
    }

    /// Event calls that fail when told to, and remember which raw events exist on the "device".
    #[derive(Default)]
    struct FakeEvents {
        alive: Vec<u64>,
        next: u64,
        fail_record: bool,
        fail_destroy: bool,
        /// Destroy, then fail (as a call that reports an earlier error).
        destroy_then_fail: bool,
        done: bool,
    }

    fn injected(op: Op) -> DriverError {
        DriverError::Injected { op, call: 1 }
    }

    /// `CUDA_ERROR_INVALID_HANDLE`: what the driver answers for an event it does not know.
    fn invalid_handle() -> DriverError {
        DriverError::Cuda {
            op: Op::DestroyEvent,
            code: 400,
            name: "CUDA_ERROR_INVALID_HANDLE".to_string(),
        }
    }

    impl EventCalls for FakeEvents {
        fn create(&mut self) -> Result<u64, DriverError> {
            self.next += 0x100;
            self.alive.push(self.next);
            Ok(self.next)
        }
        fn record(&mut self, event: u64, _stream: u64) -> Result<(), DriverError> {
            assert!(self.alive.contains(&event), "record of a dead event");
            if self.fail_record {
                return Err(injected(Op::RecordEvent));
            }
            Ok(())
        }
        fn query(&mut self, event: u64) -> Result<bool, DriverError> {
            assert!(self.alive.contains(&event), "query of a dead event");
            Ok(self.done)
        }
        fn destroy(&mut self, event: u64) -> Result<(), DriverError> {
            if !self.alive.contains(&event) {
                return Err(invalid_handle());
            }
            if self.fail_destroy {
                return Err(injected(Op::DestroyEvent));
            }
            self.alive.retain(|&e| e != event);
            if self.destroy_then_fail {
                return Err(injected(Op::DestroyEvent));
            }
            Ok(())
        }
    }

    /// The regression of issue 15: a failed `destroy_event` removed the event from the ledger before the
    /// driver had destroyed it, so the allocator's next query found `UnknownEvent` forever, and the event
    /// leaked. Now a failed destroy has no effect: the event is still known and queryable, and a later
    /// destroy (or drop) succeeds.
    #[test]
    fn a_failed_destroy_keeps_the_event_known_and_queryable() {
        let mut l = Ledger::default();
        let mut dev = FakeEvents::default();
        let e = l.record_event(&mut dev, 7).unwrap();
        dev.fail_destroy = true;
        assert_eq!(
            l.destroy_event(&mut dev, e),
            Err(injected(Op::DestroyEvent))
        );
        assert_eq!(l.events_held(), 1);
        dev.done = true;
        assert_eq!(l.event_complete(&mut dev, e), Ok(true));
        dev.fail_destroy = false;
        assert_eq!(l.destroy_event(&mut dev, e), Ok(()));
        assert!(
            dev.alive.is_empty(),
            "the event was destroyed on the device"
        );
        assert_eq!(l.events_held(), 0);
        assert_eq!(
            l.event_complete(&mut dev, e),
            Err(DriverError::UnknownEvent { event: e })
        );
        assert_eq!(
            l.destroy_event(&mut dev, e),
            Err(DriverError::UnknownEvent { event: e })
        );
    }

    #[test]
    fn a_failed_record_destroys_its_event_or_keeps_it_for_drop() {
        let mut l = Ledger::default();
        let mut dev = FakeEvents {
            fail_record: true,
            ..FakeEvents::default()
        };
        assert_eq!(l.record_event(&mut dev, 0), Err(injected(Op::RecordEvent)));
        assert!(dev.alive.is_empty(), "the unrecorded event was destroyed");
        assert_eq!(l.events_held(), 0);
        dev.fail_destroy = true;
        assert_eq!(l.record_event(&mut dev, 0), Err(injected(Op::RecordEvent)));
        assert_eq!(dev.alive.len(), 1);
        assert_eq!(l.events_held(), 1, "kept as an orphan");
        dev.fail_record = false;
        let e = l.record_event(&mut dev, 0).unwrap();
        let mut drained = l.drain().events;
        drained.sort_unstable();
        assert_eq!(
            drained, dev.alive,
            "drop gets every event the device still has"
        );
        assert_eq!(l.events_held(), 0);
        assert_eq!(
            l.event_complete(&mut dev, e),
            Err(DriverError::UnknownEvent { event: e })
        );
    }

    /// A destroy that destroyed the event and then failed keeps it known (the driver's answer cannot tell
    /// them apart); the repeat, answered "invalid handle" by the driver, reports it gone
    /// ([`DriverError::UnknownEvent`], which the allocator takes as destroyed) instead of the raw error it
    /// would retry at every poll.
    #[test]
    fn a_destroy_that_took_effect_is_reported_gone_on_the_repeat() {
        let mut l = Ledger::default();
        let mut dev = FakeEvents::default();
        let e = l.record_event(&mut dev, 7).unwrap();
        dev.destroy_then_fail = true;
        assert_eq!(
            l.destroy_event(&mut dev, e),
            Err(injected(Op::DestroyEvent))
        );
        assert!(dev.alive.is_empty());
        assert_eq!(
            l.destroy_event(&mut dev, e),
            Err(DriverError::UnknownEvent { event: e })
        );
        assert_eq!(
            l.events_held(),
            0,
            "forgotten, so drop destroys nothing twice"
        );
    }

    /// A failed record whose destroy destroyed the event and then failed keeps nothing for drop once
    /// the driver says the event is gone; otherwise the event is an orphan for drop.
    #[test]
    fn a_failed_record_whose_destroy_took_effect_leaves_no_event() {
        let mut l = Ledger::default();
        let mut dev = FakeEvents {
            fail_record: true,
            destroy_then_fail: true,
            ..FakeEvents::default()
        };
        assert_eq!(l.record_event(&mut dev, 0), Err(injected(Op::RecordEvent)));
        assert!(dev.alive.is_empty(), "the unrecorded event was destroyed");
        assert_eq!(
            l.events_held(),
            1,
            "the destroy's answer could not tell: kept for drop"
        );
        let drained = l.drain().events;
        assert_eq!(drained.len(), 1);
        assert_eq!(
            dev.destroy(drained[0]),
            Err(invalid_handle()),
            "drop's destroy is answered 'invalid', which it logs"
        );
    }
}
