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
//! - `a_graph_captured_in_a_tag_replays_after_its_memory_slept_and_woke`: a graph whose input and pool are
//!   under a tag; the tag sleeps with its bytes and wakes three times, another job writing over its memory
//!   each time: every replay is right, and only the first sleep pins host memory.
//!
//! Every test ends with `check_invariants()` and no deferred error. Without libcuda or without a device each
//! test prints why it is skipped and passes (CI has no GPU; this file's job there is to compile).
//! `CUVMM_CUDA_DEVICE=N` picks device N. Run with `--test-threads=1` on a GPU machine (docs/gpu.md).
#![cfg(feature = "cuda")]

#[path = "cuda_graphs/captures.rs"]
mod captures;
#[path = "cuda_graphs/graphs.rs"]
mod graphs;
#[path = "cuda_graphs/peers.rs"]
mod peers;
#[path = "cuda_graphs/sleep.rs"]
mod sleep;
#[path = "cuda_graphs/streams.rs"]
mod streams;

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
