//! The command line's shape: the subcommands and what each takes (each subcommand's options are in its own
//! file, beside what it does).

use crate::bench::BenchArgs;
use crate::bench_threads::BenchThreadsArgs;
use crate::capacity::CapacityArgs;
use crate::compare::CompareArgs;
use crate::driver_bench::DriverBenchArgs;
use crate::fidelity::FidelityArgs;
use crate::frontier::FrontierArgs;
use crate::snapshot::SnapshotArgs;
use crate::summary::SummaryArgs;
use crate::workload::WorkloadArgs;
use clap::{ArgAction, Parser, Subcommand};

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
    Workload(WorkloadArgs),
    /// Measure what each virtual-memory driver call costs, per physical page size.
    DriverBench(DriverBenchArgs),
    /// Replay a PyTorch memory snapshot through the matching model of PyTorch's allocator and compare
    /// its segment events and peak reserved memory with what PyTorch did.
    Fidelity(FidelityArgs),
    /// Replay a trace or workload and print memory_summary() (PyTorch's table) at the peak and at the end.
    Summary(SummaryArgs),
    /// Replay a trace or workload with history recording and write a snapshot pickle for PyTorch's memory
    /// viewer (https://pytorch.org/memory_viz).
    Snapshot(SnapshotArgs),
    /// Find the smallest device on which each allocator replays each trace with no out-of-memory, to one
    /// page, by bisection: simulated devices of each size, or with `--backend cuda` a GPU limited by a
    /// ballast allocation.
    Capacity(CapacityArgs),
    /// Replay each trace through each allocator at a handful of device capacities, from the trace's lower
    /// bound to 80 GiB (with `--backend cuda`, a GPU limited by a ballast, up to what it has free):
    /// out-of-memory, peak reserved, driver calls, synchronizations, est. driver time.
    Frontier(FrontierArgs),
    /// Measure replay speed: each trace replayed N times through each allocator on the simulated device,
    /// median events per second and wall time, and the ratio to classic.
    Bench(BenchArgs),
    /// Measure how the allocator scales with threads through each entry point (DeviceBuffer, alloc_raw /
    /// free_raw): cached alloc+free pairs per second with 1, 2, 4 and 8 threads each on its own stream and 8
    /// on 2 streams, and the 99th-percentile latency of a cached allocation while another stream grows (on
    /// the simulator, a device that sleeps each driver call's modelled latency). With `--backend cuda`,
    /// real CUDA streams, and cudarc's default, cuMemAllocAsync and cuMemAlloc for comparison.
    BenchThreads(BenchThreadsArgs),
}
