//! What each subcommand does. Results go to stdout, diagnostics to stderr.

use crate::args::{CompareArgs, DriverBenchArgs, FidelityArgs, Format};
use crate::plot::PlotFile;
use crate::progress::CompareProgress;
use cuvmm::driver::DriverError;
use cuvmm::driver::device::DeviceError;
use cuvmm::driver::sim::SimConfig;
use cuvmm::lab::experiments::compare::{CompareOptions, compare_observed};
use cuvmm::lab::experiments::driver_bench::{self, BenchOptions};
use cuvmm::lab::experiments::fidelity::fidelity;
use cuvmm::lab::replay::ReplayOptions;
use cuvmm::lab::reports::sample::Sampler;
use cuvmm::lab::reports::table;
use cuvmm::lab::workload;
use cuvmm::size::format_size;
use std::io::Write;
use std::process::ExitCode;

/// Exit status for a request that cannot be served as asked (bad name, bad size).
pub const USAGE: u8 = 2;

/// `cuvmm compare`.
pub fn run_compare(args: CompareArgs) -> ExitCode {
    let mut options = CompareOptions {
        backend: args.backend.backend,
        latency: args.backend.latency_model,
        traces: args.traces,
        trace_device: args.device,
        replay: ReplayOptions {
            touch: args.touch,
            ..ReplayOptions::default()
        },
        capacity: args.capacity,
        page_size: args.page_size,
        seed: args.seed,
        alloc_conf: args
            .alloc_conf
            .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
            .unwrap_or_default(),
        ..CompareOptions::default()
    };
    if !args.allocators.is_empty() {
        options.allocators = args.allocators;
    }
    // Without --workload: every workload, unless trace files are given.
    if !args.workloads.is_empty() || !options.traces.is_empty() {
        options.workloads = args.workloads;
    }
    let plot = match args.plot.as_deref().map(PlotFile::create).transpose() {
        Ok(plot) => plot,
        Err(status) => return status,
    };
    // One trace per file, unless a snapshot holds several devices' (the bar then grows).
    let replays = (options.workloads.len() + options.traces.len()) * options.allocators.len();
    let mut progress = CompareProgress::new(replays, args.quiet);
    let mut sampler = plot.as_ref().map(|_| Sampler::default());
    let compared = match &mut sampler {
        Some(sampler) => compare_observed(&options, &mut (sampler, &mut progress)),
        None => compare_observed(&options, &mut progress),
    };
    progress.finish();
    let results = match compared {
        Ok(results) => results,
        Err(e) => {
            eprintln!("cuvmm: {}", one_line(&e.to_string()));
            return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
        }
    };
    if let Some(result) = results.iter().find(|r| r.first_oom.is_some()) {
        crate::source::report_oom(result);
    }
    if let (Some(plot), Some(sampler)) = (plot, sampler) {
        if let Err(status) = plot.write(sampler.series()) {
            return status;
        }
    }
    match args.format {
        Format::Table => emit(&table::render_table(&results)),
        Format::Json => match table::render_json(&results) {
            Ok(json) => emit(&format!("{json}\n")),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                ExitCode::FAILURE
            }
        },
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

/// `message` on one line: a message quoting a user's file could hold a line break.
pub fn one_line(message: &str) -> String {
    message.replace(['\n', '\r'], " ")
}

/// Writes results to stdout. A reader that went away (`cuvmm | head`) ends the program quietly, as it
/// would any Unix filter; another write error is reported on stderr.
pub fn emit(text: &str) -> ExitCode {
    let mut stdout = std::io::stdout().lock();
    match stdout
        .write_all(text.as_bytes())
        .and_then(|()| stdout.flush())
    {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("cuvmm: cannot write results: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The exit status for a device that cannot be opened: 2 when this build or this machine has no CUDA
/// (the request cannot be served as asked), 1 when the driver is there but failed.
fn device_error_status(e: &DeviceError) -> u8 {
    match e {
        DeviceError::Driver(DriverError::NoDriver { .. }) | DeviceError::NoCudaSupport => USAGE,
        DeviceError::Driver(_) => 1,
    }
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
