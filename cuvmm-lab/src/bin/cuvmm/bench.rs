//! `cuvmm bench`: replay throughput of each allocator on the simulated device.

use crate::options::{Format, parse_workload};
use crate::output::{USAGE, emit};
use clap::Args;
use cuvmm_lab::experiments::bench::{BenchOptions, bench, render_table};
use cuvmm_lab::replay::allocators::ALLOCATORS;
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::load;
use cuvmm_lab::workload;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// A built-in workload to replay (repeat for several; default: all, unless --trace is given).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// A trace file to replay (PyTorch snapshot, ...; repeat for several). Each device with events is
    /// replayed as its own trace.
    #[arg(long = "trace", value_name = "FILE")]
    pub traces: Vec<PathBuf>,
    /// An allocator to measure (repeat for several; default: all).
    #[arg(long = "allocator", value_name = "NAME", value_parser = parse_allocator)]
    pub allocators: Vec<String>,
    /// Replays of each trace per allocator; medians are reported.
    #[arg(long, value_name = "N", default_value_t = 5, value_parser = clap::value_parser!(u64).range(1..=10_000))]
    pub repetitions: u64,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

fn parse_allocator(name: &str) -> Result<String, String> {
    if ALLOCATORS.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown allocator `{name}` (known: {})",
            ALLOCATORS.join(", ")
        ))
    }
}

/// `cuvmm bench`.
pub fn run_bench(args: BenchArgs) -> ExitCode {
    let mut names = args.workloads;
    if names.is_empty() && args.traces.is_empty() {
        names = workload::BUILTIN.iter().map(|w| w.to_string()).collect();
    }
    let mut traces: Vec<Trace> = Vec::new();
    for name in &names {
        match workload::generate(name, args.seed) {
            Some(trace) => traces.push(trace),
            None => {
                eprintln!("cuvmm: unknown workload `{name}`");
                return ExitCode::from(USAGE);
            }
        }
    }
    for path in &args.traces {
        match load::load(path, None) {
            Ok(loaded) => traces.extend(loaded),
            Err(e) => {
                let message = e.to_string();
                eprintln!("cuvmm: {}", message.lines().next().unwrap_or_default());
                return ExitCode::from(USAGE);
            }
        }
    }
    let mut options = BenchOptions {
        repetitions: usize::try_from(args.repetitions).unwrap_or(usize::MAX),
        ..BenchOptions::default()
    };
    if !args.allocators.is_empty() {
        options.allocators = args.allocators;
    }
    let results = match bench(&traces, &options) {
        Ok(results) => results,
        Err(e) => {
            eprintln!("cuvmm: {e}");
            return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
        }
    };
    match args.format {
        Format::Table => emit(&render_table(&results)),
        Format::Json => {
            match serde_json::to_string_pretty(&serde_json::json!({ "results": results })) {
                Ok(json) => emit(&format!("{json}\n")),
                Err(e) => {
                    eprintln!("cuvmm: cannot write JSON: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
