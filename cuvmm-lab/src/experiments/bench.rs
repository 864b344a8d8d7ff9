//! Replay throughput: each trace replayed several times through each allocator on a fresh simulated
//! device, with medians of the replay loop's speed and of the whole run's wall time (`cuvmm bench`).
//!
//! What is timed is [`replay`]'s own loop
//! ([`ReplayResult::replay_seconds`](crate::replay::ReplayResult::replay_seconds)): every allocation, free
//! and record_stream of the trace through the allocator and the simulator, with the simulator's rule checks
//! and counters. The wall time adds building the allocator on its device and dropping it (which unmaps and
//! releases everything). Generating or reading the trace is not timed: it is done once and every replay
//! shares it.

use crate::replay::allocators::{self, BuildError};
use crate::replay::{ReplayError, ReplayOptions, replay};
use crate::trace::event::Trace;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::{GIB, MIB};
use cuvmm::strategy::config::Config;
use serde::Serialize;
use std::time::Instant;

/// The allocator the others are compared with in [`BenchResult::ratio_to_classic`].
pub const BASELINE: &str = "classic";

/// What to measure.
#[derive(Clone, Debug, PartialEq)]
pub struct BenchOptions {
    /// Allocators to replay each trace through, in order.
    pub allocators: Vec<String>,
    /// Replays of each trace per allocator (at least 1).
    pub repetitions: usize,
    /// Memory of the simulated device, in bytes.
    pub capacity: u64,
    /// The simulated device's granularity and the allocators' page size, in bytes.
    pub page_size: u64,
    /// The allocators' configuration.
    pub config: Config,
}

impl Default for BenchOptions {
    /// Every allocator, 5 replays each, on an 80 GiB device with 2 MiB pages, default configuration.
    fn default() -> Self {
        Self {
            allocators: allocators::ALLOCATORS
                .iter()
                .map(|a| a.to_string())
                .collect(),
            repetitions: 5,
            capacity: 80 * GIB,
            page_size: 2 * MIB,
            config: Config::default(),
        }
    }
}

/// What replaying one trace several times through one allocator measured. JSON field names are stable.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct BenchResult {
    /// The trace's name.
    pub trace: String,
    /// The allocator's name.
    pub allocator: String,
    /// Events in the trace.
    pub events: usize,
    /// Replays measured.
    pub repetitions: usize,
    /// Median over the replays of events / replay-loop seconds.
    pub median_events_per_second: f64,
    /// Median replay-loop time, in seconds.
    pub median_replay_seconds: f64,
    /// Median wall time of one run (build the allocator, replay, drop it), in seconds.
    pub median_wall_seconds: f64,
    /// This allocator's median events per second over [`BASELINE`]'s on the same trace (above 1: faster);
    /// `None` when the baseline was not measured.
    pub ratio_to_classic: Option<f64>,
    /// Allocations that failed with out-of-memory. This and the fields below are the same in every replay
    /// (a replay on the simulated device is deterministic); they come from the last one.
    pub ooms: u64,
    /// Peak of the allocator's reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Driver calls made (every operation of [`DriverCalls`](crate::replay::DriverCalls)).
    pub driver_calls: u64,
    /// Driver time the calls cost in the simulator's latency model, in microseconds.
    pub estimated_driver_us: f64,
}

/// Why a benchmark stopped.
#[derive(Debug, thiserror::Error)]
pub enum BenchError {
    /// An allocator could not be built (an unknown name, a page size it rejects).
    #[error(transparent)]
    Build(#[from] BuildError),
    /// A replay failed.
    #[error("replaying `{trace}` through `{allocator}`: {source}")]
    Replay {
        /// The trace.
        trace: String,
        /// The allocator.
        allocator: String,
        /// What went wrong.
        source: Box<ReplayError>,
    },
}

impl BenchError {
    /// Whether the caller asked for something that cannot be (an unknown allocator, a bad configuration),
    /// rather than a replay going wrong.
    pub fn is_usage_error(&self) -> bool {
        matches!(self, BenchError::Build(_))
    }
}

/// Replays every trace `options.repetitions` times through every allocator of `options`, each replay on a
/// fresh simulated device. Allocator names are checked before anything runs. Results come trace by trace,
/// allocators in the order given.
pub fn bench(traces: &[Trace], options: &BenchOptions) -> Result<Vec<BenchResult>, BenchError> {
    if let Some(name) = options
        .allocators
        .iter()
        .find(|a| !allocators::ALLOCATORS.contains(&a.as_str()))
    {
        return Err(BuildError::Unknown { name: name.clone() }.into());
    }
    let sim = SimConfig::default()
        .with_capacity(options.capacity)
        .with_granularity(options.page_size);
    let mut config = options.config.clone();
    config.page_size = config.page_size.or(Some(options.page_size));
    let mut results = Vec::new();
    for trace in traces {
        let first = results.len();
        for allocator in &options.allocators {
            let mut rates = Vec::new();
            let mut replay_seconds = Vec::new();
            let mut wall_seconds = Vec::new();
            let mut last = None;
            for _ in 0..options.repetitions.max(1) {
                let start = Instant::now();
                let device = SimDriver::new(sim.clone());
                let mut strategy = allocators::build_on(allocator, device, config.clone())?;
                let result = replay(strategy.as_mut(), trace, &ReplayOptions::default()).map_err(
                    |source| BenchError::Replay {
                        trace: trace.name.clone(),
                        allocator: allocator.clone(),
                        source: Box::new(source),
                    },
                )?;
                drop(strategy);
                wall_seconds.push(start.elapsed().as_secs_f64());
                rates.push(events_per_second(result.events, result.replay_seconds));
                replay_seconds.push(result.replay_seconds);
                last = Some(result);
            }
            let last = last.expect("at least one replay");
            results.push(BenchResult {
                trace: trace.name.clone(),
                allocator: allocator.clone(),
                events: trace.events.len(),
                repetitions: rates.len(),
                median_events_per_second: median(&mut rates),
                median_replay_seconds: median(&mut replay_seconds),
                median_wall_seconds: median(&mut wall_seconds),
                ratio_to_classic: None,
                ooms: last.ooms,
                peak_reserved_bytes: last.peak_reserved_bytes,
                driver_calls: last.driver_calls.total(),
                estimated_driver_us: last.estimated_driver_us,
            });
        }
        let ours = &mut results[first..];
        let baseline = ours
            .iter()
            .find(|r| r.allocator == BASELINE)
            .map(|r| r.median_events_per_second);
        for result in ours {
            result.ratio_to_classic = baseline
                .filter(|&b| b > 0.0)
                .map(|b| result.median_events_per_second / b);
        }
    }
    Ok(results)
}

/// Events per second of a replay; infinite for a replay too fast for the clock, 0 for an empty trace.
fn events_per_second(events: usize, seconds: f64) -> f64 {
    if events == 0 {
        0.0
    } else {
        events as f64 / seconds
    }
}

/// The median of `values` (the mean of the middle two for an even count); 0 for none.
pub fn median(values: &mut [f64]) -> f64 {
    if values.is_empty() {
        return 0.0;
    }
    values.sort_by(f64::total_cmp);
    let mid = values.len() / 2;
    if values.len() % 2 == 1 {
        values[mid]
    } else {
        (values[mid - 1] + values[mid]) / 2.0
    }
}

/// The results as an aligned table, one row per trace and allocator, each line ending in a newline.
pub fn render_table(results: &[BenchResult]) -> String {
    let headers = [
        "trace",
        "allocator",
        "events",
        "runs",
        "events/s",
        "replay",
        "wall",
        "vs classic",
    ];
    let rows: Vec<[String; 8]> = results
        .iter()
        .map(|r| {
            [
                r.trace.clone(),
                r.allocator.clone(),
                r.events.to_string(),
                r.repetitions.to_string(),
                format!("{:.2} M", r.median_events_per_second / 1e6),
                format!("{:.4} s", r.median_replay_seconds),
                format!("{:.4} s", r.median_wall_seconds),
                r.ratio_to_classic
                    .map_or_else(|| "-".to_string(), |x| format!("{x:.2}x")),
            ]
        })
        .collect();
    crate::reports::table::aligned(headers, &rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(&mut []), 0.0);
        assert_eq!(median(&mut [3.0, 1.0, 2.0]), 2.0);
        assert_eq!(median(&mut [4.0, 1.0, 3.0, 2.0]), 2.5);
    }
}
