//! `cuvmm driver-bench`: what each virtual-memory call costs on a device, per physical page size.
//!
//! For each page size (2, 20 and 64 MiB by default) and each repetition, on a reservation of two page
//! slots A and B:
//!
//! 1. `create` a handle, `map` it at A, `set_access` on A: growing by one page with a **fresh** handle;
//! 2. `unmap` A, `map` the same handle at B, `set_access` on B: growing by one page with a **reused**
//!    handle, which is what cuvmm's compaction does with an idle page;
//! 3. `unmap` B, `release` the handle.
//!
//! Then the same size as a run of granularity-sized handles mapped side by side (what cuvmm maps when
//! it grows by single pages): `set_access` and `unmap` once per page (summed) and once over the whole run,
//! which CUDA accepts over several mappings; and `cuMemAlloc` / `cuMemFree` of the same size. Last, on the
//! default stream: a synchronization with nothing queued, an event record and an event query.
//!
//! One repetition is run first and thrown away (first calls pay for lazy driver set-up). Each call's time is
//! the change in the driver's [`DriverCounters::time_ns`](cuvmm::driver::DriverCounters::time_ns) across it: **measured** with `Instant` on a CUDA
//! device, **estimated** from the [`LatencyModel`] on the simulated one (the report then includes the
//! model). Reported figures are medians over the repetitions (map, set_access and unmap have two samples
//! per repetition, one per slot), in microseconds.
//!
//! # JSON (`--format json`)
//! Stable: later versions only add fields.
//! ```json
//! {
//!   "schema": "cuvmm-driver-bench/1",
//!   "device": {"kind": "sim" | "cuda", "name": "...", "ordinal": 0 | null,
//!              "granularity": 2097152, "recommended_granularity": 2097152, "total_bytes": 85899345920},
//!   "timing": "modeled" | "measured",
//!   "repetitions": 20,
//!   "latency_model_ns": {"create": 193000, ...} | null,
//!   "latency_model": "a100" | "h100" | "h200" | null,
//!   "latency_model_parts_ns": {"create": [0, 193000], ...} | null,
//!   "pages": [{"page_bytes": 2097152, "create_us": 193.0, "map_us": 1.5, "set_access_us": 36.0,
//!              "unmap_us": 26.0, "release_us": 26.0, "grow_fresh_us": 230.5, "grow_reused_us": 63.5,
//!              "run_pages": 1, "set_access_per_page_us": 36.0, "set_access_run_us": 36.0,
//!              "unmap_per_page_us": 26.0, "unmap_run_us": 26.0, "malloc_us": 230.5, "free_us": 52.0}, ...],
//!   "stream": {"synchronize_idle_us": 5.0, "record_event_us": 1.0, "query_event_us": 1.0}
//! }
//! ```
//! `latency_model_ns` is the simulated device's cost of one call on a 2 MiB page, per operation, and
//! `latency_model_parts_ns` its fixed part (per call; per mapping for set_access and unmap) and its part per
//! 2 MiB unit (`cuvmm driver-bench --latency-model h100` for the measured H100's); all three are `null` on a
//! CUDA device.

use cuvmm::driver::device::Device;
use cuvmm::driver::sim::LatencyModel;
use cuvmm::driver::{Driver, DriverError, Op};
use cuvmm::size::{MIB, format_size};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

mod measure;

pub use measure::{PageBench, StreamBench};
use measure::{measure, measure_malloc, measure_run, measure_stream};

/// The JSON schema name and version.
pub const SCHEMA: &str = "cuvmm-driver-bench/1";

/// The page sizes measured by default: PyTorch's small (2 MiB) and large (20 MiB) segment sizes, and
/// large pages up to 1 GiB.
pub const DEFAULT_PAGE_SIZES: [u64; 5] = [2 * MIB, 20 * MIB, 64 * MIB, 512 * MIB, 1024 * MIB];

/// What to measure.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct BenchOptions {
    /// Physical page sizes in bytes; each must be a multiple of the device's granularity.
    pub page_sizes: Vec<u64>,
    /// Repetitions per page size (at least 1), after one warm-up repetition.
    pub repetitions: usize,
}

impl Default for BenchOptions {
    /// [`DEFAULT_PAGE_SIZES`], 20 repetitions.
    fn default() -> Self {
        Self {
            page_sizes: DEFAULT_PAGE_SIZES.to_vec(),
            repetitions: 20,
        }
    }
}

/// Why a benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// A page size that the device cannot map.
    #[error(
        "page size {} is not a positive multiple of the device's granularity {}",
        format_size(*page), format_size(*granularity)
    )]
    PageSize {
        /// The page size asked for.
        page: u64,
        /// The device's granularity.
        granularity: u64,
    },
    /// A driver call failed.
    #[error("page size {}: {source}", format_size(*page))]
    Driver {
        /// The page size being measured.
        page: u64,
        /// What the driver said.
        source: DriverError,
    },
}

/// The device a report was taken on.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DeviceInfo {
    /// `sim` or `cuda`.
    pub kind: &'static str,
    /// The device's name.
    pub name: String,
    /// The CUDA ordinal (`null` for the simulated device).
    pub ordinal: Option<usize>,
    /// The allocation granularity in bytes.
    pub granularity: u64,
    /// The granularity recommended for performance, in bytes.
    pub recommended_granularity: u64,
    /// Device memory in bytes.
    pub total_bytes: u64,
}

/// What `driver-bench` reports. Its JSON is described in the [module docs](self).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchReport {
    /// [`SCHEMA`].
    pub schema: &'static str,
    /// The device.
    pub device: DeviceInfo,
    /// `measured` (a CUDA device) or `modeled` (the simulated device's latency model).
    pub timing: &'static str,
    /// Repetitions per page size.
    pub repetitions: usize,
    /// The simulated device's latency model: nanoseconds per call on a 2 MiB page, by operation name.
    pub latency_model_ns: Option<BTreeMap<&'static str, u64>>,
    /// The simulated device's latency model's name (`a100`, `h100`, `h200`).
    pub latency_model: Option<&'static str>,
    /// Its two parts, by operation name: `[fixed ns per call (per mapping for set_access and unmap), ns per
    /// 2 MiB unit]`.
    pub latency_model_parts_ns: Option<BTreeMap<&'static str, [u64; 2]>>,
    /// One entry per page size, in the order asked for.
    pub pages: Vec<PageBench>,
    /// Stream calls.
    pub stream: StreamBench,
}

/// Runs the benchmark on `device`.
pub fn run(device: &mut Device, options: &BenchOptions) -> Result<BenchReport, BenchError> {
    let info = describe(device).map_err(|source| BenchError::Driver { page: 0, source })?;
    let model = device.as_sim().map(|sim| sim.config().latency.clone());
    let latency_model_ns = model.as_ref().map(model_table);
    let latency_model_parts_ns = model.as_ref().map(|m| {
        Op::ALL
            .iter()
            .map(|&op| {
                (
                    op.name(),
                    [m.fixed_ns[op as usize], m.per_unit_ns[op as usize]],
                )
            })
            .collect()
    });
    let repetitions = options.repetitions.max(1);
    let mut pages = Vec::new();
    for &page in &options.page_sizes {
        if page == 0 || page % info.granularity != 0 {
            return Err(BenchError::PageSize {
                page,
                granularity: info.granularity,
            });
        }
        let fail = |source| BenchError::Driver { page, source };
        let samples = measure(device, page, repetitions).map_err(fail)?;
        let mut bench = samples.medians(page);
        measure_run(device, page, repetitions, &mut bench).map_err(fail)?;
        measure_malloc(device, page, repetitions, &mut bench).map_err(fail)?;
        pages.push(bench);
    }
    let stream = measure_stream(device, repetitions)
        .map_err(|source| BenchError::Driver { page: 0, source })?;
    Ok(BenchReport {
        schema: SCHEMA,
        timing: if device.is_measured() {
            "measured"
        } else {
            "modeled"
        },
        device: info,
        repetitions,
        latency_model_ns,
        latency_model: model.map(|m| m.name),
        latency_model_parts_ns,
        pages,
        stream,
    })
}

/// The report as a table for people.
pub fn render_table(report: &BenchReport) -> String {
    let mut out = String::new();
    let d = &report.device;
    let how = if report.timing == "measured" {
        "measured"
    } else {
        "estimated from the latency model below, not measured"
    };
    let _ = writeln!(out, "device: {} ({}); times {how}", d.kind, d.name);
    let _ = writeln!(
        out,
        "granularity {} (recommended {}), {} in all; medians of {} repetitions, in microseconds",
        format_size(d.granularity),
        format_size(d.recommended_granularity),
        format_size(d.total_bytes),
        report.repetitions
    );
    let _ = writeln!(out);
    let header = [
        "page",
        "create",
        "map",
        "set_access",
        "unmap",
        "release",
        "grow fresh",
        "grow reused",
    ];
    let _ = writeln!(
        out,
        "{:<10} {:>10} {:>10} {:>10} {:>10} {:>10} {:>11} {:>11}",
        header[0], header[1], header[2], header[3], header[4], header[5], header[6], header[7]
    );
    for p in &report.pages {
        let _ = writeln!(
            out,
            "{:<10} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>10.1} {:>11.1} {:>11.1}",
            format_size(p.page_bytes),
            p.create_us,
            p.map_us,
            p.set_access_us,
            p.unmap_us,
            p.release_us,
            p.grow_fresh_us,
            p.grow_reused_us
        );
    }
    let _ = writeln!(out);
    let _ = writeln!(
        out,
        "{:<10} {:>6} {:>14} {:>14} {:>14} {:>14} {:>10} {:>10}",
        "run",
        "pages",
        "access/page",
        "access/run",
        "unmap/page",
        "unmap/run",
        "cuMemAlloc",
        "cuMemFree"
    );
    for p in &report.pages {
        let _ = writeln!(
            out,
            "{:<10} {:>6} {:>14.1} {:>14.1} {:>14.1} {:>14.1} {:>10.1} {:>10.1}",
            format_size(p.page_bytes),
            p.run_pages,
            p.set_access_per_page_us,
            p.set_access_run_us,
            p.unmap_per_page_us,
            p.unmap_run_us,
            p.malloc_us,
            p.free_us
        );
    }
    let s = &report.stream;
    let _ = writeln!(
        out,
        "\ndefault stream: synchronize (idle) {:.1}, event record {:.1}, event query {:.1}",
        s.synchronize_idle_us, s.record_event_us, s.query_event_us
    );
    if let Some(parts) = &report.latency_model_parts_ns {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "latency model {} (ns: fixed per call, per mapping for set_access and unmap; and per 2 MiB unit):",
            report.latency_model.unwrap_or("?")
        );
        for op in Op::ALL {
            if let Some([fixed, per_unit]) = parts.get(op.name()) {
                let _ = writeln!(out, "  {:<16} {fixed:>9} {per_unit:>9}", op.name());
            }
        }
    }
    out
}

/// What the report says about the device. An `if let` rather than a `match` on [`Device`]: with cuvmm's
/// `cuda` feature turned on by another crate of the build (`cargo test --workspace`: cuvmm-torch) and this
/// crate's off, `Device` has a variant this crate does not name; such a device is reported by its ordinal.
fn describe(device: &mut Device) -> Result<DeviceInfo, DriverError> {
    let total_bytes = device.mem_info()?.total;
    let granularity = device.granularity();
    #[cfg(feature = "cuda")]
    if let Device::Cuda(cuda) = device {
        return Ok(DeviceInfo {
            kind: "cuda",
            name: cuda.name().to_string(),
            ordinal: Some(cuda.ordinal()),
            granularity,
            recommended_granularity: cuda.recommended_granularity(),
            total_bytes,
        });
    }
    let (kind, name, ordinal) = match device.as_sim() {
        Some(_) => ("sim", "simulated device", None),
        None => ("cuda", "CUDA device", Some(device.ordinal())),
    };
    Ok(DeviceInfo {
        kind,
        name: name.to_string(),
        ordinal,
        granularity,
        recommended_granularity: granularity,
        total_bytes,
    })
}

/// The latency model as operation name -> nanoseconds.
fn model_table(model: &LatencyModel) -> BTreeMap<&'static str, u64> {
    Op::ALL
        .iter()
        .map(|&op| (op.name(), model.per_page(op)))
        .collect()
}
