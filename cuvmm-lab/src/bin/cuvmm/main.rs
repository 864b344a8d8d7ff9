//! The `cuvmm` command-line tool: replays workloads through allocators and compares them.
//! With no arguments it runs `compare` on every built-in workload.

mod args;
mod backend;
mod bench;
mod bench_threads;
mod capacity;
mod compare;
mod driver_bench;
mod fidelity;
mod frontier;
mod logging;
mod options;
mod output;
mod plot;
mod progress;
mod snapshot;
mod source;
mod summary;
mod workload;

use args::{Cli, Command};
use clap::Parser;
use clap::error::ErrorKind;
use std::process::ExitCode;

fn main() -> ExitCode {
    let (leading_verbose, args) = logging::leading_verbosity(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        // Help and version: clap's own output and status.
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::DisplayHelp
                    | ErrorKind::DisplayVersion
                    | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand
            ) =>
        {
            e.exit()
        }
        // A bad flag or value (unknown flag, unknown workload, bad size, missing argument): one line naming
        // it, status 2.
        Err(e) => {
            eprintln!("cuvmm: {}", first_paragraph(&e.to_string()));
            return ExitCode::from(output::USAGE);
        }
    };
    logging::init(cli.verbose.saturating_add(leading_verbose));
    match cli.command {
        None => compare::run_compare(cli.compare),
        Some(Command::Compare(args)) => compare::run_compare(args),
        Some(Command::Workloads) => workload::run_workloads(),
        Some(Command::Workload(args)) => workload::run(args),
        Some(Command::DriverBench(args)) => driver_bench::run_driver_bench(args),
        Some(Command::Fidelity(args)) => fidelity::run_fidelity(args),
        Some(Command::Summary(args)) => summary::run_summary(args),
        Some(Command::Snapshot(args)) => snapshot::run_snapshot(args),
        Some(Command::Capacity(args)) => capacity::run_capacity(args),
        Some(Command::Frontier(args)) => frontier::run_frontier(args),
        Some(Command::Bench(args)) => bench::run_bench(args),
        Some(Command::BenchThreads(args)) => bench_threads::run_bench_threads(args),
    }
}

/// The first paragraph of a clap error, on one line: clap puts the problem there and the flag it names
/// either on the same line or on the indented lines below (missing arguments), then a tip and the usage.
fn first_paragraph(message: &str) -> String {
    let lines: Vec<&str> = message
        .lines()
        .take_while(|line| !line.trim().is_empty())
        .map(str::trim)
        .collect();
    lines.join(" ").trim_start_matches("error: ").to_string()
}
