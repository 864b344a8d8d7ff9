//! `cuvmm driver-bench`: what each virtual-memory driver call costs, per physical page size.

use crate::options::{BackendArgs, Format};
use crate::output::{device_error_status, emit};
use clap::Args;
use cuvmm::driver::sim::SimConfig;
use cuvmm_lab::experiments::driver_bench::{self, BenchOptions};
use std::process::ExitCode;

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

/// `cuvmm driver-bench`.
pub fn run_driver_bench(args: DriverBenchArgs) -> ExitCode {
    let mut device = match args
        .backend
        .backend
        .open_for_replay(SimConfig::default().with_latency(args.backend.latency_model.clone()))
    {
        Ok(device) => device,
        Err(e) => {
            eprintln!("cuvmm: {e}");
            return ExitCode::from(device_error_status(&e));
        }
    };
    let options = BenchOptions {
        repetitions: usize::try_from(args.repetitions).unwrap_or(usize::MAX),
        ..BenchOptions::default()
    };
    let bench = match driver_bench::run(&mut device, &options) {
        Ok(bench) => bench,
        Err(e) => {
            eprintln!("cuvmm: driver-bench: {e}");
            return ExitCode::FAILURE;
        }
    };
    match args.format {
        Format::Table => emit(&driver_bench::render_table(&bench)),
        Format::Json => match serde_json::to_string_pretty(&bench) {
            Ok(json) => emit(&format!("{json}\n")),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                ExitCode::FAILURE
            }
        },
    }
}
