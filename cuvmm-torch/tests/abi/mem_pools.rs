//! What PyTorch's `MemPool` and cudagraph trees ask through the C functions: use counts, checkpoints put
//! back, one pool's `empty_cache`, `use_on_oom`, and pools with an allocator of their own (segments the
//! caller got from that allocator, carved and counted as PyTorch's caching allocator does).

use super::*;
use cuvmm_torch::structs::{CForeignSegment, CPoolBlock, CPrivatePoolStat};

unsafe extern "C" fn only_stream(context: *mut c_void, stream: *mut c_void) -> std::ffi::c_int {
    (context == stream) as std::ffi::c_int
}

pub(super) fn begin(device: i32, pool: (u64, u64), on: *mut c_void) {
    // SAFETY: `only_stream` may be called from any thread with this context (it only compares pointers).
    let begun =
        unsafe { cuvmm_begin_allocate_to_pool(device, pool.0, pool.1, Some(only_stream), on) };
    assert_eq!(begun, 0, "{:?}", last_error());
}

pub(super) fn blocks(device: i32, pool: (u64, u64)) -> Vec<CPoolBlock> {
    // SAFETY: a null `out` with `cap` 0 only counts.
    let n = unsafe { cuvmm_pool_blocks(device, pool.0, pool.1, ptr::null_mut(), 0) };
    assert!(n >= 0, "{:?}", last_error());
    let mut out = vec![CPoolBlock::default(); n as usize];
    // SAFETY: `out` has room for `n` blocks.
    let again = unsafe { cuvmm_pool_blocks(device, pool.0, pool.1, out.as_mut_ptr(), out.len()) };
    assert_eq!(again, n);
    out
}

/// `cuvmm_pool_restore` of `checkpoint`.
pub(super) fn restore(device: i32, pool: (u64, u64), checkpoint: &[CPoolBlock]) -> i32 {
    // SAFETY: `checkpoint` holds its length of blocks.
    unsafe {
        cuvmm_pool_restore(
            device,
            pool.0,
            pool.1,
            checkpoint.as_ptr(),
            checkpoint.len(),
        )
    }
}

#[test]
fn use_counts_and_a_checkpoint_put_back_through_the_c_functions() {
    setup();
    let device = 19;
    let (pool, s) = ((0, 41), stream(0x71));
    assert_eq!(cuvmm_pool_use_count(device, pool.0, pool.1), 0);
    assert_eq!(cuvmm_incref_pool(device, pool.0, pool.1), 0);
    begin(device, pool, s);
    assert_eq!(cuvmm_pool_use_count(device, pool.0, pool.1), 2);
    let x = cuvmm_malloc(3 << 20, device, s);
    let checkpoint = blocks(device, pool);
    assert_eq!(checkpoint.len(), 1);
    assert_eq!(
        (checkpoint[0].address, checkpoint[0].requested_size),
        (x.addr() as u64, 3 << 20)
    );
    let y = cuvmm_malloc(5 << 20, device, s);
    cuvmm_free(x, 0, device, s);
    assert_eq!(restore(device, pool, &checkpoint), 0, "{:?}", last_error());
    assert_eq!(blocks(device, pool), checkpoint);
    cuvmm_free(y, 0, device, s);
    assert_failed("y was freed by the checkpoint", "double free");
    cuvmm_free(x, 0, device, s);
    assert_eq!(cuvmm_end_allocate_to_pool(device, pool.0, pool.1), 0);
    assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    assert_eq!(
        cuvmm_empty_pool_cache(device, pool.0, pool.1),
        0,
        "still a MemPool"
    );
    assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    assert!(cuvmm_empty_pool_cache(device, pool.0, pool.1) > 0);
    // SAFETY: a null block list with n > 0 is refused before it is read.
    let refused = unsafe { cuvmm_pool_restore(device, 0, 41, ptr::null(), 2) };
    assert_eq!(refused, -1);
    assert_failed("null checkpoint", "null");
    assert_eq!(cuvmm_set_use_on_oom(device, 0, 41, 1), 0);
    assert_eq!(cuvmm_set_no_split(device, 0, 41), 0);
    assert_eq!(cuvmm_pool_use_count(-1, 0, 41), -1);
    // A block at an address of free memory (allocateWithAddress), and not over a live one.
    let z = cuvmm_malloc(4 << 20, device, s);
    cuvmm_free(z, 0, device, s);
    assert_eq!(cuvmm_malloc_at(device, z, 1 << 20), z, "{:?}", last_error());
    assert!(cuvmm_malloc_at(device, z, 1 << 20).is_null());
    assert_failed("over a live block", "not an address");
    cuvmm_free(z, 0, device, s);
    check_invariants(device);
}

fn foreign_malloc(
    device: i32,
    pool: (u64, u64),
    size: isize,
    s: *mut c_void,
) -> Result<u64, usize> {
    let mut grow = 0usize;
    // SAFETY: `grow` is valid for one write.
    let p = unsafe { cuvmm_foreign_malloc(device, pool.0, pool.1, size, s, 0, &mut grow) };
    if p.is_null() {
        Err(grow)
    } else {
        Ok(p.addr() as u64)
    }
}

fn release(device: i32, pool: (u64, u64)) -> Vec<CForeignSegment> {
    let mut len = 0usize;
    // SAFETY: `len` is valid for one write.
    let out = unsafe { cuvmm_foreign_release(device, pool.0, pool.1, 0, &mut len) };
    if out.is_null() {
        return Vec::new();
    }
    // SAFETY: a non-null result holds `len` segments until freed.
    let segments = unsafe { std::slice::from_raw_parts(out, len) }.to_vec();
    // SAFETY: `out` came from cuvmm_foreign_release with this length, and is freed once.
    unsafe { cuvmm_foreign_segments_free(out, len) };
    segments
}

/// The recorded events of `pool` on `device`: (action, address, size).
fn events_of(device: i32, pool: (u64, u64)) -> Vec<(i32, u64, u64)> {
    let taken = cuvmm_snapshot_take(device);
    assert!(!taken.is_null(), "{:?}", last_error());
    // SAFETY: a non-null snapshot's arrays hold their lengths until freed.
    let events = unsafe {
        let snap = &*taken;
        (std::slice::from_raw_parts(snap.traces, snap.num_traces).iter())
            .filter(|t| (t.pool_a, t.pool_b) == pool)
            .map(|t| (t.action, t.addr, t.size))
            .collect()
    };
    // SAFETY: freed once.
    unsafe { cuvmm_snapshot_free(taken) };
    events
}

/// vLLM's and NCCL's pools: the C++ layer asks for a block, gets the size of a segment to get from the
/// pool's own allocator (PyTorch's sizes), hands it over, and gets blocks carved in it; frees, statistics,
/// the snapshot, its events and `record_stream` see them; once the pool is released its free segments go
/// back.
#[test]
fn a_pool_with_its_own_allocator_carves_the_segments_it_is_given() {
    setup();
    let device = 20;
    let (pool, s) = ((0, 42), stream(0x72));
    assert_eq!(cuvmm_record_history(device, 1000), 0);
    assert_eq!(cuvmm_incref_pool(device, pool.0, pool.1), 0);
    let base_allocated = stat(device, "allocated_bytes.all.current");
    assert_eq!(
        foreign_malloc(device, pool, 1000, s),
        Err(2 << 20),
        "a small segment"
    );
    let seg: u64 = 0x7e00_0000_0000;
    assert_eq!(
        cuvmm_foreign_add_segment(
            device,
            pool.0,
            pool.1,
            s,
            ptr::with_exposed_provenance_mut(seg as usize),
            2 << 20
        ),
        0
    );
    let a = foreign_malloc(device, pool, 1000, s).unwrap();
    let b = foreign_malloc(device, pool, 3000, s).unwrap();
    assert_eq!(
        (a, b),
        (seg, seg + 1024),
        "carved in order, 512-byte rounded"
    );
    assert_eq!(
        foreign_malloc(device, pool, 3 << 20, s),
        Err(20 << 20),
        "a large one"
    );
    assert_eq!(
        foreign_malloc(device, pool, 11 << 20, s),
        Err(12 << 20),
        "rounded to 2 MiB"
    );
    assert_eq!(
        foreign_malloc(device, pool, 1000, stream(0x73)),
        Err(2 << 20),
        "another stream's"
    );
    assert_eq!(
        stat(device, "allocated_bytes.all.current"),
        base_allocated + 1024 + 3072
    );
    assert_eq!(stat(device, "allocation.small_pool.current"), 2);
    assert_eq!(stat(device, "reserved_bytes.all.current") % (2 << 20), 0);
    assert!(stat(device, "segment.small_pool.current") >= 1);
    // The snapshot shows the segment, of the pool, with its blocks.
    let taken = cuvmm_snapshot_take(device);
    // SAFETY: a non-null snapshot's arrays hold their lengths until freed.
    let found = unsafe {
        let snap = &*taken;
        let segs = std::slice::from_raw_parts(snap.segments, snap.num_segments);
        segs.iter().find(|g| g.address == seg).map(|g| {
            (
                g.pool_a,
                g.pool_b,
                g.total_size,
                g.allocated_size,
                g.num_blocks,
            )
        })
    };
    // SAFETY: freed once.
    unsafe { cuvmm_snapshot_free(taken) };
    assert_eq!(found, Some((0, 42, 2 << 20, 1024 + 3072, 3)));
    // record_stream, then free: pending until its event is polled at the next request.
    cuvmm_record_stream(
        ptr::with_exposed_provenance_mut(b as usize),
        device,
        stream(0x74),
    );
    assert!(last_error().is_none(), "{:?}", last_error());
    cuvmm_free_any(ptr::with_exposed_provenance_mut(b as usize));
    assert!(last_error().is_none(), "{:?}", last_error());
    assert_eq!(
        stat(device, "active_bytes.all.current") - stat(device, "allocated_bytes.all.current"),
        3072
    );
    cuvmm_free_any(ptr::with_exposed_provenance_mut(b as usize));
    assert_failed("a second free", "double free");
    let c = foreign_malloc(device, pool, 2000, s).unwrap();
    assert_eq!(c, b, "its event completed: reused");
    for p in [a, c] {
        cuvmm_free(ptr::with_exposed_provenance_mut(p as usize), 0, device, s);
        assert!(last_error().is_none(), "{:?}", last_error());
    }
    assert_eq!(stat(device, "allocated_bytes.all.current"), base_allocated);
    assert!(release(device, pool).is_empty(), "the MemPool still lives");
    assert_eq!(cuvmm_foreign_segment_count(device, pool.0, pool.1), 1);
    assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    let released = release(device, pool);
    assert_eq!(released.len(), 1);
    assert_eq!(
        cuvmm_foreign_segment_count(device, pool.0, pool.1),
        0,
        "its allocator is no longer needed"
    );
    assert_eq!(cuvmm_foreign_segment_count(-1, pool.0, pool.1), -1);
    assert_failed("a device out of range", "device");
    assert_eq!(
        (released[0].address, released[0].size, released[0].pool_b),
        (seg, 2 << 20, 42)
    );
    assert_eq!(stat(device, "segment.small_pool.current"), 0);
    // As PyTorch records them: the segment made and given back; each block's alloc, free requested, and
    // free completed (b's once the event of its other stream completed).
    let (alloc, requested, completed, segment_alloc, segment_free) = (0, 1, 2, 3, 4);
    assert_eq!(
        events_of(device, pool),
        [
            (segment_alloc, seg, 2 << 20),
            (alloc, a, 1000),
            (alloc, b, 3000),
            (requested, b, 3000),
            (completed, b, 3000),
            (alloc, c, 2000),
            (requested, a, 1000),
            (completed, a, 1000),
            (requested, c, 2000),
            (completed, c, 2000),
            (segment_free, seg, 2 << 20),
        ]
    );
    check_invariants(device);
}

/// A block of a pool with an allocator of its own, used on another stream and freed while another pool is
/// being allocated to (a capture underway: no event may be recorded), is waited for once the capture ends:
/// the pool released, one `emptyCache` gives its segment back (before, the block was still pending then,
/// and the segment stayed until the next).
#[test]
fn a_free_deferred_during_a_capture_does_not_keep_its_segment() {
    setup();
    let device = 30;
    let (pool, capture, s) = ((0, 61), (0, 62), stream(0x81));
    assert_eq!(cuvmm_incref_pool(device, pool.0, pool.1), 0);
    let seg: u64 = 0x7d00_0000_0000;
    let segment = ptr::with_exposed_provenance_mut(seg as usize);
    assert_eq!(
        cuvmm_foreign_add_segment(device, pool.0, pool.1, s, segment, 2 << 20),
        0
    );
    let a = foreign_malloc(device, pool, 1000, s).unwrap();
    cuvmm_record_stream(
        ptr::with_exposed_provenance_mut(a as usize),
        device,
        stream(0x82),
    );
    begin(device, capture, stream(0x83));
    cuvmm_free_any(ptr::with_exposed_provenance_mut(a as usize));
    assert!(last_error().is_none(), "{:?}", last_error());
    assert_eq!(cuvmm_end_allocate_to_pool(device, capture.0, capture.1), 0);
    assert_eq!(cuvmm_release_pool(device, capture.0, capture.1), 0);
    assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    let released = release(device, pool);
    assert_eq!(
        released.iter().map(|r| r.address).collect::<Vec<_>>(),
        [seg]
    );
    assert_eq!(cuvmm_foreign_segment_count(device, pool.0, pool.1), 0);
    check_invariants(device);
}

/// The pools' memory counts in the peaks of the sum: vLLM loads weights into its pool, resets the peaks,
/// then runs the model in cuvmm's memory; the peak is the run's plus the weights.
#[test]
fn a_pools_memory_counts_in_the_peaks_of_the_sum() {
    setup();
    let device = 21;
    let (pool, s) = ((0, 43), stream(0x75));
    assert_eq!(cuvmm_incref_pool(device, pool.0, pool.1), 0);
    let seg: u64 = 0x7d00_0000_0000;
    assert_eq!(foreign_malloc(device, pool, 12 << 20, s), Err(12 << 20));
    assert_eq!(
        cuvmm_foreign_add_segment(
            device,
            pool.0,
            pool.1,
            s,
            ptr::with_exposed_provenance_mut(seg as usize),
            12 << 20
        ),
        0
    );
    let weights = foreign_malloc(device, pool, 12 << 20, s).unwrap();
    assert_eq!(cuvmm_reset_peak_stats(device), 0);
    assert_eq!(stat(device, "allocated_bytes.all.peak"), 12 << 20);
    let run = cuvmm_malloc(30 << 20, device, s);
    cuvmm_free(run, 0, device, s);
    assert_eq!(stat(device, "allocated_bytes.all.peak"), 42 << 20);
    assert_eq!(stat(device, "allocated_bytes.all.current"), 12 << 20);
    cuvmm_free(
        ptr::with_exposed_provenance_mut(weights as usize),
        0,
        device,
        s,
    );
    assert_eq!(cuvmm_reset_accumulated_stats(device), 0);
    assert_eq!(stat(device, "allocated_bytes.all.allocated"), 0);
    check_invariants(device);
}

/// `cuvmm_private_pool_stats(device, NULL, 0)` counts, then the entries.
fn private_pool_stats(device: i32) -> Vec<CPrivatePoolStat> {
    // SAFETY: a null `out` with `cap` 0 only counts.
    let n = unsafe { cuvmm_private_pool_stats(device, ptr::null_mut(), 0) };
    assert!(n >= 0, "{:?}", last_error());
    let mut out = vec![CPrivatePoolStat::default(); n as usize];
    // SAFETY: `out` has room for `n` entries.
    let again = unsafe { cuvmm_private_pool_stats(device, out.as_mut_ptr(), out.len()) };
    assert_eq!(again, n);
    out
}

/// PyTorch's `reserved_bytes_by_private_pools`, through the C function and the statistics' JSON: a graph
/// pool's mapped bytes and the segments of a pool with an allocator of its own, each under its id, the
/// common memory under neither; at 0 once given back, with their peaks.
#[test]
fn each_private_pools_reserved_bytes_under_its_id() {
    setup();
    let device = 29;
    let (graph, own, s) = ((0, 51), (0, 52), stream(0x79));
    let common = cuvmm_malloc(1 << 20, device, s);
    assert_eq!(cuvmm_incref_pool(device, graph.0, graph.1), 0);
    begin(device, graph, s);
    let x = cuvmm_malloc(30 << 20, device, s);
    assert_eq!(cuvmm_end_allocate_to_pool(device, graph.0, graph.1), 0);
    assert_eq!(cuvmm_incref_pool(device, own.0, own.1), 0);
    assert_eq!(foreign_malloc(device, own, 12 << 20, s), Err(12 << 20));
    let seg = ptr::with_exposed_provenance_mut(0x7c00_0000_0000);
    let added = cuvmm_foreign_add_segment(device, own.0, own.1, s, seg, 12 << 20);
    assert_eq!(added, 0, "{:?}", last_error());
    let y = foreign_malloc(device, own, 12 << 20, s).unwrap();

    let pools = private_pool_stats(device);
    let ids: Vec<_> = pools.iter().map(|p| (p.pool_a, p.pool_b)).collect();
    assert_eq!(ids, [graph, own]);
    let (in_graph, in_own) = (pools[0].reserved_bytes, pools[1].reserved_bytes);
    assert!(in_graph.all.current >= 30 << 20, "{in_graph:?}");
    assert_eq!(in_graph.large_pool, in_graph.all);
    assert_eq!(in_own.all.current, 12 << 20);
    let json = |pool: (u64, u64), key: &str| {
        stat(
            device,
            &format!(
                "reserved_bytes_by_private_pools.{}_{}.{key}",
                pool.0, pool.1
            ),
        )
    };
    assert_eq!(json(graph, "all.current"), in_graph.all.current as u64);
    assert_eq!(json(own, "large_pool.peak"), 12 << 20);
    assert!(
        stat(device, "reserved_bytes.all.current")
            > (in_graph.all.current + in_own.all.current) as u64,
        "the common memory too"
    );
    // SAFETY: a null `out` with `cap` > 0 is refused before it is written.
    let refused = unsafe { cuvmm_private_pool_stats(device, ptr::null_mut(), 1) };
    assert_eq!(refused, -1);
    assert_failed("null out", "null");

    cuvmm_free(x, 0, device, s);
    cuvmm_free(ptr::with_exposed_provenance_mut(y as usize), 0, device, s);
    // The graph pool's begin and incref, the other pool's incref.
    for pool in [graph, graph, own] {
        assert_eq!(cuvmm_release_pool(device, pool.0, pool.1), 0);
    }
    assert!(cuvmm_empty_pool_cache(device, graph.0, graph.1) > 0);
    assert_eq!(release(device, own).len(), 1);
    let gone = private_pool_stats(device);
    assert!(
        gone.iter().all(|p| p.reserved_bytes.all.current == 0),
        "{gone:?}"
    );
    assert_eq!(gone[0].reserved_bytes.all.peak, in_graph.all.current);
    assert_eq!(cuvmm_reset_peak_stats(device), 0);
    assert_eq!(cuvmm_reset_accumulated_stats(device), 0);
    assert!(
        private_pool_stats(device).is_empty(),
        "forgotten once both resets cleared them"
    );
    cuvmm_free(common, 0, device, s);
    check_invariants(device);
}
