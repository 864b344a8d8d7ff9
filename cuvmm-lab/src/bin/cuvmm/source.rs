//! What `summary` and `snapshot` replay: a trace file or a built-in workload, through one allocator on a
//! fresh simulated device.

use crate::options::{parse_nonzero_size, parse_workload};
use crate::output::USAGE;
use clap::Args;
use cuvmm::config::Config;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::strategy::Strategy;
use cuvmm_lab::replay::ReplayResult;
use cuvmm_lab::replay::allocators::{self, ALLOCATORS};
use cuvmm_lab::trace::Trace;
use cuvmm_lab::trace::load;
use cuvmm_lab::workload;
use std::path::{Path, PathBuf};

/// The trace to replay and the allocator to replay it through.
#[derive(Debug, Args)]
pub struct SourceArgs {
    /// A trace file to replay (a PyTorch memory snapshot, ...).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// A built-in workload to replay.
    #[arg(long, value_name = "NAME", value_parser = parse_workload)]
    pub workload: Option<String>,
    /// The allocator: cuvmm, classic or pytorch-expandable.
    #[arg(long, value_name = "A", default_value = "cuvmm", value_parser = parse_allocator)]
    pub allocator: String,
    /// The device of a trace file to replay (a PyTorch snapshot may hold several; default: each device
    /// with events, the first one used).
    #[arg(long, value_name = "N")]
    pub device: Option<usize>,
    /// Memory of the simulated device, e.g. 80GiB.
    #[arg(long, value_name = "SIZE", default_value = "80GiB", value_parser = parse_nonzero_size)]
    pub capacity: u64,
    /// Page size (the simulated device's granularity and the allocator's page size), e.g. 2MiB.
    #[arg(long, value_name = "SIZE", default_value = "2MiB", value_parser = parse_nonzero_size)]
    pub page_size: u64,
    /// Seed of the workload generators.
    #[arg(long, value_name = "N", default_value_t = workload::DEFAULT_SEED)]
    pub seed: u64,
    /// Allocator configuration in PyTorch's `key:value,...` syntax; default: `CUVMM_ALLOC_CONF`.
    #[arg(long, value_name = "CONF")]
    pub alloc_conf: Option<String>,
}

fn parse_allocator(name: &str) -> Result<String, String> {
    if ALLOCATORS.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown allocator `{name}` (known: {})",
            ALLOCATORS.join(", ")
        ))
    }
}

/// A request that cannot be served: the line to print and the exit status.
pub struct Failure {
    /// The message, without the `cuvmm: ` prefix.
    pub message: String,
    /// The exit status.
    pub status: u8,
}

impl Failure {
    fn usage(message: String) -> Self {
        Self {
            message,
            status: USAGE,
        }
    }
}

impl SourceArgs {
    /// The trace to replay. A file with several devices and no `--device` gives its first device, with a
    /// note on stderr.
    pub fn trace(&self, command: &str) -> Result<Trace, Failure> {
        match (&self.trace, &self.workload) {
            (Some(_), Some(_)) => Err(Failure::usage(format!(
                "{command}: give either --trace or --workload, not both"
            ))),
            (None, None) => Err(Failure::usage(format!(
                "{command}: give --trace FILE or --workload NAME"
            ))),
            (None, Some(name)) => workload::generate(name, self.seed)
                .ok_or_else(|| Failure::usage(format!("unknown workload `{name}`"))),
            (Some(path), None) => load_one(path, self.device, "replaying"),
        }
    }

    /// A fresh allocator on a fresh simulated device.
    pub fn strategy(&self) -> Result<Box<dyn Strategy>, Failure> {
        let conf = self
            .alloc_conf
            .clone()
            .or_else(|| std::env::var(cuvmm::config::ENV_VAR).ok())
            .unwrap_or_default();
        let mut config = Config::from_alloc_conf(&conf)
            .map_err(|e| Failure::usage(format!("bad allocator configuration: {e}")))?;
        config.page_size = config.page_size.or(Some(self.page_size));
        let device = SimDriver::new(
            SimConfig::default()
                .with_capacity(self.capacity)
                .with_granularity(self.page_size),
        );
        allocators::build_on(&self.allocator, device, config)
            .map_err(|e| Failure::usage(first_line(&e)))
    }
}

/// The one trace of the file at `path` that a command works on: that of `device`, else the first device with
/// events, with a note on stderr (saying what the command is `doing` with it) when several have some.
pub fn load_one(path: &Path, device: Option<usize>, doing: &str) -> Result<Trace, Failure> {
    let mut traces = load::load(path, device).map_err(|e| Failure::usage(first_line(&e)))?;
    if traces.len() > 1 {
        eprintln!(
            "cuvmm: {}: {} devices have events; {doing} `{}` (choose with --device N)",
            path.display(),
            traces.len(),
            traces[0].name
        );
    }
    if traces.is_empty() {
        return Err(Failure::usage(format!(
            "{}: no trace in the file",
            path.display()
        )));
    }
    Ok(traces.swap_remove(0))
}

/// The first line of an error's message.
pub fn first_line(e: &dyn std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}

/// Prints the first out-of-memory error of a replay on stderr, once, with how many allocations failed.
pub fn report_oom(result: &ReplayResult) {
    if let Some(oom) = &result.first_oom {
        eprintln!(
            "cuvmm: `{}` through {}: {} allocation(s) failed with out-of-memory; the first: {oom}",
            result.workload, result.allocator, result.ooms
        );
    }
}
