//! Simulated stream capture: which streams are being captured into a CUDA graph, and which calls CUDA
//! refuses while they are.
//!
//! A capture is begun and ended by the test ([`SimDriver::begin_capture`](super::SimDriver::begin_capture),
//! [`SimDriver::end_capture`](super::SimDriver::end_capture)), on the calling thread, in a
//! [`CaptureMode`]. While it is under way:
//! - a call on the capturing stream itself that needs its work to run (`synchronize` of it, a query of an
//!   event recorded on it during the capture) is refused in every mode;
//! - a *potentially unsafe* call made by thread T is refused while a `Global` capture is under way (begun
//!   by any thread) or a `ThreadLocal` one begun by T; `Relaxed` forbids none. The unsafe calls are
//!   `event_complete`, `synchronize`, and, stricter than CUDA may be until a GPU run says otherwise,
//!   `unmap`, `release`, `free_reservation` and `free`.
//!
//! A refused call is [`DriverError::CaptureUnsupported`] naming a capturing stream, has no effect, and
//! invalidates every capture that forbade it (and the capture of the stream it names): ending one of them
//! is [`DriverError::CaptureInvalidated`]. An invalidated capture still forbids what it forbade until it is
//! ended, as the capture sequence is still open on CUDA.
//!
//! An event recorded on a capturing stream is a node of the graph: it never completes, and once its capture
//! has ended a query of it is [`DriverError::CapturedEvent`].
//!
//! Work launched on a capturing stream is a node of the graph too: the ranges it touches are kept with the
//! capture, and a capture that ends well leaves a graph whose replay
//! ([`SimDriver::replay_graph`](super::SimDriver::replay_graph)) launches that work again, refused as any
//! launch is where its memory is not mapped with access (the illegal address a GPU's replay would meet).

use crate::base::sync::{Arc, AtomicBool, Mutex};
use crate::driver::{
    CaptureMisuse, CaptureMode, CaptureProbe, CaptureStatus, DriverError, EventId, Op, StreamId,
    VaRange,
};
use rustc_hash::FxHashMap;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::thread::ThreadId;

/// One capture under way.
#[derive(Debug, Clone, Copy)]
struct Capture {
    id: u64,
    mode: CaptureMode,
    /// The thread that began it.
    thread: ThreadId,
    invalidated: bool,
}

/// What [`Captures::probe`]s answer from any thread.
#[derive(Debug, Default)]
struct Published {
    /// Whether `statuses` has any: a probe while nothing captures (the common case) reads only this, so
    /// threads asking at once share no written cache line, as with CUDA's query.
    any: AtomicBool,
    statuses: Mutex<BTreeMap<StreamId, CaptureStatus>>,
}

/// The captures under way, the events recorded during one, and what was refused.
#[derive(Debug, Default)]
pub(super) struct Captures {
    last_id: u64,
    /// By stream, in stream order, so the stream a refusal names does not depend on hashing.
    active: BTreeMap<StreamId, Capture>,
    /// The status of every stream in `active`, for [`probe`](Self::probe)s asked from other threads;
    /// published after every change.
    published: Arc<Published>,
    /// Events recorded on a stream while it was capturing: the stream and the capture's id.
    events: FxHashMap<u64, (StreamId, u64)>,
    /// The ranges the work launched during each capture touches, by capture id: the graphs once ended.
    graphs: FxHashMap<u64, Vec<VaRange>>,
    refusals: u64,
    invalidated: u64,
}

impl Captures {
    /// Whether no capture is under way and no event was recorded during one: then no call is refused.
    #[inline]
    pub(super) fn idle(&self) -> bool {
        self.active.is_empty() && self.events.is_empty()
    }

    /// Begins capturing `stream` in `mode` on the calling thread; returns the capture's id (from 1).
    pub(super) fn begin(
        &mut self,
        stream: StreamId,
        mode: CaptureMode,
    ) -> Result<u64, DriverError> {
        let misuse = |misuse| DriverError::CaptureMisuse { stream, misuse };
        if stream == StreamId::DEFAULT || stream == StreamId::LEGACY {
            return Err(misuse(CaptureMisuse::DefaultStream));
        }
        if self.active.contains_key(&stream) {
            return Err(misuse(CaptureMisuse::AlreadyCapturing));
        }
        self.last_id += 1;
        let capture = Capture {
            id: self.last_id,
            mode,
            thread: std::thread::current().id(),
            invalidated: false,
        };
        self.active.insert(stream, capture);
        self.publish();
        Ok(self.last_id)
    }

    /// Ends the capture of `stream`: it stops capturing either way, and the result says whether the
    /// capture made a graph ([`DriverError::CaptureInvalidated`] if it had been invalidated).
    pub(super) fn end(&mut self, stream: StreamId) -> Result<(), DriverError> {
        let capture = self
            .active
            .remove(&stream)
            .ok_or(DriverError::CaptureMisuse {
                stream,
                misuse: CaptureMisuse::NotCapturing,
            })?;
        self.publish();
        if capture.invalidated {
            self.graphs.remove(&capture.id);
            return Err(DriverError::CaptureInvalidated { stream });
        }
        self.graphs.entry(capture.id).or_default();
        Ok(())
    }

    /// Notes work launched on `stream`, which is capturing: a node of its capture's graph.
    pub(super) fn captured_launch(&mut self, stream: StreamId, ranges: &[VaRange]) {
        if let Some(c) = self.active.get(&stream) {
            self.graphs
                .entry(c.id)
                .or_default()
                .extend_from_slice(ranges);
        }
    }

    /// The ranges the work of graph `id` (a capture that has ended well) touches.
    pub(super) fn graph(&self, id: u64) -> Option<&[VaRange]> {
        let ended = !self.active.values().any(|c| c.id == id);
        (self.graphs.get(&id).filter(|_| ended)).map(Vec::as_slice)
    }

    /// Makes the statuses of the captures under way what [`probe`](Self::probe)s answer.
    fn publish(&self) {
        let statuses: BTreeMap<_, _> = self.active.keys().map(|&s| (s, self.status(s))).collect();
        let mut published = self.published.statuses.lock();
        // Set under the lock, so that a probe that sees `any` also sees the statuses it was set with.
        self.published
            .any
            .store(!statuses.is_empty(), Ordering::Release);
        *published = statuses;
    }

    /// [`status`](Self::status), for any thread (`Driver::capture_probe`).
    pub(super) fn probe(&self) -> CaptureProbe {
        let published = Arc::clone(&self.published);
        CaptureProbe::new(move |stream| {
            if !published.any.load(Ordering::Acquire) {
                return Ok(CaptureStatus::None);
            }
            let statuses = published.statuses.lock();
            Ok(statuses
                .get(&stream)
                .copied()
                .unwrap_or(CaptureStatus::None))
        })
    }

    /// `cuStreamGetCaptureInfo`.
    pub(super) fn status(&self, stream: StreamId) -> CaptureStatus {
        match self.active.get(&stream) {
            None => CaptureStatus::None,
            Some(c) if c.invalidated => CaptureStatus::Invalidated { id: c.id },
            Some(c) => CaptureStatus::Active {
                id: c.id,
                mode: Some(c.mode),
            },
        }
    }

    /// Whether `stream` is being captured (its capture active or invalidated).
    #[inline]
    pub(super) fn is_capturing(&self, stream: StreamId) -> bool {
        !self.active.is_empty() && self.active.contains_key(&stream)
    }

    /// Notes that `event` was recorded on `stream`, which is capturing.
    pub(super) fn recorded(&mut self, event: EventId, stream: StreamId) {
        if let Some(c) = self.active.get(&stream) {
            self.events.insert(event.0, (stream, c.id));
        }
    }

    /// Forgets a destroyed event.
    pub(super) fn destroyed(&mut self, event: EventId) {
        if !self.events.is_empty() {
            self.events.remove(&event.0);
        }
    }

    /// Whether `event` was recorded during a capture (a node of a graph, never complete).
    pub(super) fn is_captured_event(&self, event: EventId) -> bool {
        self.events.contains_key(&event.0)
    }

    /// Checks a query of `event` (`cuEventQuery`), counting a refusal.
    pub(super) fn check_query(&mut self, event: EventId) -> Result<(), DriverError> {
        let own = match self.events.get(&event.0) {
            None => None,
            Some(&(stream, id)) if self.active.get(&stream).is_some_and(|c| c.id == id) => {
                Some(stream)
            }
            Some(_) => {
                self.refusals += 1;
                return Err(DriverError::CapturedEvent { event });
            }
        };
        self.check(Op::QueryEvent, own)
    }

    /// Checks a call of `op` that waits for every stream of the device: refused while any stream captures,
    /// whatever its mode, and every capture underway is invalidated.
    pub(super) fn check_device(&mut self, op: Op) -> Result<(), DriverError> {
        let Some(&first) = self.active.keys().min() else {
            return Ok(());
        };
        for capture in self.active.values_mut() {
            if !capture.invalidated {
                capture.invalidated = true;
                self.invalidated += 1;
            }
        }
        self.publish();
        self.refusals += 1;
        Err(DriverError::CaptureUnsupported { op, stream: first })
    }

    /// Checks a potentially unsafe call of `op` from the calling thread; `own` is the stream whose work the
    /// call needs to run (refused if it is capturing, whatever its mode). A refusal is counted and
    /// invalidates every capture that forbade the call.
    pub(super) fn check(&mut self, op: Op, own: Option<StreamId>) -> Result<(), DriverError> {
        if self.active.is_empty() {
            return Ok(());
        }
        let thread = std::thread::current().id();
        let mut named = None;
        let mut newly_invalidated = 0;
        for (&stream, capture) in &mut self.active {
            let forbids = match capture.mode {
                CaptureMode::Global => true,
                CaptureMode::ThreadLocal => capture.thread == thread,
                CaptureMode::Relaxed => false,
            };
            if forbids || own == Some(stream) {
                if !capture.invalidated {
                    capture.invalidated = true;
                    newly_invalidated += 1;
                }
                // The call's own stream first, else the first capturing stream that forbade it.
                if named.is_none() || own == Some(stream) {
                    named = Some(stream);
                }
            }
        }
        let Some(stream) = named else {
            return Ok(());
        };
        self.invalidated += newly_invalidated;
        self.publish();
        self.refusals += 1;
        Err(DriverError::CaptureUnsupported { op, stream })
    }

    /// Calls refused because of a capture.
    pub(super) fn refusals(&self) -> u64 {
        self.refusals
    }

    /// Captures invalidated by a refused call.
    pub(super) fn invalidated(&self) -> u64 {
        self.invalidated
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_invalidates_the_captures_that_forbid_the_call_and_names_the_own_stream() {
        let mut c = Captures::default();
        let (global, relaxed) = (StreamId(7), StreamId(9));
        assert_eq!(c.begin(global, CaptureMode::Global), Ok(1));
        assert_eq!(c.begin(relaxed, CaptureMode::Relaxed), Ok(2));
        let err = c.check(Op::Synchronize, Some(relaxed)).unwrap_err();
        assert_eq!(
            err,
            DriverError::CaptureUnsupported {
                op: Op::Synchronize,
                stream: relaxed
            }
        );
        assert_eq!((c.refusals(), c.invalidated()), (1, 2));
        // Already invalidated: refused again, counted as a refusal, not as a new invalidation.
        assert!(c.check(Op::Unmap, None).is_err());
        assert_eq!((c.refusals(), c.invalidated()), (2, 2));
        assert_eq!(c.status(global), CaptureStatus::Invalidated { id: 1 });
        assert_eq!(
            c.end(relaxed),
            Err(DriverError::CaptureInvalidated { stream: relaxed })
        );
        assert_eq!(c.status(relaxed), CaptureStatus::None);
    }

    #[test]
    fn relaxed_forbids_nothing_but_its_own_stream() {
        let mut c = Captures::default();
        let s = StreamId(3);
        c.begin(s, CaptureMode::Relaxed).unwrap();
        assert_eq!(c.check(Op::Unmap, None), Ok(()));
        assert_eq!(c.check(Op::Synchronize, Some(StreamId(4))), Ok(()));
        assert_eq!(
            c.status(s),
            CaptureStatus::Active {
                id: 1,
                mode: Some(CaptureMode::Relaxed)
            }
        );
        assert_eq!(c.end(s), Ok(()));
        assert_eq!(c.refusals(), 0);
    }
}
