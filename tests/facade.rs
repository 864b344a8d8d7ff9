//! The facade: thread safety, RAII buffers, deferred errors.

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, StreamId};

const PAGE: u64 = 1 << 16;

fn allocator(pages: u64) -> Allocator<Expandable<SimDriver>> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(pages * PAGE)
            .with_granularity(PAGE),
    );
    Allocator::expandable(sim, Config::default()).unwrap()
}

#[test]
fn allocator_and_buffers_are_send_and_sync() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Allocator<Expandable<SimDriver>>>();
    assert_send_sync::<cuvmm::DeviceBuffer<Expandable<SimDriver>>>();
}

#[test]
fn buffers_free_on_drop() {
    let alloc = allocator(64);
    {
        let a = alloc.alloc(3 * PAGE).unwrap();
        let b = alloc.alloc_on(1000, StreamId(3)).unwrap();
        assert_eq!(
            (a.len(), b.len(), b.stream()),
            (3 * PAGE, 1000, StreamId(3))
        );
        assert_eq!(alloc.stats().allocation.current, 2);
    }
    assert_eq!(alloc.stats().allocation.current, 0);
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    let c = alloc.alloc(PAGE).unwrap();
    c.free().expect("explicit free");
    assert_eq!(alloc.stats().allocation.current, 0);
    assert!(alloc.take_deferred_errors().is_empty());
    alloc.check_invariants().unwrap();
}

#[test]
fn a_failed_free_in_drop_is_kept_for_the_program() {
    let alloc = allocator(64);
    let buffer = alloc.alloc(PAGE).unwrap();
    // Free it behind the buffer's back: its own drop then fails and must not be lost.
    alloc.free_raw(buffer.ptr()).unwrap();
    // The drop keeps the address in the thread's stream cache; the next drain (here, reading the
    // statistics) frees it to the strategy, which reports the double free.
    drop(buffer);
    let _ = alloc.stats();
    let errors = alloc.take_deferred_errors();
    assert_eq!(errors.len(), 1);
    assert!(
        matches!(errors[0], cuvmm::Error::DoubleFree { .. }),
        "{}",
        errors[0]
    );
}

#[test]
fn many_threads_on_several_streams() {
    let alloc = allocator(512);
    let threads: Vec<_> = (0..8u64)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || {
                let mut held = Vec::new();
                let mut state = t * 7919 + 1;
                for i in 0..400u64 {
                    state = state
                        .wrapping_mul(6364136223846793005)
                        .wrapping_add(1442695040888963407);
                    let size = 1 + (state >> 33) % (2 * PAGE);
                    match alloc.alloc_on(size, StreamId(t % 3)) {
                        Ok(buffer) => held.push(buffer),
                        Err(err) => assert!(err.is_out_of_memory(), "{err}"),
                    }
                    if held.len() > 6 || (state >> 20) % 3 == 0 {
                        let k = (state as usize) % held.len().max(1);
                        if k < held.len() {
                            held.swap_remove(k);
                        }
                    }
                    if i % 97 == 0 {
                        alloc.trim(PAGE).unwrap();
                        let stats = alloc.stats();
                        assert!(stats.allocated_bytes.current <= stats.reserved_bytes.current);
                        alloc.check_invariants().unwrap();
                    }
                }
            })
        })
        .collect();
    for thread in threads {
        thread.join().unwrap();
    }
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
    alloc.empty_cache().unwrap();
    assert_eq!(alloc.stats().reserved_bytes.current, 0);
    alloc.with_strategy(|s| assert!(s.driver().leak_report().is_empty()));
}

#[test]
fn a_trace_tracker_sees_the_mappings_and_blocks_as_they_happen_and_its_panic_is_contained() {
    use cuvmm::history::{TraceAction, TraceEntry};
    use std::sync::{Arc, Mutex};
    let alloc = allocator(64);
    let seen = Arc::new(Mutex::new(Vec::new()));
    let sink = Arc::clone(&seen);
    alloc
        .attach_trace_tracker(|e: &TraceEntry| {
            assert_ne!(e.action, TraceAction::FreeCompleted, "a tracker's bug")
        })
        .unwrap();
    alloc
        .attach_trace_tracker(move |e: &TraceEntry| {
            sink.lock().unwrap().push((e.action, e.addr, e.size))
        })
        .unwrap();
    let buffer = alloc.alloc(3 * PAGE).unwrap();
    let addr = buffer.ptr();
    drop(buffer);
    alloc.empty_cache().unwrap();
    alloc.check_invariants().unwrap();
    let seen = seen.lock().unwrap().clone();
    use TraceAction::*;
    let actions: Vec<TraceAction> = seen.iter().map(|e| e.0).collect();
    assert_eq!(
        actions,
        [
            SegmentMap,
            Alloc,
            FreeRequested,
            FreeCompleted,
            SegmentUnmap
        ],
        "{seen:x?}"
    );
    assert_eq!(seen[1], (Alloc, addr, 3 * PAGE));
    let (mapped, unmapped) = (seen[0], seen[4]);
    assert!(
        mapped.1 <= addr && addr + 3 * PAGE <= mapped.1 + mapped.2,
        "{seen:x?}"
    );
    assert_eq!(
        (unmapped.1, unmapped.2),
        (mapped.1, mapped.2),
        "the pages mapped for it, given back"
    );
    assert_eq!(alloc.stats().reserved_bytes.current, 0);
    alloc.with_strategy(|s| assert!(s.driver().leak_report().is_empty()));
}
