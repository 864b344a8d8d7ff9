//! Command-line arguments.

use crate::backend::{parse_backend, parse_device};
use crate::capacity::CapacityArgs;
use clap::{ArgAction, Args, Parser, Subcommand, ValueEnum};
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::{LATENCY_MODELS, LatencyModel};
use cuvmm::lab::replay::allocators;
use cuvmm::lab::workload;

/// Replays allocation workloads through CUDA allocators on a simulated device and compares them.
#[derive(Debug, Parser)]
#[command(name = "cuvmm", version, args_conflicts_with_subcommands = true)]
pub struct Cli {
    /// What to do; `compare` when left out.
    #[command(subcommand)]
    pub command: Option<Command>,
    /// Options of `compare`, accepted without the subcommand's name.
    #[command(flatten)]
    pub compare: CompareArgs,
    /// Log to stderr: -v info (segments reserved), -vv debug (map and unmap batches), -vvv trace.
    /// Without it, RUST_LOG (e.g. `RUST_LOG=cuvmm=debug`) chooses; by default only errors are logged.
    #[arg(short = 'v', long = "verbose", action = ArgAction::Count, global = true)]
    pub verbose: u8,
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay workloads through every allocator and print a table or JSON (the default).
    Compare(CompareArgs),
    /// List the built-in workloads.
    Workloads,
    /// Write a built-in workload, or a trace file of another format (`--trace FILE`), in cuvmm's trace format
    /// (docs/trace-format.md).
    Workload(crate::workload::WorkloadArgs),
    /// Measure what each virtual-memory driver call costs, per physical page size.
    DriverBench(DriverBenchArgs),
    /// Replay a PyTorch memory snapshot through the matching model of PyTorch's allocator and compare
    /// its segment events and peak reserved memory with what PyTorch did.
    Fidelity(FidelityArgs),
    /// Replay a trace or workload and print memory_summary() (PyTorch's table) at the peak and at the end.
    Summary(crate::summary::SummaryArgs),
    /// Replay a trace or workload with history recording and write a snapshot pickle for PyTorch's memory
    /// viewer (https://pytorch.org/memory_viz).
    Snapshot(crate::snapshot::SnapshotArgs),
    /// Find the smallest device on which each allocator replays each trace with no out-of-memory, to one
    /// page, by bisection: simulated devices of each size, or with `--backend cuda` a GPU limited by a
    /// ballast allocation.
    Capacity(CapacityArgs),
    /// Replay each trace through each allocator at a handful of device capacities, from the trace's lower
    /// bound to 80 GiB (with `--backend cuda`, a GPU limited by a ballast, up to what it has free):
    /// out-of-memory, peak reserved, driver calls, synchronizations, est. driver time.
    Frontier(crate::frontier::FrontierArgs),
    /// Measure replay speed: each trace replayed N times through each allocator on the simulated device,
    /// median events per second and wall time, and the ratio to classic.
    Bench(crate::bench::BenchArgs),
    /// Measure how the allocator scales with threads through each entry point (DeviceBuffer, alloc_raw /
    /// free_raw): cached alloc+free pairs per second with 1, 2, 4 and 8 threads each on its own stream and 8
    /// on 2 streams, and the 99th-percentile latency of a cached allocation while another stream grows (on
    /// the simulator, a device that sleeps each driver call's modelled latency). With `--backend cuda`,
    /// real CUDA streams, and cudarc's default, cuMemAllocAsync and cuMemAlloc for comparison.
    BenchThreads(crate::bench_threads::BenchThreadsArgs),
}

/// Which device to run on; shared by every subcommand that uses one, so `--backend` parses the same way
/// everywhere.
#[derive(Debug, Args)]
pub struct BackendArgs {
    /// The device to run on: sim (simulated, the default), cuda (CUDA device 0) or cuda:N.
    #[arg(long, value_name = "BACKEND", default_value = "sim", value_parser = parse_backend)]
    pub backend: DeviceSpec,
    /// The simulated device's latency model, which its driver times are estimated from: a100 (published
    /// figures, the default), h100 or h200 (measured). A CUDA device's times are measured instead.
    #[arg(long, value_name = "MODEL", default_value = "a100", value_parser = parse_latency_model)]
    pub latency_model: LatencyModel,
}

/// Options of `driver-bench`.
#[derive(Debug, Args)]
pub struct DriverBenchArgs {
    /// Where to measure.
    #[command(flatten)]
    pub backend: BackendArgs,
    /// Repetitions per page size (medians are reported).
    #[arg(long, value_name = "N", default_value_t = 20, value_parser = clap::value_parser!(u64).range(1..))]
    pub repetitions: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Options of `fidelity`.
#[derive(Debug, Args)]
pub struct FidelityArgs {
    /// The snapshot (`torch.cuda.memory._dump_snapshot` pickle).
    #[arg(long, value_name = "FILE")]
    pub trace: std::path::PathBuf,
    /// The device to replay (default: the one with the most trace entries).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

/// Options of `compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// A built-in workload to replay (repeat for several; default: all, unless --trace is given).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// A trace file to replay: a PyTorch memory snapshot, an RMM log or a cuvmm trace (repeat for several).
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

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// An aligned table for people.
    Table,
    /// JSON: `{"results": [...]}`.
    Json,
}

/// A built-in workload's name, or the list of them.
pub fn parse_workload(name: &str) -> Result<String, String> {
    if workload::BUILTIN.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown workload `{name}` (built-in: {})",
            workload::BUILTIN.join(", ")
        ))
    }
}

/// An allocator name the tools know ([`allocators::is_known`]: the default ones, and CUDA-only ones).
pub fn parse_allocator(name: &str) -> Result<String, String> {
    if allocators::is_known(name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown allocator `{name}` (known: {}, {})",
            allocators::ALLOCATORS.join(", "),
            allocators::CUDA_ONLY.join(", ")
        ))
    }
}

/// A `--latency-model` value: one of the simulator's latency models.
fn parse_latency_model(text: &str) -> Result<LatencyModel, String> {
    LatencyModel::named(text).ok_or_else(|| {
        format!(
            "unknown latency model `{text}` (known: {})",
            LATENCY_MODELS.join(", ")
        )
    })
}

/// A `--device` value: a trace device's index. `sim` or `cuda` get a pointer to `--backend`, which took
/// over `--device`'s old meaning.
fn parse_trace_device(text: &str) -> Result<usize, String> {
    if text.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = text.parse() {
            return Ok(n);
        }
    }
    if parse_device(text).is_ok() {
        return Err(format!(
            "--device is a trace's device index; to run on {text}, use --backend {text}"
        ));
    }
    Err("expected a device index (0, 1, ...)".to_string())
}

/// A size such as `2MiB`, not 0.
pub fn parse_nonzero_size(text: &str) -> Result<u64, String> {
    match cuvmm::size::parse_size(text) {
        Ok(0) => Err("the size must not be 0".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(e.to_string()),
    }
}
