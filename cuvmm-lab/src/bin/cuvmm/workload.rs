//! `cuvmm workload NAME -o FILE`: a built-in workload written out as a trace file in cuvmm's format; with
//! `--trace FILE` instead of a name, a trace file of another format (a PyTorch snapshot, ...) converted to it.

use crate::options::parse_workload;
use crate::output::{USAGE, emit, one_line};
use crate::source::load_one;
use clap::Args;
use cuvmm_lab::trace::text;
use cuvmm_lab::workload;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `workload`.
#[derive(Debug, Args)]
pub struct WorkloadArgs {
    /// The built-in workload (`cuvmm workloads` lists them).
    #[arg(
        value_name = "NAME",
        value_parser = parse_workload,
        required_unless_present = "trace",
        conflicts_with = "trace"
    )]
    pub name: Option<String>,
    /// A trace file to convert instead (a PyTorch memory snapshot, an RMM log, a Kineto trace): memory live
    /// before recording began comes first, as allocations, as in every replay of it.
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The device of a trace file with several (default: the first device with events); only with --trace.
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// The file to write; `-` writes to stdout.
    #[arg(short = 'o', long = "output", value_name = "FILE")]
    pub output: PathBuf,
    /// Seed of the workload generator.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
}

/// `cuvmm workload`.
pub fn run(args: WorkloadArgs) -> ExitCode {
    let trace = match (&args.trace, &args.name) {
        (Some(path), _) => match load_one(path, args.device, "converting") {
            Ok(trace) => trace,
            Err(failure) => {
                eprintln!("cuvmm: {}", failure.message);
                return ExitCode::from(failure.status);
            }
        },
        // (clap's `requires` lets a conflicting NAME excuse the missing --trace: checked here.)
        (None, _) if args.device.is_some() => {
            eprintln!("cuvmm: workload: --device applies to a trace file (--trace FILE)");
            return ExitCode::from(USAGE);
        }
        (None, name) => {
            let name = name.as_deref().unwrap_or_default();
            let Some(trace) = workload::generate(name, args.seed) else {
                eprintln!("cuvmm: unknown workload `{name}`");
                return ExitCode::from(USAGE);
            };
            trace
        }
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

/// `cuvmm workloads`.
pub fn run_workloads() -> ExitCode {
    let width = workload::BUILTIN.iter().map(|w| w.len()).max().unwrap_or(0);
    let mut out = String::new();
    for name in workload::BUILTIN {
        let description = workload::description(name).unwrap_or_default();
        out.push_str(&format!("{name:<width$}  {description}\n"));
    }
    emit(&out)
}
