//! CUDA graph capture: what a driver refuses while a stream is being captured, written once for the
//! simulator and for CUDA.
//!
//! - [`capture_rules`]: what CUDA documents and the simulator enforces. `capture_status` follows a capture
//!   from begin to end; synchronizing the capturing stream, and querying an event recorded on it during
//!   the capture, are refused; in `Global` mode a query of another stream's event is refused from the
//!   capturing thread and from any other thread, and invalidates the capture, while `Relaxed` mode allows
//!   it; the VMM calls that grow memory (reserve, create, map, set_access) and event records are allowed.
//! - [`capture_facts`]: the calls that give memory back (unmap, release, free_reservation, free) during a
//!   `Global` capture. The simulator refuses them, stricter than CUDA may be; on a GPU the outcome is
//!   printed (`fact: ...`), not judged, until a run says what CUDA does.
//!
//! Captures are made on stream 7; stream 8 is another, non-capturing stream. On CUDA both are stand-in
//! streams the driver creates (`CudaDriver::with_stand_in_streams`), so neither is a default stream.

use super::{Subject, rejected, setup, teardown};
use cuvmm::driver::{CaptureMode, CaptureStatus, Driver, DriverError, StreamId};

/// The stream the rules capture.
pub const CAPTURED: StreamId = StreamId(7);
/// Another stream, never captured.
pub const OTHER: StreamId = StreamId(8);

/// A driver whose streams the suite can capture: the simulator's and CUDA's test controls. `Send`, so that a
/// rule can call it from another thread.
pub trait Capture: Subject + Send {
    /// Begins capturing `stream` in `mode` on the calling thread; returns the capture's id.
    fn begin_capture(&mut self, stream: StreamId, mode: CaptureMode) -> Result<u64, DriverError>;
    /// Ends the capture of `stream` (the graph is thrown away).
    fn end_capture(&mut self, stream: StreamId) -> Result<(), DriverError>;
}

/// Every capture rule, by name.
pub fn capture_rules<D: Capture>() -> Vec<super::Rule<D>> {
    vec![
        ("capture_status_follows_begin_and_end", status_follows::<D>),
        (
            "synchronizing_the_capturing_stream_is_refused_and_invalidates",
            synchronize_refused::<D>,
        ),
        (
            "an_event_recorded_during_capture_cannot_be_queried",
            captured_event::<D>,
        ),
        (
            "global_capture_refuses_other_queries_from_the_capturing_thread",
            global_refuses_queries::<D>,
        ),
        (
            "relaxed_capture_allows_other_queries",
            relaxed_allows_queries::<D>,
        ),
        (
            "growing_memory_is_allowed_during_a_global_capture",
            growing_allowed::<D>,
        ),
        (
            "global_capture_refuses_queries_from_another_thread",
            other_thread_refused::<D>,
        ),
    ]
}

/// Runs every capture rule on a fresh driver from `make`, as [`run_rules`](super::run_rules) does.
pub fn run_capture_rules<D: Capture>(make: impl Fn() -> D) {
    for (name, rule) in capture_rules::<D>() {
        eprintln!("conformance: {name}");
        let mut d = make();
        rule(&mut d);
        let held = d.held();
        assert!(held.is_empty(), "{name}: the driver still holds {held}");
    }
}

fn refused_in_capture<T: std::fmt::Debug>(what: &str, result: Result<T, DriverError>) {
    rejected(what, result, |e| {
        matches!(
            e,
            DriverError::CaptureUnsupported { .. } | DriverError::CapturedEvent { .. }
        )
    });
}

fn invalidated(d: &mut impl Capture, what: &str) {
    let status = d.capture_status(CAPTURED).expect("capture_status");
    assert!(
        matches!(status, CaptureStatus::Invalidated { .. }),
        "{what}: the capture should be invalidated, but its status is {status:?}"
    );
    assert_eq!(
        d.end_capture(CAPTURED),
        Err(DriverError::CaptureInvalidated { stream: CAPTURED }),
        "{what}: ending the capture"
    );
}

fn status_follows<D: Capture>(d: &mut D) {
    assert_eq!(d.capture_status(CAPTURED), Ok(CaptureStatus::None));
    let id = d
        .begin_capture(CAPTURED, CaptureMode::Global)
        .expect("begin_capture");
    match d.capture_status(CAPTURED).expect("capture_status") {
        CaptureStatus::Active { id: got, mode } => {
            assert_eq!(got, id, "the status names the capture begun");
            assert!(mode.is_none_or(|m| m == CaptureMode::Global), "{mode:?}");
        }
        other => panic!("capturing, but the status is {other:?}"),
    }
    assert_eq!(d.capture_status(OTHER), Ok(CaptureStatus::None));
    d.end_capture(CAPTURED).expect("end_capture");
    assert_eq!(d.capture_status(CAPTURED), Ok(CaptureStatus::None));
    let misuse = |e: &DriverError| matches!(e, DriverError::CaptureMisuse { .. });
    rejected(
        "end_capture of a stream not capturing",
        d.end_capture(CAPTURED),
        misuse,
    );
    rejected(
        "begin_capture on the legacy default stream",
        d.begin_capture(StreamId::DEFAULT, CaptureMode::Global),
        misuse,
    );
    let second = d
        .begin_capture(CAPTURED, CaptureMode::Relaxed)
        .expect("a second capture");
    assert_ne!(second, id, "capture ids are unique");
    d.end_capture(CAPTURED).expect("end the second capture");
}

fn synchronize_refused<D: Capture>(d: &mut D) {
    d.begin_capture(CAPTURED, CaptureMode::Global)
        .expect("begin_capture");
    refused_in_capture(
        "synchronize of the capturing stream",
        d.synchronize(CAPTURED),
    );
    invalidated(d, "after a synchronize of the capturing stream");
    d.synchronize(CAPTURED)
        .expect("synchronize once the capture ended");
}

fn captured_event<D: Capture>(d: &mut D) {
    d.begin_capture(CAPTURED, CaptureMode::Relaxed)
        .expect("begin_capture");
    let e = d
        .record_event(CAPTURED)
        .expect("record_event on a capturing stream");
    refused_in_capture(
        "query of an event recorded during the capture",
        d.event_complete(e),
    );
    // Whether CUDA also invalidates a relaxed capture here is not asserted.
    let _ = d.end_capture(CAPTURED);
    refused_in_capture(
        "query, after the capture, of an event last recorded during it",
        d.event_complete(e),
    );
    d.destroy_event(e).expect("destroy_event");
}

/// Records an event on [`OTHER`] and waits for it, so that it is complete.
fn complete_event_elsewhere<D: Capture>(d: &mut D) -> cuvmm::driver::EventId {
    let e = d.record_event(OTHER).expect("record_event");
    d.synchronize(OTHER).expect("synchronize");
    e
}

fn global_refuses_queries<D: Capture>(d: &mut D) {
    let e = complete_event_elsewhere(d);
    d.begin_capture(CAPTURED, CaptureMode::Global)
        .expect("begin_capture");
    refused_in_capture(
        "query of another stream's event during a global capture",
        d.event_complete(e),
    );
    invalidated(d, "after a query during a global capture");
    assert_eq!(d.event_complete(e), Ok(true), "the query after the capture");
    d.destroy_event(e).expect("destroy_event");
}

fn relaxed_allows_queries<D: Capture>(d: &mut D) {
    let e = complete_event_elsewhere(d);
    d.begin_capture(CAPTURED, CaptureMode::Relaxed)
        .expect("begin_capture");
    assert_eq!(
        d.event_complete(e),
        Ok(true),
        "query of another stream's event during a relaxed capture"
    );
    d.end_capture(CAPTURED)
        .expect("the relaxed capture ends into a graph");
    d.destroy_event(e).expect("destroy_event");
}

fn growing_allowed<D: Capture>(d: &mut D) {
    let g = d.granularity();
    d.begin_capture(CAPTURED, CaptureMode::Global)
        .expect("begin_capture");
    let (r, hs) = setup(d, 2, 2);
    d.map(r.start, g, hs[0]).expect("map during the capture");
    d.map(r.start + g, g, hs[1])
        .expect("map during the capture");
    d.set_access(r.start, 2 * g)
        .expect("set_access during the capture");
    let e = d
        .record_event(CAPTURED)
        .expect("record_event during the capture");
    d.destroy_event(e)
        .expect("destroy_event during the capture");
    assert!(
        d.capture_status(CAPTURED)
            .expect("capture_status")
            .is_capturing()
    );
    d.end_capture(CAPTURED)
        .expect("the capture ends into a graph");
    d.unmap(r.start, 2 * g).expect("unmap after the capture");
    teardown(d, r, &hs);
}

fn other_thread_refused<D: Capture>(d: &mut D) {
    let e = complete_event_elsewhere(d);
    d.begin_capture(CAPTURED, CaptureMode::Global)
        .expect("begin_capture");
    let from_other = std::thread::scope(|s| {
        s.spawn(|| d.event_complete(e))
            .join()
            .expect("the other thread")
    });
    refused_in_capture(
        "query from another thread during a global capture",
        from_other,
    );
    invalidated(d, "after a query from another thread");
    d.destroy_event(e).expect("destroy_event");
}

/// What a driver did with a call that gives memory back, made during a `Global` capture.
#[derive(Debug)]
pub struct CaptureFact {
    /// The call.
    pub call: &'static str,
    /// What it returned.
    pub outcome: Result<(), DriverError>,
    /// What ending the capture returned afterwards.
    pub end: Result<(), DriverError>,
}

/// Makes each of unmap, release, free_reservation and free (`cuMemFree`) during a `Global` capture on a
/// fresh driver from `make`, ends the capture, and gives everything back (the call again if it was
/// refused). Returns what happened, for the caller to assert (simulator) or print (GPU).
pub fn capture_facts<D: Capture>(make: impl Fn() -> D) -> Vec<CaptureFact> {
    let mut found = Vec::new();
    for call in ["unmap", "release", "free_reservation", "free"] {
        let mut d = make();
        let g = d.granularity();
        let (r, hs) = setup(&mut d, 1, 1);
        d.map(r.start, g, hs[0]).expect("map");
        d.set_access(r.start, g).expect("set_access");
        let p = d.malloc(g).expect("malloc");
        let (empty, _) = setup(&mut d, 1, 0);
        d.begin_capture(CAPTURED, CaptureMode::Global)
            .expect("begin_capture");
        let attempt = |d: &mut D| match call {
            "unmap" => d.unmap(r.start, g),
            "release" => d.release(hs[0]),
            "free_reservation" => d.free_reservation(empty),
            _ => d.free(p),
        };
        let outcome = attempt(&mut d);
        let end = d.end_capture(CAPTURED);
        if outcome.is_err() {
            attempt(&mut d).unwrap_or_else(|e| panic!("{call} after the capture: {e}"));
        }
        if call != "unmap" {
            d.unmap(r.start, g).expect("unmap");
        }
        if call != "release" {
            d.release(hs[0]).expect("release");
        }
        if call != "free_reservation" {
            d.free_reservation(empty).expect("free_reservation");
        }
        if call != "free" {
            d.free(p).expect("free");
        }
        d.free_reservation(r).expect("free_reservation");
        let held = d.held();
        assert!(held.is_empty(), "{call}: the driver still holds {held}");
        found.push(CaptureFact { call, outcome, end });
    }
    found
}
