//! Tests of `give_back.rs` without a GPU: a fake device whose calls fail before or after their effect, and
//! whose queries can fail too, against the allocator's settle rule (one repeat; success or "gone" is done).

use super::errors::says_unknown;
use super::give_back::GiveBackCalls;
use super::ledger::Ledger;
use crate::driver::{DriverError, Op, PhysHandle, VaRange};
use std::collections::{BTreeMap, BTreeSet, VecDeque};

/// `CUDA_ERROR_ILLEGAL_ADDRESS`: a sticky error from earlier work, which says nothing about the call.
const STICKY: u32 = 700;
const PAGE: u64 = 0x20_0000;

/// How one call fails.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Fail {
    /// Before doing anything.
    Before,
    /// After doing its work.
    After,
}

fn cuda(op: Op, code: u32) -> DriverError {
    DriverError::Cuda {
        op,
        code,
        name: format!("CUDA error {code}"),
    }
}

/// What the "device" holds, with the failures planned for its next calls.
#[derive(Default, Debug)]
struct FakeDevice {
    handles: BTreeSet<u64>,
    mappings: BTreeMap<u64, u64>,
    reservations: BTreeMap<u64, u64>,
    mallocs: BTreeSet<u64>,
    /// Failures of the next calls (queries excluded), in order.
    fails: VecDeque<Fail>,
    /// Whether every query fails.
    query_fails: bool,
    /// Calls made, queries included.
    calls: usize,
}

impl FakeDevice {
    /// Runs a call of `op`: a planned failure before, the validity check (`valid`, else
    /// `CUDA_ERROR_INVALID_VALUE`), the effect, a planned failure after.
    fn run(
        &mut self,
        op: Op,
        valid: impl FnOnce(&Self) -> bool,
        effect: impl FnOnce(&mut Self),
    ) -> Result<(), DriverError> {
        self.calls += 1;
        let fail = self.fails.pop_front();
        if fail == Some(Fail::Before) {
            return Err(cuda(op, STICKY));
        }
        if !valid(self) {
            return Err(cuda(op, 1));
        }
        effect(self);
        match fail {
            Some(Fail::After) => Err(cuda(op, STICKY)),
            _ => Ok(()),
        }
    }

    fn query(&mut self, op: Op, answer: bool) -> Result<bool, DriverError> {
        self.calls += 1;
        if self.query_fails {
            Err(cuda(op, STICKY))
        } else {
            Ok(answer)
        }
    }

    fn overlapping(&self, va: u64, size: u64) -> Vec<(u64, u64)> {
        self.mappings
            .iter()
            .filter(|&(&s, &len)| s < va + size && va < s + len)
            .map(|(&s, &len)| (s, len))
            .collect()
    }
}

impl GiveBackCalls for FakeDevice {
    fn release(&mut self, handle: u64) -> Result<(), DriverError> {
        self.run(
            Op::Release,
            |d| d.handles.contains(&handle),
            |d| {
                d.handles.remove(&handle);
            },
        )
    }
    fn map(&mut self, va: u64, size: u64, _offset: u64, handle: u64) -> Result<(), DriverError> {
        self.run(
            Op::Map,
            |d| d.handles.contains(&handle) && d.overlapping(va, size).is_empty(),
            |d| {
                d.mappings.insert(va, size);
            },
        )
    }
    fn unmap(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        self.run(
            Op::Unmap,
            |d| {
                let held = d.overlapping(va, size);
                !held.is_empty() && held.iter().all(|&(s, len)| s >= va && s + len <= va + size)
            },
            |d| d.mappings.retain(|&s, _| s < va || s >= va + size),
        )
    }
    fn address_free(&mut self, start: u64, size: u64) -> Result<(), DriverError> {
        self.run(
            Op::FreeReservation,
            |d| d.reservations.get(&start) == Some(&size) && d.overlapping(start, size).is_empty(),
            |d| {
                d.reservations.remove(&start);
            },
        )
    }
    fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        self.run(
            Op::Free,
            |d| d.mallocs.contains(&ptr),
            |d| {
                d.mallocs.remove(&ptr);
            },
        )
    }
    fn handle_live(&mut self, handle: u64) -> Result<bool, DriverError> {
        let live = self.handles.contains(&handle);
        self.query(Op::Release, live)
    }
    fn mapped(&mut self, va: u64) -> Result<bool, DriverError> {
        let mapped = !self.overlapping(va, 1).is_empty() || self.mallocs.contains(&va);
        self.query(Op::Unmap, mapped)
    }
}

/// The allocator's settle (`src/expandable/settle.rs`): on a failure, the same call once more; success or
/// the resource reported gone means done, another error means the first is returned.
fn settle(
    mut call: impl FnMut() -> Result<(), DriverError>,
    gone: fn(&DriverError) -> bool,
) -> Result<(), DriverError> {
    let Err(first) = call() else {
        return Ok(());
    };
    match call() {
        Ok(()) => Ok(()),
        Err(e) if gone(&e) => Ok(()),
        Err(_) => Err(first),
    }
}

/// A reservation of two pages, two handles, the first page mapped by one handle, and one `malloc`, on the
/// device and in the ledger.
fn world() -> (Ledger, FakeDevice) {
    let mut l = Ledger::default();
    let mut dev = FakeDevice::default();
    l.reserved(VaRange::new(0, 2 * PAGE));
    dev.reservations.insert(0, 2 * PAGE);
    for h in [1, 2] {
        l.created(PhysHandle(h), PAGE);
        dev.handles.insert(h);
    }
    l.mapped(0, PAGE);
    dev.mappings.insert(0, PAGE);
    l.malloced(0x9000_0000, 512);
    dev.mallocs.insert(0x9000_0000);
    (l, dev)
}

/// The ledger holds what the device holds.
fn agree(l: &Ledger, dev: &FakeDevice, what: &str) {
    let report = l.report();
    let handles: BTreeSet<u64> = report.handles.iter().map(|(h, _)| h.0).collect();
    assert_eq!(handles, dev.handles, "{what}: handles");
    let mappings: BTreeMap<u64, u64> = report.mappings.iter().map(|r| (r.start, r.size)).collect();
    assert_eq!(mappings, dev.mappings, "{what}: mappings");
    let reservations: BTreeMap<u64, u64> = report
        .reservations
        .iter()
        .map(|r| (r.start, r.size))
        .collect();
    assert_eq!(reservations, dev.reservations, "{what}: reservations");
    let mallocs: BTreeSet<u64> = report.allocations.iter().map(|r| r.start).collect();
    assert_eq!(mallocs, dev.mallocs, "{what}: mallocs");
}

/// One of the calls that give something back, made through the ledger.
#[derive(Clone, Copy, Debug)]
enum GiveBack {
    Release,
    Unmap,
    FreeReservation,
    Free,
}

impl GiveBack {
    fn call(self, l: &mut Ledger, dev: &mut FakeDevice) -> Result<(), DriverError> {
        match self {
            GiveBack::Release => l.release(dev, PhysHandle(2)),
            GiveBack::Unmap => l.unmap(dev, 0, PAGE),
            GiveBack::FreeReservation => l.free_reservation(dev, VaRange::new(0, 2 * PAGE)),
            GiveBack::Free => l.free(dev, 0x9000_0000),
        }
    }

    fn gone(self) -> fn(&DriverError) -> bool {
        match self {
            GiveBack::Release => |e| matches!(e, DriverError::UnknownHandle { .. }),
            GiveBack::Unmap => |e| matches!(e, DriverError::NotMapped { .. }),
            GiveBack::FreeReservation => |e| matches!(e, DriverError::UnknownReservation { .. }),
            GiveBack::Free => |e| matches!(e, DriverError::UnknownPointer { .. }),
        }
    }

    /// Sets the world up for this call (a reservation is freed only once empty).
    fn prepare(self, l: &mut Ledger, dev: &mut FakeDevice) {
        if let GiveBack::FreeReservation = self {
            l.unmap(dev, 0, PAGE)
                .expect("unmap before free_reservation");
        }
    }
}

/// Every call that gives something back, failing before or after its effect, once or twice, with the
/// queries answering or failing: the settle ends after at most two calls (and their queries), its "done"
/// means the device no longer holds the resource, its error that the ledger still does (so the
/// allocator's later retry reaches the driver again), and once the device answers again one more settle
/// ends with the ledger and the device agreeing.
#[test]
fn settle_terminates_and_the_books_follow_the_device() {
    let plans: &[&[Fail]] = &[
        &[],
        &[Fail::Before],
        &[Fail::After],
        &[Fail::Before, Fail::Before],
        &[Fail::After, Fail::Before],
        &[Fail::After, Fail::After],
    ];
    let ops = [
        GiveBack::Release,
        GiveBack::Unmap,
        GiveBack::FreeReservation,
        GiveBack::Free,
    ];
    for op in ops {
        for &plan in plans {
            for query_fails in [false, true] {
                let what = format!("{op:?}, failing {plan:?}, queries failing: {query_fails}");
                let (mut l, mut dev) = world();
                op.prepare(&mut l, &mut dev);
                dev.fails = plan.iter().copied().collect();
                dev.query_fails = query_fails;
                let calls0 = dev.calls;
                let outcome = settle(|| op.call(&mut l, &mut dev), op.gone());
                assert!(
                    dev.calls - calls0 <= 4,
                    "{what}: {} device calls",
                    dev.calls - calls0
                );
                match &outcome {
                    Ok(()) => {
                        agree(&l, &dev, &what);
                        assert!(!holds(op, &dev), "{what}: settled, yet the device holds it");
                        assert!(
                            op.gone()(&op.call(&mut l, &mut dev).unwrap_err()),
                            "{what}: a repeat after settling reports the resource gone"
                        );
                    }
                    Err(e) => {
                        assert!(!says_unknown(e), "{what}: {e}");
                        assert!(
                            ledger_holds(op, &l),
                            "{what}: the settle failed, so the ledger keeps the resource"
                        );
                    }
                }
                dev.query_fails = false;
                dev.fails.clear();
                settle(|| op.call(&mut l, &mut dev), op.gone())
                    .unwrap_or_else(|e| panic!("{what}: the retry once the device answers: {e}"));
                agree(&l, &dev, &what);
                assert!(!holds(op, &dev), "{what}");
            }
        }
    }
}

/// Whether the device holds the resource `op` gives back.
fn holds(op: GiveBack, dev: &FakeDevice) -> bool {
    match op {
        GiveBack::Release => dev.handles.contains(&2),
        GiveBack::Unmap => dev.mappings.contains_key(&0),
        GiveBack::FreeReservation => dev.reservations.contains_key(&0),
        GiveBack::Free => dev.mallocs.contains(&0x9000_0000),
    }
}

/// Whether the ledger holds the resource `op` gives back.
fn ledger_holds(op: GiveBack, l: &Ledger) -> bool {
    let r = l.report();
    match op {
        GiveBack::Release => r.handles.iter().any(|&(h, _)| h == PhysHandle(2)),
        GiveBack::Unmap => r.mappings.iter().any(|m| m.start == 0),
        GiveBack::FreeReservation => r.reservations.iter().any(|m| m.start == 0),
        GiveBack::Free => r.allocations.iter().any(|m| m.start == 0x9000_0000),
    }
}

/// The regression of issue 15: a `cuMemRelease` that released the handle and then failed left it in the
/// ledger, so the allocator's repeat got `CUDA_ERROR_INVALID_VALUE`, which it reads as "no effect": the
/// handle stayed pooled, counted in `reserved_bytes`, and failed every map and release after. Now the
/// repeat reports it gone, from the query or, when the query fails too, from the driver's answer.
#[test]
fn a_release_that_took_effect_is_reported_gone_on_the_repeat() {
    for query_fails in [false, true] {
        let (mut l, mut dev) = world();
        dev.fails.push_back(Fail::After);
        dev.query_fails = query_fails;
        assert_eq!(
            l.release(&mut dev, PhysHandle(2)),
            Err(cuda(Op::Release, STICKY))
        );
        assert!(!dev.handles.contains(&2));
        assert_eq!(
            l.release(&mut dev, PhysHandle(2)),
            Err(DriverError::UnknownHandle {
                op: Op::Release,
                handle: PhysHandle(2)
            }),
            "queries failing: {query_fails}"
        );
        agree(&l, &dev, "after the repeat");
    }
}

#[test]
fn a_release_that_had_no_effect_keeps_the_handle() {
    let (mut l, mut dev) = world();
    dev.fails.push_back(Fail::Before);
    assert_eq!(
        l.release(&mut dev, PhysHandle(2)),
        Err(cuda(Op::Release, STICKY))
    );
    agree(&l, &dev, "after the failure");
    assert_eq!(l.handle_size(Op::Map, PhysHandle(2)), Ok(PAGE));
    assert_eq!(l.release(&mut dev, PhysHandle(2)), Ok(()));
    agree(&l, &dev, "after the repeat");
}

/// A `cuMemMap` that mapped and then failed is recorded, so the allocator's undo (an `unmap` of the page)
/// reaches the driver and the reservation can be freed; one that was rejected is not, and its undo is
/// `NotMapped` without a driver call.
#[test]
fn a_failed_map_is_recorded_when_it_mapped_and_undone_by_an_unmap() {
    for query_fails in [false, true] {
        let (mut l, mut dev) = world();
        dev.fails.push_back(Fail::After);
        dev.query_fails = query_fails;
        assert!(l.map(&mut dev, PAGE, PAGE, PhysHandle(2), 0).is_err());
        agree(&l, &dev, "the mapping is known");
        dev.query_fails = false;
        assert_eq!(l.unmap(&mut dev, PAGE, PAGE), Ok(()));
        agree(&l, &dev, "after the undo");
    }
    let (mut l, mut dev) = world();
    dev.fails.push_back(Fail::Before);
    assert!(l.map(&mut dev, PAGE, PAGE, PhysHandle(2), 0).is_err());
    agree(&l, &dev, "a map without effect");
    let calls = dev.calls;
    assert_eq!(
        l.unmap(&mut dev, PAGE, PAGE),
        Err(DriverError::NotMapped {
            op: Op::Unmap,
            addr: PAGE
        })
    );
    assert_eq!(dev.calls, calls, "answered from the ledger");
    // A map the driver rejects (here: over a mapping) changes nothing and asks nothing.
    let calls = dev.calls;
    assert_eq!(
        l.map(&mut dev, 0, PAGE, PhysHandle(2), 0),
        Err(cuda(Op::Map, 1))
    );
    assert_eq!(dev.calls, calls + 1);
    agree(&l, &dev, "a rejected map");
}

/// A failed map whose query fails is recorded as mapped; if it was not, the undo's "invalid" on a range
/// the ledger's mappings tile says so, and the mapping is forgotten.
#[test]
fn a_maybe_mapping_is_forgotten_when_the_driver_says_nothing_is_mapped() {
    let (mut l, mut dev) = world();
    dev.fails.push_back(Fail::Before);
    dev.query_fails = true;
    assert!(l.map(&mut dev, PAGE, PAGE, PhysHandle(2), 0).is_err());
    assert!(l.has_mapping_at(PAGE), "kept: it cannot be told");
    assert_eq!(
        l.unmap(&mut dev, PAGE, PAGE),
        Err(DriverError::NotMapped {
            op: Op::Unmap,
            addr: PAGE
        })
    );
    agree(&l, &dev, "after the undo");
}

/// An unmap of part of a mapping is CUDA's own error, and changes nothing.
#[test]
fn a_partial_unmap_is_cudas_error_and_keeps_the_mapping() {
    let (mut l, mut dev) = world();
    assert_eq!(l.unmap(&mut dev, 0, PAGE / 2), Err(cuda(Op::Unmap, 1)));
    agree(&l, &dev, "after a partial unmap");
    dev.query_fails = true;
    assert_eq!(l.unmap(&mut dev, 0, PAGE / 2), Err(cuda(Op::Unmap, 1)));
    agree(&l, &dev, "the range is not tiled: no guess");
}

/// An unmap of two mappings that took effect and failed: both are forgotten, and the repeat is `NotMapped`
/// without a driver call.
#[test]
fn an_unmap_of_a_run_that_took_effect_forgets_every_mapping() {
    let (mut l, mut dev) = world();
    l.map(&mut dev, PAGE, PAGE, PhysHandle(2), 0).expect("map");
    dev.fails.push_back(Fail::After);
    assert_eq!(l.unmap(&mut dev, 0, 2 * PAGE), Err(cuda(Op::Unmap, STICKY)));
    agree(&l, &dev, "after the failure");
    let calls = dev.calls;
    assert!(matches!(
        l.unmap(&mut dev, 0, 2 * PAGE),
        Err(DriverError::NotMapped { .. })
    ));
    assert_eq!(dev.calls, calls);
}

/// A reservation whose free took effect and failed is reported gone by the repeat (CUDA has no query for
/// a reservation: the repeat's "invalid" tells).
#[test]
fn a_free_reservation_that_took_effect_is_reported_gone_on_the_repeat() {
    let (mut l, mut dev) = world();
    l.unmap(&mut dev, 0, PAGE).expect("unmap");
    dev.fails.push_back(Fail::After);
    let r = VaRange::new(0, 2 * PAGE);
    assert_eq!(
        l.free_reservation(&mut dev, r),
        Err(cuda(Op::FreeReservation, STICKY))
    );
    assert_eq!(
        l.free_reservation(&mut dev, r),
        Err(DriverError::UnknownReservation {
            op: Op::FreeReservation,
            start: 0
        })
    );
    agree(&l, &dev, "after the repeat");
}

/// A `cuMemFree` that freed and failed is forgotten at once (the pointer is no longer mapped), and the
/// repeat is `UnknownPointer` without a driver call.
#[test]
fn a_free_that_took_effect_is_reported_gone_on_the_repeat() {
    let (mut l, mut dev) = world();
    dev.fails.push_back(Fail::After);
    assert_eq!(l.free(&mut dev, 0x9000_0000), Err(cuda(Op::Free, STICKY)));
    agree(&l, &dev, "after the failure");
    let calls = dev.calls;
    assert_eq!(
        l.free(&mut dev, 0x9000_0000),
        Err(DriverError::UnknownPointer {
            op: Op::Free,
            addr: 0x9000_0000
        })
    );
    assert_eq!(dev.calls, calls);
}
