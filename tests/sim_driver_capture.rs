//! SimDriver's model of CUDA stream capture and of peer access: what a capture refuses, by mode and by
//! thread; that a refused call has no effect, is counted and invalidates the captures that forbade it; that
//! work and events on a capturing stream never run; and which mappings a peer may reach.

mod common;

use common::sim_device::{G, device, fails, mapped, teardown};
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{
    CaptureMisuse, CaptureMode, CaptureStatus, Driver, DriverError, EventId, Op, StreamId, VaRange,
};

const S: StreamId = StreamId(7);
const OTHER: StreamId = StreamId(8);
const MODES: [CaptureMode; 3] = [
    CaptureMode::Global,
    CaptureMode::ThreadLocal,
    CaptureMode::Relaxed,
];

fn unsupported(op: Op, stream: StreamId) -> DriverError {
    DriverError::CaptureUnsupported { op, stream }
}

/// Runs `call` on a new thread (scoped) and returns what it returned.
fn on_another_thread<T: Send>(
    d: &mut SimDriver,
    call: impl FnOnce(&mut SimDriver) -> T + Send,
) -> T {
    std::thread::scope(|s| s.spawn(|| call(d)).join().expect("the other thread"))
}

#[test]
fn begin_and_end_are_refused_where_cuda_refuses_them_and_are_not_counted() {
    let mut d = device();
    let misuse = |stream, misuse| DriverError::CaptureMisuse { stream, misuse };
    for stream in [StreamId::DEFAULT, StreamId::LEGACY] {
        assert_eq!(
            d.begin_capture(stream, CaptureMode::Relaxed),
            Err(misuse(stream, CaptureMisuse::DefaultStream))
        );
    }
    assert_eq!(
        d.end_capture(S),
        Err(misuse(S, CaptureMisuse::NotCapturing))
    );
    assert_eq!(d.begin_capture(S, CaptureMode::Global), Ok(1));
    assert_eq!(
        d.begin_capture(S, CaptureMode::Relaxed),
        Err(misuse(S, CaptureMisuse::AlreadyCapturing))
    );
    assert_eq!(
        d.begin_capture(StreamId::PER_THREAD, CaptureMode::Relaxed),
        Ok(2),
        "the per-thread default stream can be captured"
    );
    assert_eq!(d.end_capture(S), Ok(()), "the refused begin left it intact");
    assert_eq!(d.end_capture(StreamId::PER_THREAD), Ok(()));
    assert_eq!(
        d.begin_capture(S, CaptureMode::Global),
        Ok(3),
        "ids are unique"
    );
    assert_eq!(d.end_capture(S), Ok(()));
    assert_eq!(
        d.counters().total(),
        0,
        "test controls are not driver calls"
    );
    assert_eq!((d.capture_refusals(), d.invalidated_captures()), (0, 0));
}

#[test]
fn capture_status_follows_the_capture_and_is_counted() {
    let mut d = device();
    for mode in MODES {
        assert_eq!(d.capture_status(S), Ok(CaptureStatus::None));
        let id = d.begin_capture(S, mode).unwrap();
        assert_eq!(
            d.capture_status(S),
            Ok(CaptureStatus::Active {
                id,
                mode: Some(mode)
            })
        );
        assert_eq!(d.capture_status(OTHER), Ok(CaptureStatus::None));
        d.end_capture(S).unwrap();
    }
    assert_eq!(d.counters().get(Op::CaptureInfo), 9);
    d.fail_nth(Op::CaptureInfo, 1, cuvmm::driver::sim::FaultKind::Error);
    assert!(matches!(
        d.capture_status(S),
        Err(DriverError::Injected { .. })
    ));
}

#[test]
fn synchronizing_the_capturing_stream_is_refused_in_every_mode_and_invalidates() {
    for mode in MODES {
        let mut d = device();
        let (r, hs) = mapped(&mut d, 1, 1);
        d.launch(S, &[r]).unwrap();
        let id = d.begin_capture(S, mode).unwrap();
        let err = fails(&mut d, |d| d.synchronize(S));
        assert_eq!(err, unsupported(Op::Synchronize, S), "{mode:?}");
        assert_eq!(
            d.pending_work(S),
            1,
            "{mode:?}: the refused synchronize ran nothing"
        );
        assert_eq!((d.capture_refusals(), d.invalidated_captures()), (1, 1));
        assert_eq!(d.capture_status(S), Ok(CaptureStatus::Invalidated { id }));
        assert_eq!(
            d.end_capture(S),
            Err(DriverError::CaptureInvalidated { stream: S })
        );
        assert_eq!(d.capture_status(S), Ok(CaptureStatus::None));
        d.synchronize(S).unwrap();
        assert_eq!(d.pending_work(S), 0);
        teardown(&mut d, r, &hs);
    }
}

#[test]
fn an_event_recorded_during_capture_never_completes_and_cannot_be_queried() {
    for mode in MODES {
        let mut d = device();
        d.begin_capture(S, mode).unwrap();
        let e = d.record_event(S).expect("record_event during a capture");
        assert_eq!(d.pending_events(S), 0, "a node of the graph, not queued");
        assert_eq!(d.live_events(), 1);
        let err = fails(&mut d, |d| d.event_complete(e));
        assert_eq!(err, unsupported(Op::QueryEvent, S), "{mode:?}");
        assert_eq!(
            d.complete_event(e),
            Err(DriverError::CapturedEvent { event: e })
        );
        assert_eq!(
            d.end_capture(S),
            Err(DriverError::CaptureInvalidated { stream: S })
        );
        assert_eq!(
            fails(&mut d, |d| d.event_complete(e)),
            DriverError::CapturedEvent { event: e },
            "after the capture"
        );
        assert_eq!(d.capture_refusals(), 2);
        d.synchronize(S).unwrap();
        d.destroy_event(e).unwrap();
        assert_eq!(d.live_events(), 0);
        assert_eq!(
            d.event_complete(e),
            Err(DriverError::UnknownEvent { event: e })
        );
    }
}

#[test]
fn work_launched_on_a_capturing_stream_is_not_queued() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 1, 1);
    d.begin_capture(S, CaptureMode::Relaxed).unwrap();
    d.launch(S, &[r]).expect("launch during the capture");
    assert_eq!(d.pending_work(S), 0);
    assert!(d.streams_using(r).is_empty());
    let unmapped = VaRange::new(r.end() + G, G);
    assert!(
        d.launch(S, &[unmapped]).is_err(),
        "still refused on memory that is not mapped"
    );
    d.end_capture(S).unwrap();
    teardown(&mut d, r, &hs);
}

/// The potentially unsafe calls, each on a fresh device holding what it needs: a complete event on
/// another stream, a mapping, a mapped handle, an empty reservation and a `malloc`.
struct Held {
    event: EventId,
    mapping: VaRange,
    handle: cuvmm::driver::PhysHandle,
    empty: VaRange,
    ptr: u64,
}

fn hold(d: &mut SimDriver) -> Held {
    let event = d.record_event(OTHER).unwrap();
    let (mapping, hs) = mapped(d, 1, 1);
    Held {
        event,
        mapping,
        handle: hs[0],
        empty: d.reserve(G).unwrap(),
        ptr: d.malloc(512).unwrap(),
    }
}

type Unsafe = (Op, fn(&mut SimDriver, &Held) -> Result<(), DriverError>);

const UNSAFE: [Unsafe; 6] = [
    (Op::QueryEvent, |d, h| d.event_complete(h.event).map(|_| ())),
    (Op::Synchronize, |d, _| d.synchronize(OTHER)),
    (Op::Unmap, |d, h| d.unmap(h.mapping.start, h.mapping.size)),
    (Op::Release, |d, h| d.release(h.handle)),
    (Op::FreeReservation, |d, h| d.free_reservation(h.empty)),
    (Op::Free, |d, h| d.free(h.ptr)),
];

#[test]
fn unsafe_calls_are_refused_by_mode_and_thread() {
    for mode in MODES {
        for other_thread in [false, true] {
            let refused = match mode {
                CaptureMode::Global => true,
                CaptureMode::ThreadLocal => !other_thread,
                CaptureMode::Relaxed => false,
            };
            for (op, call) in UNSAFE {
                let what = format!(
                    "{op} from the {} thread, {mode:?}",
                    if other_thread { "other" } else { "capturing" }
                );
                let mut d = device();
                let held = hold(&mut d);
                d.begin_capture(S, mode).unwrap();
                let run = |d: &mut SimDriver| {
                    if other_thread {
                        on_another_thread(d, |d| call(d, &held))
                    } else {
                        call(d, &held)
                    }
                };
                if refused {
                    assert_eq!(fails(&mut d, run), unsupported(op, S), "{what}");
                    assert_eq!(
                        (d.capture_refusals(), d.invalidated_captures()),
                        (1, 1),
                        "{what}"
                    );
                    assert_eq!(
                        d.end_capture(S),
                        Err(DriverError::CaptureInvalidated { stream: S }),
                        "{what}"
                    );
                } else {
                    run(&mut d).unwrap_or_else(|e| panic!("{what}: refused: {e}"));
                    assert_eq!(d.end_capture(S), Ok(()), "{what}");
                }
            }
        }
    }
}

#[test]
fn growing_memory_and_recording_events_are_allowed_during_a_global_capture() {
    let mut d = device();
    let e = d.record_event(OTHER).unwrap();
    d.begin_capture(S, CaptureMode::Global).unwrap();
    let r = d.reserve(2 * G).unwrap();
    let h = d.create(G).unwrap();
    d.map(r.start, G, h).unwrap();
    d.set_access(r.start, G).unwrap();
    d.mem_info().unwrap();
    let p = d.malloc(512).unwrap();
    d.memset_d8(r.start, G, 9).unwrap();
    let mut out = [0; 4];
    d.copy_to_host(r.start, &mut out).unwrap();
    let on_s = d.record_event(S).unwrap();
    let elsewhere = d.record_event(OTHER).unwrap();
    d.destroy_event(on_s).unwrap();
    d.destroy_event(elsewhere).unwrap();
    d.destroy_event(e).unwrap();
    assert!(d.capture_status(S).unwrap().is_capturing());
    assert_eq!(d.capture_refusals(), 0);
    assert_eq!(d.end_capture(S), Ok(()));
    d.free(p).unwrap();
    d.unmap(r.start, G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn a_refusal_invalidates_every_capture_that_forbids_the_call_and_only_those() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 1, 1);
    let (global, local, relaxed, elsewhere) =
        (StreamId(10), StreamId(11), StreamId(12), StreamId(13));
    d.begin_capture(global, CaptureMode::Global).unwrap();
    d.begin_capture(local, CaptureMode::ThreadLocal).unwrap();
    d.begin_capture(relaxed, CaptureMode::Relaxed).unwrap();
    on_another_thread(&mut d, |d| {
        d.begin_capture(elsewhere, CaptureMode::ThreadLocal)
    })
    .unwrap();
    assert_eq!(
        fails(&mut d, |d| d.unmap(r.start, r.size)),
        unsupported(Op::Unmap, global),
        "the first capturing stream that forbids it is named"
    );
    assert_eq!(d.invalidated_captures(), 2);
    assert!(matches!(
        d.capture_status(local),
        Ok(CaptureStatus::Invalidated { .. })
    ));
    assert!(matches!(
        d.capture_status(relaxed),
        Ok(CaptureStatus::Active { .. })
    ));
    assert!(matches!(
        d.capture_status(elsewhere),
        Ok(CaptureStatus::Active { .. })
    ));
    // An invalidated capture still forbids until it is ended.
    fails(&mut d, |d| d.unmap(r.start, r.size));
    assert_eq!((d.capture_refusals(), d.invalidated_captures()), (2, 2));
    for s in [global, local] {
        assert_eq!(
            d.end_capture(s),
            Err(DriverError::CaptureInvalidated { stream: s })
        );
    }
    // Another thread's thread-local capture and a relaxed one forbid nothing here.
    d.unmap(r.start, r.size).unwrap();
    d.end_capture(relaxed).unwrap();
    d.end_capture(elsewhere).unwrap();
    for h in hs {
        d.release(h).unwrap();
    }
    d.free_reservation(r).unwrap();
}

#[test]
fn set_access_grants_the_added_peers_access_and_unmap_forgets_it() {
    let mut d = SimDriver::new(
        SimConfig::default()
            .with_granularity(G)
            .with_capacity(16 * G)
            .with_devices(4),
    );
    assert_eq!(d.add_peer(0), Ok(()), "the device itself");
    assert_eq!(
        d.add_peer(4),
        Err(DriverError::PeerAccess { device: 0, peer: 4 })
    );
    let (a, hs) = mapped(&mut d, 1, 1);
    assert!(d.peer_access(a.start, 0));
    assert!(!d.peer_access(a.start, 1));
    let calls = d.counters().total();
    d.add_peer(1).unwrap();
    d.add_peer(1).unwrap();
    assert_eq!(d.counters().total(), calls, "add_peer makes no driver call");
    assert!(
        !d.peer_access(a.start, 1),
        "access set before the peer was added is not widened"
    );
    d.set_access(a.start, a.size).unwrap();
    assert!(d.peer_access(a.start + G - 1, 1));
    assert!(!d.peer_access(a.start, 2), "a peer not added");
    assert!(!d.peer_access(a.start, 99));
    d.unmap(a.start, a.size).unwrap();
    assert!(!d.peer_access(a.start, 1), "nothing mapped");
    d.map(a.start, G, hs[0]).unwrap();
    assert!(
        !d.peer_access(a.start, 1) && !d.peer_access(a.start, 0),
        "before set_access"
    );
    teardown(&mut d, a, &hs);
    let mut default = device();
    assert_eq!(default.config().devices, 8);
    assert_eq!(default.add_peer(7), Ok(()));
    assert!(matches!(
        default.add_peer(8),
        Err(DriverError::PeerAccess { .. })
    ));
}
