//! The exported C functions, called as PyTorch or ctypes call them, on simulated devices: each bad input
//! returns null, -1 or nothing with an error for `cuvmm_last_error`, and leaves the allocator usable (its
//! invariants hold afterwards).
//!
//! All tests share the process's registry (14 simulated devices of 8 GiB); each test uses its own device,
//! so the statistics one test reads are not moved by another running at the same time.
//!
//! Unsafe here only calls the exported functions as C does (reading and freeing the strings they return),
//! each call with its `// SAFETY:` comment.
#![allow(unsafe_code)]

use cuvmm_torch::ffi::*;
use cuvmm_torch::registry::{Backend, Registry, Settings, global};
use cuvmm_torch::structs::{CBlock, CDeviceStats, COomInfo, CSegment, CSnapshot, CTraceEntry};
use cuvmm_torch::{AbiError, last_error};
use std::ffi::{CStr, CString, c_void};
use std::ptr;

const GIB: u64 = 1 << 30;
const DEVICES: usize = 14;

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

fn stats(device: i32) -> serde_json::Map<String, serde_json::Value> {
    let text = cuvmm_memory_stats_json(device);
    assert!(!text.is_null(), "{:?}", last_error());
    // SAFETY: a non-null result of cuvmm_memory_stats_json is a NUL-terminated string until freed.
    let json = unsafe { CStr::from_ptr(text) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: `text` came from cuvmm_memory_stats_json and is freed once.
    unsafe { cuvmm_string_free(text) };
    serde_json::from_str(&json).unwrap()
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
fn summary_and_snapshot_are_written_and_a_null_path_is_refused() {
    setup();
    let device = 4;
    let p = cuvmm_malloc(5 << 20, device, ptr::null_mut());
    assert!(!p.is_null());
    let text = cuvmm_memory_summary(device);
    assert!(!text.is_null());
    // SAFETY: a non-null result of cuvmm_memory_summary is a NUL-terminated string until freed.
    let summary = unsafe { CStr::from_ptr(text) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: `text` came from cuvmm_memory_summary and is freed once.
    unsafe { cuvmm_string_free(text) };
    assert!(summary.contains("Allocated memory"), "{summary}");
    // SAFETY: null is allowed.
    unsafe { cuvmm_string_free(ptr::null_mut()) };

    // SAFETY: a null path is allowed (refused with -1).
    assert_eq!(unsafe { cuvmm_dump_snapshot(device, ptr::null()) }, -1);
    assert_failed("null path", "null path");
    let file = std::env::temp_dir().join(format!("cuvmm-torch-{}.pickle", std::process::id()));
    let path = CString::new(file.to_str().unwrap()).unwrap();
    // SAFETY: `path` is a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { cuvmm_dump_snapshot(device, path.as_ptr()) }, 0);
    let bytes = std::fs::read(&file).unwrap();
    std::fs::remove_file(&file).unwrap();
    assert_eq!(bytes.first(), Some(&0x80), "not a pickle");
    let missing = CString::new("/nonexistent-dir/x.pickle").unwrap();
    // SAFETY: `missing` is a NUL-terminated string that outlives the call.
    assert_eq!(unsafe { cuvmm_dump_snapshot(device, missing.as_ptr()) }, -1);
    assert_failed("unwritable path", "nonexistent-dir");
    cuvmm_free(p, 5 << 20, device, ptr::null_mut());
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

/// The filter PyTorch's `CUDAGraph` passes, as the C++ layer hands it over: here, "the stream in
/// `context`".
unsafe extern "C" fn only_stream(context: *mut c_void, stream: *mut c_void) -> std::ffi::c_int {
    (context == stream) as std::ffi::c_int
}

#[test]
fn a_graph_pool_keeps_its_memory_from_other_allocations_until_released() {
    setup();
    let device = 9;
    let capture = stream(0x51);
    // SAFETY: `only_stream` may be called from any thread with this context (it only compares pointers).
    let begun = unsafe { cuvmm_begin_allocate_to_pool(device, 1, 0, Some(only_stream), capture) };
    assert_eq!(begun, 0, "{:?}", last_error());
    let temp = cuvmm_malloc(4 << 20, device, capture);
    assert!(!temp.is_null(), "{:?}", last_error());
    cuvmm_free(temp, 4 << 20, device, capture);
    assert_eq!(
        cuvmm_end_allocate_to_pool(device, 1, 0),
        0,
        "{:?}",
        last_error()
    );
    assert_eq!(stat(device, "cuvmm.graph_pools"), 1);
    let taken = cuvmm_snapshot_take(device);
    assert!(!taken.is_null(), "{:?}", last_error());
    // SAFETY: a non-null result of cuvmm_snapshot_take points to a snapshot whose segment array holds
    // `num_segments` elements until cuvmm_snapshot_free.
    let pools: Vec<(u64, u64)> = unsafe {
        let s = &*taken;
        std::slice::from_raw_parts(s.segments, s.num_segments)
            .iter()
            .map(|seg| (seg.pool_a, seg.pool_b))
            .collect()
    };
    // SAFETY: `taken` came from cuvmm_snapshot_take and is freed once.
    unsafe { cuvmm_snapshot_free(taken) };
    assert!(
        pools.contains(&(1, 0)),
        "no segment of the pool in the snapshot: {pools:?}"
    );
    // The same size on the same stream, outside the pool: other memory.
    let eager = cuvmm_malloc(4 << 20, device, capture);
    assert!(!eager.is_null());
    let (t, e) = (temp.addr(), eager.addr());
    assert!(
        e + (4 << 20) <= t || t + (4 << 20) <= e,
        "pool memory handed out"
    );
    cuvmm_free(eager, 4 << 20, device, capture);
    assert_eq!(cuvmm_release_pool(device, 1, 0), 0, "{:?}", last_error());
    assert_eq!(stat(device, "cuvmm.graph_pools"), 0);
    cuvmm_empty_cache(device);
    assert_eq!(stat(device, "reserved_bytes.all.current"), 0);
    check_invariants(device);
}

/// What `cuvmm_torch.h` lays out, computed by hand from its declarations (x86-64 / aarch64 Linux); the C++
/// layer asserts the same sizes against the header, so a field added on one side only fails both.
#[test]
fn the_structs_have_the_headers_layout() {
    use std::mem::{offset_of, size_of};
    assert_eq!(
        size_of::<CDeviceStats>(),
        9 * 3 * 32 + 2 * 8 + 2 * 32 + 5 * 8
    );
    assert_eq!(offset_of!(CDeviceStats, num_alloc_retries), 9 * 3 * 32);
    assert_eq!(offset_of!(CDeviceStats, largest_free_block), 976);
    assert_eq!(size_of::<COomInfo>(), 7 * 8);
    assert_eq!(size_of::<CSegment>(), 88);
    assert_eq!(offset_of!(CSegment, pool_a), 56);
    assert_eq!(size_of::<CBlock>(), 32);
    assert_eq!(size_of::<CTraceEntry>(), 32);
    assert_eq!(size_of::<CSnapshot>(), 48);
}

fn device_stats(device: i32) -> CDeviceStats {
    let mut out = CDeviceStats::default();
    // SAFETY: `out` is a valid place for one struct.
    let status = unsafe { cuvmm_get_device_stats(device, &mut out) };
    assert_eq!(status, 0, "{:?}", last_error());
    out
}

#[test]
fn device_stats_follow_the_json_and_reset_their_peaks_and_totals() {
    setup();
    let device = 6;
    let small = cuvmm_malloc(1000, device, ptr::null_mut());
    let large = cuvmm_malloc(30 << 20, device, ptr::null_mut());
    assert!(!small.is_null() && !large.is_null(), "{:?}", last_error());
    let c = device_stats(device);
    let json = stats(device);
    let key = |k: &str| json[k].as_u64().unwrap() as i64;
    assert_eq!(
        c.allocated_bytes.all.current,
        key("allocated_bytes.all.current")
    );
    assert_eq!(c.allocated_bytes.small_pool.current, 1024);
    assert_eq!(c.allocated_bytes.large_pool.current, 30 << 20);
    assert_eq!(c.reserved_bytes.all.peak, key("reserved_bytes.all.peak"));
    assert_eq!(
        c.requested_bytes.all.allocated,
        key("requested_bytes.all.allocated")
    );
    assert_eq!(c.allocation.all.current, 2);
    assert_eq!(c.segment.all.current, key("segment.all.current"));
    assert_eq!(c.num_device_alloc, key("num_device_alloc"));
    assert_eq!(c.max_split_size, -1);
    assert!(c.largest_free_block >= 0);
    // SAFETY: a null `out` is allowed (refused with -1).
    let status = unsafe { cuvmm_get_device_stats(device, ptr::null_mut()) };
    assert_eq!(status, -1);
    assert_failed("null out", "null out");

    cuvmm_free(large, 30 << 20, device, ptr::null_mut());
    assert_eq!(
        device_stats(device).allocated_bytes.all.peak,
        1024 + (30 << 20)
    );
    assert_eq!(cuvmm_reset_peak_stats(device), 0, "{:?}", last_error());
    let c = device_stats(device);
    assert_eq!(c.allocated_bytes.all.peak, 1024);
    assert_eq!(c.allocated_bytes.large_pool.peak, 0);
    assert_eq!(c.reserved_bytes.all.peak, c.reserved_bytes.all.current);
    assert_eq!(
        c.allocated_bytes.all.allocated,
        1024 + (30 << 20),
        "totals survive a peak reset"
    );

    assert_eq!(
        cuvmm_reset_accumulated_stats(device),
        0,
        "{:?}",
        last_error()
    );
    let c = device_stats(device);
    assert_eq!(
        (c.allocated_bytes.all.allocated, c.allocated_bytes.all.freed),
        (0, 0)
    );
    assert_eq!(
        (c.num_device_alloc, c.num_device_free, c.num_ooms),
        (0, 0, 0)
    );
    assert_eq!(
        c.allocated_bytes.all.current, 1024,
        "current values survive"
    );
    assert_eq!(c.allocated_bytes.all.peak, 1024);
    cuvmm_free(small, 1000, device, ptr::null_mut());
    assert_eq!(device_stats(device).allocated_bytes.all.freed, 1024);
    check_invariants(device);
}

#[test]
fn pool_and_peer_misuse_returns_minus_one_with_an_error() {
    setup();
    let device = 10;
    // SAFETY: a null filter is refused before anything is called.
    let null_filter = unsafe { cuvmm_begin_allocate_to_pool(device, 2, 0, None, ptr::null_mut()) };
    assert_eq!(null_filter, -1);
    assert_failed("null filter", "filter");
    assert_eq!(cuvmm_begin_allocate_to_pool_capture(device, 0, 0, 5), -1);
    assert_failed("pool {0, 0}", "names no pool");
    assert_eq!(cuvmm_end_allocate_to_pool(device, 3, 0), -1);
    assert_failed("end of a pool never begun", "not being allocated to");
    assert_eq!(cuvmm_release_pool(device, 3, 0), -1);
    assert_failed("release of a pool never begun", "not live");
    assert_eq!(cuvmm_begin_allocate_to_pool_capture(device, 3, 0, 5), 0);
    assert_eq!(cuvmm_begin_allocate_to_pool_capture(device, 3, 0, 6), -1);
    assert_failed("a pool begun twice", "already");
    assert_eq!(cuvmm_end_allocate_to_pool(device, 3, 0), 0);
    // A MemPool's own reference (createOrIncrefPool) keeps the pool live past the graph's release.
    assert_eq!(cuvmm_incref_pool(device, 3, 0), 0, "{:?}", last_error());
    assert_eq!(cuvmm_release_pool(device, 3, 0), 0);
    assert_eq!(cuvmm_release_pool(device, 3, 0), 0, "{:?}", last_error());
    assert_eq!(cuvmm_release_pool(device, 3, 0), -1);
    assert_eq!(cuvmm_incref_pool(device, 0, 0), -1);
    assert_eq!(cuvmm_add_peer(device, -1), -1);
    assert_failed("a negative peer", "invalid peer");
    assert_eq!(cuvmm_add_peer(device, 1), 0, "{:?}", last_error());
    assert_eq!(cuvmm_add_peer(99, 1), -1);
    check_invariants(device);
}

#[test]
fn a_memory_fraction_limits_growth_and_its_oom_is_flagged_with_numbers() {
    setup();
    let device = 7;
    assert_eq!(
        cuvmm_memory_fraction(device),
        1.0,
        "no limit: 1, as PyTorch"
    );
    for bad in [-0.1, 1.5, f64::NAN, f64::INFINITY] {
        assert_eq!(cuvmm_set_memory_fraction(device, bad), -1, "{bad}");
        assert_failed(&format!("fraction {bad}"), "per_process_memory_fraction");
    }
    assert_eq!(
        cuvmm_set_memory_fraction(device, 0.25),
        0,
        "{:?}",
        last_error()
    );
    assert_eq!(cuvmm_memory_fraction(device), 0.25);
    let fits = cuvmm_malloc(1 << 30, device, ptr::null_mut());
    assert!(!fits.is_null(), "{:?}", last_error());
    // SAFETY: null `out` is allowed.
    let flagged = unsafe { cuvmm_last_oom(ptr::null_mut()) };
    assert_eq!(flagged, 0, "success is no OOM");
    assert!(cuvmm_malloc(3 << 30, device, ptr::null_mut()).is_null());
    let mut oom = COomInfo::default();
    // SAFETY: `oom` is a valid place for one struct.
    assert_eq!(unsafe { cuvmm_last_oom(&mut oom) }, 1);
    assert_eq!(oom.allowed, 2 * GIB);
    assert_eq!(oom.requested, 3 << 30);
    assert_eq!(oom.device_total, 8 * GIB);
    assert_eq!(oom.allocated, 1 << 30);
    assert_failed("over the limit", "out of memory");
    // Reading the OOM leaves the record; the next call clears it, and other errors are no OOM.
    // SAFETY: as above.
    assert_eq!(unsafe { cuvmm_last_oom(&mut oom) }, 1);
    assert!(cuvmm_malloc(0, device, ptr::null_mut()).is_null());
    // SAFETY: as above.
    let flagged = unsafe { cuvmm_last_oom(&mut oom) };
    assert_eq!(flagged, 0, "a bad size is no OOM");
    assert_eq!(cuvmm_set_memory_fraction(device, 1.0), 0);
    let now_fits = cuvmm_malloc(3 << 30, device, ptr::null_mut());
    assert!(!now_fits.is_null(), "{:?}", last_error());
    for p in [fits, now_fits] {
        cuvmm_free(p, 0, device, ptr::null_mut());
    }
    check_invariants(device);
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

#[test]
fn snapshots_list_segments_blocks_and_recorded_events() {
    setup();
    let device = 8;
    assert_eq!(cuvmm_record_history(device, 100), 0, "{:?}", last_error());
    let a = cuvmm_malloc(3 << 20, device, stream(5));
    let b = cuvmm_malloc(2048, device, stream(5));
    assert!(!a.is_null() && !b.is_null());
    cuvmm_free(b, 2048, device, stream(5));
    assert!(last_error().is_none(), "{:?}", last_error());

    let taken = cuvmm_snapshot_take(device);
    assert!(!taken.is_null(), "{:?}", last_error());
    // SAFETY: a non-null result of cuvmm_snapshot_take points to a snapshot, and its arrays to as many
    // elements as it says, until cuvmm_snapshot_free.
    let (segments, blocks, traces) = unsafe {
        let s = &*taken;
        (
            std::slice::from_raw_parts(s.segments, s.num_segments).to_vec(),
            std::slice::from_raw_parts(s.blocks, s.num_blocks).to_vec(),
            std::slice::from_raw_parts(s.traces, s.num_traces).to_vec(),
        )
    };
    // SAFETY: `taken` came from cuvmm_snapshot_take and is freed once.
    unsafe { cuvmm_snapshot_free(taken) };
    // SAFETY: null is allowed.
    unsafe { cuvmm_snapshot_free(ptr::null_mut()) };

    assert!(!segments.is_empty());
    for seg in &segments {
        let own = &blocks[seg.first_block..seg.first_block + seg.num_blocks];
        assert_eq!(own.first().unwrap().address, seg.address);
        assert_eq!(
            own.iter().map(|b| b.size).sum::<u64>(),
            seg.total_size,
            "blocks tile it"
        );
        assert_eq!(seg.stream, stream(5));
        assert_eq!((seg.is_expandable, seg.pool_a, seg.pool_b), (1, 0, 0));
    }
    let live: Vec<_> = blocks.iter().filter(|b| b.state == 1).collect();
    assert_eq!(live.len(), 1);
    assert_eq!(
        (live[0].address, live[0].requested_size),
        (a.addr() as u64, 3 << 20)
    );
    assert_eq!(
        segments.iter().map(|s| s.allocated_size).sum::<u64>(),
        3 << 20
    );
    let actions: Vec<_> = traces
        .iter()
        .filter(|t| t.action <= 2)
        .map(|t| (t.action, t.addr))
        .collect();
    let (a, b) = (a.addr() as u64, b.addr() as u64);
    assert_eq!(actions, [(0, a), (0, b), (1, b), (2, b)], "{traces:?}");
    assert_eq!(cuvmm_record_history(device, 0), 0);
    cuvmm_free(stream(a as usize), 0, device, ptr::null_mut());
    check_invariants(device);
}

/// A thread's tag puts its allocations in memory that sleeps and wakes at the same address; what a
/// sleeping tag refuses returns -1 or nothing with an error, and a NULL tag is refused.
#[test]
fn tagged_memory_sleeps_and_wakes_at_the_same_address() {
    setup();
    let device = 13;
    let tag = CString::new("kv_cache").unwrap();
    // SAFETY: `tag` is a NUL-terminated string valid for the call.
    assert_eq!(unsafe { cuvmm_set_tag(tag.as_ptr()) }, 0);
    let kv = cuvmm_malloc(60 << 20, device, stream(3));
    // SAFETY: NULL clears the tag.
    assert_eq!(unsafe { cuvmm_set_tag(ptr::null()) }, 0);
    let other = cuvmm_malloc(1 << 20, device, stream(3));
    assert!(!kv.is_null() && !other.is_null(), "{:?}", last_error());
    let reserved = stat(device, "reserved_bytes.all.current");

    // The registry's simulated devices hold no bytes, so nothing is kept (tests/sleep_wake.rs checks bytes).
    // SAFETY: `tag` is valid for each call.
    let given = unsafe { cuvmm_sleep(device, tag.as_ptr(), 0) };
    assert_eq!(given, 60 << 20, "{:?}", last_error());
    assert_eq!(
        stat(device, "reserved_bytes.all.current"),
        reserved - (60 << 20)
    );
    assert_eq!(stat(device, "cuvmm.asleep_bytes"), 60 << 20);
    // SAFETY: as above.
    let again = unsafe { cuvmm_sleep(device, tag.as_ptr(), 1) };
    assert_eq!(again, 0, "idempotent");
    cuvmm_free(kv, 60 << 20, device, stream(3));
    assert_failed("free of a sleeping block", "asleep");
    // SAFETY: `tag` is valid for the calls.
    unsafe {
        assert_eq!(cuvmm_set_tag(tag.as_ptr()), 0);
        assert!(cuvmm_malloc(4096, device, stream(3)).is_null());
        assert_failed("allocation under a sleeping tag", "asleep");
        assert_eq!(cuvmm_set_tag(ptr::null()), 0);
    }
    let summary = cuvmm_memory_summary(device);
    // SAFETY: a non-null result is a NUL-terminated string until freed, and is freed once.
    let text = unsafe { CStr::from_ptr(summary) }
        .to_str()
        .unwrap()
        .to_string();
    // SAFETY: as above.
    unsafe { cuvmm_string_free(summary) };
    assert!(text.contains("tag kv_cache"), "{text}");

    // SAFETY: `tag` is valid for the call; a NULL tag is refused.
    unsafe {
        assert_eq!(cuvmm_wake(device, tag.as_ptr()), 0, "{:?}", last_error());
        assert_eq!(cuvmm_wake(device, tag.as_ptr()), 0);
        assert_eq!(cuvmm_sleep(device, ptr::null(), 0), -1);
        assert_failed("a NULL tag", "null tag");
        assert_eq!(cuvmm_wake(device, ptr::null()), -1);
    }
    assert_eq!(stat(device, "cuvmm.asleep_bytes"), 0);
    cuvmm_free(kv, 60 << 20, device, stream(3));
    cuvmm_free(other, 1 << 20, device, stream(3));
    assert!(last_error().is_none());
    assert_eq!(stat(device, "allocation.all.current"), 0);
    check_invariants(device);
}
