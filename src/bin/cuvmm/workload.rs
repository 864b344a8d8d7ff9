//! `cuvmm workload NAME -o FILE`: a built-in workload written out as a trace file in cuvmm's format.

use crate::args::parse_workload;
use crate::commands::{USAGE, one_line};
use clap::Args;
use cuvmm::trace::{text, workload};
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `workload`.
#[derive(Debug, Args)]
pub struct WorkloadArgs {
    /// The built-in workload (`cuvmm workloads` lists them).
    #[arg(value_name = "NAME", value_parser = parse_workload)]
    pub name: String,
    /// The file to write; `-` writes to stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Seed of the workload generator.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
}

/// `cuvmm workload`.
pub fn run(args: WorkloadArgs) -> ExitCode {
    let Some(trace) = workload::generate(&args.name, args.seed) else {
        eprintln!("cuvmm: unknown workload `{}`", args.name);
        return ExitCode::from(USAGE);
    };
    if args.output.as_os_str() == "-" {
        return match text::write(&trace, std::io::stdout().lock()) {
            Ok(()) => ExitCode::SUCCESS,
            // A reader that went away (`cuvmm workload moe -o - | head`) ends the program quietly.
            Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("cuvmm: cannot write the trace: {e}");
                ExitCode::FAILURE
            }
        };
    }
    let path = args.output.display();
    // A path that cannot be created is the user's to fix: status 2. Failing halfway is not: status 1.
    let file = match std::fs::File::create(&args.output) {
        Ok(file) => file,
        Err(e) => {
            eprintln!("cuvmm: {path}: cannot create: {}", one_line(&e.to_string()));
            return ExitCode::from(USAGE);
        }
    };
    match text::write(&trace, file) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuvmm: {path}: cannot write: {e}");
            ExitCode::FAILURE
        }
    }
}
