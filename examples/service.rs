//! A multi-threaded GPU service on cuvmm: worker threads, each with its own stream, serve requests of
//! varying sizes; every fourth buffer is handed to the next worker, which uses it on its own stream
//! (`record_stream`) and frees it there; at the end the service prints its statistics and
//! `memory_summary()`.
//!
//! ```sh
//! cargo run --release --example service                                          # simulated device
//! cargo run --release --example service --features cuda -- --backend cuda[:N]   # a GPU
//! ```
//!
//! Options: `--workers N` (default 4), `--requests N` per worker (default 200), `--seed N`.
//!
//! On the simulated device a request's "kernel" is `SimDriver::launch` on the worker's stream, completed
//! when the worker next waits for its stream, and the device refuses to unmap memory that pending work
//! touches: a missing stream dependency fails the run. On a GPU the workers' streams are cudarc streams,
//! the buffers are `CudaBuffer`s, and each request launches a real kernel (hand-written PTX, loaded with
//! cudarc) that fills the buffer with `tag + i`; a handed-over buffer is copied back on the receiving
//! worker's stream and checked.

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{StreamId, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, DeviceBuffer, Strategy};
use std::process::ExitCode;
use std::sync::mpsc;
use std::thread;

const USAGE: &str =
    "usage: service [--backend sim|cuda[:N]] [--workers N] [--requests N] [--seed N]";

/// What the command line asked for (public for `tests/service_example.rs`, which runs the example).
#[derive(Clone, Copy, Debug)]
pub struct Options {
    cuda: Option<usize>,
    workers: usize,
    requests: usize,
    seed: u64,
}

/// The options from the command line's arguments (without the program name).
pub fn parse(args: impl Iterator<Item = String>) -> Result<Options, String> {
    let mut opts = Options {
        cuda: None,
        workers: 4,
        requests: 200,
        seed: 1,
    };
    let mut args = args.peekable();
    while let Some(flag) = args.next() {
        let value = args.next().ok_or(format!("{flag} needs a value"))?;
        let number = || {
            value
                .parse::<u64>()
                .map_err(|_| format!("{flag}: not a number: {value}"))
        };
        match flag.as_str() {
            "--backend" => {
                opts.cuda = match value.as_str() {
                    "sim" => None,
                    "cuda" => Some(0),
                    other => match other.strip_prefix("cuda:").map(str::parse) {
                        Some(Ok(n)) => Some(n),
                        _ => {
                            return Err(format!(
                                "--backend: expected sim, cuda or cuda:N, got {value}"
                            ));
                        }
                    },
                }
            }
            "--workers" => opts.workers = number()?.clamp(1, 64) as usize,
            "--requests" => opts.requests = number()? as usize,
            "--seed" => opts.seed = number()?,
            _ => return Err(format!("unknown option {flag}")),
        }
    }
    Ok(opts)
}

fn main() -> ExitCode {
    let opts = match parse(std::env::args().skip(1)) {
        Ok(opts) => opts,
        Err(err) => {
            eprintln!("service: {err}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(opts) {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(err) => {
            eprintln!("service: {err}");
            ExitCode::FAILURE
        }
    }
}

/// Runs the service on the device `opts` names; returns what it prints.
pub fn run(opts: Options) -> Result<String, String> {
    match opts.cuda {
        None => run_sim(opts),
        Some(ordinal) => run_cuda(ordinal, opts),
    }
}

/// One worker's view of the device: how it allocates, queues work on its stream, takes over a buffer
/// from another worker, and waits for its stream.
trait Lane: Send {
    /// A buffer of this backend.
    type Buffer: Send;
    /// Allocates `size` bytes for this worker's stream.
    fn alloc(&self, size: u64) -> Result<Self::Buffer, cuvmm::Error>;
    /// Queues a kernel on this worker's stream that writes the buffer with `tag`.
    fn work(&self, buffer: &mut Self::Buffer, tag: u32) -> Result<(), String>;
    /// Takes over a buffer that another worker wrote with `tag`: uses (and checks) it on this worker's
    /// stream.
    fn adopt(&self, buffer: &mut Self::Buffer, tag: u32) -> Result<(), String>;
    /// Waits for this worker's stream.
    fn wait(&self) -> Result<(), String>;
}

/// What one worker did.
#[derive(Debug, Default, Clone, Copy)]
struct Tally {
    requests: u64,
    bytes: u64,
    handed_over: u64,
    adopted: u64,
}

/// A small deterministic generator (xorshift64*), so a run is reproducible from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A request size, roughly log-uniform from 1 KiB to 32 MiB, in whole 4-byte elements.
    fn size(&mut self) -> u64 {
        let shift = 10 + self.next() % 15;
        let size = (1u64 << shift) + self.next() % (1u64 << shift);
        size.next_multiple_of(4)
    }
}

/// Runs every worker on its lane; worker `i` hands every fourth buffer to worker `i + 1`.
fn serve<L: Lane + 'static>(lanes: Vec<L>, opts: Options) -> Result<Vec<Tally>, String> {
    let n = lanes.len();
    let (senders, receivers): (Vec<_>, Vec<_>) = (0..n).map(|_| mpsc::channel()).unzip();
    let mut handles = Vec::new();
    for (i, (lane, inbox)) in lanes.into_iter().zip(receivers).enumerate() {
        let next = senders[(i + 1) % n].clone();
        let seed = opts.seed ^ (i as u64 + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        let requests = opts.requests;
        handles.push(thread::spawn(move || {
            worker(&lane, inbox, next, Rng(seed | 1), requests)
        }));
    }
    drop(senders);
    handles
        .into_iter()
        .map(|h| h.join().map_err(|_| "a worker panicked".to_string())?)
        .collect()
}

/// One worker: `requests` requests, keeping up to eight buffers live, then its inbox drained.
fn worker<L: Lane>(
    lane: &L,
    inbox: mpsc::Receiver<(L::Buffer, u32)>,
    next: mpsc::Sender<(L::Buffer, u32)>,
    mut rng: Rng,
    requests: usize,
) -> Result<Tally, String> {
    let mut tally = Tally::default();
    let mut live = std::collections::VecDeque::new();
    for r in 0..requests {
        let size = rng.size();
        let mut buffer = lane.alloc(size).map_err(|e| e.to_string())?;
        let tag = (rng.next() as u32) & 0x00ff_ffff;
        lane.work(&mut buffer, tag)?;
        tally.requests += 1;
        tally.bytes += size;
        if r % 4 == 3 {
            // The receiver is alive until it has drained its inbox, which it does after its own requests.
            next.send((buffer, tag))
                .map_err(|_| "the next worker stopped early".to_string())?;
            tally.handed_over += 1;
        } else {
            live.push_back(buffer);
            if live.len() > 8 {
                live.pop_front(); // freed in stream order: the next request on this stream may reuse it
            }
        }
        while let Ok((mut adopted, tag)) = inbox.try_recv() {
            lane.adopt(&mut adopted, tag)?;
            tally.adopted += 1;
        }
        if r % 16 == 15 {
            lane.wait()?;
        }
    }
    drop(next);
    drop(live);
    // The other workers may still be sending: take what comes until every sender is done.
    for (mut adopted, tag) in inbox {
        lane.adopt(&mut adopted, tag)?;
        tally.adopted += 1;
    }
    lane.wait()?;
    Ok(tally)
}

/// Writes what the service did and the allocator's statistics to `out`, and checks that nothing went
/// wrong on the way (no deferred error, invariants hold, every buffer freed).
fn report<S: Strategy>(
    allocator: &Allocator<S>,
    tallies: &[Tally],
    out: &mut String,
) -> Result<(), String> {
    let mut line = |text: String| {
        out.push_str(&text);
        out.push('\n');
    };
    line("worker  requests  bytes requested  handed over  adopted".to_string());
    for (i, t) in tallies.iter().enumerate() {
        line(format!(
            "{i:>6}  {:>8}  {:>15}  {:>11}  {:>7}",
            t.requests, t.bytes, t.handed_over, t.adopted
        ));
    }
    let total: u64 = tallies.iter().map(|t| t.requests).sum();
    let handed: u64 = tallies.iter().map(|t| t.handed_over).sum();
    let adopted: u64 = tallies.iter().map(|t| t.adopted).sum();
    if handed != adopted {
        return Err(format!(
            "{handed} buffers handed over but {adopted} adopted"
        ));
    }
    let stats = allocator.stats();
    let calls = allocator.with_strategy(|s| s.driver_counters());
    line(format!(
        "requests served: {total}, buffers handed between streams: {handed}"
    ));
    line(format!(
        "peak allocated: {} bytes, peak reserved: {} bytes, now allocated: {} bytes",
        stats.allocated_bytes.peak, stats.reserved_bytes.peak, stats.allocated_bytes.current
    ));
    line(format!(
        "freed and waiting for another stream's events (polled at the next allocation): {} bytes",
        stats.active_bytes.current - stats.allocated_bytes.current
    ));
    line(format!(
        "OOMs: {}, retries: {}, synchronizations: {}, handles reused: {}, driver calls: {}",
        stats.num_ooms,
        stats.num_alloc_retries,
        stats.num_synchronizations,
        stats.handles_reused,
        calls.total()
    ));
    line(allocator.memory_summary());
    let deferred = allocator.take_deferred_errors();
    if let Some(err) = deferred.first() {
        return Err(format!(
            "{} error(s) while freeing; the first: {err}",
            deferred.len()
        ));
    }
    allocator
        .check_invariants()
        .map_err(|e| format!("broken invariant: {e}"))?;
    if stats.allocated_bytes.current != 0 {
        return Err(format!(
            "{} bytes still allocated",
            stats.allocated_bytes.current
        ));
    }
    allocator.empty_cache().map_err(|e| e.to_string())?;
    line(format!(
        "after empty_cache: {} bytes reserved",
        allocator.stats().reserved_bytes.current
    ));
    Ok(())
}

// --- The simulated device ---------------------------------------------------------------------------

type SimAllocator = Allocator<Expandable<SimDriver>>;

/// A worker on the simulated device: its stream is an identity.
struct SimLane {
    allocator: SimAllocator,
    stream: StreamId,
}

impl SimLane {
    /// Queues a simulated kernel touching the buffer on this worker's stream.
    fn launch(&self, buffer: &DeviceBuffer<Expandable<SimDriver>>) -> Result<(), String> {
        let range = VaRange::new(buffer.ptr(), buffer.len());
        self.allocator
            .with_strategy(|s| s.driver_mut().launch(self.stream, &[range]))
            .map(drop)
            .map_err(|e| format!("launch on {}: {e}", self.stream))
    }
}

impl Lane for SimLane {
    type Buffer = DeviceBuffer<Expandable<SimDriver>>;

    fn alloc(&self, size: u64) -> Result<Self::Buffer, cuvmm::Error> {
        self.allocator.alloc_on(size, self.stream)
    }

    fn work(&self, buffer: &mut Self::Buffer, _tag: u32) -> Result<(), String> {
        self.launch(buffer)
    }

    fn adopt(&self, buffer: &mut Self::Buffer, _tag: u32) -> Result<(), String> {
        buffer
            .record_stream(self.stream)
            .map_err(|e| e.to_string())?;
        self.launch(buffer)
    }

    fn wait(&self) -> Result<(), String> {
        // The simulated GPU finishes this stream's work; a real one does so by itself.
        self.allocator
            .with_strategy(|s| s.driver_mut().complete_stream(self.stream));
        Ok(())
    }
}

fn run_sim(opts: Options) -> Result<String, String> {
    let config = SimConfig::default().with_capacity(4 << 30);
    let mut out = format!(
        "service on the simulated device: {} GiB, {} MiB pages, {} workers x {} requests\n",
        config.capacity >> 30,
        config.granularity >> 20,
        opts.workers,
        opts.requests
    );
    let allocator = Allocator::expandable(SimDriver::new(config), Config::default())
        .map_err(|e| e.to_string())?;
    let lanes = (0..opts.workers)
        .map(|i| SimLane {
            allocator: allocator.clone(),
            stream: StreamId(0x10 + i as u64),
        })
        .collect();
    let tallies = serve(lanes, opts)?;
    report(&allocator, &tallies, &mut out)?;
    Ok(out)
}

// --- A GPU ------------------------------------------------------------------------------------------

#[cfg(not(feature = "cuda"))]
fn run_cuda(_ordinal: usize, _opts: Options) -> Result<String, String> {
    Err(
        "no CUDA driver found: this example was built without CUDA support; \
         run it with `--features cuda -- --backend cuda`"
            .to_string(),
    )
}

#[cfg(feature = "cuda")]
fn run_cuda(ordinal: usize, opts: Options) -> Result<String, String> {
    gpu::run(ordinal, opts)
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::{Lane, Options, report, serve};
    use cudarc::driver::{CudaFunction, CudaStream, DevicePtrMut, LaunchConfig, PushKernelArg};
    use cudarc::nvrtc::Ptx;
    use cuvmm::driver::DriverError;
    use cuvmm::driver::cuda::CudaDriver;
    use cuvmm::expandable::Expandable;
    use cuvmm::{Allocator, Config, CudaBuffer};
    use std::sync::Arc;

    /// `fill_u32(out, n, tag)`: `out[i] = tag + i` for `i < n`. Hand-written PTX, so no CUDA toolkit and
    /// no NVRTC are needed: the driver compiles it for the GPU when the module is loaded.
    const FILL_PTX: &str = r#"
.version 7.0
.target sm_52
.address_size 64

.visible .entry fill_u32(
    .param .u64 param_out,
    .param .u32 param_n,
    .param .u32 param_tag
)
{
    .reg .pred %p<2>;
    .reg .b32 %r<8>;
    .reg .b64 %rd<5>;

    ld.param.u64 %rd1, [param_out];
    ld.param.u32 %r1, [param_n];
    ld.param.u32 %r2, [param_tag];
    mov.u32 %r3, %ctaid.x;
    mov.u32 %r4, %ntid.x;
    mov.u32 %r5, %tid.x;
    mad.lo.s32 %r6, %r3, %r4, %r5;
    setp.ge.u32 %p1, %r6, %r1;
    @%p1 bra DONE;
    cvta.to.global.u64 %rd2, %rd1;
    mul.wide.u32 %rd3, %r6, 4;
    add.s64 %rd4, %rd2, %rd3;
    add.u32 %r7, %r2, %r6;
    st.global.u32 [%rd4], %r7;
DONE:
    ret;
}
"#;

    type GpuAllocator = Allocator<Expandable<CudaDriver>>;

    /// A worker on a GPU: its own cudarc stream.
    struct GpuLane {
        allocator: GpuAllocator,
        stream: Arc<CudaStream>,
        fill: CudaFunction,
    }

    impl Lane for GpuLane {
        type Buffer = CudaBuffer<Expandable<CudaDriver>>;

        fn alloc(&self, size: u64) -> Result<Self::Buffer, cuvmm::Error> {
            self.allocator.alloc_on_stream(size, &self.stream)
        }

        fn work(&self, buffer: &mut Self::Buffer, tag: u32) -> Result<(), String> {
            let n = (buffer.len() / 4) as u32;
            let mut view = buffer.view_mut::<u32>();
            let (ptr, _record) = view.device_ptr_mut(&self.stream);
            let mut launch = self.stream.launch_builder(&self.fill);
            launch.arg(&ptr).arg(&n).arg(&tag);
            launch_fill(&mut launch, n)
        }

        fn adopt(&self, buffer: &mut Self::Buffer, tag: u32) -> Result<(), String> {
            // Read on this worker's stream: the view makes this stream wait for the writer's, and records
            // this stream's use with the allocator, so the free below waits for the copy.
            let mut host = vec![0u32; (buffer.len() / 4) as usize];
            self.stream
                .memcpy_dtoh(&buffer.view::<u32>(), &mut host)
                .map_err(|e| format!("memcpy_dtoh: {e:?}"))?;
            self.stream
                .synchronize()
                .map_err(|e| format!("synchronize: {e:?}"))?;
            match host
                .iter()
                .enumerate()
                .find(|&(i, &v)| v != tag.wrapping_add(i as u32))
            {
                None => Ok(()),
                Some((i, v)) => Err(format!(
                    "the kernel's result is wrong at element {i}: {v:#x}, expected {:#x}",
                    tag.wrapping_add(i as u32)
                )),
            }
        }

        fn wait(&self) -> Result<(), String> {
            self.stream
                .synchronize()
                .map_err(|e| format!("synchronize: {e:?}"))
        }
    }

    /// Launches `fill_u32` over `n` elements.
    #[allow(unsafe_code)]
    fn launch_fill(launch: &mut cudarc::driver::LaunchArgs<'_>, n: u32) -> Result<(), String> {
        // SAFETY: the arguments match `fill_u32`'s parameters (a u64 pointer, two u32s); the pointer is a
        // live CudaBuffer of at least `4 n` bytes, borrowed mutably for the launch, and the kernel writes
        // only its first `n` u32s.
        unsafe { launch.launch(LaunchConfig::for_num_elems(n.max(1))) }
            .map(drop)
            .map_err(|e| format!("launching fill_u32: {e:?}"))
    }

    pub(super) fn run(ordinal: usize, opts: Options) -> Result<String, String> {
        let driver = match CudaDriver::new(ordinal) {
            Ok(driver) => driver,
            Err(DriverError::NoDriver { reason }) => {
                return Err(format!("no CUDA driver found: {reason}"));
            }
            Err(err) => return Err(format!("opening CUDA device {ordinal}: {err}")),
        };
        let mut out = format!(
            "service on CUDA device {ordinal} ({}), {} workers x {} requests\n",
            driver.name(),
            opts.workers,
            opts.requests
        );
        let ctx = driver.context().clone();
        let module = ctx
            .load_module(Ptx::from_src(FILL_PTX))
            .map_err(|e| format!("loading the PTX: {e:?}"))?;
        let fill = module
            .load_function("fill_u32")
            .map_err(|e| format!("fill_u32: {e:?}"))?;
        let allocator =
            Allocator::expandable(driver, Config::default()).map_err(|e| e.to_string())?;
        // The workers' streams outlive the allocator's last wait on them (they are dropped after it).
        let streams = (0..opts.workers)
            .map(|_| ctx.new_stream())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("creating a stream: {e:?}"))?;
        let lanes = streams
            .iter()
            .map(|stream| GpuLane {
                allocator: allocator.clone(),
                stream: stream.clone(),
                fill: fill.clone(),
            })
            .collect();
        let tallies = serve(lanes, opts)?;
        report(&allocator, &tallies, &mut out)?;
        let checked: u64 = tallies.iter().map(|t| t.adopted).sum();
        out.push_str(&format!(
            "kernel results checked on {checked} handed-over buffers: all correct\n"
        ));
        drop(allocator);
        drop(streams);
        Ok(out)
    }
}
