//! `cuvmm fidelity`: a PyTorch snapshot replayed through the matching model of PyTorch's allocator, its
//! decisions compared with PyTorch's.

use crate::options::Format;
use crate::output::{USAGE, emit};
use clap::Args;
use cuvmm::size::format_size;
use cuvmm_lab::experiments::fidelity::fidelity;
use std::process::ExitCode;

/// Options of `fidelity`.
#[derive(Debug, Args)]
pub struct FidelityArgs {
    /// The snapshot (`torch.cuda.memory._dump_snapshot` pickle).
    #[arg(long, value_name = "FILE")]
    pub trace: std::path::PathBuf,
    /// The device to replay (default: the one with the most trace entries).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
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
            Ok(json) => emit(&format!("{json}\n")),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                ExitCode::FAILURE
            }
        },
        Format::Table => {
            let (t, m) = (&report.ground_truth, &report.model);
            let lines = [
                format!("trace                {}", report.trace),
                format!("device               {}", report.device),
                format!("mode                 {}", report.mode),
                format!("                     {:>16}  {:>16}", "PyTorch", "model"),
                format!(
                    "segment events       {:>16}  {:>16}",
                    t.segment_events, m.segment_events
                ),
                format!(
                    "peak reserved        {:>16}  {:>16}",
                    format_size(t.peak_reserved_bytes),
                    format_size(m.peak_reserved_bytes)
                ),
                format!(
                    "same address         {} of {} allocations placed where PyTorch placed them",
                    report.details.same_address, report.details.allocs
                ),
                format!("segment_event_match  {:.4}", report.segment_event_match),
                format!("peak_reserved_error  {:.4}", report.peak_reserved_error),
            ];
            emit(&(lines.join("\n") + "\n"))
        }
    }
}
