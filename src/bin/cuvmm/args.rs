//! Command-line arguments.

use clap::{Args, Parser, Subcommand, ValueEnum};
use cuvmm::driver::device::DeviceSpec;
use cuvmm::trace::workload;

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
}

/// The subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Replay workloads through every allocator and print a table or JSON (the default).
    Compare(CompareArgs),
    /// List the built-in workloads.
    Workloads,
    /// Measure what each virtual-memory driver call costs, per physical page size.
    DriverBench(DriverBenchArgs),
    /// Replay a PyTorch memory snapshot through the matching model of PyTorch's allocator and compare
    /// its segment events and peak reserved memory with what PyTorch did.
    Fidelity(FidelityArgs),
    /// Measure replay speed: each trace replayed N times through each allocator on the simulated device,
    /// median events per second and wall time, and the ratio to classic.
    Bench(crate::bench::BenchArgs),
}

/// Which device to run on; shared by every subcommand that uses one, so `--device` parses the same way
/// everywhere.
#[derive(Debug, Args)]
pub struct DeviceArgs {
    /// The device: sim (simulated, the default), cuda (CUDA device 0) or cuda:N.
    #[arg(long, value_name = "DEVICE", default_value = "sim", value_parser = parse_device)]
    pub device: DeviceSpec,
}

/// Options of `driver-bench`.
#[derive(Debug, Args)]
pub struct DriverBenchArgs {
    /// Where to measure.
    #[command(flatten)]
    pub device: DeviceArgs,
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
    /// A built-in workload to replay (repeat for several; default: all).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// Where to replay.
    #[command(flatten)]
    pub device: DeviceArgs,
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
}

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// An aligned table for people.
    Table,
    /// JSON: `{"results": [...]}`.
    Json,
}

/// A built-in workload's name, or why not.
pub(crate) fn parse_workload(name: &str) -> Result<String, String> {
    if workload::BUILTIN.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown workload `{name}` (built-in: {})",
            workload::BUILTIN.join(", ")
        ))
    }
}

/// A `--device` value this build can run on: `cuda` is refused here, with the reason, when the `cuda`
/// feature is off.
fn parse_device(text: &str) -> Result<DeviceSpec, String> {
    let spec: DeviceSpec = text
        .parse()
        .map_err(|e: cuvmm::driver::device::DeviceError| e.to_string())?;
    spec.check_supported().map_err(|e| e.to_string())?;
    Ok(spec)
}

fn parse_nonzero_size(text: &str) -> Result<u64, String> {
    match cuvmm::size::parse_size(text) {
        Ok(0) => Err("the size must not be 0".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(e.to_string()),
    }
}
