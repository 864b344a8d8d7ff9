//! `record_stream` and a memory limit: a buffer is never handed to another stream before the work that
//! reads it finished.

use super::*;

#[test]
fn record_stream_keeps_a_buffer_until_the_other_streams_kernel_read_it() {
    let test = "record_stream_keeps_a_buffer_until_the_other_streams_kernel_read_it";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let a = cx.new_stream().expect("stream A");
    let b = cx.new_stream().expect("stream B");
    let (sa, sb) = (sid(&a), sid(&b));
    let mut same_address = 0;
    for round in 0..10u32 {
        // Small pool and large pool in turn.
        let bytes = if round % 2 == 0 { 256 << 10 } else { 3 * page };
        let n = elems(bytes);
        let base = 0x1000_0000 + round * 0x0100_0000;
        let x = allocator.alloc_on(bytes, sa).expect("alloc X on A");
        k.iota(&a, x.ptr(), n, base);
        let y = allocator.alloc_on(bytes, sb).expect("alloc Y on B");
        b.join(&a).expect("B waits for X's fill");
        k.copy_add(&b, y.ptr(), x.ptr(), n, 0, SPIN);
        x.record_stream(sb).expect("record_stream");
        let old = x.ptr();
        drop(x);
        // At once, the same size on A, overwritten: if it is X's memory, A must not write it before B read it.
        let again = allocator.alloc_on(bytes, sa).expect("alloc on A again");
        same_address += u32::from(again.ptr() == old);
        let other = 0xf000_0000 + round;
        k.iota(&a, again.ptr(), n, other);
        a.synchronize().expect("stream A completes");
        b.synchronize().expect("stream B completes");
        check_iota(
            &read(&b, y.ptr(), n),
            base,
            &format!("round {round}: Y, B's copy of X"),
        );
        check_iota(
            &read(&a, again.ptr(), n),
            other,
            &format!("round {round}: the allocation made on A after X's free"),
        );
    }
    eprintln!("{test}: X's address came back at once in {same_address} of 10 rounds");
    finish(&allocator);
    assert_all_given_back(&allocator);
}

#[test]
fn a_memory_limit_never_hands_a_block_to_another_stream_before_its_reader_finished() {
    let test = "a_memory_limit_never_hands_a_block_to_another_stream_before_its_reader_finished";
    let settings = [
        ("pressure", Compaction::Pressure, true),
        (
            "pressure, no cross-stream reuse",
            Compaction::Pressure,
            false,
        ),
        ("eager", Compaction::Eager, false),
    ];
    for (round, (name, compaction, cross)) in (0u32..).zip(settings) {
        let limited = |page: u64| Config {
            // Room for X's 4 pages and no more; one page per handle, so that pages can move one by one.
            memory_limit: Some(Budget::Bytes(4 * page)),
            large_handle: page,
            ..Config::default()
                .with_compaction(compaction)
                .with_cross_stream_reuse(cross)
        };
        let Some((allocator, cx, k, page)) = open(test, limited) else {
            return;
        };
        let a = cx.new_stream().expect("stream A");
        let b = cx.new_stream().expect("stream B");
        let bytes = 4 * page;
        let n = elems(bytes);
        let base = 0x3000_0000 + round;
        let x = allocator.alloc_on(bytes, sid(&a)).expect("alloc X on A");
        let x_addr = x.ptr();
        k.iota(&a, x.ptr(), n, base);
        // A's result goes to cudarc's own memory, outside the limit.
        let mut out = a.alloc_zeros::<u32>(n as usize).expect("cudarc buffer");
        {
            let (out_ptr, _record) = out.device_ptr_mut(&a);
            k.copy_add(&a, out_ptr, x.ptr(), n, 1, SPIN);
        }
        // X is freed while A's kernel has still to read it.
        drop(x);
        let unmaps = allocator.with_strategy(|s| s.driver().counters().get(Op::Unmap));
        let began = Instant::now();
        let y = (allocator.alloc_on(bytes, sid(&b)))
            .expect("Y can only have X's pages, which are free once A's kernel is done");
        let waited = began.elapsed();
        let unmapped = allocator.with_strategy(|s| s.driver().counters().get(Op::Unmap)) - unmaps;
        k.iota(&b, y.ptr(), n, 0x7700_0000);
        a.synchronize()
            .expect("stream A completes (no illegal address)");
        b.synchronize().expect("stream B completes");
        let got = a.clone_dtoh(&out).expect("reading A's result");
        check_iota(
            &got,
            base.wrapping_add(1),
            &format!("{name}: A's kernel read X after B's allocation overwrote it"),
        );
        check_iota(&read(&b, y.ptr(), n), 0x7700_0000, &format!("{name}: Y"));
        let peak = allocator.stats().reserved_bytes.peak;
        assert!(
            peak <= bytes,
            "{name}: reserved memory reached {peak} bytes past the limit of {bytes}"
        );
        eprintln!(
            "{test} ({name}): Y {} X's address, {unmapped} unmaps, the allocation took {waited:?}",
            if y.ptr() == x_addr {
                "took"
            } else {
                "did not take"
            }
        );
        drop(y);
        finish(&allocator);
        assert_all_given_back(&allocator);
    }
}
