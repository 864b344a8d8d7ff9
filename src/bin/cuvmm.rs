//! The `cuvmm` command-line tool: replays workloads through allocators and compares them.
//! With no arguments it runs `compare` on every built-in workload.

// The crate root's submodules live in `cuvmm/`, next to it, rather than beside it in `src/bin/`, where
// Cargo would take each file for a binary of its own.
#[path = "cuvmm/args.rs"]
mod args;
#[path = "cuvmm/capacity.rs"]
mod capacity;
#[path = "cuvmm/commands.rs"]
mod commands;
#[path = "cuvmm/logging.rs"]
mod logging;
#[path = "cuvmm/plot.rs"]
mod plot;
#[path = "cuvmm/progress.rs"]
mod progress;
#[path = "cuvmm/snapshot.rs"]
mod snapshot;
#[path = "cuvmm/source.rs"]
mod source;
#[path = "cuvmm/summary.rs"]
mod summary;

use args::{Cli, Command};
use clap::Parser;
use clap::error::ErrorKind;
use std::process::ExitCode;

fn main() -> ExitCode {
    let (leading_verbose, args) = logging::leading_verbosity(std::env::args_os().collect());
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        // A bad value (unknown workload, bad size): one line naming it.
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::ValueValidation | ErrorKind::InvalidValue
            ) =>
        {
            let message = e.to_string();
            let first = message.lines().next().unwrap_or_default();
            eprintln!("cuvmm: {}", first.trim_start_matches("error: "));
            return ExitCode::from(commands::USAGE);
        }
        // Help, version, unknown flags: clap's own output and status (2 for errors).
        Err(e) => e.exit(),
    };
    logging::init(cli.verbose.saturating_add(leading_verbose));
    match cli.command {
        None => commands::run_compare(cli.compare),
        Some(Command::Compare(args)) => commands::run_compare(args),
        Some(Command::Workloads) => commands::run_workloads(),
        Some(Command::DriverBench(args)) => commands::run_driver_bench(args),
        Some(Command::Fidelity(args)) => commands::run_fidelity(args),
        Some(Command::Summary(args)) => summary::run_summary(args),
        Some(Command::Snapshot(args)) => snapshot::run_snapshot(args),
        Some(Command::Capacity(args)) => capacity::run_capacity(args),
    }
}
