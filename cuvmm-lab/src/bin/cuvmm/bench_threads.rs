//! `cuvmm bench-threads`: how the facade (`Allocator`) scales with threads, through each of its entry points,
//! and how long a cached allocation waits while another stream grows.
//!
//! Two measurements, through the facade as a program uses it:
//! - cached alloc+free pairs per second through each entry point (`DeviceBuffer`: `alloc_on` + drop;
//!   raw: `alloc_raw` + `free_raw`, what the C ABI and PyTorch call), with 1, 2, 4 and 8 threads each on its
//!   own stream, and 8 threads sharing 2 streams; on the simulator the latencies are not slept (no pair makes
//!   a driver call once warm). With `--backend cuda` the streams are real CUDA streams created per run
//!   (cudarc's), and the same pairs are also made with cudarc's default allocation (`CudaStream::alloc`,
//!   cuMemAllocAsync with its event tracking), plain cuMemAllocAsync / cuMemFreeAsync on the device's
//!   default pool (release threshold at its maximum) and cuMemAlloc / cuMemFree, for comparison. The C ABI
//!   (`cuvmm_malloc` / `cuvmm_free`) lives in cuvmm-torch, which depends on this crate: its own bench,
//!   `cargo bench -p cuvmm-torch`, measures it the same way.
//! - the 99th-percentile latency of a cached allocation on one stream, alone and while another stream
//!   grows on a device that sleeps each driver call's modelled latency (`SimConfig::sleep_latency`; an
//!   estimate from published A100 figures, not a measurement; on `--backend cuda`, the real driver).
//!   Requests arrive every 50 us, as a service's do, rather than back to back, which would make one sample
//!   of a 2 ms wait and thousands of fast ones after it. Reported from each request's arrival to its return,
//!   which also charges the requests that arrived while the thread was held up (by an earlier request
//!   waiting for the lock, or by the host: on a virtual machine that preempts it this has a floor of tens of
//!   microseconds even alone), and as the allocation call's own duration (`cached_alloc_call_p99_ns_*`),
//!   which misses those. The first 50 ms, with the other stream already growing, are not timed.
//!   `arrival_p99_ns_floor` is the same paced loop making no request: the machine's own share.
//!
//! Each measurement runs `--millis` per repetition; medians over `--repetitions` are reported.

use crate::options::{BackendArgs, Format, parse_nonzero_size};
use crate::output::{USAGE, emit};
use clap::Args;
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::{GIB, MIB, format_size};
use cuvmm::{Allocator, Config, Strategy, StreamId};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[cfg(feature = "cuda")]
mod cuda;

/// The (threads, streams) of the throughput measurement: each thread on its own stream, then 8 threads
/// sharing 2 streams (4 to a stream, each thread with its own cache shard).
const SCENARIOS: [(usize, usize); 5] = [(1, 1), (2, 2), (4, 4), (8, 8), (8, 2)];
/// The simulated device: 8 GiB with 2 MiB pages.
const CAPACITY: u64 = 8 * GIB;
const PAGE: u64 = 2 * MIB;
/// What the growing stream allocates at a time, and holds at most before it frees it all and goes on
/// growing on the next stream (whose growth then reclaims the old stream's idle pages).
const GROWTH_STEP: u64 = 20 * MIB;
const GROWTH_HELD: u64 = 4 * GIB;
/// Streams the growing thread cycles through.
const GROWER_STREAMS: usize = 8;
/// Pairs each thread runs before it is timed.
const WARM_UP: usize = 1_000;
/// The cached allocations of the latency measurement arrive at this interval, as a service's requests do.
const ARRIVAL: Duration = Duration::from_micros(50);
/// How long the latency measurement's stream serves requests, with the other stream already growing,
/// before it is timed: caches that wait for contention turn on when a thread first finds the lock taken.
const SETTLE: Duration = Duration::from_millis(50);

/// Options of `bench-threads`.
#[derive(Debug, Args)]
pub struct BenchThreadsArgs {
    /// Where to measure: the simulator (default) or a CUDA device, whose streams are then real ones.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Bytes of each cached request (several, comma-separated, measure each: 512,64KiB,20MiB).
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_delimiter = ',', value_parser = parse_nonzero_size)]
    pub size: Vec<u64>,
    /// Milliseconds each repetition of each measurement runs.
    #[arg(long, value_name = "MS", default_value_t = 300, value_parser = clap::value_parser!(u64).range(1..=600_000))]
    pub millis: u64,
    /// Repetitions of each measurement; medians are reported.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=1_000))]
    pub repetitions: u64,
    /// Allocator configuration in PyTorch's `key:value,...` syntax (e.g. `stream_cache_mb:0`); default:
    /// the `CUVMM_ALLOC_CONF` environment variable, else the defaults.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// One entry point at one size and one (threads, streams).
#[derive(Debug, Serialize)]
struct ThreadsResult {
    /// `DeviceBuffer`, `alloc_raw/free_raw`, or on CUDA a comparison: `cudarc`, `cuMemAllocAsync`,
    /// `cuMemAlloc`.
    entry: &'static str,
    size_bytes: u64,
    threads: usize,
    streams: usize,
    pairs_per_second: f64,
    /// One thread's time per pair: threads over pairs per second.
    ns_per_pair: f64,
    /// Pairs per second over one thread's, same entry and size.
    speedup: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    backend: String,
    threads: Vec<ThreadsResult>,
    /// From each request's arrival to its allocation's return: also counts the requests that arrived while
    /// an earlier one, or the host, held the thread up (coordinated omission corrected). Of the first size.
    cached_alloc_p99_ns_during_growth: u64,
    cached_alloc_p99_ns_idle: u64,
    /// The allocation call's own duration.
    cached_alloc_call_p99_ns_during_growth: u64,
    cached_alloc_call_p99_ns_idle: u64,
    /// The same paced loop from arrival with no request at all: what the machine alone adds (a host that
    /// preempts the thread).
    arrival_p99_ns_floor: u64,
    /// Growth steps (20 MiB allocations, each creating and mapping handles) the growing stream made per
    /// repetition, median.
    growth_steps: u64,
    size_bytes: u64,
    millis: u64,
    repetitions: u64,
    latency_model: &'static str,
}

/// `cuvmm bench-threads`.
pub fn run_bench_threads(args: BenchThreadsArgs) -> ExitCode {
    let conf = args
        .alloc_conf
        .clone()
        .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
        .unwrap_or_default();
    let config = match Config::from_alloc_conf(&conf) {
        Ok(config) => config,
        Err(e) => {
            eprintln!("cuvmm: bad allocator configuration: {e}");
            return ExitCode::from(USAGE);
        }
    };
    let measured = match args.backend.backend {
        DeviceSpec::Sim => measure_sim(&args, &config),
        #[cfg(feature = "cuda")]
        DeviceSpec::Cuda { ordinal } => cuda::measure(&args, &config, ordinal),
        // `--backend cuda` is refused while parsing when the feature is off.
        #[cfg(not(feature = "cuda"))]
        DeviceSpec::Cuda { .. } => Err("this build has no CUDA backend".to_string()),
    };
    match measured {
        Ok(report) => emit(&match args.format {
            Format::Json => {
                serde_json::to_string_pretty(&report).expect("a report serializes") + "\n"
            }
            Format::Table => table(&report),
        }),
        Err(e) => {
            eprintln!("cuvmm: bench-threads: {e}");
            ExitCode::FAILURE
        }
    }
}

type SimAlloc = Allocator<cuvmm::expandable::Expandable<SimDriver>>;

fn sim_allocator(config: &Config, sleep: bool) -> Result<SimAlloc, String> {
    let device = SimDriver::new(
        SimConfig::default()
            .with_capacity(CAPACITY)
            .with_granularity(PAGE)
            .with_sleep_latency(sleep),
    );
    Allocator::expandable(device, config.clone()).map_err(|e| e.to_string())
}

/// The facade's entry points, as one thread's alloc+free pair on `stream`.
#[derive(Clone, Copy, Debug)]
enum Entry {
    Buffer,
    Raw,
}

impl Entry {
    const ALL: [Entry; 2] = [Entry::Buffer, Entry::Raw];

    fn name(self) -> &'static str {
        match self {
            Entry::Buffer => "DeviceBuffer",
            Entry::Raw => "alloc_raw/free_raw",
        }
    }

    /// One pair through this entry point.
    #[inline]
    fn pair<S: Strategy>(
        self,
        alloc: &Allocator<S>,
        size: u64,
        stream: StreamId,
    ) -> Result<(), String> {
        let e = |e: cuvmm::Error| e.to_string();
        match self {
            Entry::Buffer => alloc.alloc_on(size, stream).map_err(e)?.free().map_err(e),
            Entry::Raw => alloc
                .free_raw(alloc.alloc_raw(size, stream).map_err(e)?)
                .map_err(e),
        }
    }
}

fn measure_sim(args: &BenchThreadsArgs, config: &Config) -> Result<Report, String> {
    let run = Duration::from_millis(args.millis);
    let mut threads = Vec::new();
    for &size in &args.size {
        for entry in Entry::ALL {
            let mut series = Series::new(entry.name(), size);
            for (n, streams) in SCENARIOS {
                series.push(n, streams, args.repetitions, || {
                    let alloc = sim_allocator(config, false)?;
                    pairs_per_second(n, run, |t| {
                        let stream = StreamId((t % streams) as u64 + 1);
                        let alloc = &alloc;
                        Ok(move || entry.pair(alloc, size, stream))
                    })
                })?;
            }
            threads.extend(series.results);
        }
    }
    let size = args.size[0];
    let growers: Vec<StreamId> = (0..GROWER_STREAMS as u64)
        .map(|s| StreamId(s + 2))
        .collect();
    let latency = latencies(
        args,
        || sim_allocator(config, true),
        StreamId(1),
        &growers,
        size,
    )?;
    Ok(latency.report(
        "sim".to_string(),
        threads,
        args,
        "simulated device; the growing stream's driver calls sleep their modelled A100 latency (an \
         estimate, not a measurement)",
    ))
}

/// One entry point's results at one size, scenario by scenario, with speedups over its first.
pub(crate) struct Series {
    entry: &'static str,
    size: u64,
    results: Vec<ThreadsResult>,
}

impl Series {
    pub(crate) fn new(entry: &'static str, size: u64) -> Self {
        Self {
            entry,
            size,
            results: Vec::new(),
        }
    }

    /// Measures `n` threads on `streams` streams: the median of `repetitions` runs of `once`.
    pub(crate) fn push(
        &mut self,
        n: usize,
        streams: usize,
        repetitions: u64,
        mut once: impl FnMut() -> Result<f64, String>,
    ) -> Result<(), String> {
        let rates = (0..repetitions)
            .map(|_| once())
            .collect::<Result<Vec<_>, _>>()?;
        let rate = median_f64(rates);
        let one = self.results.first().map_or(rate, |t| t.pairs_per_second);
        self.results.push(ThreadsResult {
            entry: self.entry,
            size_bytes: self.size,
            threads: n,
            streams,
            pairs_per_second: rate,
            ns_per_pair: n as f64 / rate * 1e9,
            speedup: rate / one,
        });
        Ok(())
    }
}

/// Alloc+free pairs per second of `n` threads for `run`: thread `t` makes its pair function with
/// `make(t)`, on its own thread (so that it may create what it needs there), warms up, then repeats it.
pub(crate) fn pairs_per_second<P>(
    n: usize,
    run: Duration,
    make: impl Fn(usize) -> Result<P, String> + Sync,
) -> Result<f64, String>
where
    P: FnMut() -> Result<(), String>,
{
    let stop = AtomicBool::new(false);
    let start = Barrier::new(n + 1);
    let (pairs, elapsed) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..n)
            .map(|t| {
                let (stop, start, make) = (&stop, &start, &make);
                scope.spawn(move || -> Result<u64, String> {
                    // Every thread reaches the barrier, even one that failed, so none waits forever.
                    let warmed = make(t).and_then(|mut pair| {
                        (0..WARM_UP).try_for_each(|_| pair())?;
                        Ok(pair)
                    });
                    start.wait();
                    let mut pair = warmed?;
                    let mut pairs = 0;
                    while !stop.load(Ordering::Relaxed) {
                        pair()?;
                        pairs += 1;
                    }
                    Ok(pairs)
                })
            })
            .collect();
        start.wait();
        let began = Instant::now();
        std::thread::sleep(run);
        stop.store(true, Ordering::Relaxed);
        let pairs: Result<Vec<u64>, _> = workers
            .into_iter()
            .map(|w| w.join().expect("a bench thread panicked"))
            .collect();
        (pairs, began.elapsed())
    });
    Ok(pairs?.iter().sum::<u64>() as f64 / elapsed.as_secs_f64())
}

/// The latency measurement's medians.
pub(crate) struct Latencies {
    during: Vec<Latency>,
    idle: Vec<Latency>,
    floor: Vec<u64>,
    size: u64,
}

impl Latencies {
    fn report(
        self,
        backend: String,
        threads: Vec<ThreadsResult>,
        args: &BenchThreadsArgs,
        latency_model: &'static str,
    ) -> Report {
        let of = |runs: &[Latency], f: fn(&Latency) -> u64| median(runs.iter().map(f).collect());
        Report {
            backend,
            threads,
            cached_alloc_p99_ns_during_growth: of(&self.during, |l| l.p99_from_arrival),
            cached_alloc_p99_ns_idle: of(&self.idle, |l| l.p99_from_arrival),
            cached_alloc_call_p99_ns_during_growth: of(&self.during, |l| l.p99),
            cached_alloc_call_p99_ns_idle: of(&self.idle, |l| l.p99),
            arrival_p99_ns_floor: median(self.floor),
            growth_steps: of(&self.during, |l| l.growth_steps),
            size_bytes: self.size,
            millis: args.millis,
            repetitions: args.repetitions,
            latency_model,
        }
    }
}

/// The latency measurement, `--repetitions` times, each on a fresh allocator from `allocator`: requests of
/// `size` on `served`, while a thread grows on `growers` (or not).
pub(crate) fn latencies<S: Strategy + Send>(
    args: &BenchThreadsArgs,
    allocator: impl Fn() -> Result<Allocator<S>, String>,
    served: StreamId,
    growers: &[StreamId],
    size: u64,
) -> Result<Latencies, String> {
    let run = Duration::from_millis(args.millis);
    let (mut during, mut idle, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.repetitions {
        floor.push(arrival_floor(run));
        during.push(cached_p99(&allocator()?, size, run, served, growers)?);
        idle.push(cached_p99(&allocator()?, size, run, served, &[])?);
    }
    Ok(Latencies {
        during,
        idle,
        floor,
        size,
    })
}

/// What [`cached_p99`] measures in one run, in nanoseconds.
struct Latency {
    /// 99th percentile of the allocation call's own duration.
    p99: u64,
    /// 99th percentile of the time from each request's arrival to its allocation's return.
    p99_from_arrival: u64,
    growth_steps: u64,
}

/// The 99th-percentile latency of a cached allocation on `served` over `run`, and the growth steps of the
/// other thread, which, given `growers`, keeps allocating 20 MiB buffers (creating and mapping handles, on
/// the simulator each call slept) on the first; once it holds 4 GiB it frees them and goes on on the next,
/// and so on. It never
/// empties the cache or reads statistics, which give every stream's cached buffers back to the strategy.
fn cached_p99<S: Strategy + Send>(
    alloc: &Allocator<S>,
    size: u64,
    run: Duration,
    served: StreamId,
    growers: &[StreamId],
) -> Result<Latency, String> {
    let e = |e: cuvmm::Error| e.to_string();
    let stop = AtomicBool::new(false);
    let start = Barrier::new(2);
    std::thread::scope(|scope| {
        let grower = scope.spawn(|| -> Result<u64, String> {
            start.wait();
            let (mut steps, mut next) = (0, 0);
            let mut held = Vec::new();
            while !growers.is_empty() && !stop.load(Ordering::Relaxed) {
                let stream = growers[next % growers.len()];
                held.push(alloc.alloc_on(GROWTH_STEP, stream).map_err(e)?);
                steps += 1;
                if held.len() as u64 * GROWTH_STEP >= GROWTH_HELD {
                    held.clear();
                    next += 1;
                }
            }
            Ok(steps)
        });
        let stream = served;
        start.wait();
        let settling = Instant::now();
        while settling.elapsed() < SETTLE {
            drop(alloc.alloc_on(size, stream).map_err(e)?);
        }
        let (mut service, mut from_arrival) = (Vec::new(), Vec::new());
        paced(run, |arrival| {
            let called = Instant::now();
            let buffer = alloc.alloc_on(size, stream).map_err(e)?;
            let done = Instant::now();
            service.push((done - called).as_nanos() as u64);
            from_arrival.push((done - arrival).as_nanos() as u64);
            drop(buffer);
            Ok::<(), String>(())
        })?;
        stop.store(true, Ordering::Relaxed);
        let steps = grower.join().expect("the growing thread panicked")?;
        Ok(Latency {
            p99: p99(service),
            p99_from_arrival: p99(from_arrival),
            growth_steps: steps,
        })
    })
}

/// The 99th percentile, from arrival, of requests that do nothing, paced as in [`cached_p99`].
fn arrival_floor(run: Duration) -> u64 {
    let mut from_arrival = Vec::new();
    paced(run, |arrival| {
        from_arrival.push(arrival.elapsed().as_nanos() as u64);
        Ok::<(), std::convert::Infallible>(())
    })
    .unwrap_or_else(|never| match never {});
    p99(from_arrival)
}

/// Runs `request` once per [`ARRIVAL`] for `run`, each call given its arrival time; a request that comes late
/// (the previous one, or the host, held the thread up) runs at once.
fn paced<E>(run: Duration, mut request: impl FnMut(Instant) -> Result<(), E>) -> Result<(), E> {
    let began = Instant::now();
    for k in 0..(run.as_nanos() / ARRIVAL.as_nanos()) as u32 {
        let arrival = began + ARRIVAL * k;
        while Instant::now() < arrival {
            std::hint::spin_loop();
        }
        request(arrival)?;
    }
    Ok(())
}

/// The 99th percentile.
fn p99(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values[(values.len() * 99 / 100).min(values.len() - 1)]
}

fn median(mut values: Vec<u64>) -> u64 {
    values.sort_unstable();
    values[values.len() / 2]
}

fn median_f64(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values[values.len() / 2]
}

fn table(report: &Report) -> String {
    let mut out = format!(
        "cached alloc+free pairs per entry point ({} backend; medians of {} x {} ms)\n\n",
        report.backend, report.repetitions, report.millis
    );
    out += &format!(
        "{:<20} {:>9} {:>8} {:>8} {:>14} {:>10} {:>8}\n",
        "entry", "size", "threads", "streams", "pairs/s", "ns/pair", "speedup"
    );
    for t in &report.threads {
        out += &format!(
            "{:<20} {:>9} {:>8} {:>8} {:>14.0} {:>10.1} {:>7.2}x\n",
            t.entry,
            format_size(t.size_bytes),
            t.threads,
            t.streams,
            t.pairs_per_second,
            t.ns_per_pair,
            t.speedup
        );
    }
    out += &format!(
        "\ncached allocation p99 from arrival (a request every {} us): {} ns idle, {} ns while another stream \
         grows (this machine's floor, requests that do nothing: {} ns); the call alone: {} ns idle, {} ns while \
         another stream grows\n({} growth steps of 20 MiB per run; {})\n",
        ARRIVAL.as_micros(),
        report.cached_alloc_p99_ns_idle,
        report.cached_alloc_p99_ns_during_growth,
        report.arrival_p99_ns_floor,
        report.cached_alloc_call_p99_ns_idle,
        report.cached_alloc_call_p99_ns_during_growth,
        report.growth_steps,
        report.latency_model
    );
    out
}
