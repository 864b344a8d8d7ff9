//! The replay engine against a tiny mock strategy: OOM counting, skipped frees, errors with event indices,
//! invariant checks, the stable JSON field names, and `touch` finding overlapping allocations.

use cuvmm::driver::{DriverCounters, Op, StreamId};
use cuvmm::error::{Error, InvariantViolation, OutOfMemory};
use cuvmm::stats::Stats;
use cuvmm::strategy::{DeviceBytes, Strategy};
use cuvmm_lab::replay::ReplayError;
use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::replay::replay;
use cuvmm_lab::replay::touch_byte;
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::Trace;
use std::collections::HashMap;

/// A bump allocator that never reuses memory and fails with out-of-memory above `limit` live bytes. Each
/// allocation costs one `malloc` call, each free one `free` call, 10 µs each.
#[derive(Default)]
struct Bump {
    limit: u64,
    next: u64,
    live: HashMap<u64, u64>,
    stats: Stats,
    counters: DriverCounters,
    freed: Vec<u64>,
    /// Report a broken invariant once this many allocations are live.
    break_at_live: Option<usize>,
}

impl Bump {
    fn new(limit: u64) -> Self {
        Self {
            limit,
            next: 0x1000,
            ..Self::default()
        }
    }
}

impl Strategy for Bump {
    fn name(&self) -> &'static str {
        "bump"
    }
    fn alloc(&mut self, size: u64, stream: StreamId) -> Result<u64, Error> {
        if size == 0 {
            return Err(Error::ZeroSize);
        }
        let allocated = self.stats.allocated_bytes.current;
        if allocated + size > self.limit {
            return Err(Error::OutOfMemory(Box::new(OutOfMemory {
                requested: size,
                stream,
                device_total: self.limit,
                device_free: self.limit - allocated,
                allocated,
                reserved: allocated,
                idle: 0,
                largest_free_block: 0,
                retried: false,
                ..OutOfMemory::default()
            })));
        }
        let addr = self.next;
        self.next += size;
        self.live.insert(addr, size);
        self.stats.allocated_bytes.add(size);
        self.stats.reserved_bytes.add(size);
        self.counters.record(Op::Malloc, 10_000);
        Ok(addr)
    }
    fn free(&mut self, addr: u64) -> Result<(), Error> {
        let size = self
            .live
            .remove(&addr)
            .ok_or(Error::UnknownAddress { addr })?;
        self.stats.allocated_bytes.sub(size);
        self.stats.reserved_bytes.sub(size);
        self.counters.record(Op::Free, 10_000);
        self.freed.push(addr);
        Ok(())
    }
    fn empty_cache(&mut self) -> Result<(), Error> {
        Ok(())
    }
    fn trim(&mut self, _bytes: u64) -> Result<u64, Error> {
        Ok(0)
    }
    fn stats(&self) -> Stats {
        self.stats
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        match self.break_at_live {
            Some(n) if self.live.len() >= n => Err(InvariantViolation::LostAllocation { addr: 0 }),
            _ => Ok(()),
        }
    }
    fn driver_counters(&self) -> DriverCounters {
        self.counters
    }
}

fn alloc(id: u64, size: u64) -> Event {
    Event::Alloc {
        id,
        size,
        stream: StreamId::DEFAULT,
    }
}

fn trace(events: Vec<Event>) -> Trace {
    Trace {
        name: "mock".into(),
        events,
    }
}

#[test]
fn ooms_are_counted_and_their_frees_skipped() {
    let t = trace(vec![
        alloc(1, 600),
        alloc(2, 600), // OOM: 1200 > 1000
        Event::Free { id: 2 },
        alloc(3, 300),
        Event::Free { id: 1 },
        alloc(4, 700),
        alloc(5, 900), // OOM
        Event::Free { id: 5 },
    ]);
    let mut bump = Bump::new(1000);
    let result = replay(&mut bump, &t, &ReplayOptions::default()).unwrap();
    assert_eq!(result.ooms, 2);
    assert_eq!(result.events, 8);
    assert_eq!(bump.freed.len(), 1, "only allocation 1 was live when freed");
    assert_eq!(result.peak_allocated_bytes, 1000);
    assert_eq!(result.peak_reserved_bytes, 1000);
    assert_eq!(result.peak_live_bytes, t.peak_live_bytes());
    assert_eq!(result.utilization, 1.0);
    assert_eq!(result.driver_calls.malloc, 3);
    assert_eq!(result.driver_calls.free, 1);
    assert_eq!(result.driver_calls.total(), 4);
    assert_eq!(result.estimated_driver_us, 40.0);
    assert_eq!(result.workload, "mock");
    assert_eq!(result.allocator, "bump");
    assert!(result.replay_seconds >= 0.0);
}

#[test]
fn an_id_that_failed_may_be_allocated_again() {
    let t = trace(vec![
        alloc(1, 2000), // OOM
        alloc(1, 10),
        Event::Free { id: 1 },
    ]);
    let mut bump = Bump::new(1000);
    let result = replay(&mut bump, &t, &ReplayOptions::default()).unwrap();
    assert_eq!(result.ooms, 1);
    assert_eq!(bump.freed, vec![0x1000]);
}

#[test]
fn other_errors_stop_the_replay_at_their_event() {
    let t = trace(vec![alloc(1, 10), Event::Free { id: 1 }, alloc(2, 0)]);
    let err = replay(&mut Bump::new(1000), &t, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(
            err,
            ReplayError::Alloc {
                index: 2,
                id: 2,
                size: 0,
                source: Error::ZeroSize
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("event 2"), "{err}");

    let t = trace(vec![
        alloc(1, 10),
        Event::Free { id: 1 },
        Event::Free { id: 1 },
    ]);
    let err = replay(&mut Bump::new(1000), &t, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(err, ReplayError::UnknownFree { index: 2, id: 1 }),
        "{err:?}"
    );

    let t = trace(vec![alloc(1, 10), alloc(1, 10)]);
    let err = replay(&mut Bump::new(1000), &t, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(err, ReplayError::DuplicateId { index: 1, id: 1 }),
        "{err:?}"
    );
}

#[test]
fn invariants_are_checked_every_n_events() {
    let t = trace((0..10).map(|id| alloc(id, 10)).collect());
    let mut bump = Bump::new(1000);
    bump.break_at_live = Some(5);
    let every_4 = ReplayOptions {
        check_invariants_every: Some(4),
        ..ReplayOptions::default()
    };
    let err = replay(&mut bump, &t, &every_4).unwrap_err();
    // Checked after events 3 (4 live) and 7 (8 live): the first violation is seen after index 7.
    assert!(
        matches!(err, ReplayError::Invariant { index: 7, .. }),
        "{err:?}"
    );

    let mut bump = Bump::new(1000);
    bump.break_at_live = Some(5);
    assert!(
        replay(&mut bump, &t, &ReplayOptions::default()).is_ok(),
        "no checks unless asked"
    );
}

#[test]
fn json_has_the_stable_field_names() {
    let t = trace(vec![alloc(1, 10), Event::Free { id: 1 }]);
    let result = replay(&mut Bump::new(1000), &t, &ReplayOptions::default()).unwrap();
    let value = serde_json::to_value(&result).unwrap();
    let object = value.as_object().unwrap();
    for key in [
        "workload",
        "allocator",
        "events",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "utilization",
        "ooms",
        "driver_calls",
        "estimated_driver_us",
        "replay_seconds",
        "synchronizations",
    ] {
        assert!(object.contains_key(key), "missing {key}");
    }
    let calls = object["driver_calls"].as_object().unwrap();
    let mut keys: Vec<&str> = calls.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "create",
            "free",
            "malloc",
            "map",
            "release",
            "set_access",
            "unmap"
        ]
    );
    assert_eq!(calls["malloc"], 1);
    assert_eq!(object["events"], 2);
    assert_eq!(object["allocator"], "bump");
}

#[test]
fn replaying_a_builtin_workload_reaches_its_peak_live_bytes() {
    for name in cuvmm_lab::workload::BUILTIN {
        let t = cuvmm_lab::workload::generate(name, 3).unwrap();
        let mut bump = Bump::new(u64::MAX / 2);
        let result = replay(&mut bump, &t, &ReplayOptions::default()).unwrap();
        assert_eq!(result.ooms, 0, "{name}");
        assert_eq!(result.peak_allocated_bytes, t.peak_live_bytes(), "{name}");
        assert_eq!(result.driver_calls.malloc, t.alloc_count() as u64, "{name}");
        assert_eq!(result.events, t.events.len(), "{name}");
    }
}

/// A strategy with real bytes (a flat memory from address 0) that can be told to hand out overlapping
/// allocations: each starts `overlap` bytes before the previous one ends.
struct Flat {
    memory: Vec<u8>,
    next: u64,
    overlap: u64,
}

impl Flat {
    fn new(overlap: u64) -> Self {
        Self {
            memory: vec![0; 1 << 16],
            next: 0,
            overlap,
        }
    }
}

impl Strategy for Flat {
    fn name(&self) -> &'static str {
        "flat"
    }
    fn alloc(&mut self, size: u64, _stream: StreamId) -> Result<u64, Error> {
        let addr = self.next;
        self.next = addr + size - self.overlap;
        Ok(addr)
    }
    fn free(&mut self, _addr: u64) -> Result<(), Error> {
        Ok(())
    }
    fn empty_cache(&mut self) -> Result<(), Error> {
        Ok(())
    }
    fn trim(&mut self, _bytes: u64) -> Result<u64, Error> {
        Ok(0)
    }
    fn stats(&self) -> Stats {
        Stats::default()
    }
    fn check_invariants(&self) -> Result<(), InvariantViolation> {
        Ok(())
    }
    fn driver_counters(&self) -> DriverCounters {
        DriverCounters::default()
    }
    fn device_bytes(&mut self) -> Option<&mut dyn DeviceBytes> {
        Some(self)
    }
}

impl DeviceBytes for Flat {
    fn memset(&mut self, addr: u64, len: u64, value: u8) -> Result<(), Error> {
        self.memory[addr as usize..(addr + len) as usize].fill(value);
        Ok(())
    }
    fn copy_to_host(&mut self, addr: u64, out: &mut [u8]) -> Result<(), Error> {
        out.copy_from_slice(&self.memory[addr as usize..addr as usize + out.len()]);
        Ok(())
    }
}

fn touching() -> ReplayOptions {
    ReplayOptions {
        touch: true,
        ..ReplayOptions::default()
    }
}

#[test]
fn touch_passes_when_allocations_are_apart() {
    let t = trace(vec![
        alloc(1, 100),
        alloc(2, 100),
        Event::Free { id: 1 },
        Event::Free { id: 2 },
    ]);
    replay(&mut Flat::new(0), &t, &touching()).expect("no overlap, no corruption");
}

#[test]
fn touch_finds_overlapping_allocations() {
    let t = trace(vec![alloc(1, 100), alloc(2, 100), Event::Free { id: 1 }]);
    // Without touching, the overlap goes unnoticed.
    replay(&mut Flat::new(16), &t, &ReplayOptions::default()).expect("untouched");
    let err = replay(&mut Flat::new(16), &t, &touching()).unwrap_err();
    match err {
        ReplayError::Corrupted {
            index,
            id,
            addr,
            offset,
            expected,
            found,
        } => {
            assert_eq!((index, id, addr), (2, 1, 0));
            assert_eq!(offset, 84, "the first byte allocation 2 overwrote");
            assert_eq!(expected, touch_byte(1));
            assert_eq!(found, touch_byte(2));
            assert_ne!(expected, found);
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn touch_needs_a_strategy_that_can_write_bytes() {
    let t = trace(vec![alloc(1, 10), Event::Free { id: 1 }]);
    let err = replay(&mut Bump::new(1000), &t, &touching()).unwrap_err();
    assert!(
        matches!(
            &err,
            ReplayError::Touch {
                index: 0,
                id: 1,
                source: Error::Unsupported {
                    allocator: "bump",
                    ..
                }
            }
        ),
        "{err:?}"
    );
    assert!(err.to_string().contains("memset"), "{err}");
}

#[test]
fn touch_bytes_are_never_zero_and_differ_between_neighbours() {
    for id in 0..1000 {
        assert_ne!(touch_byte(id), 0);
        assert_ne!(touch_byte(id), touch_byte(id + 1));
    }
}

fn record(id: u64, stream: u64) -> Event {
    Event::RecordStream {
        id,
        stream: StreamId(stream),
    }
}

#[test]
fn record_stream_is_nothing_for_an_allocator_without_streams_but_names_live_ids() {
    let mut bump = Bump::new(1000);
    assert!(bump.stream_uses().is_none());
    let t = trace(vec![
        alloc(1, 10),
        record(1, 1),
        alloc(2, 5000), // OOM: its record_stream and free are skipped
        record(2, 1),
        Event::Free { id: 2 },
        Event::Free { id: 1 },
    ]);
    let result = replay(&mut bump, &t, &ReplayOptions::default()).unwrap();
    assert_eq!((result.ooms, bump.freed.len()), (1, 1));

    let t = trace(vec![alloc(1, 10), Event::Free { id: 1 }, record(1, 1)]);
    let err = replay(&mut Bump::new(1000), &t, &ReplayOptions::default()).unwrap_err();
    assert!(
        matches!(err, ReplayError::RecordStreamNotLive { index: 2, id: 1 }),
        "{err}"
    );
}

#[test]
fn record_stream_reaches_the_expandable_allocator() {
    use cuvmm::driver::sim::{SimConfig, SimDriver};
    use cuvmm::expandable::Expandable;
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(1 << 24)
            .with_granularity(1 << 16),
    );
    let mut cuvmm_alloc = Expandable::new(sim, cuvmm::Config::default()).unwrap();
    let t = trace(vec![alloc(1, 1 << 20), record(1, 3), Event::Free { id: 1 }]);
    replay(&mut cuvmm_alloc, &t, &ReplayOptions::default()).unwrap();
    let stats = cuvmm_alloc.stats();
    assert_eq!(stats.allocated_bytes.current, 0);
    assert_eq!(
        stats.active_bytes.current,
        1 << 20,
        "the free waits for an event on stream 3, polled at the next allocation"
    );
    assert_eq!(cuvmm_alloc.driver_counters().get(Op::RecordEvent), 1);
}
