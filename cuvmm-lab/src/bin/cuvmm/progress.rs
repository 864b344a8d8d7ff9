//! A progress bar on stderr for long runs, drawn by indicatif: only when stderr is a terminal and `--quiet`
//! is not given, only once a run has taken a second, and redrawn at most ten times a second. Never on stdout.
//!
//! The observers here are told about every event of every replay; they look at the clock only every
//! [`CHECK_EVERY`] events, so the replay loop pays a decrement and a branch per event.

use cuvmm::Strategy;
use cuvmm::size::format_size;
use cuvmm_lab::experiments::capacity::{Bracket, CapacityObserver};
use cuvmm_lab::replay::observe::ReplayObserver;
use cuvmm_lab::trace::Trace;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::time::{Duration, Instant};

/// Events between two looks at the clock (a replay runs a few million events a second).
const CHECK_EVERY: u32 = 4096;
/// No bar for runs shorter than this.
const DELAY: Duration = Duration::from_secs(1);
/// The shortest time between two updates (indicatif draws at most this often too).
const INTERVAL: Duration = Duration::from_millis(100);
/// Steps of the bar: a fraction is shown to a tenth of a percent.
const STEPS: u64 = 1000;
/// `[=====>      ]  42%   3s  label`; indicatif cuts the label to the terminal's width.
const TEMPLATE: &str = "[{bar:20}] {percent:>3}% {elapsed:>4}  {wide_msg}";

/// The bar itself: whether it may draw, when the run started, and indicatif's bar once it is shown.
#[derive(Debug)]
pub struct Progress {
    enabled: bool,
    start: Instant,
    last_update: Option<Instant>,
    bar: Option<ProgressBar>,
}

impl Progress {
    /// A bar that draws only if stderr is a terminal and `quiet` is false.
    pub fn new(quiet: bool) -> Self {
        Self {
            enabled: !quiet && std::io::stderr().is_terminal(),
            start: Instant::now(),
            last_update: None,
            bar: None,
        }
    }

    /// Moves the bar to `fraction` (0 to 1) with `label`, if it is enabled, the run has taken a second,
    /// and the last update is a tenth of a second old.
    pub fn update(&mut self, fraction: f64, label: impl FnOnce() -> String) {
        if !self.enabled {
            return;
        }
        let now = Instant::now();
        let elapsed = now.duration_since(self.start);
        if elapsed < DELAY
            || self
                .last_update
                .is_some_and(|last| now.duration_since(last) < INTERVAL)
        {
            return;
        }
        self.last_update = Some(now);
        let bar = self.bar.get_or_insert_with(|| new_bar(elapsed));
        bar.set_position(position(fraction));
        bar.set_message(label());
    }

    /// Erases the bar, if it was drawn, so what follows starts on a clean line.
    pub fn finish(&mut self) {
        if let Some(bar) = self.bar.take() {
            bar.finish_and_clear();
        }
        self.last_update = None;
    }
}

impl Drop for Progress {
    fn drop(&mut self) {
        self.finish();
    }
}

/// indicatif's bar on stderr, its clock starting `elapsed` ago (when the run did).
fn new_bar(elapsed: Duration) -> ProgressBar {
    let style = ProgressStyle::with_template(TEMPLATE)
        .expect("the template is valid")
        .progress_chars("=> ");
    ProgressBar::with_draw_target(Some(STEPS), ProgressDrawTarget::stderr_with_hz(10))
        .with_style(style)
        .with_elapsed(elapsed)
}

/// The bar's position for `fraction`, clamped to the bar (a fraction that is not a number shows 0).
fn position(fraction: f64) -> u64 {
    let fraction = if fraction.is_finite() {
        fraction.clamp(0.0, 1.0)
    } else {
        0.0
    };
    (fraction * STEPS as f64).round() as u64
}

/// The bar of `cuvmm compare`: one step per replay, split by events within it.
#[derive(Debug)]
pub struct CompareProgress {
    bar: Progress,
    replays: usize,
    started: usize,
    events: usize,
    label: String,
    countdown: u32,
}

impl CompareProgress {
    /// A bar for `replays` replays (more may come: the bar grows to the replays started).
    pub fn new(replays: usize, quiet: bool) -> Self {
        Self {
            bar: Progress::new(quiet),
            replays: replays.max(1),
            started: 0,
            events: 1,
            label: String::new(),
            countdown: CHECK_EVERY,
        }
    }

    /// Erases the bar.
    pub fn finish(&mut self) {
        self.bar.finish();
    }
}

impl ReplayObserver for CompareProgress {
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        self.started += 1;
        // A snapshot file may hold several devices' traces: the count given is then a lower bound.
        self.replays = self.replays.max(self.started);
        self.events = trace.events.len().max(1);
        self.label = format!("{} / {}", trace.name, strategy.name());
    }

    #[inline]
    fn after_event(&mut self, index: usize, _: &dyn Strategy) {
        self.countdown -= 1;
        if self.countdown > 0 {
            return;
        }
        self.countdown = CHECK_EVERY;
        let done = (self.started - 1) as f64 + (index + 1) as f64 / self.events as f64;
        let (replays, started, label) = (self.replays, self.started, &self.label);
        self.bar.update(done / replays as f64, || {
            format!("replay {started} of {replays}: {label}")
        });
    }
}

/// The bar of `cuvmm capacity`: one step per (trace, allocator) search, split by an estimate of the
/// replays the search still needs.
#[derive(Debug)]
pub struct CapacityProgress {
    bar: Progress,
    searches: usize,
    search: usize,
    label: String,
    page_size: u64,
    replays: usize,
    capacity: u64,
    within: f64,
    expected: f64,
    events: usize,
    countdown: u32,
}

impl CapacityProgress {
    /// A bar for `searches` searches on pages of `page_size` bytes.
    pub fn new(searches: usize, page_size: u64, quiet: bool) -> Self {
        Self {
            bar: Progress::new(quiet),
            searches: searches.max(1),
            search: 0,
            label: String::new(),
            page_size: page_size.max(1),
            replays: 0,
            capacity: 0,
            within: 0.0,
            expected: 1.0,
            events: 1,
            countdown: CHECK_EVERY,
        }
    }

    /// The next search, of `trace` through `allocator`, starts.
    pub fn next_search(&mut self, trace: &str, allocator: &str) {
        self.search += 1;
        self.label = format!("{trace} / {allocator}");
        self.replays = 0;
        self.within = 0.0;
    }

    /// Erases the bar.
    pub fn finish(&mut self) {
        self.bar.finish();
    }
}

impl CapacityObserver for CapacityProgress {
    fn probe(&mut self, capacity: u64, bracket: Bracket) {
        self.replays += 1;
        self.capacity = capacity;
        // Replays still to come after this one, if this one does not end the search: the bisection of
        // the bracket; before any capacity is known to fit, a doubling and a bisection of the range it
        // leaves (the guess from peak reserved usually cuts that short; the bar then jumps ahead).
        let pages = |bytes: u64| (bytes / self.page_size).max(2) as f64;
        let rest = match bracket {
            Bracket {
                fails: Some(fails),
                fits: Some(fits),
            } => pages(fits - fails).log2().ceil() - 1.0,
            Bracket { fails, .. } => {
                let lower = fails.unwrap_or(capacity);
                pages(lower).log2().ceil().min(12.0) + 1.0
            }
        };
        self.expected = self.replays as f64 + rest.max(0.0);
    }
}

impl ReplayObserver for CapacityProgress {
    fn start(&mut self, trace: &Trace, _: &dyn Strategy) {
        self.events = trace.events.len().max(1);
    }

    #[inline]
    fn after_event(&mut self, index: usize, _: &dyn Strategy) {
        self.countdown -= 1;
        if self.countdown > 0 {
            return;
        }
        self.countdown = CHECK_EVERY;
        let replay = (index + 1) as f64 / self.events as f64;
        let within = ((self.replays - 1) as f64 + replay) / self.expected.max(1.0);
        // Never go back within a search when the estimate grows.
        self.within = self.within.max(within.min(1.0));
        let done = ((self.search - 1) as f64 + self.within) / self.searches as f64;
        let (search, searches, replays, label) =
            (self.search, self.searches, self.replays, &self.label);
        let capacity = format_size(self.capacity);
        self.bar.update(done, || {
            format!("{search}/{searches} {label}: replay {replays}, {capacity}")
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fractions_map_onto_the_bar() {
        assert_eq!(position(0.5), STEPS / 2);
        assert_eq!(position(1.5), STEPS);
        assert_eq!(position(-1.0), 0);
        assert_eq!(position(f64::NAN), 0);
        assert!(ProgressStyle::with_template(TEMPLATE).is_ok());
    }

    #[test]
    fn a_quiet_bar_never_draws() {
        let mut bar = Progress::new(true);
        bar.start -= DELAY * 2;
        bar.update(0.5, || unreachable!("a quiet bar builds no label"));
        assert!(bar.bar.is_none() && bar.last_update.is_none());
    }

    #[test]
    fn an_enabled_bar_waits_a_second_then_follows_the_fraction() {
        let mut bar = Progress {
            enabled: true,
            start: Instant::now(),
            last_update: None,
            bar: None,
        };
        bar.update(0.1, || unreachable!("no bar in the first second"));
        assert!(bar.bar.is_none());
        bar.start -= DELAY * 2;
        bar.update(0.25, || "label".to_string());
        let shown = bar.bar.as_ref().expect("shown after a second");
        assert_eq!(shown.position(), STEPS / 4);
        assert_eq!(shown.message(), "label");
        bar.finish();
        assert!(bar.bar.is_none());
    }
}
