//! The exported C functions, called as PyTorch or ctypes call them, on simulated devices: each bad input
//! returns null, -1 or nothing with an error for `cuvmm_last_error`, and leaves the allocator usable (its
//! invariants hold afterwards).
//!
//! All tests share the process's registry (33 simulated devices of 8 GiB); each test uses its own device,
//! so the statistics one test reads are not moved by another running at the same time.
//!
//! Unsafe here only calls the exported functions as C does (reading and freeing the strings they return),
//! each call with its `// SAFETY:` comment.
#![allow(unsafe_code)]

use cuvmm_torch::ffi::*;
#[path = "abi/mem_pools.rs"]
mod mem_pools;
#[path = "abi/pools_and_limits.rs"]
mod pools_and_limits;
#[path = "abi/sharing.rs"]
mod sharing;
#[path = "abi/stats_and_snapshots.rs"]
mod stats_and_snapshots;

use cuvmm_torch::registry::{Backend, Registry, Settings, global};
use cuvmm_torch::structs::{
    CBlockInfo, CDeviceStats, COomInfo, CSegmentInfo, CSnapshot, CTraceEntry,
};
use cuvmm_torch::{AbiError, last_error};
use std::ffi::{CStr, CString, c_void};
use std::ptr;

const GIB: u64 = 1 << 30;
const DEVICES: usize = 33;

fn setup() {
    // Only the first test to run installs it; the others find it there.
    cuvmm_torch::install(Settings::sim(8 * GIB, DEVICES));
    assert_eq!(
        global().unwrap().settings().backend,
        Backend::Sim {
            capacity: 8 * GIB,
            devices: DEVICES
        }
    );
}

fn stream(n: usize) -> *mut c_void {
    ptr::with_exposed_provenance_mut(n)
}

/// The text of a string the library returned (asserting it returned one), freed.
fn taken(text: *mut std::ffi::c_char) -> String {
    assert!(!text.is_null(), "{:?}", last_error());
    // SAFETY: a non-null string from the library is NUL-terminated until freed, and is freed once, below.
    let owned = unsafe { CStr::from_ptr(text) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: as above.
    unsafe { cuvmm_string_free(text) };
    owned
}

fn stats(device: i32) -> serde_json::Map<String, serde_json::Value> {
    serde_json::from_str(&taken(cuvmm_memory_stats_json(device))).unwrap()
}

fn stat(device: i32, key: &str) -> u64 {
    stats(device)[key].as_u64().unwrap()
}

fn check_invariants(device: i32) {
    let allocator = global().unwrap().allocator(device).unwrap();
    allocator.check_invariants().unwrap();
}

fn assert_failed(what: &str, expected: &str) {
    let error = last_error().unwrap_or_else(|| panic!("{what}: no error recorded"));
    assert!(error.contains(expected), "{what}: {error}");
    // SAFETY: the pointer is null or a NUL-terminated string valid until the next cuvmm call here.
    let raw = unsafe { CStr::from_ptr(cuvmm_last_error()) };
    assert_eq!(raw.to_str().unwrap(), error);
}

#[test]
fn malloc_and_free_move_the_statistics_and_clear_the_last_error() {
    setup();
    let device = 0;
    let p = cuvmm_malloc(3 << 20, device, stream(7));
    assert!(!p.is_null(), "{:?}", last_error());
    assert!(last_error().is_none());
    assert!(cuvmm_last_error().is_null());
    assert_eq!(p.addr() % 512, 0);
    assert_eq!(stat(device, "allocated_bytes.all.current"), 3 << 20);
    assert_eq!(stat(device, "requested_bytes.all.current"), 3 << 20);
    assert!(stat(device, "reserved_bytes.all.current") >= 3 << 20);
    cuvmm_free(p, 3 << 20, device, stream(7));
    assert!(last_error().is_none());
    assert_eq!(stat(device, "allocated_bytes.all.current"), 0);
    assert_eq!(stat(device, "allocated_bytes.all.peak"), 3 << 20);
    cuvmm_empty_cache(device);
    assert_eq!(stat(device, "reserved_bytes.all.current"), 0);
    check_invariants(device);
}

#[test]
fn bad_sizes_return_null_and_leave_the_allocator_usable() {
    setup();
    let device = 1;
    for size in [0, -1, -512, isize::MIN] {
        assert!(cuvmm_malloc(size, device, ptr::null_mut()).is_null());
        assert_failed(&format!("size {size}"), "invalid size");
    }
    for size in [isize::MAX, 1 << 50, 9 << 30] {
        assert!(cuvmm_malloc(size, device, ptr::null_mut()).is_null());
        assert!(last_error().is_some(), "size {size}: no error recorded");
    }
    let p = cuvmm_malloc(4096, device, ptr::null_mut());
    assert!(!p.is_null(), "{:?}", last_error());
    cuvmm_free(p, 4096, device, ptr::null_mut());
    assert!(last_error().is_none());
    assert_eq!(stat(device, "allocation.all.current"), 0);
    check_invariants(device);
}

#[test]
fn foreign_pointers_and_double_frees_are_refused() {
    setup();
    let device = 2;
    let p = cuvmm_malloc(1 << 20, device, ptr::null_mut());
    assert!(!p.is_null());
    let q = cuvmm_malloc(1 << 20, device, ptr::null_mut());
    assert!(!q.is_null());
    // Never handed out: a stack address, an address inside an allocation, one past the device.
    let local = 0u64;
    for foreign in [
        ptr::from_ref(&local).cast_mut().cast::<c_void>(),
        p.wrapping_byte_add(512),
        stream(usize::MAX - 4095),
    ] {
        cuvmm_free(foreign, 512, device, ptr::null_mut());
        assert!(last_error().is_some(), "{foreign:p}: no error recorded");
    }
    cuvmm_free(p, 1 << 20, device, ptr::null_mut());
    assert!(last_error().is_none());
    cuvmm_free(p, 1 << 20, device, ptr::null_mut());
    assert!(last_error().is_some(), "double free: no error recorded");
    // The other device never handed out q.
    cuvmm_free(q, 1 << 20, device + 1, ptr::null_mut());
    assert!(
        last_error().is_some(),
        "free on the wrong device: no error recorded"
    );
    // Null is nothing to free.
    cuvmm_free(ptr::null_mut(), 0, device, ptr::null_mut());
    assert!(last_error().is_none());
    assert_eq!(stat(device, "allocation.all.current"), 1);
    cuvmm_free(q, 1 << 20, device, ptr::null_mut());
    assert_eq!(stat(device, "allocation.all.current"), 0);
    check_invariants(device);
}

#[test]
fn devices_out_of_range_are_refused_by_every_function() {
    setup();
    let path = CString::new(
        std::env::temp_dir()
            .join("cuvmm-torch-unused.pickle")
            .to_str()
            .unwrap(),
    )
    .unwrap();
    for device in [-1, DEVICES as i32, i32::MAX, i32::MIN] {
        let what = format!("device {device}");
        assert!(cuvmm_malloc(512, device, ptr::null_mut()).is_null());
        assert_failed(&what, "out of range");
        cuvmm_free(stream(1 << 40), 512, device, ptr::null_mut());
        assert_failed(&what, "out of range");
        cuvmm_record_stream(stream(1 << 40), device, stream(3));
        assert_failed(&what, "out of range");
        assert!(cuvmm_memory_stats_json(device).is_null());
        assert_failed(&what, "out of range");
        assert!(cuvmm_memory_summary(device).is_null());
        assert_failed(&what, "out of range");
        cuvmm_empty_cache(device);
        assert_failed(&what, "out of range");
        // SAFETY: `path` is a NUL-terminated string that outlives the call.
        assert_eq!(unsafe { cuvmm_dump_snapshot(device, path.as_ptr()) }, -1);
        assert_failed(&what, "out of range");
        let mut out = CDeviceStats::default();
        // SAFETY: `out` is a valid place for one struct.
        assert_eq!(unsafe { cuvmm_get_device_stats(device, &mut out) }, -1);
        assert_failed(&what, "out of range");
        assert_eq!(cuvmm_reset_peak_stats(device), -1);
        assert_failed(&what, "out of range");
        assert_eq!(cuvmm_reset_accumulated_stats(device), -1);
        assert_failed(&what, "out of range");
        assert_eq!(cuvmm_set_memory_fraction(device, 0.5), -1);
        assert_failed(&what, "out of range");
        assert_eq!(cuvmm_memory_fraction(device), -1.0);
        assert_failed(&what, "out of range");
        assert_eq!(cuvmm_record_history(device, 10), -1);
        assert_failed(&what, "out of range");
        let track: Option<TraceTrackerFn> = Some(stats_and_snapshots::track);
        // SAFETY: the tracker is a function that may be called from any thread (never, here).
        let status = unsafe { cuvmm_attach_trace_tracker(device, track, ptr::null_mut()) };
        assert_eq!(status, -1);
        assert_failed(&what, "out of range");
        assert!(cuvmm_snapshot_take(device).is_null());
        assert_failed(&what, "out of range");
    }
}

#[test]
fn record_stream_delays_reuse_until_the_other_stream_is_done() {
    setup();
    let device = 3;
    let p = cuvmm_malloc(1 << 20, device, stream(1));
    assert!(!p.is_null());
    cuvmm_record_stream(p, device, stream(2));
    assert!(last_error().is_none(), "{:?}", last_error());
    cuvmm_free(p, 1 << 20, device, stream(1));
    // Freed, but stream 2's work may still use it: active, not allocated.
    assert_eq!(stat(device, "allocated_bytes.all.current"), 0);
    assert_eq!(stat(device, "active_bytes.all.current"), 1 << 20);
    // Not live any more: recording a stream on it is an error.
    cuvmm_record_stream(p, device, stream(2));
    assert!(
        last_error().is_some(),
        "record_stream after free: no error recorded"
    );
    check_invariants(device);
}

#[test]
fn allocations_from_several_threads_and_streams_add_up() {
    setup();
    let device = 5;
    let threads: Vec<_> = (0..4usize)
        .map(|t| {
            std::thread::spawn(move || {
                let mut live = Vec::new();
                for i in 0..200usize {
                    let size = 512 * (1 + (i * 7 + t) % 4000);
                    let p = cuvmm_malloc(size as isize, device, stream(t % 2 + 1));
                    assert!(!p.is_null(), "{:?}", last_error());
                    live.push((p.addr(), size));
                    if i % 3 == 0 {
                        let (addr, size) = live.swap_remove(i % live.len());
                        cuvmm_free(stream(addr), size as isize, device, ptr::null_mut());
                        assert!(last_error().is_none(), "{:?}", last_error());
                    }
                }
                live
            })
        })
        .collect();
    let mut live: Vec<(usize, usize)> = threads
        .into_iter()
        .flat_map(|t| t.join().unwrap())
        .collect();
    let total: usize = live.iter().map(|&(_, size)| size).sum();
    assert_eq!(stat(device, "allocated_bytes.all.current"), total as u64);
    live.sort_unstable();
    for pair in live.windows(2) {
        assert!(pair[0].0 + pair[0].1 <= pair[1].0, "overlap: {pair:?}");
    }
    check_invariants(device);
    for (addr, size) in live {
        cuvmm_free(stream(addr), size as isize, device, ptr::null_mut());
    }
    assert_eq!(stat(device, "allocated_bytes.all.current"), 0);
    check_invariants(device);
}

#[test]
fn the_cuda_backend_without_a_driver_is_an_error_not_a_panic() {
    let registry = Registry::new(Settings {
        backend: Backend::Cuda,
        config: cuvmm::Config::default(),
    });
    match registry.allocator(0) {
        // A machine with a GPU: nothing to check here.
        Ok(_) => eprintln!("a CUDA device is present; skipping the no-driver check"),
        Err(e) => {
            assert!(matches!(e, AbiError::Init(_)), "{e:?}");
            assert!(e.to_string().contains("CUDA"), "{e}");
            // Kept: the second call reports the same failure without trying again.
            let again = registry.allocator(0).unwrap_err();
            assert_eq!(again.to_string(), e.to_string());
        }
    }
}

#[test]
fn free_any_frees_on_the_device_that_handed_the_address_out() {
    setup();
    // Through the C function: nothing to free, and an address no device handed out.
    cuvmm_free_any(ptr::null_mut());
    assert!(last_error().is_none());
    cuvmm_free_any(stream(0x1234_5000));
    assert_failed("foreign pointer", "0x12345000");
    // Simulated devices hand out the same addresses, so the search is shown on a registry of its own
    // where only device 2 holds memory (device 0 is built, and empty).
    let registry = Registry::new(Settings::sim(GIB, 3));
    let empty = registry.allocator(0).unwrap();
    let holder = registry.allocator(2).unwrap();
    let p = holder.alloc_raw(4096, cuvmm::StreamId(1)).unwrap();
    cuvmm_torch::ops::free_any(&registry, p).unwrap();
    assert_eq!(holder.stats().allocation.current, 0);
    assert_eq!(empty.stats().allocation.allocated, 0);
    let again = cuvmm_torch::ops::free_any(&registry, p).unwrap_err();
    assert!(again.to_string().contains("double free"), "{again}");
    cuvmm_torch::ops::free_any(&registry, 0).unwrap();
}

/// torch_memory_saver's `memory_margin_bytes` is process-wide: `set_device_margin` reaches the devices
/// built already and those built later, and a request that would cross it fails with an out-of-memory that
/// names it, on a registry of its own (the margin would reach every test's device here). The C function
/// only passes it on.
#[test]
fn a_device_margin_reaches_every_device_built_before_and_after() {
    let registry = Registry::new(Settings::sim(GIB, 3));
    let before = registry.allocator(0).unwrap();
    cuvmm_torch::ops::set_device_margin(&registry, 600 << 20);
    for device in [0, 2] {
        let allocator = registry.allocator(device).unwrap();
        let err = allocator
            .alloc_raw(500 << 20, cuvmm::StreamId(1))
            .unwrap_err();
        assert!(
            err.to_string().contains("device margin"),
            "device {device}: {err}"
        );
        let p = allocator.alloc_raw(400 << 20, cuvmm::StreamId(1)).unwrap();
        allocator.free_raw(p).unwrap();
        allocator.check_invariants().unwrap();
    }
    cuvmm_torch::ops::set_device_margin(&registry, 0);
    let p = before.alloc_raw(900 << 20, cuvmm::StreamId(1)).unwrap();
    before.free_raw(p).unwrap();
    let missing = registry.existing(1).unwrap();
    assert!(missing.is_none(), "setting the margin opens no device");
    setup();
    assert_eq!(cuvmm_set_device_margin(0), 0);
    assert!(last_error().is_none());
}
