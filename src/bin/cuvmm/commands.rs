//! What each subcommand does. Results go to stdout, diagnostics to stderr.

use crate::args::{CompareArgs, Format};
use cuvmm::trace::compare::{CompareOptions, compare};
use cuvmm::trace::{report, workload};
use std::process::ExitCode;

/// Exit status for a request that cannot be served as asked (bad name, bad size).
pub const USAGE: u8 = 2;

/// `cuvmm compare`.
pub fn run_compare(args: CompareArgs) -> ExitCode {
    let mut options = CompareOptions {
        capacity: args.capacity,
        page_size: args.page_size,
        seed: args.seed,
        alloc_conf: args
            .alloc_conf
            .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
            .unwrap_or_default(),
        ..CompareOptions::default()
    };
    if !args.workloads.is_empty() {
        options.workloads = args.workloads;
    }
    let results = match compare(&options) {
        Ok(results) => results,
        Err(e) => {
            eprintln!("cuvmm: {e}");
            return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
        }
    };
    match args.format {
        Format::Table => print!("{}", report::render_table(&results)),
        Format::Json => match report::render_json(&results) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                return ExitCode::FAILURE;
            }
        },
    }
    ExitCode::SUCCESS
}

/// `cuvmm workloads`.
pub fn run_workloads() -> ExitCode {
    let width = workload::BUILTIN.iter().map(|w| w.len()).max().unwrap_or(0);
    for name in workload::BUILTIN {
        let description = workload::description(name).unwrap_or_default();
        println!("{name:<width$}  {description}");
    }
    ExitCode::SUCCESS
}
