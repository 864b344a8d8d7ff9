//! What PyTorch reads: the statistics as JSON and as the header's structs, the summary, snapshots.

use super::*;

#[test]
fn summary_and_snapshot_are_written_and_a_null_path_is_refused() {
    setup();
    let device = 4;
    let p = cuvmm_malloc(5 << 20, device, ptr::null_mut());
    assert!(!p.is_null());
    let summary = taken(cuvmm_memory_summary(device));
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
    assert_eq!(size_of::<CSegmentInfo>(), 88);
    assert_eq!(offset_of!(CSegmentInfo, pool_a), 56);
    assert_eq!(size_of::<CBlockInfo>(), 32);
    assert_eq!(size_of::<CTraceEntry>(), 56);
    assert_eq!(offset_of!(CTraceEntry, pool_a), 40);
    assert_eq!(size_of::<CSnapshot>(), 48);
    assert_eq!(
        size_of::<cuvmm_torch::structs::CPrivatePoolStat>(),
        2 * 8 + 3 * 32
    );
}

fn device_stats(device: i32) -> CDeviceStats {
    let mut out = CDeviceStats::default();
    // SAFETY: `out` is a valid place for one struct.
    let status = unsafe { cuvmm_get_device_stats(device, &mut out) };
    assert_eq!(status, 0, "{:?}", last_error());
    out
}

/// `torch.cuda.memory_stats(i)` for every `i`: a device never named reads as zeros and resets as a no-op,
/// and no allocator is built for it (on CUDA that would make a context on a GPU the program never uses).
#[test]
fn statistics_of_a_device_never_named_are_zeros_and_build_nothing() {
    setup();
    let device = 15;
    let is_built = || global().unwrap().built().any(|(d, _)| d == device);
    assert!(!is_built());
    let c = device_stats(device);
    assert_eq!(c.reserved_bytes.all.current, 0);
    assert_eq!(c.allocation.all.allocated, 0);
    assert_eq!(c.num_device_alloc, 0);
    assert_eq!(c.max_split_size, -1);
    assert_eq!(cuvmm_reset_peak_stats(device), 0, "{:?}", last_error());
    assert_eq!(
        cuvmm_reset_accumulated_stats(device),
        0,
        "{:?}",
        last_error()
    );
    assert!(
        !is_built(),
        "reading and resetting statistics built an allocator"
    );
    for out_of_range in [-1, DEVICES as i32] {
        let mut out = CDeviceStats::default();
        // SAFETY: `out` is a valid place for one struct.
        let status = unsafe { cuvmm_get_device_stats(out_of_range, &mut out) };
        assert_eq!(status, -1);
        assert_failed("a device out of range", "device");
        assert_eq!(cuvmm_reset_peak_stats(out_of_range), -1);
    }
    // Once named, it is built and counts.
    let p = cuvmm_malloc(4096, device, ptr::null_mut());
    assert!(!p.is_null(), "{:?}", last_error());
    assert!(is_built());
    assert_eq!(device_stats(device).allocation.all.current, 1);
    cuvmm_free(p, 4096, device, ptr::null_mut());
    check_invariants(device);
}

/// The C++ layer's retry after PyTorch's free-memory callbacks made room: the out-of-memory it reports as
/// recovered from counts as a retry, as PyTorch counts it, not as an out-of-memory.
#[test]
fn an_out_of_memory_recovered_from_counts_as_a_retry() {
    setup();
    let device = 23;
    let big = cuvmm_malloc(7 << 30, device, ptr::null_mut());
    assert!(!big.is_null(), "{:?}", last_error());
    assert!(cuvmm_malloc(2 << 30, device, ptr::null_mut()).is_null());
    // SAFETY: a null `out` is allowed (only the answer is wanted).
    let oom = unsafe { cuvmm_last_oom(ptr::null_mut()) };
    assert_eq!(oom, 1);
    let before = device_stats(device);
    assert_eq!(before.num_ooms, 1);
    cuvmm_free(big, 7 << 30, device, ptr::null_mut());
    let p = cuvmm_malloc(2 << 30, device, ptr::null_mut());
    assert!(!p.is_null(), "{:?}", last_error());
    assert_eq!(cuvmm_recovered_oom(device), 0, "{:?}", last_error());
    let after = device_stats(device);
    assert_eq!(after.num_ooms, 0);
    assert_eq!(after.num_alloc_retries, before.num_alloc_retries + 1);
    assert_eq!(cuvmm_recovered_oom(DEVICES as i32), -1);
    assert_failed("a device out of range", "device");
    cuvmm_free(p, 2 << 30, device, ptr::null_mut());
    check_invariants(device);
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

/// An event as a test's tracker saw it: (context, device, action, addr, size).
type Tracked = (usize, i32, i32, u64, u64);

static TRACKED: std::sync::Mutex<Vec<Tracked>> = std::sync::Mutex::new(Vec::new());

/// A C trace tracker that notes each event it is called with.
pub(super) unsafe extern "C" fn track(
    context: *mut c_void,
    device: i32,
    entry: *const CTraceEntry,
) {
    // SAFETY: cuvmm passes an entry valid for the call.
    let e = unsafe { &*entry };
    let noted = (context.addr(), device, e.action, e.addr, e.size);
    TRACKED.lock().unwrap().push(noted);
}

#[test]
fn a_trace_tracker_is_called_with_each_event_of_its_device_without_recording() {
    setup();
    let device = 27;
    // SAFETY: a null tracker is allowed (refused with -1).
    let refused = unsafe { cuvmm_attach_trace_tracker(device, None, ptr::null_mut()) };
    assert_eq!(refused, -1);
    assert_failed("a null tracker", "null");
    // SAFETY: `track` may be called from any thread for the life of the process, and calls no cuvmm.
    let attached = unsafe { cuvmm_attach_trace_tracker(device, Some(track), stream(7)) };
    assert_eq!(attached, 0, "{:?}", last_error());
    let p = cuvmm_malloc(3 << 20, device, stream(5));
    assert!(!p.is_null(), "{:?}", last_error());
    cuvmm_free(p, 3 << 20, device, stream(5));
    cuvmm_empty_cache(device);
    check_invariants(device);
    let mine: Vec<_> = (TRACKED.lock().unwrap().iter())
        .filter(|e| e.1 == device)
        .copied()
        .collect();
    assert!(
        mine.iter().all(|e| e.0 == 7),
        "the context as given: {mine:x?}"
    );
    let actions: Vec<i32> = mine.iter().map(|e| e.2).collect();
    // PyTorch's TraceEntry::Action: segment_map, alloc, free_requested, free_completed, segment_unmap.
    assert_eq!(actions, [5, 0, 1, 2, 6], "{mine:x?}");
    assert_eq!((mine[1].3, mine[1].4), (p.addr() as u64, 3 << 20));
    assert_eq!(
        (mine[4].3, mine[4].4),
        (mine[0].3, mine[0].4),
        "the mapping given back"
    );
}
