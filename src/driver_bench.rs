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
//! One repetition is run first and thrown away (first calls pay for lazy driver set-up). Each call's time is
//! the change in the driver's [`DriverCounters::time_ns`] across it: **measured** with `Instant` on a CUDA
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
//!   "pages": [{"page_bytes": 2097152, "create_us": 193.0, "map_us": 1.5, "set_access_us": 36.0,
//!              "unmap_us": 26.0, "release_us": 26.0, "grow_fresh_us": 230.5, "grow_reused_us": 63.5}, ...]
//! }
//! ```
//! `latency_model_ns` is the simulated device's cost of one call on a 2 MiB page, per operation (larger
//! pages cost proportionally more); it is `null` on a CUDA device.

use crate::driver::device::Device;
use crate::driver::sim::LatencyModel;
use crate::driver::{Driver, DriverCounters, DriverError, Op, PhysHandle};
use crate::size::{MIB, format_size};
use serde::Serialize;
use std::collections::BTreeMap;
use std::fmt::Write as _;

/// The JSON schema name and version.
pub const SCHEMA: &str = "cuvmm-driver-bench/1";

/// The page sizes measured by default: PyTorch's small (2 MiB) and large (20 MiB) segment sizes, and a
/// large page.
pub const DEFAULT_PAGE_SIZES: [u64; 3] = [2 * MIB, 20 * MIB, 64 * MIB];

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

/// Median costs for one page size, in microseconds.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PageBench {
    /// The physical page size in bytes.
    pub page_bytes: u64,
    /// `cuMemCreate`.
    pub create_us: f64,
    /// `cuMemMap`.
    pub map_us: f64,
    /// `cuMemSetAccess`.
    pub set_access_us: f64,
    /// `cuMemUnmap`.
    pub unmap_us: f64,
    /// `cuMemRelease`.
    pub release_us: f64,
    /// Growing by one page with a new handle: create + map + set_access.
    pub grow_fresh_us: f64,
    /// Growing by one page with a handle moved from elsewhere: unmap + map + set_access.
    pub grow_reused_us: f64,
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
    /// One entry per page size, in the order asked for.
    pub pages: Vec<PageBench>,
}

/// Runs the benchmark on `device`.
pub fn run(device: &mut Device, options: &BenchOptions) -> Result<BenchReport, BenchError> {
    let info = describe(device).map_err(|source| BenchError::Driver { page: 0, source })?;
    let latency_model_ns = device
        .as_sim()
        .map(|sim| model_table(&sim.config().latency));
    let repetitions = options.repetitions.max(1);
    let mut pages = Vec::new();
    for &page in &options.page_sizes {
        if page == 0 || page % info.granularity != 0 {
            return Err(BenchError::PageSize {
                page,
                granularity: info.granularity,
            });
        }
        let samples = measure(device, page, repetitions)
            .map_err(|source| BenchError::Driver { page, source })?;
        pages.push(samples.medians(page));
    }
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
        pages,
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
    if let Some(model) = &report.latency_model_ns {
        let _ = writeln!(out);
        let _ = writeln!(
            out,
            "latency model (ns per call on a 2 MiB page; larger pages cost proportionally more):"
        );
        for op in Op::ALL {
            if let Some(ns) = model.get(op.name()) {
                let _ = writeln!(out, "  {:<16} {ns:>9}", op.name());
            }
        }
    }
    out
}

/// What the report says about the device.
fn describe(device: &mut Device) -> Result<DeviceInfo, DriverError> {
    let total_bytes = device.mem_info()?.total;
    let granularity = device.granularity();
    Ok(match device {
        Device::Sim(_) => DeviceInfo {
            kind: "sim",
            name: "simulated device".to_string(),
            ordinal: None,
            granularity,
            recommended_granularity: granularity,
            total_bytes,
        },
        #[cfg(feature = "cuda")]
        Device::Cuda(cuda) => DeviceInfo {
            kind: "cuda",
            name: cuda.name().to_string(),
            ordinal: Some(cuda.ordinal()),
            granularity,
            recommended_granularity: cuda.recommended_granularity(),
            total_bytes,
        },
    })
}

/// The latency model as operation name -> nanoseconds.
fn model_table(model: &LatencyModel) -> BTreeMap<&'static str, u64> {
    Op::ALL
        .iter()
        .map(|&op| (op.name(), model.per_call(op)))
        .collect()
}

/// Per-call times in nanoseconds, one entry per sample.
#[derive(Debug, Default)]
struct Samples {
    create: Vec<u64>,
    map: Vec<u64>,
    set_access: Vec<u64>,
    unmap: Vec<u64>,
    release: Vec<u64>,
    grow_fresh: Vec<u64>,
    grow_reused: Vec<u64>,
}

impl Samples {
    fn medians(mut self, page: u64) -> PageBench {
        PageBench {
            page_bytes: page,
            create_us: median_us(&mut self.create),
            map_us: median_us(&mut self.map),
            set_access_us: median_us(&mut self.set_access),
            unmap_us: median_us(&mut self.unmap),
            release_us: median_us(&mut self.release),
            grow_fresh_us: median_us(&mut self.grow_fresh),
            grow_reused_us: median_us(&mut self.grow_reused),
        }
    }
}

/// The median of `ns`, in microseconds (0 if empty).
fn median_us(ns: &mut [u64]) -> f64 {
    if ns.is_empty() {
        return 0.0;
    }
    ns.sort_unstable();
    let mid = ns.len() / 2;
    let median = if ns.len() % 2 == 0 {
        (ns[mid - 1] as f64 + ns[mid] as f64) / 2.0
    } else {
        ns[mid] as f64
    };
    median / 1_000.0
}

/// The driver time one call costs: the change in the counters' time across it.
fn timed<T, D: Driver>(
    driver: &mut D,
    call: impl FnOnce(&mut D) -> Result<T, DriverError>,
) -> Result<(T, u64), DriverError> {
    let before: DriverCounters = driver.counters();
    let value = call(driver)?;
    Ok((value, driver.counters().time_ns - before.time_ns))
}

/// The times of the calls of one repetition, in nanoseconds.
#[derive(Clone, Copy, Debug, Default)]
struct Rep {
    create: u64,
    map_a: u64,
    access_a: u64,
    unmap_a: u64,
    map_b: u64,
    access_b: u64,
    unmap_b: u64,
    release: u64,
}

impl Samples {
    fn push(&mut self, r: Rep) {
        self.create.push(r.create);
        self.map.extend([r.map_a, r.map_b]);
        self.set_access.extend([r.access_a, r.access_b]);
        self.unmap.extend([r.unmap_a, r.unmap_b]);
        self.release.push(r.release);
        self.grow_fresh.push(r.create + r.map_a + r.access_a);
        self.grow_reused.push(r.unmap_a + r.map_b + r.access_b);
    }
}

/// Runs one warm-up and `repetitions` measured repetitions for one page size.
fn measure<D: Driver>(
    driver: &mut D,
    page: u64,
    repetitions: usize,
) -> Result<Samples, DriverError> {
    let range = driver.reserve(2 * page)?;
    let (a, b) = (range.start, range.start + page);
    let mut samples = Samples::default();
    let mut outcome = Ok(());
    for rep in 0..=repetitions {
        match repetition(driver, page, a, b) {
            Ok(times) if rep > 0 => samples.push(times),
            Ok(_) => {}
            Err(e) => {
                outcome = Err(e);
                break;
            }
        }
    }
    let freed = driver.free_reservation(range);
    outcome?;
    freed?;
    Ok(samples)
}

/// One repetition: fresh growth at `a`, reused growth at `b`, teardown. On failure, gives back what it
/// holds (logging what cannot be) and returns the first error.
fn repetition<D: Driver>(driver: &mut D, page: u64, a: u64, b: u64) -> Result<Rep, DriverError> {
    let (handle, create) = timed(driver, |d| d.create(page))?;
    let mut mapped_at = None;
    match grow_and_move(driver, page, a, b, handle, &mut mapped_at) {
        Ok(rep) => {
            let (_, release) = timed(driver, |d| d.release(handle))?;
            Ok(Rep {
                create,
                release,
                ..rep
            })
        }
        Err(err) => {
            let unmapped = mapped_at.map_or(Ok(()), |at| driver.unmap(at, page));
            for cleanup in [unmapped, driver.release(handle)] {
                if let Err(e) = cleanup {
                    tracing::warn!(%e, "driver-bench: cleanup after a failed call failed too");
                }
            }
            Err(err)
        }
    }
}

/// Maps `handle` at `a` (fresh growth), moves it to `b` (reused growth), and unmaps it. `mapped_at` says
/// where it is mapped, for cleanup after a failure.
fn grow_and_move<D: Driver>(
    driver: &mut D,
    page: u64,
    a: u64,
    b: u64,
    handle: PhysHandle,
    mapped_at: &mut Option<u64>,
) -> Result<Rep, DriverError> {
    let (_, map_a) = timed(driver, |d| d.map(a, page, handle))?;
    *mapped_at = Some(a);
    let (_, access_a) = timed(driver, |d| d.set_access(a, page))?;
    let (_, unmap_a) = timed(driver, |d| d.unmap(a, page))?;
    *mapped_at = None;
    let (_, map_b) = timed(driver, |d| d.map(b, page, handle))?;
    *mapped_at = Some(b);
    let (_, access_b) = timed(driver, |d| d.set_access(b, page))?;
    let (_, unmap_b) = timed(driver, |d| d.unmap(b, page))?;
    *mapped_at = None;
    Ok(Rep {
        map_a,
        access_a,
        unmap_a,
        map_b,
        access_b,
        unmap_b,
        ..Rep::default()
    })
}
