//! cuvmm on a GPU as a program that uses `record_stream`, a memory limit, CUDA graphs and peers hits it:
//! real kernels on cudarc streams, real graphs captured, instantiated and replayed (cudarc's
//! `CudaStream::begin_capture` / `end_capture` and `CudaGraph::launch`), every result read back from the
//! device and compared with what it must be.
//!
//! - `record_stream_keeps_a_buffer_until_the_other_streams_kernel_read_it`: X is filled on stream A, read on
//!   stream B by a kernel that spins first; X is recorded on B and freed, and the same size is allocated
//!   on A at once and overwritten. B's copy of X must hold X's values (ten rounds, small and large pool).
//! - `a_memory_limit_never_hands_a_block_to_another_stream_before_its_reader_finished`: a memory limit of
//!   X's size; X is freed on A while A's kernel has still to read it, and B's request can only be served
//!   with X's pages. A's result must be X's values, B's its own, with no illegal address.
//! - `graphs_captured_back_to_back_replay_their_eager_results`: two graphs captured one after the other on
//!   one stream, each into its own pool (one announced with `StreamFilter::Capture`, one with
//!   `StreamFilter::Streams`), each allocating and freeing temporaries inside the capture; replayed in both
//!   orders, their outputs equal the same work run eagerly; the pools and a later eager allocation are apart.
//! - `a_graph_survives_heavy_allocation_and_empty_cache`: a graph whose pool holds idle pages, replayed
//!   between hundreds of allocations of varied sizes on two other streams under a memory limit with eager
//!   compaction, then after `empty_cache()` and a request taking all the rest: its output is right each
//!   time and no other allocation's bytes change; once released, the pool's pages serve others.
//! - `two_threads_capture_at_once_into_their_own_pools`: two threads capture (thread-local mode) on two
//!   streams at the same time, each into its own pool; the pools are apart and every replay is right.
//! - `a_capture_nobody_announced_gets_a_pool_and_keeps_it`: a capture with no `begin_allocate_to_pool`:
//!   its allocations go to an implicit pool, not to a block freed before it, and an eager allocation after
//!   it does not get the graph's memory; replays are right.
//! - `a_peer_device_reads_and_writes_memory_mapped_before_and_after_add_peer`: with two GPUs, a kernel on
//!   the other device reads and writes this device's memory (skipped with one GPU).
//!
//! Every test ends with `check_invariants()` and no deferred error. Without libcuda or without a device each
//! test prints why it is skipped and passes (CI has no GPU; this file's job there is to compile).
//! `CUVMM_CUDA_DEVICE=N` picks device N. Run with `--test-threads=1` on a GPU machine (docs/gpu.md).
#![cfg(feature = "cuda")]

use cudarc::driver::sys::{self, CUstreamCaptureMode};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaGraph, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg,
};
use cudarc::nvrtc::Ptx;
use cuvmm::config::{Budget, Compaction};
use cuvmm::driver::cuda::CudaDriver;
use cuvmm::driver::{CaptureStatus, Driver, DriverError, Op};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, DeviceBuffer, Error, GraphPool, StreamFilter, StreamId};
use std::sync::{Arc, Barrier};
use std::time::Instant;

/// Two kernels in hand-written PTX (no CUDA toolkit is needed), both grid-stride loops over u32s:
/// - `iota(out, n, base)`: `out[i] = base + i`;
/// - `copy_add(dst, src, n, add, cycles)`: each block spins for `cycles` clock cycles, then
///   `dst[i] = src[i] + add`.
const PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry iota(
    .param .u64 param_out,
    .param .u32 param_n,
    .param .u32 param_base
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [param_out];
    ld.param.u32 %r1, [param_n];
    ld.param.u32 %r2, [param_base];
    cvta.to.global.u64 %rd2, %rd1;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r6, %nctaid.x;
    mad.lo.s32 %r7, %r5, %r4, %r3;
    mul.lo.s32 %r8, %r4, %r6;
IOTA_LOOP:
    setp.ge.u32 %p1, %r7, %r1;
    @%p1 bra IOTA_DONE;
    add.s32 %r9, %r7, %r2;
    mul.wide.u32 %rd3, %r7, 4;
    add.s64 %rd4, %rd2, %rd3;
    st.global.u32 [%rd4], %r9;
    add.s32 %r7, %r7, %r8;
    bra.uni IOTA_LOOP;
IOTA_DONE:
    ret;
}

.visible .entry copy_add(
    .param .u64 param_dst,
    .param .u64 param_src,
    .param .u32 param_n,
    .param .u32 param_add,
    .param .u64 param_cycles
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<10>;
    .reg .b64 %rd<12>;

    ld.param.u64 %rd1, [param_dst];
    ld.param.u64 %rd2, [param_src];
    ld.param.u32 %r1, [param_n];
    ld.param.u32 %r2, [param_add];
    ld.param.u64 %rd3, [param_cycles];
    mov.u64 %rd4, %clock64;
CA_SPIN:
    mov.u64 %rd5, %clock64;
    sub.s64 %rd6, %rd5, %rd4;
    setp.lt.u64 %p1, %rd6, %rd3;
    @%p1 bra CA_SPIN;
    cvta.to.global.u64 %rd7, %rd1;
    cvta.to.global.u64 %rd8, %rd2;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %ctaid.x;
    mov.u32 %r6, %nctaid.x;
    mad.lo.s32 %r7, %r5, %r4, %r3;
    mul.lo.s32 %r8, %r4, %r6;
CA_LOOP:
    setp.ge.u32 %p2, %r7, %r1;
    @%p2 bra CA_DONE;
    mul.wide.u32 %rd9, %r7, 4;
    add.s64 %rd10, %rd8, %rd9;
    ld.global.u32 %r9, [%rd10];
    add.s32 %r9, %r9, %r2;
    add.s64 %rd11, %rd7, %rd9;
    st.global.u32 [%rd11], %r9;
    add.s32 %r7, %r7, %r8;
    bra.uni CA_LOOP;
CA_DONE:
    ret;
}
"#;

/// Clock cycles a reading kernel spins before it reads: a few tenths of a second on current GPUs, long
/// enough for the host to free, reallocate and overwrite what it will read if the allocator lets it.
const SPIN: u64 = 400_000_000;

type Gpu = Allocator<Expandable<CudaDriver>>;
type Buffer = DeviceBuffer<Expandable<CudaDriver>>;

/// The device under test.
fn ordinal() -> usize {
    std::env::var("CUVMM_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The device's allocator (capture detection on, as `Allocator::expandable` makes it), its context, the
/// kernels and the page size, or `None` (with a message) when this machine has no CUDA driver or device.
/// `config` gets the page size.
fn open(
    test: &str,
    config: impl FnOnce(u64) -> Config,
) -> Option<(Gpu, Arc<CudaContext>, Kernels, u64)> {
    let driver = match CudaDriver::new(ordinal()) {
        Ok(d) => d,
        Err(DriverError::NoDriver { reason }) => {
            eprintln!("skipping {test}: no CUDA driver found: {reason}");
            return None;
        }
        Err(e) => panic!("opening CUDA device {}: {e}", ordinal()),
    };
    let page = driver.granularity();
    let cx = driver.context().clone();
    let kernels = Kernels::load(&cx);
    let allocator = Allocator::expandable(driver, config(page)).expect("allocator");
    Some((allocator, cx, kernels, page))
}

/// The kernels of [`PTX`], loaded in one context.
struct Kernels {
    iota: CudaFunction,
    copy_add: CudaFunction,
}

/// 64 blocks of 256 threads: the kernels loop over the elements.
const GRID: LaunchConfig = LaunchConfig {
    grid_dim: (64, 1, 1),
    block_dim: (256, 1, 1),
    shared_mem_bytes: 0,
};

impl Kernels {
    fn load(cx: &Arc<CudaContext>) -> Self {
        let module = cx.load_module(Ptx::from_src(PTX)).expect("loading the PTX");
        Self {
            iota: module.load_function("iota").expect("iota"),
            copy_add: module.load_function("copy_add").expect("copy_add"),
        }
    }

    /// Queues `out[i] = base + i` for `i < n` on `stream`.
    #[allow(unsafe_code)]
    fn iota(&self, stream: &CudaStream, out: u64, n: u32, base: u32) {
        let mut launch = stream.launch_builder(&self.iota);
        launch.arg(&out).arg(&n).arg(&base);
        // SAFETY: the arguments match `iota`'s parameters (u64 pointer, u32, u32); `out` is a live
        // allocation of at least `4 n` bytes of this device (or one it may reach) while the kernel runs, and
        // the kernel writes only its first `n` u32s.
        unsafe { launch.launch(GRID) }.expect("launching iota");
    }

    /// Queues, on `stream`, a spin of `cycles` clock cycles, then `dst[i] = src[i] + add` for `i < n`.
    #[allow(unsafe_code)]
    fn copy_add(&self, stream: &CudaStream, dst: u64, src: u64, n: u32, add: u32, cycles: u64) {
        let mut launch = stream.launch_builder(&self.copy_add);
        launch.arg(&dst).arg(&src).arg(&n).arg(&add).arg(&cycles);
        // SAFETY: the arguments match `copy_add`'s parameters (two u64 pointers, u32, u32, u64); `dst` and
        // `src` are live allocations of at least `4 n` bytes when the launch is queued, and the kernel
        // touches only their first `n` u32s. Whether the memory still holds what it should when the kernel
        // runs is what the tests check.
        unsafe { launch.launch(GRID) }.expect("launching copy_add");
    }
}

/// `n` u32s read from device address `ptr`, in `stream`'s order (the stream is synchronized).
#[allow(unsafe_code)]
fn read(stream: &CudaStream, ptr: u64, n: u32) -> Vec<u32> {
    let mut host = vec![0u32; n as usize];
    stream
        .context()
        .bind_to_thread()
        .expect("binding the context");
    // SAFETY: `ptr` is a live allocation of at least `4 n` bytes that the stream's device can reach, and
    // `host` has room for exactly `n` u32s; `host` is neither moved nor read until the stream is
    // synchronized below, after the copy completed.
    let copied =
        unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut host, ptr, stream.cu_stream()) };
    copied.expect("cuMemcpyDtoHAsync");
    stream
        .synchronize()
        .expect("synchronizing after the copy (an illegal address shows here)");
    host
}

/// Panics, naming `what` and the first wrong element, unless `got[i] == base + i` for every `i`.
fn check_iota(got: &[u32], base: u32, what: &str) {
    let wrong = (got.iter().enumerate()).find(|&(i, &v)| v != base.wrapping_add(i as u32));
    if let Some((i, &v)) = wrong {
        panic!(
            "{what}: element {i} of {} is {v:#010x}, expected {:#010x}",
            got.len(),
            base.wrapping_add(i as u32)
        );
    }
}

/// u32 elements in `bytes`.
fn elems(bytes: u64) -> u32 {
    u32::try_from(bytes / 4).expect("fewer than 2^32 elements")
}

fn sid(stream: &CudaStream) -> StreamId {
    StreamId::from_cuda(stream)
}

/// Whether the byte ranges `(start, len)` overlap.
fn overlaps(a: (u64, u64), b: (u64, u64)) -> bool {
    a.0 < b.0 + b.1 && b.0 < a.0 + a.1
}

fn range(buffer: &Buffer) -> (u64, u64) {
    (buffer.ptr(), buffer.len())
}

/// The id of the capture underway on `stream`, as the allocator's driver reads it (`cuStreamGetCaptureInfo`).
fn capture_id(allocator: &Gpu, stream: StreamId) -> u64 {
    let status = allocator.with_strategy(|s| s.driver_mut().capture_status(stream));
    match status.expect("cuStreamGetCaptureInfo") {
        CaptureStatus::Active { id, .. } => id,
        other => panic!("{stream} should be capturing, but its status is {other:?}"),
    }
}

/// How a capture is announced to the allocator.
#[derive(Clone, Copy)]
enum Announce {
    /// `begin_allocate_to_pool(pool, Capture(id))` once the capture began (PyTorch's `CUDAGraph`).
    Capture(GraphPool),
    /// `begin_allocate_to_pool(pool, Streams([stream]))` before the capture begins.
    Streams(GraphPool),
    /// Not at all: the allocator must find the capture itself.
    Not,
}

/// Captures what `body` queues on `stream` into a graph, instantiated and ready to replay, with the
/// allocations `body` makes on `stream` going to the pool `announce` names; ends the pool after the capture.
fn captured<R>(
    allocator: &Gpu,
    stream: &Arc<CudaStream>,
    mode: CUstreamCaptureMode,
    announce: Announce,
    body: impl FnOnce() -> R,
) -> (CudaGraph, R) {
    let id = sid(stream);
    if let Announce::Streams(pool) = announce {
        (allocator.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![id])))
            .expect("begin_allocate_to_pool");
    }
    stream.begin_capture(mode).expect("cuStreamBeginCapture");
    if let Announce::Capture(pool) = announce {
        let capture = capture_id(allocator, id);
        (allocator.begin_allocate_to_pool(pool, StreamFilter::Capture(capture)))
            .expect("begin_allocate_to_pool");
    }
    let made = body();
    let graph = stream
        .end_capture(sys::CUgraphInstantiate_flags(0))
        .expect("cuStreamEndCapture / cuGraphInstantiate (invalidated by a call CUDA refuses during a capture?)")
        .expect("the capture made no graph");
    if let Announce::Capture(pool) | Announce::Streams(pool) = announce {
        allocator
            .end_allocate_to_pool(pool)
            .expect("end_allocate_to_pool");
    }
    (graph, made)
}

/// The end of every test: invariants hold, no error was deferred.
fn finish(allocator: &Gpu) {
    allocator.check_invariants().expect("invariants");
    let deferred = allocator.take_deferred_errors();
    assert!(deferred.is_empty(), "errors deferred: {deferred:?}");
}

/// After everything was freed and the pools released: `empty_cache` gives every byte back to the driver.
fn assert_all_given_back(allocator: &Gpu) {
    allocator.empty_cache().expect("empty_cache");
    let leaks = allocator.with_strategy(|s| s.driver().leak_report());
    assert!(leaks.is_empty(), "still held after empty_cache: {leaks}");
}

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

#[test]
fn a_peer_device_reads_and_writes_memory_mapped_before_and_after_add_peer() {
    let test = "a_peer_device_reads_and_writes_memory_mapped_before_and_after_add_peer";
    let Some((allocator, cx, k, page)) = open(test, |_| Config::default()) else {
        return;
    };
    let count = cudarc::driver::result::device::get_count().expect("cuDeviceGetCount");
    if count < 2 {
        eprintln!("skipping {test}: one CUDA device only");
        return;
    }
    let peer = if ordinal() == 0 { 1 } else { 0 };
    let s0 = cx.new_stream().expect("stream on the device");
    let bytes = 2 * page;
    let n = elems(bytes);
    let before = allocator
        .alloc_on(bytes, sid(&s0))
        .expect("alloc before add_peer");
    k.iota(&s0, before.ptr(), n, 0x0a00_0000);
    match allocator.add_peer(peer) {
        Ok(()) => {}
        Err(Error::Driver(DriverError::PeerAccess { .. })) => {
            eprintln!(
                "skipping {test}: device {peer} cannot access device {}'s memory",
                ordinal()
            );
            return;
        }
        Err(e) => panic!("add_peer({peer}): {e}"),
    }
    let after = allocator
        .alloc_on(3 * bytes, sid(&s0))
        .expect("alloc after add_peer");
    k.iota(&s0, after.ptr(), 3 * n, 0x0b00_0000);
    s0.synchronize().expect("the fills");

    let cx1 = CudaContext::new(peer).expect("the peer device");
    let k1 = Kernels::load(&cx1);
    let s1 = cx1.new_stream().expect("stream on the peer");
    for (buffer, base, what) in [
        (&before, 0x0a00_0000u32, "mapped before add_peer"),
        (&after, 0x0b00_0000, "mapped after add_peer"),
    ] {
        let m = elems(buffer.len());
        let mut out = s1.alloc_zeros::<u32>(m as usize).expect("peer buffer");
        {
            let (out_ptr, _record) = out.device_ptr_mut(&s1);
            k1.copy_add(&s1, out_ptr, buffer.ptr(), m, 5, 0);
            (s1.synchronize()).unwrap_or_else(|e| {
                panic!("device {peer} reading the memory {what} (an illegal address?): {e}")
            });
            // And the peer writes it: buffer = out + 1.
            k1.copy_add(&s1, buffer.ptr(), out_ptr, m, 1, 0);
            (s1.synchronize()).unwrap_or_else(|e| {
                panic!("device {peer} writing the memory {what} (an illegal address?): {e}")
            });
        }
        let got = s1.clone_dtoh(&out).expect("reading the peer's copy");
        check_iota(
            &got,
            base + 5,
            &format!("device {peer}'s copy of memory {what}"),
        );
        check_iota(
            &read(&s0, buffer.ptr(), m),
            base + 6,
            &format!("memory {what}, written by device {peer}"),
        );
    }
    drop((before, after));
    finish(&allocator);
    assert_all_given_back(&allocator);
}
