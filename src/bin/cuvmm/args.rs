//! Command-line arguments.

use clap::{Args, Parser, Subcommand, ValueEnum};
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
}

/// Options of `compare`.
#[derive(Debug, Args)]
pub struct CompareArgs {
    /// A built-in workload to replay (repeat for several; default: all).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// Device memory, e.g. 80GiB.
    #[arg(long, value_name = "SIZE", default_value = "80GiB", value_parser = parse_nonzero_size)]
    pub capacity: u64,
    /// Device page size (allocation granularity), e.g. 2MiB.
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

fn parse_workload(name: &str) -> Result<String, String> {
    if workload::BUILTIN.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown workload `{name}` (built-in: {})",
            workload::BUILTIN.join(", ")
        ))
    }
}

fn parse_nonzero_size(text: &str) -> Result<u64, String> {
    match cuvmm::size::parse_size(text) {
        Ok(0) => Err("the size must not be 0".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(e.to_string()),
    }
}
