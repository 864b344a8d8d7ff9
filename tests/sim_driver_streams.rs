//! SimDriver's streams and events: when work completes, that it runs only on accessible memory, and that
//! unmapping memory pending work touches is refused.

mod common;

use common::sim_device::{G, device, fails, mapped, teardown};
use cuvmm::driver::{Driver, DriverError, EventId, StreamId, VaRange};

#[test]
fn events_complete_when_the_test_or_a_synchronize_says_so() {
    let mut d = device();
    let (s1, s2) = (StreamId(1), StreamId(2));
    let (r, hs) = mapped(&mut d, 2, 1);
    let first = VaRange::new(r.start, G);
    let second = VaRange::new(r.start + G, G);
    // Events recorded behind pending work stay pending until that work completes.
    d.launch(s1, &[first]).unwrap();
    let a = d.record_event(s1).unwrap();
    d.launch(s1, &[second]).unwrap();
    let b = d.record_event(s1).unwrap();
    d.launch(s2, &[first]).unwrap();
    let c = d.record_event(s2).unwrap();
    assert_eq!((d.pending_events(s1), d.pending_events(s2)), (2, 1));
    assert_eq!((d.pending_work(s1), d.pending_work(s2)), (2, 1));
    assert_eq!(d.pending_event_ids(s1), vec![a, b]);
    assert!(!d.event_complete(a).unwrap());
    d.complete_event(a).unwrap();
    assert!(d.event_complete(a).unwrap());
    assert_eq!(
        d.pending_work(s1),
        1,
        "completing a completes the work before it only"
    );
    assert!(!d.event_complete(b).unwrap());
    d.complete_stream(s1);
    assert!(d.event_complete(b).unwrap());
    assert!(!d.event_complete(c).unwrap(), "another stream is untouched");
    d.launch(s1, &[second]).unwrap();
    let later = d.record_event(s1).unwrap();
    assert!(
        !d.event_complete(later).unwrap(),
        "recorded behind work launched after the stream completed"
    );
    d.synchronize(s2).unwrap();
    assert!(d.event_complete(c).unwrap());
    assert_eq!((d.pending_events(s1), d.pending_events(s2)), (1, 0));
    d.destroy_event(later).unwrap();
    assert_eq!(d.pending_events(s1), 0);
    assert_eq!(d.pending_work(s1), 1, "destroying an event leaves the work");
    let gone = DriverError::UnknownEvent { event: later };
    assert_eq!(d.event_complete(later), Err(gone.clone()));
    assert_eq!(d.destroy_event(later), Err(gone.clone()));
    assert_eq!(d.complete_event(later), Err(gone));
    let never = EventId(12_345);
    assert_eq!(
        d.event_complete(never),
        Err(DriverError::UnknownEvent { event: never })
    );
    d.synchronize(s1).unwrap();
    d.synchronize(StreamId::DEFAULT).unwrap();
    teardown(&mut d, r, &hs);
}

#[test]
fn an_event_on_an_idle_stream_is_complete_at_once() {
    let mut d = device();
    let e = d.record_event(StreamId(7)).unwrap();
    assert!(d.event_complete(e).unwrap());
    assert_eq!(d.pending_events(StreamId(7)), 0);
    d.complete_event(e).unwrap();
    d.destroy_event(e).unwrap();
}

#[test]
fn advance_completes_work_in_stream_order() {
    let mut d = device();
    let s = StreamId(3);
    let (r, hs) = mapped(&mut d, 3, 1);
    let pages: Vec<VaRange> = (0..3).map(|i| VaRange::new(r.start + i * G, G)).collect();
    let mut events = Vec::new();
    for &page in &pages {
        d.launch(s, &[page]).unwrap();
        events.push(d.record_event(s).unwrap());
    }
    assert_eq!(d.streams_using(r), vec![s]);
    assert_eq!(d.advance(s, 2), 2);
    let done: Vec<bool> = events
        .iter()
        .map(|&e| d.event_complete(e).unwrap())
        .collect();
    assert_eq!(done, [true, true, false]);
    assert_eq!(d.streams_using(VaRange::new(r.start, 2 * G)), vec![]);
    assert_eq!(d.streams_using(pages[2]), vec![s]);
    assert_eq!(d.advance(s, 5), 1, "only one work item was left");
    assert_eq!(d.advance(s, 1), 0);
    assert!(d.event_complete(events[2]).unwrap());
    for e in events {
        d.destroy_event(e).unwrap();
    }
    teardown(&mut d, r, &hs);
}

#[test]
fn work_launches_only_on_accessible_memory() {
    let mut d = device();
    let r = d.reserve(2 * G).unwrap();
    let h = d.create(G).unwrap();
    let s = StreamId(1);
    assert!(matches!(
        d.launch(s, &[VaRange::new(r.start, G)]),
        Err(DriverError::NotMapped { .. })
    ));
    d.map(r.start, G, h).unwrap();
    assert_eq!(
        d.launch(s, &[VaRange::new(r.start, G)]),
        Err(DriverError::AccessDenied { addr: r.start })
    );
    d.set_access(r.start, G).unwrap();
    assert!(
        d.launch(s, &[VaRange::new(r.start, G + 1)]).is_err(),
        "one byte past the mapping"
    );
    assert_eq!(d.pending_work(s), 0, "a refused launch queues nothing");
    d.launch(s, &[VaRange::new(r.start + 10, 100)]).unwrap();
    d.synchronize(s).unwrap();
    d.unmap(r.start, G).unwrap();
    d.release(h).unwrap();
    d.free_reservation(r).unwrap();
    assert!(d.leak_report().is_empty());
}

#[test]
fn unmapping_memory_that_pending_work_touches_fails_and_changes_nothing() {
    let mut d = device();
    let (r, hs) = mapped(&mut d, 4, 1);
    let (s1, s2) = (StreamId(1), StreamId(2));
    d.write(r.start + 3 * G, b"kept").unwrap();
    // s1 reads the last byte of page 1 and the first of page 2; s2 touches page 3.
    d.launch(s1, &[VaRange::new(r.start + 2 * G - 1, 2)])
        .unwrap();
    d.launch(s2, &[VaRange::new(r.start + 3 * G, 4)]).unwrap();
    let err = fails(&mut d, |d| d.unmap(r.start, r.size));
    assert_eq!(
        err,
        DriverError::UnmapWhileInUse {
            va: r.start + 2 * G - 1,
            stream: s1
        }
    );
    assert!(err.to_string().contains("pending work"), "{err}");
    assert_eq!(
        fails(&mut d, |d| d.unmap(r.start + 3 * G, G)),
        DriverError::UnmapWhileInUse {
            va: r.start + 3 * G,
            stream: s2
        }
    );
    // Page 0 is untouched by any work: it may go.
    d.unmap(r.start, G).unwrap();
    d.map(r.start, G, hs[0]).unwrap();
    d.set_access(r.start, G).unwrap();
    d.synchronize(s1).unwrap();
    d.unmap(r.start + G, 2 * G).unwrap();
    d.map(r.start + G, G, hs[1]).unwrap();
    d.map(r.start + 2 * G, G, hs[2]).unwrap();
    d.set_access(r.start + G, 2 * G).unwrap();
    assert_eq!(d.read(r.start + 3 * G, 4).unwrap(), b"kept");
    d.advance(s2, 1);
    teardown(&mut d, r, &hs);
}

#[test]
fn a_destroyed_stream_is_refused_by_every_call_and_its_work_still_completes() {
    let mut d = device();
    let (s1, s2) = (StreamId(11), StreamId(12));
    let (r, hs) = mapped(&mut d, 2, 1);
    let first = VaRange::new(r.start, G);
    d.launch(s1, &[first]).unwrap();
    let before = d.record_event(s1).unwrap();
    d.launch(s2, &[first]).unwrap();
    assert!(d.destroy_stream(s1));
    assert!(!d.destroy_stream(s1), "destroyed once");
    for default in [StreamId::DEFAULT, StreamId::LEGACY, StreamId::PER_THREAD] {
        assert!(!d.destroy_stream(default), "{default} cannot be destroyed");
    }
    let gone = |call| Err(DriverError::StreamDestroyed { call, stream: s1 });
    assert_eq!(d.record_event(s1).map(|_| ()), gone("record_event"));
    assert_eq!(d.synchronize(s1), gone("synchronize"));
    assert_eq!(d.capture_status(s1).map(|_| ()), gone("capture_info"));
    assert_eq!(d.launch(s1, &[first]).map(|_| ()), gone("launch"));
    // The work queued before the destruction still runs, and an event recorded before it still answers.
    assert_eq!(d.pending_work(s1), 1);
    assert!(!d.event_complete(before).unwrap());
    let err = fails(&mut d, |d| d.unmap(r.start, G));
    assert!(matches!(err, DriverError::UnmapWhileInUse { .. }), "{err}");
    // Synchronizing the device names no stream, and waits for every one, the destroyed one's included.
    d.synchronize_device().unwrap();
    assert_eq!((d.pending_work(s1), d.pending_work(s2)), (0, 0));
    assert!(d.event_complete(before).unwrap());
    d.destroy_event(before).unwrap();
    teardown(&mut d, r, &hs);
}
