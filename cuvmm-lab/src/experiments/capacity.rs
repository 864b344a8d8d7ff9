//! The smallest device that replays a trace with no out-of-memory, per allocator: what `cuvmm capacity`
//! answers ("on what GPU would my job fit?").
//!
//! Capacities are whole pages. No allocator can do with less than the trace's peak of live bytes rounded
//! up to a page (the *lower bound*), so the search replays there first; if that OOMs, it doubles the
//! capacity until a replay fits (up to [`CapacityOptions::max_factor`] times the lower bound: an allocator
//! that OOMs even there is reported without a capacity), then bisects between the largest capacity known
//! to OOM and the smallest known to fit. After a replay that fits, the next capacity tried is the peak
//! reserved by that replay, rounded up to a page, when it lies inside the bracket: an allocator whose
//! decisions do not depend on the capacity until it runs short fits there too, which cuts the search from
//! about twenty replays to a few.
//!
//! Whether a replay OOMs need not be monotone in the capacity: an allocator that releases its cache when a
//! request fails may fit on a smaller device and not on a slightly larger one, whose extra room changes
//! what it keeps. So the search does not claim the global minimum. What it guarantees, because it replays
//! both: the capacity reported replays with no OOM, and one page less OOMs (or is below the lower bound).
//!
//! The search is the same on every backend; only how a replay at a capacity runs differs
//! ([`device::CapacityDevice`]): on the simulator, a simulated device of that size; on a CUDA device, the
//! device as it is with a [ballast] taking all free memory but that capacity. There the search
//! also stops at what the device has free ([`device::CapacityDevice::ceiling`]).

pub mod ballast;
pub mod device;

use crate::replay::allocators::{self, BuildError};
use crate::replay::observe::{NoObserver, ReplayObserver};
use crate::replay::{ReplayError, ReplayOptions, ReplayResult, replay_observed};
use crate::trace::event::Trace;
use cuvmm::driver::DriverError;
use cuvmm::driver::device::{DeviceError, DeviceSpec};
use cuvmm::size::{MIB, format_size, round_up};
use cuvmm::strategy::config::{Config, ConfigError};
use cuvmm::strategy::error::Error;
use cuvmm::strategy::oom::{StrandedRemedy, Suggestion};
use serde::Serialize;
use std::time::Instant;

/// How to search.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CapacityOptions {
    /// Page size in bytes: the simulated device's granularity, the allocator's page size, and the step of
    /// the search.
    pub page_size: u64,
    /// The allocators' configuration in `CUVMM_ALLOC_CONF` syntax (`key:value,...`); empty for the defaults.
    pub alloc_conf: String,
    /// The search gives up above this many times the lower bound (or, on a CUDA device, above what it
    /// has free).
    pub max_factor: u64,
    /// Where to replay: simulated devices of each capacity, or a CUDA device with a ballast.
    pub backend: DeviceSpec,
}

impl Default for CapacityOptions {
    /// 2 MiB pages, default configuration, up to 16 times the lower bound.
    fn default() -> Self {
        Self {
            page_size: 2 * MIB,
            alloc_conf: String::new(),
            max_factor: 16,
            backend: DeviceSpec::Sim,
        }
    }
}

/// What the search found for one trace and one allocator. Its JSON field names are stable: later versions
/// only add fields.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct CapacityResult {
    /// The trace's name.
    pub trace: String,
    /// The allocator's name.
    pub allocator: String,
    /// The smallest capacity found that replays the trace with no OOM (one page less OOMs); `None` if even
    /// `searched_up_to_bytes` OOMs.
    pub min_capacity_bytes: Option<u64>,
    /// The trace's peak of live requested bytes.
    pub peak_live_bytes: u64,
    /// `peak_live_bytes` rounded up to a page (at least one page): no allocator fits in less.
    pub lower_bound_bytes: u64,
    /// `min_capacity_bytes / lower_bound_bytes`.
    pub capacity_ratio: Option<f64>,
    /// Peak reserved bytes of the replay at `min_capacity_bytes`.
    pub peak_reserved_bytes: Option<u64>,
    /// The largest capacity replayed.
    pub searched_up_to_bytes: u64,
    /// The page size, the step of the search.
    pub page_size_bytes: u64,
    /// Events in the trace.
    pub events: usize,
    /// Replays the search made.
    pub replays: usize,
    /// Wall time of the search, in seconds.
    pub search_seconds: f64,
    /// Where it was searched: `sim`, or `cuda:N` with a ballast.
    pub backend: String,
    /// With a ballast, what the device had free in the replay at `min_capacity_bytes`: the capacity the
    /// allocator really had (the ballast is a whole number of 2 MiB pages). Absent on the simulator.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_free_bytes: Option<u64>,
    /// Where one page less than `min_capacity_bytes` ran out of memory for want of idle pages stranded in
    /// multi-page handles that live blocks touched (cuvmm's 20 MiB chunks): those bytes, the setting that
    /// gives them back, and the min capacity with it. Absent otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub stranded_below: Option<StrandedBelow>,
}

/// One page below its min capacity, the allocator ran out of memory with idle pages stranded in handles
/// that live blocks touched, and giving those back would have served the request ([`Suggestion::Stranded`]).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct StrandedBelow {
    /// The stranded bytes at that out-of-memory.
    pub stranded_bytes: u64,
    /// The setting that gives them back, in `CUVMM_ALLOC_CONF` syntax (`compaction:split`, or single pages
    /// where that is set already).
    #[serde(serialize_with = "as_text")]
    pub setting: StrandedRemedy,
    /// The min capacity with `setting` added to the configuration: searched on the simulator, absent on a
    /// CUDA device (whose time a second search would double; `--alloc-conf` runs it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_capacity_bytes: Option<u64>,
    /// That min capacity over the lower bound.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub capacity_ratio: Option<f64>,
}

fn as_text<S: serde::Serializer>(value: &StrandedRemedy, out: S) -> Result<S::Ok, S::Error> {
    out.collect_str(value)
}

/// Why a search stopped.
#[derive(Debug, thiserror::Error)]
pub enum CapacityError {
    /// The allocator configuration does not parse.
    #[error("bad allocator configuration: {0}")]
    Config(#[from] ConfigError),
    /// An allocator could not be built.
    #[error(transparent)]
    Build(#[from] BuildError),
    /// The device could not be opened (no CUDA support in this build, no CUDA driver, ...).
    #[error(transparent)]
    Device(#[from] DeviceError),
    /// A ballast could not be placed or freed.
    #[error(transparent)]
    Ballast(#[from] ballast::BallastError),
    /// The device has less free memory than the trace's lower bound: no capacity it can offer would do.
    #[error(
        "`{trace}` needs at least {} (its peak of live bytes), above the {} the device has free",
        format_size(*.lower_bound),
        format_size(*.free)
    )]
    TraceAboveFree {
        /// The trace.
        trace: String,
        /// Its lower bound.
        lower_bound: u64,
        /// What the device has free.
        free: u64,
    },
    /// A replay failed other than by running out of memory.
    #[error("replaying `{trace}` through `{allocator}` on {capacity} bytes: {source}")]
    Replay {
        /// The trace.
        trace: String,
        /// The allocator.
        allocator: String,
        /// The device capacity replayed on.
        capacity: u64,
        /// What went wrong.
        source: Box<ReplayError>,
    },
}

impl CapacityError {
    /// Whether the caller asked for something that cannot be (an unknown allocator, a bad configuration,
    /// a trace no program could have made: a free or record_stream of an id that is not live, an id
    /// allocated twice; a CUDA device on a build or a machine without CUDA; a capacity above what the
    /// device has free), rather than a replay or a device going wrong.
    pub fn is_usage_error(&self) -> bool {
        match self {
            CapacityError::Device(DeviceError::Driver(e)) => {
                matches!(e, DriverError::NoDriver { .. })
            }
            CapacityError::Ballast(e) => matches!(e, ballast::BallastError::AboveFree { .. }),
            CapacityError::Replay { source, .. } => matches!(
                **source,
                ReplayError::DuplicateId { .. }
                    | ReplayError::UnknownFree { .. }
                    | ReplayError::RecordStreamNotLive { .. }
            ),
            _ => true,
        }
    }
}

/// What is known while searching: the largest capacity known to OOM and the smallest known to fit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Bracket {
    /// The largest capacity replayed with an OOM so far.
    pub fails: Option<u64>,
    /// The smallest capacity replayed with no OOM so far.
    pub fits: Option<u64>,
}

/// What one replay at one capacity showed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Probe {
    /// No allocation ran out of memory.
    pub fits: bool,
    /// Peak reserved bytes of the replay.
    pub peak_reserved_bytes: u64,
}

/// The outcome of [`bisect`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bisection {
    /// The capacity found and its probe; `None` if nothing up to the limit fits.
    pub found: Option<(u64, Probe)>,
    /// Every capacity probed, in order, with what it showed.
    pub probes: Vec<(u64, Probe)>,
}

impl Bisection {
    /// The largest capacity probed.
    pub fn searched_up_to(&self) -> u64 {
        self.probes.iter().map(|&(c, _)| c).max().unwrap_or(0)
    }
}

/// Told about a search as it runs; also a [`ReplayObserver`] of each replay it makes.
pub trait CapacityObserver: ReplayObserver {
    /// A replay at `capacity` bytes is about to start, knowing `bracket`.
    fn probe(&mut self, capacity: u64, bracket: Bracket) {
        let _ = (capacity, bracket);
    }
}

impl CapacityObserver for NoObserver {}

/// The lower bound of the search for `trace`: its peak of live bytes rounded up to a page, at least one page.
pub fn lower_bound(trace: &Trace, page_size: u64) -> u64 {
    round_up(trace.peak_live_bytes(), page_size)
        .unwrap_or(u64::MAX / page_size * page_size)
        .max(page_size)
}

/// Searches capacities from `lower_bound` (which must be a positive multiple of `page`) up to
/// `upper_limit`, in whole pages, calling `probe` for each capacity replayed. See the module docs for the
/// order and what the result guarantees: the capacity found fits, and it is `lower_bound` or one page less
/// was probed and did not fit.
///
/// # Errors
/// The first error `probe` returns.
pub fn bisect<E>(
    lower_bound: u64,
    page: u64,
    upper_limit: u64,
    mut probe: impl FnMut(u64, Bracket) -> Result<Probe, E>,
) -> Result<Bisection, E> {
    let upper_limit = round_up(upper_limit, page)
        .unwrap_or(lower_bound)
        .max(lower_bound);
    let mut probes = Vec::new();
    let mut run = |capacity: u64, bracket: Bracket| -> Result<Probe, E> {
        let result = probe(capacity, bracket)?;
        probes.push((capacity, result));
        Ok(result)
    };
    let first = run(lower_bound, Bracket::default())?;
    if first.fits {
        return Ok(Bisection {
            found: Some((lower_bound, first)),
            probes,
        });
    }
    // Doubling: find a capacity that fits.
    let mut fails = lower_bound;
    let (mut fits, mut fitting) = loop {
        if fails >= upper_limit {
            return Ok(Bisection {
                found: None,
                probes,
            });
        }
        let capacity = fails.saturating_mul(2).min(upper_limit);
        let bracket = Bracket {
            fails: Some(fails),
            fits: None,
        };
        let result = run(capacity, bracket)?;
        if result.fits {
            break (capacity, result);
        }
        fails = capacity;
    };
    // Bisection between `fails` and `fits`, trying the last fitting replay's peak reserved first.
    let mut guess = round_up(fitting.peak_reserved_bytes, page);
    while fits - fails > page {
        let middle = fails + (fits - fails) / page / 2 * page;
        let capacity = guess
            .take()
            .filter(|&g| fails < g && g < fits)
            .unwrap_or(middle);
        let bracket = Bracket {
            fails: Some(fails),
            fits: Some(fits),
        };
        let result = run(capacity, bracket)?;
        if result.fits {
            (fits, fitting) = (capacity, result);
            guess = round_up(result.peak_reserved_bytes, page);
        } else {
            fails = capacity;
        }
    }
    Ok(Bisection {
        found: Some((fits, fitting)),
        probes,
    })
}

/// Replays `trace` through a fresh `allocator` on a simulated device of `capacity` bytes with
/// `options.page_size` pages, configured by `config`.
///
/// # Errors
/// [`CapacityError::Build`] for an unknown allocator, a CUDA-only one, or one that rejects the device;
/// [`CapacityError::Replay`] for a replay that failed other than by OOM.
pub fn replay_at<O: ReplayObserver + ?Sized>(
    trace: &Trace,
    allocator: &str,
    capacity: u64,
    page_size: u64,
    config: &Config,
    observer: &mut O,
) -> Result<ReplayResult, CapacityError> {
    if allocators::CUDA_ONLY.contains(&allocator) {
        return Err(BuildError::NeedsGpu {
            name: allocator.to_string(),
        }
        .into());
    }
    let mut strategy = allocators::build_with(allocator, capacity, page_size, config)?;
    replay_observed(
        strategy.as_mut(),
        trace,
        &ReplayOptions::default(),
        observer,
    )
    .map_err(|source| CapacityError::Replay {
        trace: trace.name.clone(),
        allocator: allocator.to_string(),
        capacity,
        source: Box::new(source),
    })
}

/// The allocator configuration `options` describes, with the page size filled in.
///
/// # Errors
/// [`CapacityError::Config`] if `options.alloc_conf` does not parse.
pub fn config(options: &CapacityOptions) -> Result<Config, CapacityError> {
    let mut config = Config::from_alloc_conf(&options.alloc_conf)?;
    config.page_size = config.page_size.or(Some(options.page_size));
    Ok(config)
}

/// The smallest capacity at which `allocator` replays `trace` with no OOM (see the module docs), on
/// `options.backend`. On the simulator, where one page less ran out for want of stranded pages
/// ([`CapacityResult::stranded_below`]), a second search under the setting that gives them back finds the
/// min capacity with it.
///
/// # Errors
/// [`CapacityError`]: a bad configuration, an unknown allocator, a device that cannot be opened or has
/// less free than the trace's lower bound, or a replay that failed other than by OOM.
pub fn search<O: CapacityObserver + ?Sized>(
    trace: &Trace,
    allocator: &str,
    options: &CapacityOptions,
    observer: &mut O,
) -> Result<CapacityResult, CapacityError> {
    let mut device = device::for_options(options)?;
    let mut result = search_on(trace, allocator, options, &mut device, observer)?;
    if let (Some(below), DeviceSpec::Sim) = (&mut result.stranded_below, options.backend) {
        let mut config = config(options)?;
        below.setting.apply_to(&mut config);
        let mut remedied = device::SimSized {
            page_size: options.page_size,
            config,
        };
        let with = search_on(trace, allocator, options, &mut remedied, observer)?;
        below.min_capacity_bytes = with.min_capacity_bytes;
        below.capacity_ratio = with.capacity_ratio;
    }
    Ok(result)
}

/// As [`search`], replaying on `device` (whose configuration it carries; `options` gives the page size,
/// the limit factor and the backend's name).
///
/// # Errors
/// As [`search`].
pub fn search_on<D: device::CapacityDevice + ?Sized, O: CapacityObserver + ?Sized>(
    trace: &Trace,
    allocator: &str,
    options: &CapacityOptions,
    device: &mut D,
    observer: &mut O,
) -> Result<CapacityResult, CapacityError> {
    let start = Instant::now();
    let page = options.page_size;
    let lower = lower_bound(trace, page);
    let mut limit = lower.saturating_mul(options.max_factor.max(1));
    if let Some(free) = device.ceiling()? {
        if lower > free {
            return Err(CapacityError::TraceAboveFree {
                trace: trace.name.clone(),
                lower_bound: lower,
                free,
            });
        }
        limit = limit.min(free);
    }
    let mut free_seen = Vec::new();
    let mut stranded_seen = Vec::new();
    let bisection = bisect(lower, page, limit, |capacity, bracket| {
        observer.probe(capacity, bracket);
        match device.replay(trace, allocator, capacity, observer) {
            Ok(replayed) => {
                free_seen.push((capacity, replayed.free_seen));
                let first_oom = replayed.result.first_oom.as_deref();
                if let Some(Suggestion::Stranded { stranded, setting }) =
                    first_oom.map(|oom| oom.suggestion())
                {
                    stranded_seen.push((capacity, stranded, setting));
                }
                Ok(Probe {
                    fits: replayed.result.ooms == 0,
                    peak_reserved_bytes: replayed.result.peak_reserved_bytes,
                })
            }
            // A request larger than this device (after the allocator's rounding) does not fit either.
            Err(CapacityError::Replay { source, .. })
                if matches!(
                    *source,
                    ReplayError::Alloc {
                        source: Error::TooLarge { .. },
                        ..
                    }
                ) =>
            {
                Ok(Probe {
                    fits: false,
                    peak_reserved_bytes: 0,
                })
            }
            Err(e) => Err(e),
        }
    })?;
    let found = bisection.found;
    let device_free_bytes = found.and_then(|(c, _)| {
        (free_seen.iter())
            .rev()
            .find(|&&(at, _)| at == c)
            .and_then(|&(_, seen)| seen)
    });
    let stranded_below = found
        .and_then(|(c, _)| stranded_seen.iter().find(|&&(at, ..)| at + page == c))
        .map(|&(_, stranded_bytes, setting)| StrandedBelow {
            stranded_bytes,
            setting,
            min_capacity_bytes: None,
            capacity_ratio: None,
        });
    Ok(CapacityResult {
        trace: trace.name.clone(),
        allocator: allocator.to_string(),
        min_capacity_bytes: found.map(|(c, _)| c),
        peak_live_bytes: trace.peak_live_bytes(),
        lower_bound_bytes: lower,
        capacity_ratio: found.map(|(c, _)| c as f64 / lower as f64),
        peak_reserved_bytes: found.map(|(_, p)| p.peak_reserved_bytes),
        searched_up_to_bytes: bisection.searched_up_to(),
        page_size_bytes: page,
        events: trace.events.len(),
        replays: bisection.probes.len(),
        search_seconds: start.elapsed().as_secs_f64(),
        backend: options.backend.to_string(),
        device_free_bytes,
        stranded_below,
    })
}

#[cfg(test)]
mod tests;
