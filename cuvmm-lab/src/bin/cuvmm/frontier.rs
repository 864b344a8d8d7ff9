//! `cuvmm frontier`: each allocator at a handful of device capacities, from the trace's lower bound to
//! 80 GiB: out-of-memory, peak reserved, driver calls, synchronizations, estimated driver time.

use crate::capacity::SearchArgs;
use crate::options::Format;
use crate::output::{USAGE, emit};
use clap::Args;

use cuvmm_lab::experiments::frontier::{self, FrontierPoint};
use cuvmm_lab::reports::table::LATENCY_NOTE;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Options of `frontier`.
#[derive(Debug, Args)]
pub struct FrontierArgs {
    /// The traces, allocators and device.
    #[command(flatten)]
    pub search: SearchArgs,
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
    let format = args.search.format;
    let (options, traces, allocators) = match args.search.resolve() {
        Ok(resolved) => resolved,
        Err(code) => return code,
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
    match format {
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
