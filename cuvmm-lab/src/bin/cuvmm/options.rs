//! Options and value parsers that several subcommands share, parsed the same way everywhere.

use crate::backend::{parse_backend, parse_device};
use clap::{Args, ValueEnum};
use cuvmm::driver::device::DeviceSpec;
use cuvmm::driver::sim::{LATENCY_MODELS, LatencyModel};
use cuvmm_lab::replay::allocators;
use cuvmm_lab::workload;

/// Which device to run on; shared by every subcommand that uses one, so `--backend` parses the same way
/// everywhere.
#[derive(Debug, Args)]
pub struct BackendArgs {
    /// The device to run on: sim (simulated, the default), cuda (CUDA device 0) or cuda:N.
    #[arg(long, value_name = "BACKEND", default_value = "sim", value_parser = parse_backend)]
    pub backend: DeviceSpec,
    /// The simulated device's latency model, which its driver times are estimated from: a100 (published
    /// figures, the default), h100 or h200 (measured). A CUDA device's times are measured instead.
    #[arg(long, value_name = "MODEL", default_value = "a100", value_parser = parse_latency_model)]
    pub latency_model: LatencyModel,
}

/// How results are printed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// An aligned table for people.
    Table,
    /// JSON: `{"results": [...]}`.
    Json,
}

/// A built-in workload's name, or the list of them.
pub fn parse_workload(name: &str) -> Result<String, String> {
    if workload::BUILTIN.contains(&name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown workload `{name}` (built-in: {})",
            workload::BUILTIN.join(", ")
        ))
    }
}

/// An allocator name the tools know ([`allocators::is_known`]: the default ones, and CUDA-only ones).
pub fn parse_allocator(name: &str) -> Result<String, String> {
    if allocators::is_known(name) {
        Ok(name.to_string())
    } else {
        Err(format!(
            "unknown allocator `{name}` (known: {}, {})",
            allocators::ALLOCATORS.join(", "),
            allocators::CUDA_ONLY.join(", ")
        ))
    }
}

/// A `--latency-model` value: one of the simulator's latency models.
fn parse_latency_model(text: &str) -> Result<LatencyModel, String> {
    LatencyModel::named(text).ok_or_else(|| {
        format!(
            "unknown latency model `{text}` (known: {})",
            LATENCY_MODELS.join(", ")
        )
    })
}

/// A `--device` value: a trace device's index. `sim` or `cuda` get a pointer to `--backend`, which took
/// over `--device`'s old meaning.
pub fn parse_trace_device(text: &str) -> Result<usize, String> {
    if text.bytes().all(|b| b.is_ascii_digit()) {
        if let Ok(n) = text.parse() {
            return Ok(n);
        }
    }
    if parse_device(text).is_ok() {
        return Err(format!(
            "--device is a trace's device index; to run on {text}, use --backend {text}"
        ));
    }
    Err("expected a device index (0, 1, ...)".to_string())
}

/// A size such as `2MiB`, not 0.
pub fn parse_nonzero_size(text: &str) -> Result<u64, String> {
    match cuvmm::size::parse_size(text) {
        Ok(0) => Err("the size must not be 0".to_string()),
        Ok(bytes) => Ok(bytes),
        Err(e) => Err(e.to_string()),
    }
}
