//! `bench-threads --backend cuda`: the same pairs on a GPU, each thread's stream a real CUDA stream created
//! for the run (cudarc's, as a Rust service's would be), and the allocators a service would otherwise use:
//! cudarc's default (`CudaStream::alloc`, cuMemAllocAsync with cudarc's event tracking), cuMemAllocAsync /
//! cuMemFreeAsync on the device's default pool with its release threshold at the maximum, and cuMemAlloc /
//! cuMemFree.

use super::{
    BenchThreadsArgs, Entry, GROWER_STREAMS, Report, SCENARIOS, Series, latencies, pairs_per_second,
};
use cudarc::driver::{CudaContext, CudaStream};
use cuvmm::driver::cuda::{AsyncPool, CudaDriver, cudarc_alloc};
use cuvmm::expandable::Expandable;
use cuvmm::{Allocator, Config, Driver, StreamId};
use std::sync::Arc;
use std::time::Duration;

/// What one thread's pair goes through.
#[derive(Clone, Copy, Debug)]
enum Path {
    Cuvmm(Entry),
    Cudarc,
    AllocAsync,
    Alloc,
}

impl Path {
    const ALL: [Path; 5] = [
        Path::Cuvmm(Entry::Buffer),
        Path::Cuvmm(Entry::Raw),
        Path::Cudarc,
        Path::AllocAsync,
        Path::Alloc,
    ];

    fn name(self) -> &'static str {
        match self {
            Path::Cuvmm(entry) => entry.name(),
            Path::Cudarc => "cudarc",
            Path::AllocAsync => "cuMemAllocAsync",
            Path::Alloc => "cuMemAlloc",
        }
    }
}

fn text(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn new_streams(ctx: &Arc<CudaContext>, n: usize) -> Result<Vec<Arc<CudaStream>>, String> {
    (0..n)
        .map(|_| {
            ctx.new_stream()
                .map_err(|e| format!("cuStreamCreate: {e:?}"))
        })
        .collect()
}

fn allocator(config: &Config, ordinal: usize) -> Result<Allocator<Expandable<CudaDriver>>, String> {
    Allocator::expandable(CudaDriver::new(ordinal).map_err(text)?, config.clone()).map_err(text)
}

/// Pairs per second of `n` threads on `streams` new streams through `path`.
fn once(
    ctx: &Arc<CudaContext>,
    config: &Config,
    ordinal: usize,
    path: Path,
    (n, streams): (usize, usize),
    size: u64,
    run: Duration,
) -> Result<f64, String> {
    let cuda_streams = new_streams(ctx, streams)?;
    let ids: Vec<StreamId> = cuda_streams
        .iter()
        .map(|s| StreamId::from_cuda(s))
        .collect();
    let rate = match path {
        Path::Cuvmm(entry) => {
            let alloc = allocator(config, ordinal)?;
            pairs_per_second(n, run, |t| {
                let (alloc, stream) = (&alloc, ids[t % streams]);
                Ok(move || entry.pair(alloc, size, stream))
            })
        }
        Path::Cudarc => pairs_per_second(n, run, |t| {
            let stream = Arc::clone(&cuda_streams[t % streams]);
            let bytes = usize::try_from(size).map_err(text)?;
            Ok(move || cudarc_alloc(&stream, bytes).map(drop).map_err(text))
        }),
        Path::AllocAsync => pairs_per_second(n, run, |t| {
            let (mut pool, stream) = (AsyncPool::new(ordinal).map_err(text)?, ids[t % streams]);
            Ok(move || {
                let ptr = pool.alloc(size, stream).map_err(text)?;
                pool.free(ptr).map_err(text)
            })
        }),
        Path::Alloc => pairs_per_second(n, run, |_| {
            let mut driver = CudaDriver::new(ordinal).map_err(text)?;
            Ok(move || {
                let ptr = driver.malloc(size).map_err(text)?;
                driver.free(ptr).map_err(text)
            })
        }),
    };
    ctx.synchronize()
        .map_err(|e| format!("cuCtxSynchronize: {e:?}"))?;
    rate
}

/// `bench-threads --backend cuda` on device `ordinal`.
pub(super) fn measure(
    args: &BenchThreadsArgs,
    config: &Config,
    ordinal: usize,
) -> Result<Report, String> {
    // The driver's own checks first: a clear error without libcuda or a device, never a panic.
    drop(CudaDriver::new(ordinal).map_err(text)?);
    let ctx = CudaContext::new(ordinal).map_err(|e| format!("CUDA device {ordinal}: {e:?}"))?;
    let run = Duration::from_millis(args.millis);
    let mut threads = Vec::new();
    for &size in &args.size {
        for path in Path::ALL {
            let mut series = Series::new(path.name(), size);
            for scenario in SCENARIOS {
                series.push(scenario.0, scenario.1, args.repetitions, || {
                    once(&ctx, config, ordinal, path, scenario, size, run)
                })?;
            }
            threads.extend(series.results);
        }
    }
    let served = new_streams(&ctx, 1)?;
    let growers = new_streams(&ctx, GROWER_STREAMS)?;
    let grower_ids: Vec<StreamId> = growers.iter().map(|s| StreamId::from_cuda(s)).collect();
    let latency = latencies(
        args,
        || allocator(config, ordinal),
        StreamId::from_cuda(&served[0]),
        &grower_ids,
        args.size[0],
    )?;
    ctx.synchronize()
        .map_err(|e| format!("cuCtxSynchronize: {e:?}"))?;
    Ok(latency.report(
        format!("cuda:{ordinal}"),
        threads,
        args,
        "CUDA device: measured",
    ))
}
