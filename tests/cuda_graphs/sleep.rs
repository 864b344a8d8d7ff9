//! A graph captured inside a tag sleeps and wakes with it on a GPU (issue 44).

use super::*;

/// The graph's work, under the tag `graph`: `OUT = IN + 11` through a temporary freed inside the capture
/// (its memory is the graph pool's, and the replay writes it again).
fn tagged_work(allocator: &Gpu, k: &Kernels, s: &CudaStream, input: u64, bytes: u64) -> Buffer {
    let (stream, n) = (sid(s), elems(bytes));
    let t = allocator
        .alloc_tagged(bytes, stream, "graph")
        .expect("alloc T");
    k.copy_add(s, t.ptr(), input, n, 1, 0);
    let out = allocator
        .alloc_tagged(bytes, stream, "graph")
        .expect("alloc OUT");
    k.copy_add(s, out.ptr(), t.ptr(), n, 10, 0);
    drop(t);
    out
}

/// `IN` under the tag, a graph captured into a pool under the tag; three times: the tag sleeps with its
/// bytes (its memory, the graph's included, given back), another job writes over that memory, the tag
/// wakes: `IN` holds its values and the replay gives `IN + 11`. The second and later sleeps pin nothing.
#[test]
fn a_graph_captured_in_a_tag_replays_after_its_memory_slept_and_woke() {
    let test = "a_graph_captured_in_a_tag_replays_after_its_memory_slept_and_woke";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let cs = cx.new_stream().expect("capture stream");
    let bytes = 3 * page;
    let n = elems(bytes);
    let input = allocator
        .alloc_tagged(bytes, sid(&cs), "graph")
        .expect("alloc IN");
    k.iota(&cs, input.ptr(), n, 0x0100_0000);
    let pool = GraphPool(44, 0);
    let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let (graph, out) = captured(&allocator, &cs, global, Announce::Capture(pool), || {
        tagged_work(&allocator, &k, &cs, input.ptr(), bytes)
    });
    graph.launch().expect("the first replay");
    check_iota(
        &read(&cs, out.ptr(), n),
        0x0100_0000 + 11,
        "the first replay",
    );
    let pinned = |a: &Gpu| a.stats().driver.get(Op::HostAlloc);
    let mut pinned_before = pinned(&allocator);
    for cycle in 0..3 {
        let given = allocator.sleep("graph", true).expect("sleep");
        assert!(
            given >= 3 * bytes,
            "cycle {cycle}: {given} bytes given back"
        );
        let now = pinned(&allocator);
        assert!(
            cycle == 0 || now == pinned_before,
            "cycle {cycle}: pinned again"
        );
        pinned_before = now;
        let other = allocator
            .alloc_on(given, sid(&cs))
            .expect("the memory given back");
        k.iota(&cs, other.ptr(), elems(given), 0x0f00_0000);
        cs.synchronize().expect("the other job");
        drop(other);
        allocator.empty_cache().expect("empty_cache");
        allocator.wake("graph").expect("wake");
        check_iota(&read(&cs, input.ptr(), n), 0x0100_0000, "IN after the wake");
        k.iota(&cs, out.ptr(), n, 0x0d00_0000);
        graph.launch().expect("a replay after the wake");
        check_iota(
            &read(&cs, out.ptr(), n),
            0x0100_0000 + 11,
            "a replay after the wake",
        );
    }
    assert!(allocator.stats().host_kept_bytes >= 2 * bytes);
    drop(graph);
    drop(out);
    drop(input);
    allocator.release_pool(pool).expect("release_pool");
    allocator.release_host_buffers(None).expect("release");
    finish(&allocator);
    assert_all_given_back(&allocator);
}
