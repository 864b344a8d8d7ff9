//! Many threads on several streams use one `Allocator` at once: they allocate, free (explicitly and by
//! dropping the `DeviceBuffer`), record uses on other streams and queue simulated kernels there (cuvmm),
//! complete queued work, trim, empty the cache, read statistics and check invariants, all interleaved.
//!
//! Checked, during the run: every allocation succeeds (the device has room for every thread's peak); each
//! thread's buffers keep the bytes it wrote (other threads' compaction, trims and cache flushes move or
//! release only idle pages); `allocated_bytes` covers at least the thread's own live buffers and never
//! exceeds `reserved_bytes`; `check_invariants()` holds whenever a thread checks it. After the threads
//! join: nothing is live, no free failed (no deferred error), and once the streams are run dry and the
//! cache emptied nothing is reserved, no event is left and the device reports no leak.
//!
//! Each test prints threads x operations to stderr (figures for `docs/reliability.md`).

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Op, StreamId, VaRange};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, DeviceBuffer, Error, Strategy};
use cuvmm_lab::pytorch_model::Split;

const KIB: u64 = 1 << 10;
const THREADS: u64 = 8;
const STREAMS: u64 = 3;
/// Bytes of each window of the pattern written into a large buffer.
const WINDOW: u64 = 64;
/// Buffers up to this size get their whole pattern; larger ones a window every 4 KiB and at the end.
const FULL_PATTERN: u64 = 64 * KIB;

/// A strategy on a simulated device, reachable from the test for bytes and streams.
trait OnSim: Strategy + Send + 'static {
    fn sim(&self) -> &SimDriver;
    fn sim_mut(&mut self) -> &mut SimDriver;
    /// `buffer.record_stream(stream)`, for a strategy that tracks streams.
    fn record_use(buffer: &DeviceBuffer<Self>, stream: StreamId) -> Result<(), Error>
    where
        Self: Sized;
}

impl OnSim for Expandable<SimDriver> {
    fn sim(&self) -> &SimDriver {
        self.driver()
    }
    fn sim_mut(&mut self) -> &mut SimDriver {
        self.driver_mut()
    }
    fn record_use(buffer: &DeviceBuffer<Self>, stream: StreamId) -> Result<(), Error> {
        buffer.record_stream(stream)
    }
}

impl OnSim for Split<SimDriver> {
    fn sim(&self) -> &SimDriver {
        self.driver()
    }
    fn sim_mut(&mut self) -> &mut SimDriver {
        self.driver_mut()
    }
    fn record_use(_: &DeviceBuffer<Self>, _: StreamId) -> Result<(), Error> {
        Err(Error::Unsupported {
            what: "record_stream",
            allocator: "pytorch model",
        })
    }
}

/// How a run is set up.
#[derive(Clone, Copy)]
struct Plan {
    /// Operations per thread.
    ops: u64,
    /// The largest request.
    max_size: u64,
    /// Whether threads record uses on other streams and queue kernels (cuvmm only: the PyTorch models
    /// have no `record_stream`).
    streams: bool,
}

/// SplitMix64.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n
    }
}

/// The offsets and lengths of a buffer that carry its pattern.
fn windows(size: u64) -> Vec<(u64, u64)> {
    if size <= FULL_PATTERN {
        return vec![(0, size)];
    }
    let mut out: Vec<(u64, u64)> = (0..size - WINDOW)
        .step_by(4 * KIB as usize)
        .map(|o| (o, WINDOW))
        .collect();
    out.push((size - WINDOW, WINDOW));
    out
}

/// The pattern of buffer `id` at `offset`, `len` bytes.
fn pattern(id: u64, offset: u64, len: u64) -> Vec<u8> {
    (offset..offset + len)
        .map(|i| (id.wrapping_mul(131).wrapping_add(i.wrapping_mul(7)) % 251) as u8)
        .collect()
}

fn stamp<S: OnSim>(alloc: &Allocator<S>, buffer: &DeviceBuffer<S>, id: u64) {
    alloc.with_strategy(|s| {
        for (offset, len) in windows(buffer.len()) {
            s.sim_mut()
                .write(buffer.ptr() + offset, &pattern(id, offset, len))
                .expect("a live buffer is writable");
        }
    });
}

fn verify<S: OnSim>(alloc: &Allocator<S>, buffer: &DeviceBuffer<S>, id: u64) {
    alloc.with_strategy(|s| {
        for (offset, len) in windows(buffer.len()) {
            let got = s
                .sim()
                .read(buffer.ptr() + offset, len as usize)
                .expect("a live buffer is readable");
            assert!(
                got == pattern(id, offset, len),
                "buffer {id} at {:#x}+{} lost its bytes at {offset}",
                buffer.ptr(),
                buffer.len()
            );
        }
    });
}

/// One thread's work: `plan.ops` random operations on its own stream (and, with streams, another).
/// Returns the number of allocations it made.
fn worker<S: OnSim>(alloc: Allocator<S>, thread: u64, plan: Plan) -> u64 {
    let mut allocations = 0;
    let mut rng = Rng(thread.wrapping_mul(0x2545_F491_4F6C_DD1D) + 1);
    let own = StreamId(thread % STREAMS);
    let mut held: Vec<(DeviceBuffer<S>, u64)> = Vec::new();
    for i in 0..plan.ops {
        let id = thread << 32 | i;
        match rng.below(16) {
            0..=5 if held.len() < 6 => {
                // A third from four sizes that repeat, as a training step's or a service's do: once the
                // stream caches are active, those are served from them.
                let size = match rng.below(3) {
                    0 => 1 + rng.below(4 * KIB),
                    1 => [512, 3 * KIB, 16 * KIB, 64 * KIB][rng.below(4) as usize],
                    _ => 1 + rng.below(plan.max_size),
                };
                let buffer = alloc
                    .alloc_on(size, own)
                    .unwrap_or_else(|e| panic!("thread {thread}: alloc({size}) failed: {e}"));
                allocations += 1;
                stamp(&alloc, &buffer, id);
                held.push((buffer, id));
            }
            6..=7 if !held.is_empty() => {
                let (buffer, id) = held.swap_remove(rng.below(held.len() as u64) as usize);
                verify(&alloc, &buffer, id);
                buffer.free().expect("explicit free");
            }
            8..=9 if !held.is_empty() => {
                let (buffer, id) = held.swap_remove(rng.below(held.len() as u64) as usize);
                verify(&alloc, &buffer, id);
                drop(buffer);
            }
            10 if plan.streams && !held.is_empty() => {
                // Work on another stream uses one of our buffers: record it, then queue the kernel.
                let (buffer, _) = &held[rng.below(held.len() as u64) as usize];
                let other = StreamId((own.0 + 1 + rng.below(STREAMS - 1)) % STREAMS);
                S::record_use(buffer, other).expect("record_stream");
                let range = VaRange::new(buffer.ptr(), buffer.len());
                alloc.with_strategy(|s| s.sim_mut().launch(other, &[range]).expect("launch"));
            }
            11 if plan.streams => {
                let stream = StreamId(rng.below(STREAMS));
                alloc.with_strategy(|s| s.sim_mut().advance(stream, 1 + rng.below(3) as usize));
            }
            12 => {
                alloc.trim(rng.below(8) * 64 * KIB).expect("trim");
            }
            13 => {
                let mine: u64 = held.iter().map(|(b, _)| b.len()).sum();
                let stats = alloc.stats();
                assert!(stats.allocated_bytes.current >= mine, "{stats:?}");
                assert!(
                    stats.allocated_bytes.current <= stats.reserved_bytes.current,
                    "{stats:?}"
                );
            }
            14 => alloc.check_invariants().expect("invariants hold"),
            15 if rng.below(4) == 0 => alloc.empty_cache().expect("empty_cache"),
            _ => {}
        }
        if i % 16 == 0 {
            for (buffer, id) in &held {
                verify(&alloc, buffer, *id);
            }
        }
    }
    for (buffer, id) in &held {
        verify(&alloc, buffer, *id);
    }
    // The rest are freed by dropping them here.
    allocations
}

/// Runs [`THREADS`] workers on `alloc` and checks the end state; prints threads x operations.
fn run<S: OnSim>(name: &str, alloc: Allocator<S>, plan: Plan) {
    let threads: Vec<_> = (0..THREADS)
        .map(|t| {
            let alloc = alloc.clone();
            std::thread::spawn(move || worker(alloc, t, plan))
        })
        .collect();
    let allocations: u64 = threads
        .into_iter()
        .map(|t| t.join().expect("a worker panicked"))
        .sum();
    alloc.check_invariants().expect("invariants hold");
    let errors = alloc.take_deferred_errors();
    assert!(errors.is_empty(), "frees in drop failed: {errors:?}");
    assert_eq!(alloc.stats().allocation.current, 0);
    alloc.with_strategy(|s| {
        for stream in 0..STREAMS {
            s.sim_mut().complete_stream(StreamId(stream));
        }
    });
    alloc.empty_cache().expect("empty_cache");
    alloc.check_invariants().expect("invariants hold");
    let stats = alloc.stats();
    assert_eq!(
        (stats.active_bytes.current, stats.reserved_bytes.current),
        (0, 0)
    );
    alloc.with_strategy(|s| {
        assert_eq!(s.sim().live_events(), 0, "events left undestroyed");
        let leaks = s.sim().leak_report();
        assert!(leaks.is_empty(), "{leaks}");
    });
    let calls = |op| stats.driver.get(op);
    eprintln!(
        "concurrency {name}: {THREADS} threads x {} operations = {} operations on {STREAMS} streams; \
         {allocations} allocations, {} of them served by the stream caches; driver calls: {} map, {} unmap, {} malloc, {} free, {} record_event",
        plan.ops,
        THREADS * plan.ops,
        allocations - stats.allocation.allocated,
        calls(Op::Map),
        calls(Op::Unmap),
        calls(Op::Malloc),
        calls(Op::Free),
        calls(Op::RecordEvent),
    );
}

/// A simulated device of `capacity` bytes and `granularity`, with the byte store on.
fn device(capacity: u64, granularity: u64) -> SimDriver {
    SimDriver::new(
        SimConfig::default()
            .with_capacity(capacity)
            .with_granularity(granularity)
            .with_backing_store(true),
    )
}

#[test]
fn cuvmm_under_many_threads_and_streams() {
    let page = 64 * KIB;
    // Idle memory beyond 8 pages goes back on free, so frees unmap and release while others allocate.
    let config = Config {
        small_size: 16 * KIB,
        ..Config::default()
    }
    .with_max_idle_bytes(8 * page);
    let alloc = Allocator::expandable(device(1024 * page, page), config).unwrap();
    let plan = Plan {
        ops: 1500,
        max_size: 3 * page,
        streams: true,
    };
    run("cuvmm", alloc, plan);
}

#[test]
fn the_classic_model_under_many_threads() {
    let alloc = Allocator::new(Split::new(device(1 << 30, 2 << 20), Config::default()).unwrap());
    let plan = Plan {
        ops: 800,
        max_size: 3 << 20,
        streams: false,
    };
    run("classic", alloc, plan);
}

#[test]
fn pytorch_expandable_under_many_threads() {
    let config = Config {
        expandable_segments: true,
        ..Config::default()
    };
    let alloc = Allocator::new(Split::new(device(1 << 30, 2 << 20), config).unwrap());
    let plan = Plan {
        ops: 800,
        max_size: 3 << 20,
        streams: false,
    };
    run("pytorch-expandable", alloc, plan);
}
