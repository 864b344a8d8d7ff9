//! `cuvmm compare`, the default subcommand: replays workloads and traces through every allocator.

use crate::options::{
    BackendArgs, Format, parse_allocator, parse_nonzero_size, parse_trace_device, parse_workload,
};
use crate::output::{USAGE, emit, one_line};
use crate::plot::PlotFile;
use crate::progress::CompareProgress;
use clap::Args;
use cuvmm_lab::experiments::compare::{CompareOptions, compare_observed};
use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::reports::sample::Sampler;
use cuvmm_lab::reports::table;
use cuvmm_lab::workload;
use std::process::ExitCode;

/// Options of `compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// A built-in workload to replay (repeat for several; default: all, unless --trace is given).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// A trace file to replay: a PyTorch memory snapshot, an RMM log, a cuvmm trace or a PyTorch profiler
    /// trace, plain or gzipped (repeat for several).
    #[arg(long = "trace", value_name = "FILE")]
    pub traces: Vec<std::path::PathBuf>,
    /// The device of a multi-device snapshot to replay (default: each device that has events).
    #[arg(long, value_name = "N", requires = "traces", value_parser = parse_trace_device)]
    pub device: Option<usize>,
    /// An allocator (repeat for several; default: cuvmm, classic, pytorch-expandable). `cuda-async`, CUDA's
    /// own pool (cuMemAllocAsync), runs only with `--backend cuda`.
    #[arg(long = "allocator", value_name = "NAME", value_parser = parse_allocator)]
    pub allocators: Vec<String>,
    /// Where to replay.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Write a byte pattern into each allocation (cuMemsetD8) and check a sample of it before it is freed;
    /// the driver time reported then includes these writes and reads.
    #[arg(long)]
    pub touch: bool,
    /// Memory of the simulated device, e.g. 80GiB (a CUDA device has what it has).
    #[arg(long, value_name = "SIZE", default_value = "80GiB", value_parser = parse_nonzero_size)]
    pub capacity: u64,
    /// Page size, e.g. 2MiB: the simulated device's granularity and the allocator's page size (on a CUDA
    /// device, a multiple of its granularity).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = parse_nonzero_size)]
    pub page_size: u64,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
    /// Allocator configuration in PyTorch's `key:value,...` syntax (e.g. `cross_stream_reuse:True`);
    /// default: the `CUVMM_ALLOC_CONF` environment variable, else the defaults.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Also draw allocated and reserved bytes over each trace, per allocator, into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<std::path::PathBuf>,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

/// `cuvmm compare`.
pub fn run_compare(args: CompareArgs) -> ExitCode {
    let mut options = CompareOptions {
        backend: args.backend.backend,
        latency: args.backend.latency_model,
        traces: args.traces,
        trace_device: args.device,
        replay: ReplayOptions {
            touch: args.touch,
            ..ReplayOptions::default()
        },
        capacity: args.capacity,
        page_size: args.page_size,
        seed: args.seed,
        alloc_conf: args
            .alloc_conf
            .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
            .unwrap_or_default(),
        ..CompareOptions::default()
    };
    if !args.allocators.is_empty() {
        options.allocators = args.allocators;
    }
    // Without --workload: every workload, unless trace files are given.
    if !args.workloads.is_empty() || !options.traces.is_empty() {
        options.workloads = args.workloads;
    }
    let plot = match args.plot.as_deref().map(PlotFile::create).transpose() {
        Ok(plot) => plot,
        Err(status) => return status,
    };
    // One trace per file, unless a snapshot holds several devices' (the bar then grows).
    let replays = (options.workloads.len() + options.traces.len()) * options.allocators.len();
    let mut progress = CompareProgress::new(replays, args.quiet);
    let mut sampler = plot.as_ref().map(|_| Sampler::default());
    let compared = match &mut sampler {
        Some(sampler) => compare_observed(&options, &mut (sampler, &mut progress)),
        None => compare_observed(&options, &mut progress),
    };
    progress.finish();
    let results = match compared {
        Ok(results) => results,
        Err(e) => {
            eprintln!("cuvmm: {}", one_line(&e.to_string()));
            return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
        }
    };
    if let Some(result) = results.iter().find(|r| r.first_oom.is_some()) {
        crate::source::report_oom(result);
    }
    if let (Some(plot), Some(sampler)) = (plot, sampler) {
        if let Err(status) = plot.write(sampler.series()) {
            return status;
        }
    }
    match args.format {
        Format::Table => emit(&table::render_table(&results)),
        Format::Json => match table::render_json(&results) {
            Ok(json) => emit(&format!("{json}\n")),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
