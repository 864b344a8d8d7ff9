//! Two threads capturing at once, a capture nobody announced, and the capture probe the stream caches ask.

use super::*;

#[test]
fn two_threads_capture_at_once_into_their_own_pools() {
    let test = "two_threads_capture_at_once_into_their_own_pools";
    let Some((allocator, cx, _, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let barrier = Arc::new(Barrier::new(2));
    let threads: Vec<_> = (0..2u32)
        .map(|t| {
            let (allocator, cx, barrier) = (allocator.clone(), cx.clone(), barrier.clone());
            std::thread::spawn(move || {
                let k = Kernels::load(&cx);
                let s = cx.new_stream().expect("stream");
                let bytes = (2 + u64::from(t)) * page;
                let n = elems(bytes);
                let input = allocator.alloc_on(bytes, sid(&s)).expect("alloc IN");
                let pool = GraphPool(5 + u64::from(t), 0);
                let announce = if t == 0 {
                    Announce::Capture(pool)
                } else {
                    Announce::Streams(pool)
                };
                let local = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
                let add = 7 + 10 * t;
                barrier.wait();
                let (graph, (out, temp)) = captured(&allocator, &s, local, announce, || {
                    // Both captures are underway from here to the last wait.
                    barrier.wait();
                    let temp = allocator.alloc_on(bytes, sid(&s)).expect("alloc T");
                    k.copy_add(&s, temp.ptr(), input.ptr(), n, add, 0);
                    barrier.wait();
                    let out = allocator.alloc_on(bytes, sid(&s)).expect("alloc OUT");
                    k.copy_add(&s, out.ptr(), temp.ptr(), n, 1, 0);
                    let temp_range = range(&temp);
                    drop(temp);
                    barrier.wait();
                    (out, temp_range)
                });
                for round in 0..5u32 {
                    let base = 0x0100_0000 * (t + 1) + round;
                    k.iota(&s, input.ptr(), n, base);
                    graph.launch().expect("replaying");
                    check_iota(
                        &read(&s, out.ptr(), n),
                        base.wrapping_add(add + 1),
                        &format!("thread {t}, replay {round}"),
                    );
                }
                let ranges = vec![temp, range(&out)];
                // Both pools stay live until both threads have replayed.
                barrier.wait();
                drop(graph);
                allocator.release_pool(pool).expect("release_pool");
                drop((out, input));
                ranges
            })
        })
        .collect();
    let ranges: Vec<Vec<(u64, u64)>> = (threads.into_iter())
        .map(|t| t.join().expect("a capturing thread failed"))
        .collect();
    for &r0 in &ranges[0] {
        for &r1 in &ranges[1] {
            assert!(
                !overlaps(r0, r1),
                "thread 0's pool memory {r0:x?} overlaps thread 1's {r1:x?}"
            );
        }
    }
    finish(&allocator);
    assert_all_given_back(&allocator);
}

#[test]
fn a_capture_nobody_announced_gets_a_pool_and_keeps_it() {
    let test = "a_capture_nobody_announced_gets_a_pool_and_keeps_it";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let cs = cx.new_stream().expect("capture stream");
    let bytes = 2 * page;
    let n = elems(bytes);
    let input = allocator.alloc_on(bytes, sid(&cs)).expect("alloc IN");
    // A free block of the common pool on the capture stream, of the size the capture asks for.
    let before = allocator.alloc_on(bytes, sid(&cs)).expect("alloc before");
    let freed = range(&before);
    drop(before);
    let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    let (graph, (out, temp)) = captured(&allocator, &cs, global, Announce::Not, || {
        let t = allocator
            .alloc_on(bytes, sid(&cs))
            .expect("alloc T during the capture");
        k.copy_add(&cs, t.ptr(), input.ptr(), n, 3, 0);
        let out = allocator
            .alloc_on(bytes, sid(&cs))
            .expect("alloc OUT during the capture");
        k.copy_add(&cs, out.ptr(), t.ptr(), n, 30, 0);
        let temp = range(&t);
        drop(t);
        (out, temp)
    });
    for r in [temp, range(&out)] {
        assert!(
            !overlaps(r, freed),
            "a block of the common pool ({freed:x?}) was baked into the graph"
        );
    }
    let stats = allocator.stats();
    assert_eq!(stats.graph_pools, 1, "no implicit pool: {stats:?}");
    // After the capture, eager requests on the same stream and another get none of the graph's memory.
    let other = cx.new_stream().expect("another stream");
    let eager = allocator.alloc_on(bytes, sid(&cs)).expect("eager alloc");
    let eager2 = allocator
        .alloc_on(2 * bytes, sid(&other))
        .expect("eager alloc elsewhere");
    for e in [&eager, &eager2] {
        for r in [temp, range(&out)] {
            assert!(
                !overlaps(range(e), r),
                "an eager allocation got the graph's memory {r:x?}"
            );
        }
    }
    k.iota(&cs, eager.ptr(), n, 0x0e00_0000);
    k.iota(&other, eager2.ptr(), 2 * n, 0x0f00_0000);
    for round in 0..3u32 {
        let base = 0x0600_0000 + round * 0x0010_0000;
        k.iota(&cs, input.ptr(), n, base);
        graph.launch().expect("replaying");
        check_iota(
            &read(&cs, out.ptr(), n),
            base + 33,
            &format!("replay {round}"),
        );
    }
    check_iota(
        &read(&cs, eager.ptr(), n),
        0x0e00_0000,
        "the eager buffer after the replays",
    );
    check_iota(
        &read(&other, eager2.ptr(), 2 * n),
        0x0f00_0000,
        "the other stream's buffer",
    );
    drop(graph);
    drop((out, eager, eager2, input));
    // The implicit pool is never released (the allocator cannot know when the graph dies): no leak check.
    finish(&allocator);
}

/// The stream caches ask the capture probe from whatever thread allocates, without the strategy's lock: it
/// must answer on a thread where no context is current (a new thread's), before, during and after a capture
/// of a stream the program made.
#[test]
fn the_capture_probe_answers_on_a_thread_with_no_context_current() {
    let test = "the_capture_probe_answers_on_a_thread_with_no_context_current";
    let Some((allocator, cx, _, _)) = open(test, |_| Config::default()) else {
        return;
    };
    let probe =
        (allocator.with_strategy(|s| s.driver().capture_probe())).expect("a probe on real streams");
    let cs = cx.new_stream().expect("capture stream");
    let stream = sid(&cs);
    let ask = || std::thread::scope(|scope| scope.spawn(|| probe.status(stream)).join().unwrap());
    assert!(matches!(ask(), Ok(CaptureStatus::None)), "{:?}", ask());
    let global = CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_GLOBAL;
    cs.begin_capture(global).expect("cuStreamBeginCapture");
    let capture = capture_id(&allocator, stream);
    let during = ask();
    drop(cs.end_capture(sys::CUgraphInstantiate_flags(0)));
    match during {
        Ok(CaptureStatus::Active { id, .. }) => assert_eq!(id, capture),
        other => panic!("during the capture the probe answered {other:?}"),
    }
    assert!(matches!(ask(), Ok(CaptureStatus::None)), "{:?}", ask());
    finish(&allocator);
}
