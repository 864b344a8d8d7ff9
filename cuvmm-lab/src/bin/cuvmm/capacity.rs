//! `cuvmm capacity`: the smallest device on which each allocator replays each trace with no
//! out-of-memory: a simulated device of each size, or a CUDA device limited by a ballast.

use crate::backend::parse_backend;
use crate::options::{Format, parse_allocator, parse_nonzero_size, parse_workload};
use crate::output::{USAGE, emit};
use crate::progress::CapacityProgress;
use clap::Args;
use cuvmm::driver::device::DeviceSpec;
use cuvmm::size::format_size;
use cuvmm_lab::experiments::capacity::{self, CapacityOptions, CapacityResult};
use cuvmm_lab::replay::allocators::{ALLOCATORS, CUDA_ONLY, NEEDS_GPU};
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::load;
use cuvmm_lab::workload;
use serde::Serialize;
use std::path::PathBuf;
use std::process::ExitCode;

/// What `capacity` and `frontier` replay, and how: the traces, the allocators, the device, its page size
/// and the allocator configuration.
#[derive(Debug, Args)]
pub struct SearchArgs {
    /// Trace files (PyTorch memory snapshots, ...); several may follow one flag.
    #[arg(long = "trace", value_name = "FILE", num_args = 1.., conflicts_with = "workloads")]
    pub traces: Vec<PathBuf>,
    /// A built-in workload (repeat for several; default, without --trace: all).
    #[arg(long = "workload", value_name = "NAME", value_parser = parse_workload)]
    pub workloads: Vec<String>,
    /// An allocator (repeat for several; default: cuvmm, classic, pytorch-expandable). `cuda-async`, CUDA's
    /// own pool (cuMemAllocAsync), runs only with `--backend cuda`.
    #[arg(long = "allocator", value_name = "NAME", value_parser = parse_allocator)]
    pub allocators: Vec<String>,
    /// Where to replay: sim (a simulated device of each capacity, the default), cuda (CUDA device 0) or
    /// cuda:N. On CUDA a capacity C is made by a ballast, one cuMemAlloc of all the free memory but C,
    /// placed before each replay and freed after it; every allocator then sees C bytes free (up to 2 MiB
    /// more: the ballast is whole 2 MiB pages) and the device's real total. The search stops at what the
    /// device has free; a trace needing more is refused. A ballast cannot model memory other processes
    /// take or give back during a replay, nor the driver's own reservations, which come out of C.
    #[arg(long, value_name = "BACKEND", default_value = "sim", value_parser = parse_backend)]
    pub backend: DeviceSpec,
    /// Page size, e.g. 2MiB: the simulated device's granularity (and the step of the capacity search).
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = parse_nonzero_size)]
    pub page_size: u64,
    /// The device of a multi-device snapshot to replay (default: each device that has events).
    #[arg(long, value_name = "N", requires = "traces")]
    pub device: Option<usize>,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
    /// Allocator configuration in PyTorch's `key:value,...` syntax; default: the `CUVMM_ALLOC_CONF`
    /// environment variable, else the defaults.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
    /// Output format.
    #[arg(long, value_enum, default_value_t = Format::Table)]
    pub format: Format,
}

impl SearchArgs {
    /// The search options (page size, configuration), the traces and the allocators named; a bad
    /// configuration or an unreadable trace is one line on stderr and the usage status.
    pub fn resolve(self) -> Result<(CapacityOptions, Vec<Trace>, Vec<String>), ExitCode> {
        let options = CapacityOptions {
            page_size: self.page_size,
            alloc_conf: self
                .alloc_conf
                .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
                .unwrap_or_default(),
            backend: self.backend,
            ..CapacityOptions::default()
        };
        if let Err(e) = capacity::config(&options) {
            eprintln!("cuvmm: --alloc-conf: {e}");
            return Err(ExitCode::from(USAGE));
        }
        let traces =
            traces(&self.traces, &self.workloads, self.device, self.seed).map_err(|line| {
                eprintln!("cuvmm: {line}");
                ExitCode::from(USAGE)
            })?;
        // A GPU-only allocator cannot take part on the simulated device: its policy is the driver's.
        if let Some(name) = (self.allocators.iter()).find(|a| CUDA_ONLY.contains(&a.as_str())) {
            if self.backend == DeviceSpec::Sim {
                eprintln!(
                    "cuvmm: allocator `{name}` {NEEDS_GPU}; its policy is the driver's, not modelled"
                );
                return Err(ExitCode::from(USAGE));
            }
        }
        let allocators = if self.allocators.is_empty() {
            ALLOCATORS.iter().map(|a| a.to_string()).collect()
        } else {
            self.allocators
        };
        Ok((options, traces, allocators))
    }
}

/// Options of `capacity`.
#[derive(Debug, Args)]
pub struct CapacityArgs {
    /// The traces, allocators and device.
    #[command(flatten)]
    pub search: SearchArgs,
    /// No progress bar.
    #[arg(long, short)]
    pub quiet: bool,
}

/// `cuvmm capacity`.
pub fn run_capacity(args: CapacityArgs) -> ExitCode {
    let format = args.search.format;
    let (options, traces, allocators) = match args.search.resolve() {
        Ok(resolved) => resolved,
        Err(code) => return code,
    };
    let mut progress = CapacityProgress::new(
        traces.len() * allocators.len(),
        options.page_size,
        args.quiet,
    );
    let mut results = Vec::new();
    for trace in &traces {
        for allocator in &allocators {
            progress.next_search(&trace.name, allocator);
            match capacity::search(trace, allocator, &options, &mut progress) {
                Ok(result) => results.push(result),
                Err(e) => {
                    progress.finish();
                    let message = e.to_string();
                    eprintln!("cuvmm: {}", message.lines().next().unwrap_or_default());
                    return ExitCode::from(if e.is_usage_error() { USAGE } else { 1 });
                }
            }
        }
    }
    progress.finish();
    match format {
        Format::Table => emit(&render_table(&results)),
        Format::Json => match serde_json::to_string_pretty(&Report { results: &results }) {
            Ok(json) => emit(&format!("{json}\n")),
            Err(e) => {
                eprintln!("cuvmm: cannot write JSON: {e}");
                ExitCode::FAILURE
            }
        },
    }
}

/// The traces to search: the files' (one line naming the file if one cannot be read), else the workloads
/// named, else every built-in workload.
pub(crate) fn traces(
    files: &[PathBuf],
    workloads: &[String],
    device: Option<usize>,
    seed: u64,
) -> Result<Vec<Trace>, String> {
    if !files.is_empty() {
        let mut traces = Vec::new();
        for file in files {
            let loaded = load::load(file, device).map_err(|e| {
                let message = e.to_string();
                message.lines().next().unwrap_or_default().to_string()
            })?;
            if loaded.is_empty() {
                return Err(format!("{}: no device has events", file.display()));
            }
            traces.extend(loaded);
        }
        return Ok(traces);
    }
    let names: Vec<&str> = if workloads.is_empty() {
        workload::BUILTIN.to_vec()
    } else {
        workloads.iter().map(String::as_str).collect()
    };
    names
        .into_iter()
        .map(|name| {
            workload::generate(name, seed).ok_or_else(|| format!("unknown workload `{name}`"))
        })
        .collect()
}

#[derive(Serialize)]
struct Report<'a> {
    results: &'a [CapacityResult],
}

const HEADERS: [&str; 7] = [
    "trace",
    "allocator",
    "peak live",
    "min capacity",
    "x lower bound",
    "peak reserved",
    "replays",
];

/// An aligned table: names left, numbers right. A search that found nothing says how far it went.
fn render_table(results: &[CapacityResult]) -> String {
    let rows: Vec<[String; 7]> = results
        .iter()
        .map(|r| {
            let (capacity, ratio, reserved) = match r.min_capacity_bytes {
                Some(c) => (
                    format_size(c),
                    format!("{:.3}", r.capacity_ratio.unwrap_or(f64::NAN)),
                    r.peak_reserved_bytes.map(format_size).unwrap_or_default(),
                ),
                None => (
                    format!("> {}", format_size(r.searched_up_to_bytes)),
                    "-".into(),
                    "-".into(),
                ),
            };
            [
                r.trace.clone(),
                r.allocator.clone(),
                format_size(r.peak_live_bytes),
                capacity,
                ratio,
                reserved,
                r.replays.to_string(),
            ]
        })
        .collect();
    let mut text = cuvmm_lab::reports::table::aligned(HEADERS, &rows);
    text.push_str(&render_stranded(results));
    text
}

const STRANDED_HEADERS: [&str; 6] = [
    "trace",
    "allocator",
    "stranded",
    "setting",
    "min capacity",
    "x lower bound",
];

/// For the searches whose replay one page below the min capacity ran out of memory for want of pages
/// stranded in multi-page handles: a second table with the setting that gives them back and the min
/// capacity with it, and when that setting is safe. Empty when there are none.
fn render_stranded(results: &[CapacityResult]) -> String {
    let rows: Vec<[String; 6]> = (results.iter())
        .filter_map(|r| {
            let below = r.stranded_below.as_ref()?;
            let (capacity, ratio) = match (below.min_capacity_bytes, below.capacity_ratio) {
                (Some(c), Some(ratio)) => (format_size(c), format!("{ratio:.3}")),
                // Not searched (a CUDA device) or nothing fit.
                _ => ("-".into(), "-".into()),
            };
            Some([
                r.trace.clone(),
                r.allocator.clone(),
                format_size(below.stranded_bytes),
                below.setting.to_string(),
                capacity,
                ratio,
            ])
        })
        .collect();
    if rows.is_empty() {
        return String::new();
    }
    format!(
        "\nOne page below its min capacity, the replay ran out of memory with idle pages stranded in \
         handles that live\nblocks touched (a handle is unmapped only whole), and the setting below gives \
         them back (min capacity\nwith it searched on the simulator only; --alloc-conf SETTING searches it \
         anywhere):\n{}compaction:split moves live blocks' pages when memory runs out: for programs where no \
         other thread launches\nwork while an allocation is served; others call release_stranded() at a \
         quiet moment (README, \"Configuration\").\n",
        cuvmm_lab::reports::table::aligned(STRANDED_HEADERS, &rows)
    )
}
