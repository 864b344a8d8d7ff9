//! `cuvmm frontier`: each allocator at a handful of device capacities, from the trace's lower bound to
//! 80 GiB: out-of-memory, peak reserved, driver calls, synchronizations, estimated driver time.

use crate::args::{Format, parse_allocator, parse_nonzero_size, parse_workload};
use crate::capacity::traces;
use crate::commands::{USAGE, emit};
use clap::Args;
use cuvmm::trace::allocators::ALLOCATORS;
use cuvmm::trace::capacity::{self, CapacityOptions};
use cuvmm::trace::frontier::{self, FrontierPoint};
use cuvmm::trace::report::LATENCY_NOTE;
use cuvmm::trace::workload;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `frontier`.
#[derive(Debug, Args)]
pub struct FrontierArgs {
    /// Trace files (PyTorch memory snapshots, ...); several may follow one flag.
    #[arg(long = "trace", value_name = "FILE", num_args = 1.., conflicts_with = "workloads")]
    pub traces: Vec<PathBuf>,
    /// A built-in workload (repeat for several; default, without --trace: all).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// An allocator (repeat for several; default: all).
    #[arg(long = "allocator", value_name = "NAME", value_parser = parse_allocator)]
    pub allocators: Vec<String>,
    /// Page size, e.g. 2MiB: the simulated device's granularity.
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = parse_nonzero_size)]
    pub page_size: u64,
    /// The device of a multi-device snapshot to replay (default: each device that has events).
    #[arg(long, value_name = "N", requires = "traces")]
    pub device: Option<usize>,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
    /// Allocator configuration in PyTorch's `key:value,...` syntax; default: the `CUVMM_ALLOC_CONF`
    /// environment variable, else the defaults.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
    /// Also draw the estimated driver time against the capacity into this SVG file.
    #[arg(long, value_name = "FILE.svg")]
    pub plot: Option<PathBuf>,
}

#[derive(Serialize)]
struct Report<'a> {
    results: &'a [FrontierPoint],
    latency_model: &'static str,
}

/// `cuvmm frontier`.
pub fn run_frontier(args: FrontierArgs) -> ExitCode {
    let options = CapacityOptions {
        page_size: args.page_size,
        alloc_conf: args
            .alloc_conf
            .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
            .unwrap_or_default(),
        ..CapacityOptions::default()
    };
    if let Err(e) = capacity::config(&options) {
        eprintln!("cuvmm: --alloc-conf: {e}");
        return ExitCode::from(USAGE);
    }
    let mut plot = match &args.plot {
        Some(path) => match std::fs::File::create(path) {
            Ok(file) => Some(file),
            Err(e) => {
                eprintln!("cuvmm: --plot {}: cannot create: {e}", path.display());
                return ExitCode::from(USAGE);
            }
        },
        None => None,
    };
    let traces = match traces(&args.traces, &args.workloads, args.device, args.seed) {
        Ok(traces) => traces,
        Err(line) => {
            eprintln!("cuvmm: {line}");
            return ExitCode::from(USAGE);
        }
    };
    let allocators: Vec<String> = if args.allocators.is_empty() {
        ALLOCATORS.iter().map(|a| a.to_string()).collect()
    } else {
        args.allocators
    };
    let mut points = Vec::new();
    for trace in &traces {
        match frontier::frontier(trace, &allocators, &options) {
            Ok(found) => points.extend(found),
            Err(e) => {
                let message = e.to_string();
                eprintln!("cuvmm: {}", message.lines().next().unwrap_or_default());
                return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
            }
        }
    }
    if let (Some(file), Some(path)) = (&mut plot, &args.plot) {
        let svg = frontier::render_svg(&points);
        if let Err(e) = file.write_all(svg.as_bytes()).and_then(|()| file.flush()) {
            eprintln!("cuvmm: --plot {}: cannot write: {e}", path.display());
            return ExitCode::FAILURE;
        }
    }
    match args.format {
        Format::Table => emit(&format!(
            "{}(* = the allocator's min capacity; est. = {LATENCY_NOTE})\n",
            frontier::render_table(&points)
        )),
        Format::Json => {
            let report = Report {
                results: &points,
                latency_model: cuvmm::driver::sim::LATENCY_SOURCES,
            };
            match serde_json::to_string_pretty(&report) {
                Ok(json) => emit(&format!("{json}\n")),
                Err(e) => {
                    eprintln!("cuvmm: cannot write JSON: {e}");
                    ExitCode::FAILURE
                }
            }
        }
    }
}
