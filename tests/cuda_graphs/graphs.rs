//! Graphs captured back to back, and a graph that survives heavy allocation and `empty_cache`.

use super::*;

/// Graph one's work: `OUT = IN + 1111`, through two temporaries allocated and freed on the way (the second
/// may take the first's memory). Returns OUT and the temporaries' ranges.
fn work_one(
    allocator: &Gpu,
    k: &Kernels,
    s: &CudaStream,
    input: u64,
    bytes: u64,
) -> (Buffer, Vec<(u64, u64)>) {
    let (stream, n) = (sid(s), elems(bytes));
    let t1 = allocator.alloc_on(bytes, stream).expect("alloc T1");
    k.copy_add(s, t1.ptr(), input, n, 1, 0);
    let out = allocator.alloc_on(bytes, stream).expect("alloc OUT1");
    k.copy_add(s, out.ptr(), t1.ptr(), n, 10, 0);
    let mut temps = vec![range(&t1)];
    drop(t1);
    let t2 = allocator.alloc_on(bytes, stream).expect("alloc T2");
    k.copy_add(s, t2.ptr(), out.ptr(), n, 100, 0);
    k.copy_add(s, out.ptr(), t2.ptr(), n, 1000, 0);
    temps.push(range(&t2));
    drop(t2);
    (out, temps)
}

/// Graph two's work: `OUT = IN + 22` through a temporary twice the size, freed before the end.
fn work_two(
    allocator: &Gpu,
    k: &Kernels,
    s: &CudaStream,
    input: u64,
    bytes: u64,
) -> (Buffer, Vec<(u64, u64)>) {
    let (stream, n) = (sid(s), elems(bytes));
    let t = allocator.alloc_on(2 * bytes, stream).expect("alloc T");
    k.copy_add(s, t.ptr(), input, n, 2, 0);
    let out = allocator.alloc_on(bytes, stream).expect("alloc OUT2");
    k.copy_add(s, out.ptr(), t.ptr(), n, 20, 0);
    let temps = vec![range(&t)];
    drop(t);
    (out, temps)
}

#[test]
fn graphs_captured_back_to_back_replay_their_eager_results() {
    let test = "graphs_captured_back_to_back_replay_their_eager_results";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let cs = cx.new_stream().expect("capture stream");
    let bytes = 3 * page;
    let n = elems(bytes);
    let input = allocator.alloc_on(bytes, sid(&cs)).expect("alloc IN");
    let eager = |base: u32| {
        k.iota(&cs, input.ptr(), n, base);
        let (one, _) = work_one(&allocator, &k, &cs, input.ptr(), bytes);
        let (two, _) = work_two(&allocator, &k, &cs, input.ptr(), bytes);
        (read(&cs, one.ptr(), n), read(&cs, two.ptr(), n))
    };
    let (want1, want2) = eager(0x0100_0000);
    check_iota(&want1, 0x0100_0000 + 1111, "graph one's work run eagerly");
    check_iota(&want2, 0x0100_0000 + 22, "graph two's work run eagerly");

    let (p1, p2) = (GraphPool(1, 0), GraphPool(2, 0));
    let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let (graph1, (out1, temps1)) = captured(&allocator, &cs, global, Announce::Capture(p1), || {
        work_one(&allocator, &k, &cs, input.ptr(), bytes)
    });
    let (graph2, (out2, temps2)) = captured(&allocator, &cs, global, Announce::Streams(p2), || {
        work_two(&allocator, &k, &cs, input.ptr(), bytes)
    });
    let stats = allocator.stats();
    assert_eq!(stats.graph_pools, 2, "{stats:?}");
    let pool1: Vec<_> = temps1.iter().copied().chain([range(&out1)]).collect();
    let pool2: Vec<_> = temps2.iter().copied().chain([range(&out2)]).collect();
    for &r1 in &pool1 {
        for &r2 in &pool2 {
            assert!(
                !overlaps(r1, r2),
                "graph one's {r1:x?} overlaps graph two's {r2:x?}"
            );
        }
    }
    // Eager work after the captures gets neither pool's memory.
    let bystander = allocator
        .alloc_on(bytes, sid(&cs))
        .expect("alloc an eager buffer");
    for &r in pool1.iter().chain(&pool2) {
        assert!(
            !overlaps(range(&bystander), r),
            "an eager allocation got a graph's memory {r:x?}"
        );
    }
    k.iota(&cs, bystander.ptr(), n, 0x0e00_0000);
    // Captured work did not run: the outputs get sentinels, so that a replay that does nothing shows.
    k.iota(&cs, out1.ptr(), n, 0x0d00_0000);
    k.iota(&cs, out2.ptr(), n, 0x0c00_0000);

    graph1.launch().expect("replaying graph one");
    check_iota(
        &read(&cs, out1.ptr(), n),
        0x0100_0000 + 1111,
        "graph one's first replay",
    );
    assert_eq!(
        read(&cs, out1.ptr(), n),
        want1,
        "graph one's replay differs from its eager run"
    );
    check_iota(
        &read(&cs, out2.ptr(), n),
        0x0c00_0000,
        "graph two's output after graph one's replay",
    );
    graph2.launch().expect("replaying graph two");
    assert_eq!(
        read(&cs, out2.ptr(), n),
        want2,
        "graph two's replay differs from its eager run"
    );
    assert_eq!(
        read(&cs, out1.ptr(), n),
        want1,
        "graph two's replay changed graph one's output"
    );

    // A new input, the other order, against a new eager run.
    let (want1, want2) = eager(0x0200_0000);
    graph2.launch().expect("replaying graph two");
    graph1.launch().expect("replaying graph one");
    assert_eq!(
        read(&cs, out1.ptr(), n),
        want1,
        "graph one, replayed second"
    );
    assert_eq!(read(&cs, out2.ptr(), n), want2, "graph two, replayed first");
    check_iota(&want1, 0x0200_0000 + 1111, "graph one's work run eagerly");
    check_iota(
        &read(&cs, bystander.ptr(), n),
        0x0e00_0000,
        "the eager buffer after the replays",
    );
    finish(&allocator);

    drop((graph1, graph2));
    allocator.release_pool(p1).expect("release_pool one");
    allocator.release_pool(p2).expect("release_pool two");
    drop((out1, out2, bystander, input));
    finish(&allocator);
    assert_all_given_back(&allocator);
}

#[test]
fn a_graph_survives_heavy_allocation_and_empty_cache() {
    let test = "a_graph_survives_heavy_allocation_and_empty_cache";
    // 24 pages in all, eager compaction: the allocator would take any idle page, the pool's included.
    let limited = |page: u64| Config {
        memory_limit: Some(Budget::Bytes(24 * page)),
        large_handle: page,
        ..Config::default().with_compaction(Compaction::Eager)
    };
    let Some((allocator, cx, k, page)) = open(test, limited) else {
        return;
    };
    let cs = cx.new_stream().expect("capture stream");
    let others = [
        cx.new_stream().expect("stream 1"),
        cx.new_stream().expect("stream 2"),
    ];
    let bytes = 4 * page;
    let n = elems(bytes);
    let input = allocator.alloc_on(bytes, sid(&cs)).expect("alloc IN");
    let pool = GraphPool(4, 0);
    let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    // OUT = IN + 2 through a temporary freed inside the capture: its 4 pages are the pool's, idle.
    let (graph, (out, temp)) = captured(&allocator, &cs, global, Announce::Capture(pool), || {
        let t = allocator.alloc_on(bytes, sid(&cs)).expect("alloc T");
        k.copy_add(&cs, t.ptr(), input.ptr(), n, 1, 0);
        let out = allocator.alloc_on(bytes, sid(&cs)).expect("alloc OUT");
        k.copy_add(&cs, out.ptr(), t.ptr(), n, 1, 0);
        let temp = range(&t);
        drop(t);
        (out, temp)
    });
    let pool_ranges = [temp, range(&out)];
    let mut round = 0u32;
    let mut replay = |what: &str| {
        round += 1;
        let base = round.wrapping_mul(0x0101_0101);
        k.iota(&cs, input.ptr(), n, base);
        graph.launch().expect("replaying the graph");
        check_iota(
            &read(&cs, out.ptr(), n),
            base.wrapping_add(2),
            &format!("replay {round}, {what}"),
        );
    };
    replay("before anything else");

    /// A live allocation of the heavy phase, filled with `iota(base)`.
    struct Live {
        buffer: Buffer,
        stream: usize,
        base: u32,
    }
    let verify = |live: &Live, what: &str| {
        let s = &others[live.stream];
        let got = read(s, live.buffer.ptr(), elems(live.buffer.len()));
        check_iota(
            &got,
            live.base,
            &format!("{what}: an allocation of {} bytes", live.buffer.len()),
        );
    };
    let mut live: Vec<Live> = Vec::new();
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let (mut allocs, mut ooms) = (0u32, 0u32);
    for op in 0..400u32 {
        let live_bytes: u64 = live.iter().map(|l| l.buffer.len()).sum();
        if live_bytes < 8 * page && (live.is_empty() || next() % 3 != 0) {
            // Small (up to 1 MiB) or large (1 MiB to 6 pages), a multiple of 4 bytes.
            let r = next();
            let size = if r % 5 < 2 {
                4 + (r >> 8) % (1 << 20) / 4 * 4
            } else {
                (1 << 20) + (r >> 8) % (6 * page) / 4 * 4
            };
            let stream = (next() % 2) as usize;
            match allocator.alloc_on(size, sid(&others[stream])) {
                Ok(buffer) => {
                    allocs += 1;
                    let base = op.wrapping_mul(0x0001_0003);
                    k.iota(&others[stream], buffer.ptr(), elems(size), base);
                    for &r in &pool_ranges {
                        assert!(
                            !overlaps(range(&buffer), r),
                            "an allocation got the pool's memory {r:x?}"
                        );
                    }
                    live.push(Live {
                        buffer,
                        stream,
                        base,
                    });
                }
                Err(e) if e.is_out_of_memory() => ooms += 1,
                Err(e) => panic!("allocating {size} bytes: {e}"),
            }
        } else {
            let l = live.swap_remove((next() % live.len() as u64) as usize);
            verify(&l, "before its free");
            drop(l);
        }
        if op % 40 == 39 {
            replay(&format!("after {} operations", op + 1));
            for l in &live {
                verify(l, "after a replay");
            }
        }
    }
    eprintln!("{test}: {allocs} allocations served, {ooms} out of memory under the limit");
    assert!(allocs >= 50, "only {allocs} allocations were served");
    for l in live.drain(..) {
        verify(&l, "at the end");
    }
    finish(&allocator);

    allocator.empty_cache().expect("empty_cache");
    let stats = allocator.stats();
    assert!(
        stats.graph_pool_bytes >= 2 * bytes,
        "empty_cache gave back the live pool's pages: {} bytes left in it",
        stats.graph_pool_bytes
    );
    replay("after empty_cache");
    // Everything the limit leaves beside IN and the pool, in one request: then a replay must not touch it.
    let rest = 24 * page - 3 * bytes;
    let big = allocator
        .alloc_on(rest, sid(&others[0]))
        .expect("the rest under the limit");
    k.iota(&others[0], big.ptr(), elems(rest), 0x0b00_0000);
    replay("beside an allocation of all the rest");
    let big_live = Live {
        buffer: big,
        stream: 0,
        base: 0x0b00_0000,
    };
    verify(&big_live, "after the replay");
    drop(big_live);
    finish(&allocator);

    // Released, the pool's pages serve others: all but IN's now fits.
    drop(graph);
    allocator.release_pool(pool).expect("release_pool");
    drop(out);
    let all = allocator
        .alloc_on(24 * page - bytes, sid(&others[1]))
        .expect("the released pool's pages serve a request");
    k.iota(&others[1], all.ptr(), elems(all.len()), 0x0a00_0000);
    check_iota(
        &read(&others[1], all.ptr(), elems(all.len())),
        0x0a00_0000,
        "the request after the release",
    );
    drop((all, input));
    finish(&allocator);
    assert_all_given_back(&allocator);
}
