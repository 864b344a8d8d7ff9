//! The `cuvmm` command-line tool: replays workloads through allocators and compares them.
//! With no arguments it runs `compare` on every built-in workload.

// The crate root's submodules live in `cuvmm/`, next to it, rather than beside it in `src/bin/`, where
// Cargo would take each file for a binary of its own.
#[path = "cuvmm/args.rs"]
mod args;
#[path = "cuvmm/bench.rs"]
mod bench;
#[path = "cuvmm/commands.rs"]
mod commands;

use args::{Cli, Command};
use clap::Parser;
use clap::error::ErrorKind;
use std::process::ExitCode;

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
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
    match cli.command {
        None => commands::run_compare(cli.compare),
        Some(Command::Compare(args)) => commands::run_compare(args),
        Some(Command::Workloads) => commands::run_workloads(),
        Some(Command::DriverBench(args)) => commands::run_driver_bench(args),
        Some(Command::Fidelity(args)) => commands::run_fidelity(args),
        Some(Command::Bench(args)) => bench::run_bench(args),
    }
}
