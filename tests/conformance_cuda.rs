//! The conformance suite (`tests/conformance/mod.rs`) on a real GPU through `CudaDriver`.
//!
//! Without libcuda or without a device, each test prints why it is skipped and passes: CI has no GPU, and
//! this file's job there is to prove that the `cuda` build compiles and that absence is handled without a
//! panic. Set `CUVMM_CUDA_DEVICE=N` to test device N instead of device 0. The tests share one GPU, so run
//! them with `--test-threads=1` on a GPU machine (docs/gpu.md) to keep the free-memory checks exact.
#![cfg(feature = "cuda")]

mod conformance;

use conformance::Subject;
use conformance::capture::{self, Capture};
use cuvmm::driver::cuda::CudaDriver;
use cuvmm::driver::sim::LeakReport;
use cuvmm::driver::{CaptureMode, Driver, DriverError, PhysPage, StreamId};

impl Subject for CudaDriver {
    fn held(&self) -> LeakReport {
        self.leak_report()
    }
}

impl Capture for CudaDriver {
    fn begin_capture(&mut self, stream: StreamId, mode: CaptureMode) -> Result<u64, DriverError> {
        CudaDriver::begin_capture(self, stream, mode)
    }
    fn end_capture(&mut self, stream: StreamId) -> Result<(), DriverError> {
        CudaDriver::end_capture(self, stream)
    }
}

/// The device under test.
fn ordinal() -> usize {
    std::env::var("CUVMM_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The device, or `None` (with a message) when this machine has no CUDA driver or no such device.
fn gpu() -> Option<CudaDriver> {
    match CudaDriver::new(ordinal()) {
        Ok(d) => Some(d),
        Err(DriverError::NoDriver { reason }) => {
            eprintln!("skipping the CUDA conformance suite: no CUDA driver found: {reason}");
            None
        }
        Err(e) => panic!("opening CUDA device {}: {e}", ordinal()),
    }
}

fn open() -> CudaDriver {
    CudaDriver::new(ordinal()).expect("the device opened a moment ago")
}

/// The device with stand-in streams: the capture rules capture stream 7 and use stream 8, which must be
/// real, non-default streams of this process.
fn open_with_streams() -> CudaDriver {
    open().with_stand_in_streams()
}

#[test]
fn opening_never_panics_and_absence_is_no_driver() {
    match CudaDriver::new(ordinal()) {
        Ok(d) => assert!(d.granularity() > 0 && d.granularity().is_power_of_two()),
        Err(DriverError::NoDriver { reason }) => assert!(!reason.is_empty()),
        Err(e) => panic!("unexpected error opening the device: {e}"),
    }
    // A device number no machine has is always "no driver/device", never a panic.
    match CudaDriver::new(1_000_000) {
        Err(DriverError::NoDriver { reason }) => assert!(!reason.is_empty()),
        other => panic!("device 1000000: {other:?}"),
    }
}

#[test]
fn cuda_driver_obeys_every_rule() {
    if gpu().is_none() {
        return;
    }
    conformance::run_rules(open);
}

#[test]
fn cuda_driver_probes_are_recorded() {
    if gpu().is_none() {
        return;
    }
    for probe in conformance::probes(open) {
        match probe.outcome {
            Ok(()) => eprintln!(
                "probe: CUDA accepts {} (the simulator is stricter)",
                probe.name
            ),
            Err(e) => eprintln!("probe: CUDA rejects {}: {e}", probe.name),
        }
    }
}

#[test]
fn cuda_driver_obeys_every_capture_rule() {
    if gpu().is_none() {
        return;
    }
    capture::run_capture_rules(open_with_streams);
}

/// What CUDA does with unmap, release, free_reservation and free (`cuMemFree`) during a global capture, printed
/// as `fact: ...` lines for docs/gpu-results.md. The simulator refuses them all and invalidates the capture;
/// if CUDA accepts one and the capture still ends into a graph, the simulator is stricter than CUDA there.
#[test]
fn cuda_capture_facts_are_recorded() {
    if gpu().is_none() {
        return;
    }
    let outcome = |r: &Result<(), DriverError>| match r {
        Ok(()) => "accepted".to_string(),
        Err(e) => format!("rejected: {e}"),
    };
    for fact in capture::capture_facts(open_with_streams) {
        eprintln!(
            "fact: {} during a global capture: {}; then end_capture: {}",
            fact.call,
            outcome(&fact.outcome),
            outcome(&fact.end)
        );
    }
}

#[test]
fn allocator_properties_hold_on_the_cuda_driver() {
    if gpu().is_none() {
        return;
    }
    conformance::allocator_properties(open, 16);
}

/// Facts about this GPU's driver that the simulator's rules and the latency model rest on (issue 21, step 1),
/// printed as `fact: ...` lines for docs/gpu-results.md. What it can assert it asserts (free memory back
/// after everything is given back, nothing held); the rest is recorded, not judged.
#[test]
fn cuda_driver_facts_are_recorded() {
    let Some(mut d) = gpu() else { return };
    let g = d.granularity();
    let info = d.mem_info().expect("mem_info");
    eprintln!(
        "fact: granularity {g} bytes; free {} of {} bytes",
        info.free, info.total
    );
    let outcome = |r: Result<(), DriverError>| match r {
        Ok(()) => "accepted".to_string(),
        Err(e) => format!("rejected: {e}"),
    };

    // Several adjacent one-page mappings, each of its own handle: one unmap, one set_access over all of them.
    for (what, set_access) in [("unmap", false), ("set_access", true)] {
        let r = d.reserve(3 * g).expect("reserve");
        let hs: Vec<_> = (0..3).map(|_| d.create(g).expect("create")).collect();
        for (i, &h) in hs.iter().enumerate() {
            d.map(r.start + i as u64 * g, g, h).expect("map");
        }
        let result = if set_access {
            d.set_access(r.start, 3 * g)
        } else {
            d.unmap(r.start, 3 * g)
        };
        eprintln!(
            "fact: one {what} over three adjacent mappings: {}",
            outcome(result)
        );
        for i in 0..3 {
            let _ = d.unmap(r.start + i * g, g); // already gone where the single unmap was accepted
        }
        for h in hs {
            d.release(h).expect("release");
        }
        d.free_reservation(r).expect("free_reservation");
    }
    // set_access over part of one mapping (its second half) and over a mapping and the hole after it.
    {
        let r = d.reserve(4 * g).expect("reserve");
        let h = d.create(2 * g).expect("create");
        d.map(r.start, 2 * g, h).expect("map");
        let r2 = d.reserve(2 * g).expect("reserve");
        let part = d.map_from(
            r2.start,
            g,
            PhysPage {
                handle: h,
                offset: 0,
            },
        );
        eprintln!(
            "fact: map of the first page of a two-page handle (offset 0): {}",
            outcome(part.clone())
        );
        let second = d.map_from(
            r2.start + g,
            g,
            PhysPage {
                handle: h,
                offset: g,
            },
        );
        eprintln!(
            "fact: map of the second page of a two-page handle (offset one page): {}",
            outcome(second.clone())
        );
        for (va, mapped) in [(r2.start, part), (r2.start + g, second)] {
            if mapped.is_ok() {
                d.unmap(va, g).expect("unmap the part");
            }
        }
        d.free_reservation(r2).expect("free_reservation");
        let half = d.set_access(r.start + g, g);
        eprintln!(
            "fact: set_access over the second half of a two-page mapping: {}",
            outcome(half)
        );
        let hole = d.set_access(r.start, 3 * g);
        eprintln!(
            "fact: set_access over a mapping and the unmapped page after it: {}",
            outcome(hole)
        );
        d.unmap(r.start, 2 * g).expect("unmap");
        d.release(h).expect("release");
        d.free_reservation(r).expect("free_reservation");
    }
    // Reservations made with alignment 0: how their starts are aligned, by size.
    for size in [g, 2 * g, 1 << 30, 1 << 34] {
        let r = d.reserve(size).expect("reserve");
        eprintln!(
            "fact: reserve of {size} bytes (alignment 0) starts at {:#x}: aligned to 2^{} bytes",
            r.start,
            r.start.trailing_zeros()
        );
        d.free_reservation(r).expect("free_reservation");
    }
    // Large reservations: 160 GB to 1.28 TB, each alone.
    for gb in [160u64, 320, 640, 1280] {
        let size = gb * 1_000_000_000 / g * g;
        let began = std::time::Instant::now();
        match d.reserve(size) {
            Ok(r) => {
                let took = began.elapsed();
                d.free_reservation(r).expect("free_reservation");
                eprintln!(
                    "fact: reserve of {gb} GB accepted in {took:?} (start {:#x})",
                    r.start
                );
            }
            Err(e) => eprintln!("fact: reserve of {gb} GB rejected: {e}"),
        }
    }
    // cuMemCreate beyond free memory, then filling the device: 1 GiB handles, then single pages, until a
    // create fails; each failure's error and the free memory CUDA reports at that point.
    let free0 = d.mem_info().expect("mem_info").free;
    match d.create((info.total / g + 1) * g) {
        Ok(h) => {
            eprintln!("fact: create of more than the device's total memory accepted");
            d.release(h).expect("release");
        }
        Err(e) => eprintln!("fact: create of more than the device's total memory: {e}"),
    }
    let mut held = Vec::new();
    for size in [1u64 << 30, g] {
        let size = size.max(g) / g * g;
        loop {
            match d.create(size) {
                Ok(h) => held.push(h),
                Err(e) => {
                    let free = d.mem_info().map(|m| m.free).unwrap_or(0);
                    eprintln!(
                        "fact: create of {size} bytes after {} handles fails with free {free} bytes: {e}",
                        held.len()
                    );
                    break;
                }
            }
        }
    }
    let filled = d.mem_info().expect("mem_info").free;
    let malloc_when_full = d.malloc(g).map(|p| d.free(p).expect("free"));
    eprintln!(
        "fact: cuMemAlloc of one page with the device full: {}",
        outcome(malloc_when_full)
    );
    let created = held.len();
    for h in held {
        d.release(h).expect("release");
    }
    let free1 = d.mem_info().expect("mem_info").free;
    eprintln!(
        "fact: {created} handles filled the device from {free0} to {filled} free bytes; after releasing them \
         {free1} free ({} bytes short of before)",
        free0 as i64 - free1 as i64
    );
    assert!(
        free1 + g / 2 >= free0,
        "free memory not back after release: {free0} -> {free1}"
    );

    // Whether a released handle's value comes back from the next create.
    let mut reused = 0;
    let mut previous = None;
    for _ in 0..100 {
        let h = d.create(g).expect("create");
        if previous == Some(h) {
            reused += 1;
        }
        previous = Some(h);
        d.release(h).expect("release");
    }
    eprintln!("fact: a released handle's value was reused by the next create {reused} times in 99");

    // An event queried right after it is recorded on an idle stream.
    for stream in [StreamId::DEFAULT, StreamId::PER_THREAD] {
        d.synchronize(stream).expect("synchronize");
        let mut not_ready = 0;
        for _ in 0..1000 {
            let e = d.record_event(stream).expect("record_event");
            if !d.event_complete(e).expect("event_complete") {
                not_ready += 1;
            }
            d.destroy_event(e).expect("destroy_event");
        }
        eprintln!(
            "fact: an event queried right after recording on idle stream {stream}: not ready {not_ready} times \
             in 1000"
        );
    }
    let held = d.leak_report();
    assert!(held.is_empty(), "the facts left {held} held");
}
