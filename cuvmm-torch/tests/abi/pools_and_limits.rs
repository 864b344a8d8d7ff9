//! Graph pools, peers, the memory fraction and its out-of-memory report, and sleep and wake of tagged
//! memory.

use super::*;

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

/// PyTorch 2.13's `use_mem_pool` and `markCaptureBegin`/`End`, as the C++ layer makes them: before
/// captures are marked, a pool begun refuses `empty_cache`; once marked, only a marked capture does.
#[test]
fn once_captures_are_marked_only_a_marked_capture_refuses_empty_cache() {
    setup();
    let device = 28;
    let s = stream(0x71);
    // SAFETY: `only_stream` may be called from any thread with this context (it only compares pointers).
    let begun = unsafe { cuvmm_begin_allocate_to_pool(device, 0, 4, Some(only_stream), s) };
    assert_eq!(begun, 0, "{:?}", last_error());
    cuvmm_empty_cache(device);
    assert_failed(
        "empty_cache in a pool, captures not marked",
        "being captured",
    );
    assert_eq!(cuvmm_mark_captures(device), 0, "{:?}", last_error());
    cuvmm_empty_cache(device);
    assert_eq!(last_error(), None, "empty_cache in a pool begun alone");
    assert_eq!(cuvmm_mark_capture(device, 1), 0, "{:?}", last_error());
    cuvmm_empty_cache(device);
    assert_failed("empty_cache during a marked capture", "being captured");
    assert_eq!(cuvmm_mark_capture(device, 0), 0, "{:?}", last_error());
    cuvmm_empty_cache(device);
    assert_eq!(last_error(), None, "empty_cache once the capture ended");
    assert_eq!(cuvmm_end_allocate_to_pool(device, 0, 4), 0);
    assert_eq!(cuvmm_release_pool(device, 0, 4), 0);
    assert_eq!(cuvmm_mark_captures(DEVICES as i32), -1);
    assert_failed("a device out of range", "device");
    assert_eq!(cuvmm_mark_capture(-1, 1), -1);
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
fn a_memory_fraction_limits_growth_and_its_oom_or_a_too_large_request_is_flagged_with_numbers() {
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
    // A request larger than the device is an out-of-memory too, as PyTorch reports it.
    assert!(cuvmm_malloc(9 << 30, device, ptr::null_mut()).is_null());
    // SAFETY: as above.
    assert_eq!(unsafe { cuvmm_last_oom(&mut oom) }, 1);
    assert_eq!((oom.requested, oom.alloc_size), (9 << 30, 9 << 30));
    assert_eq!(
        (oom.device_total, oom.allowed),
        (8 * GIB, 8 * GIB),
        "a fraction of 1 is set"
    );
    assert_eq!(oom.allocated, 4 << 30);
    assert_eq!(oom.device_free, 8 * GIB - oom.reserved);
    assert_failed(
        "larger than the device",
        "out of memory: a request of 9663676416 bytes can never fit",
    );
    for p in [fits, now_fits] {
        cuvmm_free(p, 0, device, ptr::null_mut());
    }
    check_invariants(device);
}

/// A thread's tag puts its allocations in memory that sleeps and wakes at the same address; what a
/// sleeping tag refuses returns -1 with an error, a free of its memory takes effect at the wake, and a NULL
/// tag is refused.
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
    // A free while asleep succeeds (a tensor dropped then): freed at once, as PyTorch counts a free, its
    // memory pending until the wake.
    let allocations = stat(device, "allocation.all.current");
    let active = stat(device, "active.all.current");
    cuvmm_free(kv, 60 << 20, device, stream(3));
    assert!(last_error().is_none(), "{:?}", last_error());
    assert_eq!(stat(device, "allocation.all.current"), allocations - 1);
    assert_eq!(stat(device, "active.all.current"), active);
    // SAFETY: `tag` is valid for the calls.
    unsafe {
        assert_eq!(cuvmm_set_tag(tag.as_ptr()), 0);
        assert!(cuvmm_malloc(4096, device, stream(3)).is_null());
        assert_failed("allocation under a sleeping tag", "asleep");
        assert_eq!(cuvmm_set_tag(ptr::null()), 0);
    }
    let text = taken(cuvmm_memory_summary(device));
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
    assert_eq!(
        stat(device, "active.all.current"),
        active - 1,
        "kv's memory, given back at the wake"
    );
    cuvmm_free(other, 1 << 20, device, stream(3));
    assert!(last_error().is_none());
    assert_eq!(stat(device, "allocation.all.current"), 0);
    check_invariants(device);
}

/// A sleep that keeps bytes leaves page-locked host memory with the tag, counted in the statistics, listed
/// by `cuvmm_tags_json`, kept across the wake for the next sleep and freed by
/// `cuvmm_release_host_buffers` (never while the tag keeps its bytes).
#[test]
fn the_host_memory_a_sleep_kept_is_counted_listed_and_released() {
    setup();
    let device = 22;
    let tag = CString::new("weights").unwrap();
    // SAFETY: `tag` is a NUL-terminated string valid for the call.
    assert_eq!(unsafe { cuvmm_set_tag(tag.as_ptr()) }, 0);
    let weights = cuvmm_malloc(8 << 20, device, stream(3));
    // SAFETY: NULL clears the tag.
    assert_eq!(unsafe { cuvmm_set_tag(ptr::null()) }, 0);
    assert!(!weights.is_null(), "{:?}", last_error());
    let tags = |device| taken(cuvmm_tags_json(device));
    // SAFETY: `tag` is valid for each call; a NULL tag is refused.
    unsafe {
        // Pinned ahead, counted; a second preparation has nothing to do.
        assert_eq!(cuvmm_prepare_sleep(device, tag.as_ptr()), 8 << 20);
        assert_eq!(stat(device, "cuvmm.host_kept_bytes"), 8 << 20);
        assert_eq!(cuvmm_prepare_sleep(device, tag.as_ptr()), 0);
        assert_eq!(cuvmm_prepare_sleep(device, ptr::null()), -1);
        assert_eq!(cuvmm_prepare_sleep(DEVICES as i32, tag.as_ptr()), -1);
        assert_failed("device", "out of range");
        // The pages of its 20 MiB chunk are given back; its 8 MiB kept, in the memory pinned ahead.
        assert_eq!(cuvmm_sleep(device, tag.as_ptr(), 1), 20 << 20);
        assert_eq!(stat(device, "cuvmm.host_kept_bytes"), 8 << 20);
        let listed = tags(device);
        assert!(
            listed.contains(r#""state":"asleep""#) && listed.contains(r#""bytes_kept":true"#),
            "{listed}"
        );
        assert_eq!(
            cuvmm_release_host_buffers(device, ptr::null()),
            0,
            "kept bytes stay"
        );
        assert_eq!(cuvmm_wake(device, tag.as_ptr()), 0, "{:?}", last_error());
        assert_eq!(
            stat(device, "cuvmm.host_kept_bytes"),
            8 << 20,
            "kept for the next sleep"
        );
        assert_eq!(cuvmm_release_host_buffers(device, tag.as_ptr()), 8 << 20);
        assert_eq!(stat(device, "cuvmm.host_kept_bytes"), 0);
        assert_eq!(cuvmm_release_host_buffers(DEVICES as i32, ptr::null()), -1);
        assert!(cuvmm_tags_json(-1).is_null());
    }
    cuvmm_free(weights, 8 << 20, device, stream(3));
    assert!(last_error().is_none());
    check_invariants(device);
}

/// `cuvmm_read_kept` reads a sleeping tag's kept bytes (torch_memory_saver's `get_cpu_backup`): 1 with the
/// bytes; 0, `out` untouched, for memory of no sleeping tag and on a device never allocated on; -1 where
/// the sleep kept none, for a null `out`, and for a device out of range.
#[test]
fn a_sleeping_tags_kept_bytes_are_read_through_the_abi() {
    setup();
    let (device, unopened) = (31, 32);
    let (weights_tag, kv_tag) = (
        CString::new("weights").unwrap(),
        CString::new("kv").unwrap(),
    );
    let tagged = |tag: &CString, size| {
        // SAFETY: `tag` is a NUL-terminated string valid for the call; NULL clears the tag.
        assert_eq!(unsafe { cuvmm_set_tag(tag.as_ptr()) }, 0);
        let ptr = cuvmm_malloc(size, device, stream(3));
        // SAFETY: as above.
        assert_eq!(unsafe { cuvmm_set_tag(ptr::null()) }, 0);
        assert!(!ptr.is_null(), "{:?}", last_error());
        ptr
    };
    let weights = tagged(&weights_tag, 3 << 20);
    let kv = tagged(&kv_tag, 1 << 20);
    let untagged = cuvmm_malloc(1 << 20, device, stream(3));
    let bytes: Vec<u8> = (0..3u32 << 20).map(|i| (i % 251) as u8).collect();
    global()
        .unwrap()
        .allocator(device)
        .unwrap()
        .with_strategy(|s| {
            let sim = s.driver_mut().as_sim_mut().expect("a simulated device");
            sim.write(weights.expose_provenance() as u64, &bytes)
                .unwrap();
        });
    let read = |device, ptr: *mut c_void, len: usize| {
        let mut out = vec![0xABu8; len];
        // SAFETY: `out` has `len` writable bytes, used by nothing else during the call.
        let status = unsafe { cuvmm_read_kept(device, ptr, out.as_mut_ptr().cast(), len) };
        (status, out)
    };
    assert_eq!(read(device, weights, 16), (0, vec![0xAB; 16]), "awake");
    // SAFETY: the tags are valid for each call.
    unsafe {
        assert!(cuvmm_sleep(device, weights_tag.as_ptr(), 1) > 0);
        assert!(cuvmm_sleep(device, kv_tag.as_ptr(), 0) > 0);
    }
    assert_eq!(read(device, weights, 3 << 20), (1, bytes.clone()));
    let middle = weights.wrapping_byte_add(1 << 20);
    assert_eq!(read(device, middle, 100).1, bytes[1 << 20..(1 << 20) + 100]);
    assert_eq!(read(device, untagged, 8), (0, vec![0xAB; 8]));
    assert_eq!(
        read(unopened, weights, 8),
        (0, vec![0xAB; 8]),
        "never allocated on"
    );
    // SAFETY: the tag is valid for the call.
    let prepared = unsafe { cuvmm_prepare_sleep(unopened, weights_tag.as_ptr()) };
    assert_eq!(prepared, 0, "never allocated on: not opened");
    assert_eq!(read(device, kv, 8).0, -1);
    assert_failed("kv", "asleep without those bytes kept");
    assert_eq!(read(device, weights, (3 << 20) + 1).0, -1, "past the block");
    // SAFETY: a null `out` with bytes to read is refused; with none there is nothing to write.
    unsafe {
        assert_eq!(cuvmm_read_kept(device, weights, ptr::null_mut(), 8), -1);
        assert_failed("null out", "a null out was passed");
        assert_eq!(cuvmm_read_kept(device, weights, ptr::null_mut(), 0), 1);
    }
    assert_eq!(read(DEVICES as i32, weights, 8).0, -1);
    assert_failed("device", "out of range");
    // SAFETY: the tags are valid for each call.
    unsafe {
        assert_eq!(cuvmm_wake(device, weights_tag.as_ptr()), 0);
        assert_eq!(cuvmm_wake(device, kv_tag.as_ptr()), 0);
    }
    assert_eq!(read(device, weights, 8), (0, vec![0xAB; 8]), "awake again");
    for (ptr, size) in [(weights, 3 << 20), (kv, 1 << 20), (untagged, 1 << 20)] {
        cuvmm_free(ptr, size, device, stream(3));
    }
    assert!(last_error().is_none());
    check_invariants(device);
}

/// The frameworks' sleep calls (torch_memory_saver's `pause`, vLLM's `sleep`) ask every device for its
/// tags: a device cuvmm never allocated on answers `[]` and is not opened by the asking (on CUDA that would
/// make a context there); once allocated on, it lists its tags.
#[test]
fn every_device_can_be_asked_for_its_tags_without_opening_it() {
    setup();
    let device = 26;
    assert_eq!(cuvmm_device_count(), DEVICES as i32);
    let tags = || taken(cuvmm_tags_json(device));
    assert_eq!(tags(), "[]");
    assert!(
        global().unwrap().existing(device).unwrap().is_none(),
        "asking opened the device"
    );
    let tag = CString::new("kv").unwrap();
    // SAFETY: `tag` is a NUL-terminated string valid for the call; NULL clears the tag.
    assert_eq!(unsafe { cuvmm_set_tag(tag.as_ptr()) }, 0);
    let block = cuvmm_malloc(1 << 20, device, stream(3));
    // SAFETY: as above.
    assert_eq!(unsafe { cuvmm_set_tag(ptr::null()) }, 0);
    assert!(!block.is_null(), "{:?}", last_error());
    let listed = tags();
    assert!(listed.contains(r#""name":"kv""#), "{listed}");
    cuvmm_free(block, 1 << 20, device, stream(3));
    assert!(last_error().is_none());
    check_invariants(device);
}
