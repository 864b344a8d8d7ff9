//! cuvmm on a GPU with the program's own streams and threads (issue 15).
//!
//! - `compaction_waits_for_the_callers_stream`: a kernel queued on the program's stream still writes a
//!   buffer when the buffer is freed; another stream's request then takes the freed buffer's pages
//!   (compaction). The allocator must wait for the program's stream before unmapping them: afterwards the
//!   stream completes with no illegal address, and the other allocations' bytes are intact.
//! - `threads_keep_their_context`: memory allocated on one thread is freed on another, and every cuvmm
//!   call leaves the calling thread's current context as it found it.
//!
//! Without libcuda or without a device each test prints why it is skipped and passes (CI has no GPU; this
//! file's job there is to compile). `CUVMM_CUDA_DEVICE=N` picks device N. Run with `--test-threads=1` on
//! a GPU machine (docs/gpu.md).
#![cfg(feature = "cuda")]

use cudarc::driver::result::ctx;
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::Ptx;
use cuvmm::config::Compaction;
use cuvmm::driver::cuda::CudaDriver;
use cuvmm::driver::{Driver, DriverError, Op};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config};
use std::sync::Arc;

/// `spin_fill(out, n, value, cycles)`: one block spins for `cycles` clock cycles, then writes `value` into
/// `out[0..n]` (u32s). Hand-written PTX: no CUDA toolkit is needed.
const SPIN_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry spin_fill(
    .param .u64 param_out,
    .param .u32 param_n,
    .param .u32 param_value,
    .param .u64 param_cycles
)
{
    .reg .pred %p<3>;
    .reg .b32 %r<6>;
    .reg .b64 %rd<10>;

    ld.param.u64 %rd1, [param_out];
    ld.param.u32 %r1, [param_n];
    ld.param.u32 %r2, [param_value];
    ld.param.u64 %rd2, [param_cycles];
    mov.u64 %rd3, %clock64;
SPIN:
    mov.u64 %rd4, %clock64;
    sub.s64 %rd5, %rd4, %rd3;
    setp.lt.u64 %p1, %rd5, %rd2;
    @%p1 bra SPIN;
    cvta.to.global.u64 %rd6, %rd1;
    mov.u32 %r3, %tid.x;
    mov.u32 %r4, %ntid.x;
LOOP:
    setp.ge.u32 %p2, %r3, %r1;
    @%p2 bra DONE;
    mul.wide.u32 %rd7, %r3, 4;
    add.s64 %rd8, %rd6, %rd7;
    st.global.u32 [%rd8], %r2;
    add.u32 %r3, %r3, %r4;
    bra LOOP;
DONE:
    ret;
}
"#;

/// The device under test.
fn ordinal() -> usize {
    std::env::var("CUVMM_CUDA_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

/// The device with the caller's streams, or `None` (with a message) when this machine has none.
fn gpu(test: &str) -> Option<CudaDriver> {
    match CudaDriver::new(ordinal()) {
        Ok(d) => Some(d),
        Err(DriverError::NoDriver { reason }) => {
            eprintln!("skipping {test}: no CUDA driver found: {reason}");
            None
        }
        Err(e) => panic!("opening CUDA device {}: {e}", ordinal()),
    }
}

type GpuAllocator = Allocator<Expandable<CudaDriver>>;

/// Queues `spin_fill` on `stream`.
#[allow(unsafe_code)]
fn spin_fill(stream: &CudaStream, f: &CudaFunction, ptr: u64, n: u32, value: u32, cycles: u64) {
    let mut launch = stream.launch_builder(f);
    launch.arg(&ptr).arg(&n).arg(&value).arg(&cycles);
    let cfg = LaunchConfig {
        grid_dim: (1, 1, 1),
        block_dim: (256, 1, 1),
        shared_mem_bytes: 0,
    };
    // SAFETY: the arguments match `spin_fill`'s parameters (u64 pointer, u32, u32, u64); `ptr` is a live
    // buffer of at least `4 n` bytes when the launch is queued, and the kernel writes only its first `n`
    // u32s. Whether the memory is still mapped when the kernel writes is what the test checks.
    unsafe { launch.launch(cfg) }.expect("launching spin_fill");
}

fn read_u32s(
    stream: &Arc<CudaStream>,
    buffer: &cuvmm::CudaBuffer<Expandable<CudaDriver>>,
) -> Vec<u32> {
    let mut host = vec![0u32; (buffer.len() / 4) as usize];
    stream
        .memcpy_dtoh(&buffer.view::<u32>(), &mut host)
        .expect("memcpy_dtoh");
    stream.synchronize().expect("synchronize after the copy");
    host
}

#[test]
fn compaction_waits_for_the_callers_stream() {
    let Some(driver) = gpu("compaction_waits_for_the_callers_stream") else {
        return;
    };
    let page = driver.granularity();
    let cx: Arc<CudaContext> = driver.context().clone();
    let module = cx
        .load_module(Ptx::from_src(SPIN_PTX))
        .expect("loading the PTX");
    let spin = module.load_function("spin_fill").expect("spin_fill");
    let a = cx.new_stream().expect("stream A");
    let b = cx.new_stream().expect("stream B");
    // No cross-stream reuse of free blocks, and `compaction:eager` (the default, `pressure`, would create
    // pages on a device with room to spare): B's request must take A's idle pages by compaction (unmap them
    // from A's segment, map them into B's), the path that must wait for A's work.
    let config = Config::default()
        .with_cross_stream_reuse(false)
        .with_compaction(Compaction::Eager);
    let allocator: GpuAllocator = Allocator::expandable(driver, config).expect("allocator");

    // The other allocation, on B, with a known pattern.
    let mut keep = allocator.alloc_on_stream(4 * page, &b).expect("alloc keep");
    let pattern = vec![0x5a5a_5a5au32; (keep.len() / 4) as usize];
    b.memcpy_htod(&pattern, &mut keep.view_mut::<u32>())
        .expect("fill keep");
    b.synchronize().expect("synchronize B");

    // Long work on A writing X; X freed while the kernel spins (about a second on current GPUs).
    let x = allocator.alloc_on_stream(4 * page, &a).expect("alloc X");
    let n = (x.len() / 4) as u32;
    spin_fill(&a, &spin, x.ptr(), n, 0xdead_beef, 2_000_000_000);
    drop(x);
    let unmaps_before = allocator.with_strategy(|s| s.driver().counters().get(Op::Unmap));

    // B's request now needs 4 pages: the pool is empty and A's 4 pages are idle, so they are compacted.
    let mut y = allocator.alloc_on_stream(4 * page, &b).expect("alloc Y");
    let unmaps = allocator.with_strategy(|s| s.driver().counters().get(Op::Unmap)) - unmaps_before;
    assert!(
        unmaps > 0,
        "Y was expected to take A's idle pages (compaction), but nothing was unmapped"
    );
    let ones = vec![0x1111_1111u32; (y.len() / 4) as usize];
    b.memcpy_htod(&ones, &mut y.view_mut::<u32>())
        .expect("fill Y");

    // Everything completes without an illegal address, and no byte of Y or of the other allocation was
    // written by the late kernel.
    a.synchronize()
        .expect("stream A completes (no illegal address)");
    b.synchronize().expect("stream B completes");
    assert!(
        read_u32s(&b, &y).iter().all(|&v| v == 0x1111_1111),
        "Y was overwritten"
    );
    assert!(
        read_u32s(&b, &keep).iter().all(|&v| v == 0x5a5a_5a5a),
        "the other allocation was overwritten"
    );
    drop((y, keep));
    allocator.check_invariants().expect("invariants");
    assert!(allocator.take_deferred_errors().is_empty());
    allocator.empty_cache().expect("empty_cache");
    let leaks = allocator.with_strategy(|s| s.driver().leak_report());
    assert!(leaks.is_empty(), "{leaks}");
}

/// The calling thread's current context, as an address (0: none).
fn current() -> usize {
    ctx::get_current()
        .expect("cuCtxGetCurrent")
        .map_or(0, |c| c as usize)
}

#[test]
fn threads_keep_their_context() {
    let Some(driver) = gpu("threads_keep_their_context") else {
        return;
    };
    let cx = driver.context().clone();
    let stream = cx.new_stream().expect("stream");
    let allocator: GpuAllocator =
        Allocator::expandable(driver, Config::default()).expect("allocator");
    let page = allocator.with_strategy(|s| s.driver().granularity());

    // Thread 1 has no current context: allocating (reserve, create, map, set_access) leaves it so.
    let (alloc1, stream1) = (allocator.clone(), stream.clone());
    let mut buffer = std::thread::spawn(move || {
        assert_eq!(current(), 0, "a new thread starts without a context");
        let buffer = alloc1.alloc_on_stream(3 * page, &stream1).expect("alloc");
        assert_eq!(current(), 0, "alloc_on_stream left a context current");
        buffer
    })
    .join()
    .expect("thread 1");
    let values = vec![7u32; (buffer.len() / 4) as usize];
    stream
        .memcpy_htod(&values, &mut buffer.view_mut::<u32>())
        .expect("fill");

    // Thread 2 frees it and gives the memory back to the driver (unmap, release, free the reservation).
    let alloc2 = allocator.clone();
    std::thread::spawn(move || {
        assert_eq!(current(), 0);
        drop(buffer);
        assert_eq!(current(), 0, "freeing left a context current");
        alloc2.empty_cache().expect("empty_cache");
        assert_eq!(current(), 0, "empty_cache left a context current");
    })
    .join()
    .expect("thread 2");

    // A thread whose current context is another one (another device's, when there is one) keeps it.
    let other = std::env::var("CUVMM_CUDA_OTHER_DEVICE")
        .ok()
        .and_then(|v| v.parse().ok())
        .or_else(|| (ordinal() == 0).then_some(1))
        .and_then(|n| CudaContext::new(n).ok());
    if let Some(other) = other {
        let (alloc3, stream3) = (allocator.clone(), stream.clone());
        std::thread::spawn(move || {
            other.bind_to_thread().expect("bind the other device");
            let mine = current();
            assert_ne!(mine, 0);
            let buffer = alloc3.alloc_on_stream(page, &stream3).expect("alloc");
            assert_eq!(
                current(),
                mine,
                "alloc_on_stream changed the thread's context"
            );
            drop(buffer);
            alloc3.empty_cache().expect("empty_cache");
            assert_eq!(current(), mine, "empty_cache changed the thread's context");
        })
        .join()
        .expect("thread 3");
    } else {
        eprintln!("threads_keep_their_context: one device only; the other-context case is skipped");
    }
    assert!(allocator.take_deferred_errors().is_empty());
    allocator.check_invariants().expect("invariants");
}
