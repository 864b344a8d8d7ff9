//! Allocated and reserved bytes over a replay, sampled: what `compare --plot` draws.
//!
//! A [`Sampler`] is a [`ReplayObserver`] that reads the allocator's statistics every `k` events, `k` chosen
//! so a trace gives at most [`Sampler::max_samples`] samples, and after the last event. A spike that rises
//! and falls between two samples would be lost, so a sample whose statistic's running peak rose since the
//! previous sample records that new peak instead of the current value: every rise to a new high is kept,
//! and the highest sample of a series is the replay's peak.

use crate::replay::observe::ReplayObserver;
use crate::trace::event::Trace;
use cuvmm::strategy::Strategy;
use cuvmm::strategy::stats::Stats;

/// The statistics after some events of a replay.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Events applied so far (0 before the first).
    pub events: usize,
    /// Bytes allocated (the highest value since the previous sample, where that was a new peak).
    pub allocated_bytes: u64,
    /// Bytes reserved (the highest value since the previous sample, where that was a new peak).
    pub reserved_bytes: u64,
}

/// The samples of one replay: one trace through one allocator.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Series {
    /// The trace's name.
    pub trace: String,
    /// The allocator's name.
    pub allocator: String,
    /// Events in the trace.
    pub events: usize,
    /// The samples, by increasing `events`; the first is taken before the first event, the last after the
    /// last event.
    pub samples: Vec<Sample>,
}

/// Samples the statistics of every replay it observes, one [`Series`] per replay.
#[derive(Clone, Debug)]
pub struct Sampler {
    max_samples: usize,
    every: usize,
    events: usize,
    peaks: (u64, u64),
    series: Vec<Series>,
}

impl Default for Sampler {
    /// At most 1,000 samples per replay: more points than a plot has pixels across.
    fn default() -> Self {
        Self::new(1_000)
    }
}

impl Sampler {
    /// A sampler that takes at most about `max_samples` samples per replay (at least 2: the first and last).
    pub fn new(max_samples: usize) -> Self {
        Self {
            max_samples: max_samples.max(2),
            every: 1,
            events: 0,
            peaks: (0, 0),
            series: Vec::new(),
        }
    }

    /// The most samples one replay gives (plus the one before the first event).
    pub fn max_samples(&self) -> usize {
        self.max_samples
    }

    /// The series sampled so far, one per replay, in the order the replays ran.
    pub fn series(&self) -> &[Series] {
        &self.series
    }

    /// The series sampled.
    pub fn into_series(self) -> Vec<Series> {
        self.series
    }

    fn sample(&mut self, events: usize, stats: &Stats) -> Sample {
        let (allocated, reserved) = (&stats.allocated_bytes, &stats.reserved_bytes);
        let pick = |peak: u64, previous: u64, current: u64| {
            if peak > previous { peak } else { current }
        };
        let sample = Sample {
            events,
            allocated_bytes: pick(allocated.peak, self.peaks.0, allocated.current),
            reserved_bytes: pick(reserved.peak, self.peaks.1, reserved.current),
        };
        self.peaks = (allocated.peak, reserved.peak);
        sample
    }
}

impl ReplayObserver for Sampler {
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        let events = trace.events.len();
        self.every = events.div_ceil(self.max_samples).max(1);
        self.events = events;
        let stats = strategy.stats();
        self.peaks = (stats.allocated_bytes.peak, stats.reserved_bytes.peak);
        let first = self.sample(0, &stats);
        self.series.push(Series {
            trace: trace.name.clone(),
            allocator: strategy.name().to_string(),
            events,
            samples: vec![first],
        });
    }

    #[inline]
    fn after_event(&mut self, index: usize, strategy: &dyn Strategy) {
        let done = index + 1;
        if done % self.every != 0 && done != self.events {
            return;
        }
        let sample = self.sample(done, &strategy.stats());
        if let Some(series) = self.series.last_mut() {
            series.samples.push(sample);
        }
    }
}
