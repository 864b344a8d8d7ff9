//! `cuvmm bench-threads`: how the facade (`Allocator`) scales with threads, each on its own stream, and
//! how long a cached allocation waits while another stream grows.
//!
//! Two measurements on a simulated device, through the facade as a program uses it (`alloc_on` + drop):
//! - cached alloc+free pairs per second with 1, 2 and 4 threads, each on its own stream (latencies not
//!   slept: no pair makes a driver call once warm);
//! - the 99th-percentile latency of a cached allocation on one stream, alone and while another stream
//!   grows on a device that sleeps each driver call's modelled latency (`SimConfig::sleep_latency`; an
//!   estimate from published A100 figures, not a measurement). Requests arrive every 50 us, as a service's
//!   do, rather than back to back, which would make one sample of a 2 ms wait and thousands of fast ones
//!   after it. Reported from each request's arrival to its return, which also charges the requests that
//!   arrived while the thread was held up (by an earlier request waiting for the lock, or by the host: on a
//!   virtual machine that preempts it this has a floor of tens of microseconds even alone), and as the
//!   allocation call's own duration (`cached_alloc_call_p99_ns_*`), which misses those. The first 50 ms,
//!   with the other stream already growing, are not timed. `arrival_p99_ns_floor` is the same paced loop
//!   making no request: the machine's own share.
//!
//! Each measurement runs `--millis` per repetition; medians over `--repetitions` are reported.

use crate::args::{Format, parse_nonzero_size};
use crate::commands::{USAGE, emit};
use clap::Args;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::expandable::Expandable;
use cuvmm::size::{GIB, MIB};
use cuvmm::{Allocator, Config, StreamId};
use serde::Serialize;
use std::process::ExitCode;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// Thread counts of the throughput measurement.
const THREADS: [usize; 3] = [1, 2, 4];
/// The simulated device: 8 GiB with 2 MiB pages.
const CAPACITY: u64 = 8 * GIB;
const PAGE: u64 = 2 * MIB;
/// What the growing stream allocates at a time, and holds at most before it frees it all and goes on
/// growing on a new stream (whose growth then reclaims the old stream's idle pages).
const GROWTH_STEP: u64 = 20 * MIB;
const GROWTH_HELD: u64 = 4 * GIB;
/// Pairs each thread runs before it is timed.
const WARM_UP: usize = 1_000;
/// The cached allocations of the latency measurement arrive at this interval, as a service's requests do.
const ARRIVAL: Duration = Duration::from_micros(50);
/// How long the latency measurement's stream serves requests, with the other stream already growing,
/// before it is timed: a stream's cache turns active when it first finds the lock taken.
const SETTLE: Duration = Duration::from_millis(50);

/// Options of `bench-threads`.
#[derive(Debug, Args)]
pub struct BenchThreadsArgs {
    /// Bytes of each cached request.
    #[arg(long, value_name = "SIZE", default_value = "64KiB", value_parser = parse_nonzero_size)]
    pub size: u64,
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

#[derive(Debug, Serialize)]
struct ThreadsResult {
    threads: usize,
    pairs_per_second: f64,
    /// Pairs per second over one thread's.
    speedup: f64,
}

#[derive(Debug, Serialize)]
struct Report {
    threads: Vec<ThreadsResult>,
    /// From each request's arrival to its allocation's return: also counts the requests that arrived while
    /// an earlier one, or the host, held the thread up (coordinated omission corrected).
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
    match measure(&args, &config) {
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

type Alloc = Allocator<Expandable<SimDriver>>;

fn allocator(config: &Config, sleep: bool) -> Result<Alloc, cuvmm::Error> {
    let device = SimDriver::new(
        SimConfig::default()
            .with_capacity(CAPACITY)
            .with_granularity(PAGE)
            .with_sleep_latency(sleep),
    );
    Allocator::expandable(device, config.clone())
}

fn measure(args: &BenchThreadsArgs, config: &Config) -> Result<Report, cuvmm::Error> {
    let run = Duration::from_millis(args.millis);
    let mut threads = Vec::new();
    for n in THREADS {
        let mut rates = Vec::new();
        for _ in 0..args.repetitions {
            rates.push(pairs_per_second(
                &allocator(config, false)?,
                n,
                args.size,
                run,
            )?);
        }
        let rate = median_f64(rates);
        let one = threads
            .first()
            .map_or(rate, |t: &ThreadsResult| t.pairs_per_second);
        threads.push(ThreadsResult {
            threads: n,
            pairs_per_second: rate,
            speedup: rate / one,
        });
    }
    let (mut during, mut idle, mut floor) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..args.repetitions {
        floor.push(arrival_floor(run));
        during.push(cached_p99(&allocator(config, true)?, args.size, run, true)?);
        idle.push(cached_p99(
            &allocator(config, true)?,
            args.size,
            run,
            false,
        )?);
    }
    let of = |runs: &[Latency], f: fn(&Latency) -> u64| median(runs.iter().map(f).collect());
    Ok(Report {
        threads,
        cached_alloc_p99_ns_during_growth: of(&during, |l| l.p99_from_arrival),
        cached_alloc_p99_ns_idle: of(&idle, |l| l.p99_from_arrival),
        cached_alloc_call_p99_ns_during_growth: of(&during, |l| l.p99),
        cached_alloc_call_p99_ns_idle: of(&idle, |l| l.p99),
        arrival_p99_ns_floor: median(floor),
        growth_steps: of(&during, |l| l.growth_steps),
        size_bytes: args.size,
        millis: args.millis,
        repetitions: args.repetitions,
        latency_model: "simulated device; the growing stream's driver calls sleep their modelled A100 \
                        latency (an estimate, not a measurement)",
    })
}

/// Cached alloc+free pairs per second of `n` threads, each on its own stream, for `run`.
fn pairs_per_second(
    alloc: &Alloc,
    n: usize,
    size: u64,
    run: Duration,
) -> Result<f64, cuvmm::Error> {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(n + 1);
    let (pairs, elapsed) = std::thread::scope(|scope| {
        let workers: Vec<_> = (0..n)
            .map(|t| {
                let (stop, start) = (&stop, &start);
                scope.spawn(move || -> Result<u64, cuvmm::Error> {
                    let stream = StreamId(t as u64 + 1);
                    for _ in 0..WARM_UP {
                        drop(alloc.alloc_on(size, stream)?);
                    }
                    start.wait();
                    let mut pairs = 0;
                    while !stop.load(Ordering::Relaxed) {
                        drop(alloc.alloc_on(size, stream)?);
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

/// What [`cached_p99`] measures in one run, in nanoseconds.
struct Latency {
    /// 99th percentile of the allocation call's own duration.
    p99: u64,
    /// 99th percentile of the time from each request's arrival to its allocation's return.
    p99_from_arrival: u64,
    growth_steps: u64,
}

/// The 99th-percentile latency of a cached allocation on stream 1 over `run`, and the growth steps of the
/// other thread, which, when `grow`, keeps allocating 20 MiB buffers (creating and mapping handles, each
/// call slept) on stream 2; once it holds 4 GiB it frees them and goes on on stream 3, and so on. It never
/// empties the cache or reads statistics, which give every stream's cached buffers back to the strategy.
fn cached_p99(
    alloc: &Alloc,
    size: u64,
    run: Duration,
    grow: bool,
) -> Result<Latency, cuvmm::Error> {
    let stop = AtomicBool::new(false);
    let start = Barrier::new(2);
    std::thread::scope(|scope| {
        let grower = scope.spawn(|| -> Result<u64, cuvmm::Error> {
            start.wait();
            let (mut steps, mut stream) = (0, 2);
            let mut held = Vec::new();
            while grow && !stop.load(Ordering::Relaxed) {
                held.push(alloc.alloc_on(GROWTH_STEP, StreamId(stream))?);
                steps += 1;
                if held.len() as u64 * GROWTH_STEP >= GROWTH_HELD {
                    held.clear();
                    stream += 1;
                }
            }
            Ok(steps)
        });
        let stream = StreamId(1);
        start.wait();
        let settling = Instant::now();
        while settling.elapsed() < SETTLE {
            drop(alloc.alloc_on(size, stream)?);
        }
        let (mut service, mut from_arrival) = (Vec::new(), Vec::new());
        paced(run, |arrival| {
            let called = Instant::now();
            let buffer = alloc.alloc_on(size, stream)?;
            let done = Instant::now();
            service.push((done - called).as_nanos() as u64);
            from_arrival.push((done - arrival).as_nanos() as u64);
            drop(buffer);
            Ok::<(), cuvmm::Error>(())
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
        "cached alloc+free pairs of {} bytes through the facade, each thread on its own stream \
         (simulated {} GiB device; medians of {} x {} ms)\n\n",
        report.size_bytes,
        CAPACITY / GIB,
        report.repetitions,
        report.millis
    );
    out += &format!("{:>8} {:>16} {:>8}\n", "threads", "pairs/s", "speedup");
    for t in &report.threads {
        out += &format!(
            "{:>8} {:>16.0} {:>7.2}x\n",
            t.threads, t.pairs_per_second, t.speedup
        );
    }
    out += &format!(
        "\ncached allocation p99 from arrival (a request every {} us): {} ns idle, {} ns while another stream \
         grows (this machine's floor, requests that do nothing: {} ns); the call alone: {} ns idle, {} ns while \
         another stream grows\n({} growth steps of 20 MiB per run; driver calls sleep their modelled latency, \
         an estimate)\n",
        ARRIVAL.as_micros(),
        report.cached_alloc_p99_ns_idle,
        report.cached_alloc_p99_ns_during_growth,
        report.arrival_p99_ns_floor,
        report.cached_alloc_call_p99_ns_idle,
        report.cached_alloc_call_p99_ns_during_growth,
        report.growth_steps
    );
    out
}
