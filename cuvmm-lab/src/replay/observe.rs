//! Watching a replay while it runs: the hook behind `compare --plot` (sampling the statistics) and the
//! progress bar.
//!
//! [`replay_observed`](super::replay_observed) is generic over the observer, so
//! [`replay`](super::replay), which passes [`NoObserver`], compiles to the loop without the hook:
//! an unused observer costs nothing.

use crate::trace::event::Trace;
use cuvmm::strategy::Strategy;

/// Something told about a replay as it runs. Both methods do nothing by default.
pub trait ReplayObserver {
    /// A replay of `trace` through `strategy` starts (before its first event).
    #[inline]
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        let _ = (trace, strategy);
    }

    /// Event `index` of the trace has been applied (and the invariants checked, if they were due).
    /// Called for every event, so an implementation that does real work should do it only every so often.
    #[inline]
    fn after_event(&mut self, index: usize, strategy: &dyn Strategy) {
        let _ = (index, strategy);
    }
}

/// The observer that does nothing: what [`replay`](super::replay) uses.
#[derive(Clone, Copy, Debug, Default)]
pub struct NoObserver;

impl ReplayObserver for NoObserver {}

impl<O: ReplayObserver + ?Sized> ReplayObserver for &mut O {
    #[inline]
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        (**self).start(trace, strategy);
    }

    #[inline]
    fn after_event(&mut self, index: usize, strategy: &dyn Strategy) {
        (**self).after_event(index, strategy);
    }
}

/// Two observers, told in order: a sampler and a progress bar, say.
impl<A: ReplayObserver, B: ReplayObserver> ReplayObserver for (A, B) {
    #[inline]
    fn start(&mut self, trace: &Trace, strategy: &dyn Strategy) {
        self.0.start(trace, strategy);
        self.1.start(trace, strategy);
    }

    #[inline]
    fn after_event(&mut self, index: usize, strategy: &dyn Strategy) {
        self.0.after_event(index, strategy);
        self.1.after_event(index, strategy);
    }
}
