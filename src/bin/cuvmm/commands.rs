//! What each subcommand does. Results go to stdout, diagnostics to stderr.

use crate::args::{CompareArgs, FidelityArgs, Format};
use cuvmm::size::format_size;
use cuvmm::trace::compare::{CompareOptions, compare};
use cuvmm::trace::fidelity::fidelity;
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

/// `cuvmm fidelity`.
pub fn run_fidelity(args: FidelityArgs) -> ExitCode {
    let report = match fidelity(&args.trace, args.device) {
        Ok(report) => report,
        Err(e) => {
            // One line: the snapshot errors name the file; others get it prefixed.
            let message = e.to_string();
            let line = message.lines().next().unwrap_or_default();
            if e.is_bad_input() {
                eprintln!("cuvmm: {line}");
                return ExitCode::from(USAGE);
            }
            eprintln!("cuvmm: {}: {line}", args.trace.display());
            return ExitCode::FAILURE;
        }
    };
    match args.format {
        Format::Json => match serde_json::to_string_pretty(&report) {
            Ok(json) => println!("{json}"),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                return ExitCode::FAILURE;
            }
        },
        Format::Table => {
            let (t, m) = (&report.ground_truth, &report.model);
            println!("trace                {}", report.trace);
            println!("device               {}", report.device);
            println!("mode                 {}", report.mode);
            println!("                     {:>16}  {:>16}", "PyTorch", "model");
            println!(
                "segment events       {:>16}  {:>16}",
                t.segment_events, m.segment_events
            );
            println!(
                "peak reserved        {:>16}  {:>16}",
                format_size(t.peak_reserved_bytes),
                format_size(m.peak_reserved_bytes)
            );
            println!(
                "same address         {} of {} allocations placed where PyTorch placed them",
                report.details.same_address, report.details.allocs
            );
            println!("segment_event_match  {:.4}", report.segment_event_match);
            println!("peak_reserved_error  {:.4}", report.peak_reserved_error);
        }
    }
    ExitCode::SUCCESS
}
