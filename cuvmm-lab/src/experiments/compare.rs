//! Replaying workloads and trace files through allocators: what `cuvmm compare` does.

use crate::replay::allocators::{self, BuildError};
use crate::replay::observe::{NoObserver, ReplayObserver};
use crate::replay::{ReplayError, ReplayOptions, ReplayResult, replay_observed};
use crate::trace::event::Trace;
use crate::trace::load::{self, LoadError};
use crate::workload;
use cuvmm::driver::DriverError;
use cuvmm::driver::device::{DeviceError, DeviceSpec};
use cuvmm::driver::sim::{LatencyModel, SimConfig};
use cuvmm::size::{GIB, MIB};
use cuvmm::strategy::config::{Config, ConfigError};
use std::path::PathBuf;

/// What to compare and on which device.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CompareOptions {
    /// Built-in workloads to replay, in order.
    pub workloads: Vec<String>,
    /// Trace files to replay after the workloads, in order: PyTorch memory snapshots, RMM logs or cuvmm
    /// traces ([`load::load`]).
    pub traces: Vec<PathBuf>,
    /// The device of a multi-device snapshot to replay; `None` replays each device that has events.
    pub trace_device: Option<usize>,
    /// Allocators to replay them through, in order.
    pub allocators: Vec<String>,
    /// The device to replay on: the simulator (the default) or a CUDA device.
    pub backend: DeviceSpec,
    /// The simulated device's latency model (A100 by default; ignored on a CUDA device).
    pub latency: LatencyModel,
    /// Device memory in bytes (the simulated device's; a CUDA device has what it has).
    pub capacity: u64,
    /// Page size in bytes: the simulated device's allocation granularity, and the allocator's page size
    /// (on a CUDA device it must be a multiple of the device's granularity).
    pub page_size: u64,
    /// Seed of the workload generators.
    pub seed: u64,
    /// The allocators' configuration in `CUVMM_ALLOC_CONF` syntax (`key:value,...`); empty for the defaults.
    pub alloc_conf: String,
    /// How to replay.
    pub replay: ReplayOptions,
}

impl Default for CompareOptions {
    /// Every built-in workload (and no trace file) through every allocator on an 80 GiB device with 2 MiB
    /// pages.
    fn default() -> Self {
        Self {
            workloads: workload::BUILTIN.iter().map(|w| w.to_string()).collect(),
            traces: Vec::new(),
            trace_device: None,
            allocators: allocators::ALLOCATORS
                .iter()
                .map(|a| a.to_string())
                .collect(),
            backend: DeviceSpec::Sim,
            latency: LatencyModel::a100(),
            capacity: 80 * GIB,
            page_size: 2 * MIB,
            seed: workload::DEFAULT_SEED,
            alloc_conf: String::new(),
            replay: ReplayOptions::default(),
        }
    }
}

/// Why a comparison stopped.
#[derive(Debug, thiserror::Error)]
pub enum CompareError {
    /// No built-in workload has that name.
    #[error("unknown workload `{name}` (built-in: {})", workload::BUILTIN.join(", "))]
    UnknownWorkload {
        /// The name given.
        name: String,
    },
    /// A trace file cannot be read.
    #[error(transparent)]
    Trace(#[from] LoadError),
    /// The allocator configuration does not parse.
    #[error("bad allocator configuration: {0}")]
    Config(#[from] ConfigError),
    /// An allocator could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The device could not be opened (no CUDA support in this build, no CUDA driver, ...).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A replay failed.
    #[error("replaying `{workload}` through `{allocator}`: {source}")]
    Replay {
        /// The workload or trace.
        workload: String,
        /// The allocator.
        allocator: String,
        /// What went wrong.
        source: Box<ReplayError>,
    },
}

impl CompareError {
    /// Whether the caller asked for something that cannot be (an unknown name, a device the allocator
    /// rejects, a CUDA device on a build or a machine without CUDA), rather than a replay or a device
    /// going wrong.
    pub fn is_usage_error(&self) -> bool {
        match self {
            CompareError::Replay { .. } => false,
            CompareError::Device(DeviceError::Driver(e)) => {
                matches!(e, DriverError::NoDriver { .. })
            }
            _ => true,
        }
    }
}

/// Replays each workload, then each trace of each trace file, through each allocator, each replay on a
/// fresh device. Names are checked and trace files read before anything runs. Results come workload by
/// workload and trace by trace, allocators in the order given.
pub fn compare(options: &CompareOptions) -> Result<Vec<ReplayResult>, CompareError> {
    compare_observed(options, &mut NoObserver)
}

/// As [`compare`], with `observer` watching every replay (a [`Sampler`](crate::reports::sample::Sampler) for
/// `--plot`, a progress bar).
pub fn compare_observed<O: ReplayObserver + ?Sized>(
    options: &CompareOptions,
    observer: &mut O,
) -> Result<Vec<ReplayResult>, CompareError> {
    if let Some(name) = options
        .workloads
        .iter()
        .find(|w| !workload::BUILTIN.contains(&w.as_str()))
    {
        return Err(CompareError::UnknownWorkload { name: name.clone() });
    }
    if let Some(name) = options.allocators.iter().find(|a| !allocators::is_known(a)) {
        return Err(BuildError::Unknown { name: name.clone() }.into());
    }
    // A GPU-only allocator on the simulator is refused before anything runs.
    if let Some(name) =
        (options.allocators.iter()).find(|a| allocators::CUDA_ONLY.contains(&a.as_str()))
    {
        if options.backend == DeviceSpec::Sim {
            return Err(BuildError::NeedsGpu { name: name.clone() }.into());
        }
    }
    let sim = SimConfig::default()
        .with_latency(options.latency.clone())
        .with_capacity(options.capacity)
        .with_granularity(options.page_size)
        .with_backing_store(options.replay.touch);
    let mut config = Config::from_alloc_conf(&options.alloc_conf)?;
    config.page_size = config.page_size.or(Some(options.page_size));
    let mut files: Vec<Trace> = Vec::new();
    for path in &options.traces {
        files.extend(load::load(path, options.trace_device)?);
    }
    // Open the device once before any work, so a missing driver is reported at once.
    drop(options.backend.open_for_replay(sim.clone())?);
    let mut results = Vec::new();
    for name in &options.workloads {
        let trace = workload::generate(name, options.seed)
            .ok_or_else(|| CompareError::UnknownWorkload { name: name.clone() })?;
        replay_all(options, &sim, &config, &trace, &mut results, observer)?;
    }
    for trace in &files {
        replay_all(options, &sim, &config, trace, &mut results, observer)?;
    }
    Ok(results)
}

/// Replays `trace` through each allocator of `options`, appending the results.
fn replay_all<O: ReplayObserver + ?Sized>(
    options: &CompareOptions,
    sim: &SimConfig,
    config: &Config,
    trace: &Trace,
    results: &mut Vec<ReplayResult>,
    observer: &mut O,
) -> Result<(), CompareError> {
    for allocator in &options.allocators {
        let mut strategy = if allocators::CUDA_ONLY.contains(&allocator.as_str()) {
            allocators::build_cuda_only(allocator, &options.backend)?
        } else {
            let device = options.backend.open_for_replay(sim.clone())?;
            allocators::build_on(allocator, device, config.clone())?
        };
        let result = replay_observed(strategy.as_mut(), trace, &options.replay, observer).map_err(
            |source| CompareError::Replay {
                workload: trace.name.clone(),
                allocator: allocator.clone(),
                source: Box::new(source),
            },
        )?;
        results.push(result);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_names_are_rejected_before_any_replay() {
        let options = CompareOptions {
            workloads: vec!["moe".into(), "no-such".into()],
            ..CompareOptions::default()
        };
        let err = compare(&options).unwrap_err();
        assert!(matches!(&err, CompareError::UnknownWorkload { name } if name == "no-such"));
        assert!(err.is_usage_error());
        assert!(err.to_string().contains("no-such"));

        let options = CompareOptions {
            allocators: vec!["bogus".into()],
            ..CompareOptions::default()
        };
        let err = compare(&options).unwrap_err();
        assert!(matches!(
            err,
            CompareError::Build(BuildError::Unknown { .. })
        ));

        let options = CompareOptions {
            alloc_conf: "cross_stream_reuse:maybe".into(),
            ..CompareOptions::default()
        };
        let err = compare(&options).unwrap_err();
        assert!(matches!(err, CompareError::Config(_)), "{err}");
        assert!(err.is_usage_error());
        assert!(err.to_string().contains("cross_stream_reuse"), "{err}");
    }

    #[test]
    fn trace_files_replay_after_the_workloads_and_a_bad_one_is_a_usage_error() {
        let dir = std::env::temp_dir().join(format!("cuvmm-compare-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let csv = dir.join("log.csv");
        let log = "Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x1000,4096,0x0\n";
        std::fs::write(&csv, log).unwrap();
        let options = CompareOptions {
            workloads: Vec::new(),
            traces: vec![csv.clone()],
            allocators: vec!["cuvmm".into(), "classic".into()],
            ..CompareOptions::default()
        };
        let results = compare(&options).unwrap();
        let names: Vec<(&str, &str)> = results
            .iter()
            .map(|r| (r.workload.as_str(), r.allocator.as_str()))
            .collect();
        assert_eq!(names, [("log.csv", "cuvmm"), ("log.csv", "classic")]);
        assert!(results.iter().all(|r| r.peak_live_bytes == 4096));

        // A bad second file stops everything, even the built-in workload listed first.
        let bad = dir.join("bad.csv");
        std::fs::write(
            &bad,
            "Thread,Time,Action,Pointer,Size,Stream\n1,t,allocate,0x1,-1,0\n",
        )
        .unwrap();
        let options = CompareOptions {
            workloads: vec!["moe".into()],
            traces: vec![csv, bad],
            ..CompareOptions::default()
        };
        let err = compare(&options).unwrap_err();
        assert!(matches!(err, CompareError::Trace(_)), "{err}");
        assert!(err.is_usage_error());
        assert!(
            err.to_string().contains("bad.csv:2: negative size"),
            "{err}"
        );
    }

    #[test]
    fn a_missing_cuda_is_a_usage_error_and_a_failing_one_is_not() {
        let usage = |e: DeviceError| CompareError::Device(e).is_usage_error();
        assert!(usage(DeviceError::NoCudaSupport));
        assert!(usage(DeviceError::Driver(DriverError::NoDriver {
            reason: "none".into()
        })));
        assert!(!usage(DeviceError::Driver(DriverError::CudaSetup {
            call: "cuDevicePrimaryCtxRetain",
            code: 2,
            name: "CUDA_ERROR_OUT_OF_MEMORY".into()
        })));
        // Without CUDA support in the library, asking for CUDA fails before any replay. (The library's own
        // support, not this crate's feature: `cargo test --workspace` gives the library its CUDA backend
        // through cuvmm-torch.)
        if (DeviceSpec::Cuda { ordinal: 0 }).check_supported().is_err() {
            let options = CompareOptions {
                backend: DeviceSpec::Cuda { ordinal: 0 },
                ..CompareOptions::default()
            };
            let err = compare(&options).unwrap_err();
            assert!(matches!(
                err,
                CompareError::Device(DeviceError::NoCudaSupport)
            ));
        }
    }
}
