//! The copies of a sleep and a wake (issue 44), on the simulated device with its bytes checked through
//! the backing store:
//! - bytes stay intact over several cycles, and the host memory pinned for a tag at its first sleep is
//!   kept and reused, so a second sleep pins nothing (`Op::HostAlloc` counts the pinning); a tag that grows
//!   gets the pieces it lacks; `keep_host_buffers:False` and `release_host_buffers` give the memory back;
//! - a failed host allocation, copy, event or wait, at a sleep or a wake, and also after its effect, loses
//!   nothing: a sleep leaves the tag awake with its bytes, a wake leaves it asleep with its bytes kept, and
//!   the next try succeeds;
//! - memory of a CUDA graph captured inside a tag sleeps and wakes with it, and the graph replays after the
//!   wake (the simulator refuses a replay whose memory is unmapped);
//! - a copy job's device ranges are refused to `unmap` until it is over;
//! - a sleeping tag's kept bytes are read without waking it (`read_kept`);
//! - `prepare_sleep` pins a tag's host memory ahead of its first sleep, which then pins nothing, and a
//!   preparation that fails, or that a sleep overtakes, loses nothing.

mod common;

use common::{begin_capture, end_capture, holds_pattern, pattern, write_pattern};
use cuvmm::driver::after_effect::AfterEffect;
use cuvmm::driver::sim::{COPY_STREAM, FaultKind, SimConfig, SimDriver};
use cuvmm::driver::{
    CaptureMode, CopyDirection, CopyPlan, Driver as _, DriverError, HostCopy, HostPinning, Op,
    VaRange,
};
use cuvmm::expandable::Expandable;
use cuvmm::strategy::GraphPools;
use cuvmm::strategy::tags::Begun;
use cuvmm::{Config, Error, GraphPool, Strategy as _, StreamId};

const PAGE: u64 = 4096;
const PAGES: u64 = 64;
/// Three pages per copy and per host piece, so that a tag's bytes span several pieces.
const PIECE: u64 = 3 * PAGE;

fn config() -> Config {
    Config {
        small_size: 1024,
        ..Config::default()
    }
    .with_sleep_copy(PIECE)
}

fn new_alloc(config: Config) -> Expandable<SimDriver> {
    common::expandable_with(PAGE, PAGES, config, true)
}

/// Weights in three adjacent blocks (one run of 14 pages and 512 bytes), patterns written.
fn weights(a: &mut Expandable<SimDriver>) -> Vec<(u64, u64, u64)> {
    let sizes = [5 * PAGE, 2 * PAGE + 100, 7 * PAGE];
    let s = StreamId(1);
    (sizes.iter().enumerate())
        .map(|(i, &size)| {
            let addr = a.alloc_tagged(size, s, "weights").unwrap();
            write_pattern(a, addr, 10 + i as u64, size);
            (addr, size, 10 + i as u64)
        })
        .collect()
}

fn intact(a: &Expandable<SimDriver>, blocks: &[(u64, u64, u64)]) -> bool {
    (blocks.iter()).all(|&(addr, size, id)| holds_pattern(a, addr, id, size))
}

/// Another job takes most of the device, writes over it and gives it back.
fn another_job(a: &mut Expandable<SimDriver>) {
    let job = a.alloc(40 * PAGE, StreamId(2)).unwrap();
    write_pattern(a, job, 99, 40 * PAGE);
    a.free(job).unwrap();
    a.empty_cache().unwrap();
}

fn host_allocs(a: &Expandable<SimDriver>) -> u64 {
    a.driver().counters().get(Op::HostAlloc)
}

/// PyTorch's `pinned_*` keys choose how a sleep and a wake pin: the plan the driver gets carries them.
#[test]
fn the_pinning_keys_reach_every_copy_job() {
    for (conf, pinning) in [
        ("", HostPinning::default()),
        (
            "pinned_use_cuda_host_register:False,pinned_num_register_threads:2",
            HostPinning {
                register: false,
                threads: 2,
            },
        ),
    ] {
        let parsed = Config::from_alloc_conf(conf).unwrap();
        let mut a = new_alloc(config().with_host_pinning(parsed.host_pinning));
        let blocks = weights(&mut a);
        assert_eq!(a.driver().last_copy_pinning(), None);
        a.sleep("weights", true).unwrap();
        assert_eq!(
            a.driver().last_copy_pinning(),
            Some(pinning),
            "{conf:?}: sleep"
        );
        a.check_invariants().unwrap();
        a.wake("weights").unwrap();
        assert_eq!(
            a.driver().last_copy_pinning(),
            Some(pinning),
            "{conf:?}: wake"
        );
        assert!(intact(&a, &blocks), "{conf:?}");
        a.check_invariants().unwrap();
    }
}

#[test]
fn bytes_stay_intact_over_cycles_and_the_second_sleep_pins_nothing() {
    let mut a = new_alloc(config());
    let blocks = weights(&mut a);
    // 14 pages and 512 bytes: five pieces of three pages, the last rounded up to a whole piece.
    let pieces = 5;
    for cycle in 0..3 {
        let before = host_allocs(&a);
        assert_eq!(a.sleep("weights", true).unwrap(), 15 * PAGE);
        let pinned = host_allocs(&a) - before;
        assert_eq!(pinned, if cycle == 0 { pieces } else { 0 }, "cycle {cycle}");
        assert_eq!(a.stats().host_kept_bytes, pieces * PIECE);
        a.check_invariants().unwrap();
        another_job(&mut a);
        a.wake("weights").unwrap();
        assert!(intact(&a, &blocks), "cycle {cycle}: the bytes are back");
        assert_eq!(
            a.stats().host_kept_bytes,
            pieces * PIECE,
            "kept for the next sleep"
        );
        a.check_invariants().unwrap();
    }
    let kept = a.tag_infos();
    assert_eq!(kept.len(), 1);
    assert_eq!((kept[0].state, kept[0].bytes_kept), ("awake", false));
    assert_eq!(
        a.release_host_buffers(Some("weights")).unwrap(),
        pieces * PIECE
    );
    assert_eq!(a.stats().host_kept_bytes, 0);
    assert_eq!(
        a.driver().pinned_host_bytes(),
        pieces * PIECE,
        "let go of, for the caller to free after its lock"
    );
    drop(a.take_freed_host());
    assert_eq!(a.driver().pinned_host_bytes(), 0);
    let before = host_allocs(&a);
    a.sleep("weights", true).unwrap();
    assert_eq!(host_allocs(&a) - before, pieces, "released: pinned again");
    assert_eq!(
        a.release_host_buffers(None).unwrap(),
        0,
        "a sleeping tag's bytes are never released"
    );
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));
    a.check_invariants().unwrap();
}

#[test]
fn without_keep_host_buffers_a_wake_frees_them_and_each_sleep_pins_again() {
    let mut a = new_alloc(config().with_keep_host_buffers(false));
    let blocks = weights(&mut a);
    for _ in 0..2 {
        let before = host_allocs(&a);
        a.sleep("weights", true).unwrap();
        assert_eq!(host_allocs(&a) - before, 5);
        a.wake("weights").unwrap();
        assert_eq!(a.stats().host_kept_bytes, 0);
        assert_eq!(a.driver().pinned_host_bytes(), 0, "freed by the wake");
        assert!(intact(&a, &blocks));
    }
    // In phases, as the facade runs them under its lock, the wake lets go of the pieces and the caller
    // frees them after its lock.
    a.sleep("weights", true).unwrap();
    let Begun::Copy(mut copy) = a.begin_wake("weights").unwrap() else {
        panic!("the kept bytes are copied back");
    };
    copy.run();
    a.finish_wake(*copy).unwrap();
    assert_eq!(a.stats().host_kept_bytes, 0);
    assert_eq!(a.driver().pinned_host_bytes(), 5 * PIECE, "not freed yet");
    let freed = a.take_freed_host();
    assert_eq!(freed.len(), 5);
    drop(freed);
    assert_eq!(a.driver().pinned_host_bytes(), 0);
    assert!(a.take_freed_host().is_empty());
    a.check_invariants().unwrap();
    let parsed = Config::from_alloc_conf("keep_host_buffers:False,sleep_copy_mb:16").unwrap();
    assert!(!parsed.keep_host_buffers);
    assert_eq!(parsed.sleep_copy, 16 << 20);
    assert!(Config::from_alloc_conf("sleep_copy_mb:0").is_err());
}

#[test]
fn a_tag_that_grows_gets_the_pieces_it_lacks_and_one_that_shrinks_frees_the_rest() {
    let mut a = new_alloc(config());
    let mut blocks = weights(&mut a);
    a.sleep("weights", true).unwrap();
    a.wake("weights").unwrap();
    let more = a.alloc_tagged(7 * PAGE, StreamId(1), "weights").unwrap();
    write_pattern(&mut a, more, 20, 7 * PAGE);
    blocks.push((more, 7 * PAGE, 20));
    // 21 pages and 512 bytes: eight pieces; the five kept are long enough.
    let before = host_allocs(&a);
    a.sleep("weights", true).unwrap();
    assert_eq!(host_allocs(&a) - before, 3);
    assert_eq!(a.stats().host_kept_bytes, 8 * PIECE);
    another_job(&mut a);
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));
    let (addr, _, _) = blocks.pop().unwrap();
    a.free(addr).unwrap();
    a.sleep("weights", true).unwrap();
    assert_eq!(
        a.stats().host_kept_bytes,
        5 * PIECE,
        "the pieces beyond are freed"
    );
    assert_eq!(
        a.driver().pinned_host_bytes(),
        5 * PIECE,
        "a sleep in one call frees them itself"
    );
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));
    a.check_invariants().unwrap();
}

/// `prepare_sleep` pins the host memory the first sleep would, ahead of it, and copies nothing: the first
/// sleep then pins nothing, a second preparation has nothing to do, a tag that grew gets only the pieces
/// it lacks, and a tag asleep, never named, with nothing live or during a capture gets none.
#[test]
fn a_prepared_first_sleep_pins_nothing() {
    let mut a = new_alloc(config());
    let mut blocks = weights(&mut a);
    let copies = |a: &Expandable<SimDriver>| a.driver().counters().get(Op::CopyToHost);
    assert_eq!(a.prepare_sleep("nobody").unwrap(), 0, "never named");
    a.alloc_tagged(PAGE, StreamId(1), "empty")
        .map(|addr| a.free(addr))
        .unwrap()
        .unwrap();
    assert_eq!(a.prepare_sleep("empty").unwrap(), 0, "nothing live");
    assert_eq!(host_allocs(&a), 0);

    assert_eq!(a.prepare_sleep("weights").unwrap(), 5 * PIECE);
    assert_eq!((host_allocs(&a), copies(&a)), (5, 0), "pinned, not copied");
    assert_eq!(a.stats().host_kept_bytes, 5 * PIECE);
    assert_eq!(a.tag_infos()[0].state, "awake");
    a.check_invariants().unwrap();
    assert_eq!(a.prepare_sleep("weights").unwrap(), 0, "held already");
    assert_eq!(host_allocs(&a), 5);

    a.sleep("weights", true).unwrap();
    assert_eq!(host_allocs(&a), 5, "the first sleep pins nothing");
    assert_eq!(a.stats().host_kept_bytes, 5 * PIECE);
    assert_eq!(a.prepare_sleep("weights").unwrap(), 0, "asleep");
    another_job(&mut a);
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));

    // 16 pages and 512 bytes: one piece more.
    let more = a.alloc_tagged(2 * PAGE, StreamId(1), "weights").unwrap();
    write_pattern(&mut a, more, 20, 2 * PAGE);
    blocks.push((more, 2 * PAGE, 20));
    assert_eq!(a.prepare_sleep("weights").unwrap(), PIECE);
    assert_eq!(host_allocs(&a), 6);
    a.sleep("weights", true).unwrap();
    assert_eq!(host_allocs(&a), 6);
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));

    let pool = GraphPool(1, 0);
    begin_capture(&mut a, StreamId(3), pool, CaptureMode::ThreadLocal);
    a.release_host_buffers(None).unwrap_err();
    assert!(matches!(
        a.prepare_sleep("weights"),
        Err(Error::CaptureUnderway {
            operation: "prepare_sleep"
        })
    ));
    end_capture(&mut a, StreamId(3), pool);
    a.release_pool(pool).unwrap();
    a.check_invariants().unwrap();
}

/// A preparation runs without the allocator's lock (its phases): meanwhile the tag counts the memory
/// being pinned, allocates, and may fall asleep, which pins its own pieces and leaves the preparation's
/// to be freed; a second preparation has nothing to do.
#[test]
fn a_sleep_during_a_preparation_pins_its_own_and_the_preparations_are_freed() {
    let mut a = new_alloc(config());
    let blocks = weights(&mut a);
    let Begun::Copy(mut pinning) = a.begin_prepare_sleep("weights").unwrap() else {
        panic!("five pieces to pin");
    };
    assert_eq!(pinning.pinned_bytes(), 5 * PIECE);
    assert_eq!(a.stats().host_kept_bytes, 5 * PIECE, "counted while pinned");
    assert!(matches!(
        a.begin_prepare_sleep("weights"),
        Ok(Begun::Done(0))
    ));
    let other = a.alloc_tagged(PAGE, StreamId(1), "weights").unwrap();
    a.free(other).unwrap();
    a.check_invariants().unwrap();

    a.sleep("weights", true).unwrap();
    pinning.run();
    assert_eq!(a.finish_prepare_sleep(*pinning).unwrap(), 0, "not kept");
    assert_eq!(a.stats().host_kept_bytes, 5 * PIECE, "the sleep's pieces");
    drop(a.take_freed_host());
    assert_eq!(
        a.driver().pinned_host_bytes(),
        5 * PIECE,
        "the others freed"
    );
    a.check_invariants().unwrap();
    another_job(&mut a);
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));

    // Finished while the tag is awake, the pieces are its buffers.
    a.release_host_buffers(None).unwrap();
    drop(a.take_freed_host());
    let Begun::Copy(mut pinning) = a.begin_prepare_sleep("weights").unwrap() else {
        panic!("five pieces to pin");
    };
    pinning.run();
    assert_eq!(a.finish_prepare_sleep(*pinning).unwrap(), 5 * PIECE);
    let before = host_allocs(&a);
    a.sleep("weights", true).unwrap();
    assert_eq!(host_allocs(&a), before);
    a.wake("weights").unwrap();
    assert!(intact(&a, &blocks));
    a.check_invariants().unwrap();
}

/// A preparation that fails (pinning the first or a later piece, the event, the wait; also after its
/// effect) loses nothing: the tag stays awake with its bytes, keeps the pieces pinned before the
/// failure, and its sleep pins the rest.
#[test]
fn a_failed_preparation_keeps_what_it_pinned() {
    for (op, n) in [
        (Op::HostAlloc, 1),
        (Op::HostAlloc, 3),
        (Op::RecordEvent, 1),
        (Op::Synchronize, 1),
    ] {
        for after_effect in [false, true] {
            let case = format!("{op} {n} (after its effect: {after_effect})");
            let mut a = failing_alloc();
            let addr = a.alloc_tagged(15 * PAGE, StreamId(1), "weights").unwrap();
            let bytes = pattern(1, 15 * PAGE as usize);
            a.driver_mut().inner_mut().write(addr, &bytes).unwrap();
            match after_effect {
                true => a.driver_mut().fail_nth_after_effect(op, n),
                false => (a.driver_mut().inner_mut()).fail_nth(op, n, FaultKind::Error),
            }
            let err = a.prepare_sleep("weights").unwrap_err();
            assert!(matches!(err, Error::Driver(_)), "{case}: {err:?}");
            a.check_invariants().unwrap();
            assert_eq!(a.tag_infos()[0].state, "awake", "{case}");
            let pinned = a.driver().inner().counters().get(Op::HostAlloc);
            let kept = a.stats().host_kept_bytes;
            // A failed pinning (also one whose memory was made, then freed) ends the job there.
            let whole = if op == Op::HostAlloc { n - 1 } else { 5 };
            assert_eq!(kept, whole * PIECE, "{case}: what it pinned, kept");
            a.driver_mut().clear();
            a.driver_mut().inner_mut().clear_faults();
            a.sleep("weights", true).unwrap();
            let again = a.driver().inner().counters().get(Op::HostAlloc) - pinned;
            assert_eq!(again, 5 - whole, "{case}: the sleep pins the rest");
            a.wake("weights").unwrap();
            assert_eq!(
                a.driver().inner().read(addr, bytes.len()).unwrap(),
                bytes,
                "{case}"
            );
            a.check_invariants().unwrap();
        }
    }
}

/// A sleeping tag's kept bytes are read without waking it (torch_memory_saver's `get_cpu_backup`): a
/// whole block, a range across two adjacent blocks and across pieces, the same after another job wrote
/// over the device; memory of no sleeping tag reads as `None`; bytes not kept are `NotKept`; a copy
/// underway is `TagBusy`.
#[test]
fn a_sleeping_tags_kept_bytes_are_read_without_waking_it() {
    let mut a = new_alloc(config());
    let blocks = weights(&mut a);
    let s = StreamId(1);
    let untagged = a.alloc(PAGE, s).unwrap();
    let kv = a.alloc_tagged(2 * PAGE, s, "kv").unwrap();
    let freed = a.alloc_tagged(PAGE, s, "weights").unwrap();
    a.free(freed).unwrap();
    let read = |a: &Expandable<SimDriver>, addr: u64, len: u64| {
        let mut out = vec![0xAB; len as usize];
        a.read_kept(addr, &mut out).map(|tag| (tag, out))
    };
    let (addr0, size0, id0) = blocks[0];
    assert_eq!(read(&a, addr0, 16).unwrap(), (None, vec![0xAB; 16]));
    a.sleep("weights", true).unwrap();
    a.sleep("kv", false).unwrap();
    another_job(&mut a);
    a.check_invariants().unwrap();
    for &(addr, size, id) in &blocks {
        let (tag, out) = read(&a, addr, size).unwrap();
        assert_eq!(tag.as_deref(), Some("weights"));
        assert_eq!(out, pattern(id, size as usize), "block {addr:#x}");
    }
    // From the last page of the first block into the second (adjacent: one run), across pieces of three
    // pages (the first block's fifth page is the second piece's second).
    let (addr1, _, id1) = blocks[1];
    assert_eq!(addr0 + size0, addr1, "adjacent");
    let (_, out) = read(&a, addr1 - PAGE - 3, 2 * PAGE).unwrap();
    let mut expected = pattern(id0, size0 as usize)[(size0 - PAGE - 3) as usize..].to_vec();
    expected.extend(&pattern(id1, (PAGE - 3) as usize));
    assert_eq!(out, expected);
    assert_eq!(read(&a, untagged, 8).unwrap(), (None, vec![0xAB; 8]));
    assert_eq!(read(&a, 1 << 50, 8).unwrap().0, None, "not cuvmm's memory");
    let (last, size, _) = blocks[2];
    for (addr, len, tag) in [
        (kv, 8, "kv"),
        (freed, 8, "weights"),
        (last + size - 4, 8, "weights"),
    ] {
        let err = read(&a, addr, len).unwrap_err();
        assert!(
            matches!(&err, Error::NotKept { tag: t, addr: at, len: l } if t == tag && *at == addr && *l == len),
            "{addr:#x}: {err:?}"
        );
    }
    let Begun::Copy(mut copy) = a.begin_wake("weights").unwrap() else {
        panic!("the kept bytes are copied back");
    };
    assert!(matches!(
        read(&a, addr0, 8),
        Err(Error::TagBusy {
            operation: "read_kept",
            ..
        })
    ));
    copy.run();
    a.finish_wake(*copy).unwrap();
    assert_eq!(read(&a, addr0, 8).unwrap().0, None, "awake: on the device");
    assert!(intact(&a, &blocks));
    a.check_invariants().unwrap();
}

/// An allocator whose driver can fail a call, or a step after its effect (`AfterEffect`).
fn failing_alloc() -> Expandable<AfterEffect<SimDriver>> {
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(PAGE * PAGES)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    Expandable::new(AfterEffect::new(sim), config()).unwrap()
}

/// What every failure must leave: the tag awake (after a sleep) or asleep with its bytes kept (after a
/// wake), the books right, and the next try succeeding with every byte.
fn fails_and_recovers((waking, op, n): (bool, Op, u64), after_effect: bool) {
    let mut a = failing_alloc();
    let s = StreamId(1);
    let sizes = [5 * PAGE, 2 * PAGE + 100, 7 * PAGE];
    let blocks: Vec<(u64, u64)> = (sizes.iter())
        .map(|&size| (a.alloc_tagged(size, s, "weights").unwrap(), size))
        .collect();
    for (i, &(addr, size)) in blocks.iter().enumerate() {
        let bytes = pattern(i as u64, size as usize);
        a.driver_mut().inner_mut().write(addr, &bytes).unwrap();
    }
    let intact = |a: &Expandable<AfterEffect<SimDriver>>| {
        (blocks.iter().enumerate()).all(|(i, &(addr, size))| {
            a.driver().inner().read(addr, size as usize).unwrap()
                == pattern(i as u64, size as usize)
        })
    };
    let plan = |a: &mut Expandable<AfterEffect<SimDriver>>| match after_effect {
        true => a.driver_mut().fail_nth_after_effect(op, n),
        false => a.driver_mut().inner_mut().fail_nth(op, n, FaultKind::Error),
    };
    let reserved = a.stats().reserved_bytes.current;
    let case = format!("{op} {n}, waking {waking} (after its effect: {after_effect})");
    if !waking {
        plan(&mut a);
        let err = a.sleep("weights", true).unwrap_err();
        assert!(matches!(err, Error::Driver(_)), "{case}: {err:?}");
        a.check_invariants().unwrap();
        assert!(a.asleep_tags().is_empty(), "{case}: the tag stays awake");
        assert_eq!(a.stats().reserved_bytes.current, reserved, "{case}");
        assert!(intact(&a), "{case}: its bytes on the device");
        let mut out = [7u8; 8];
        assert_eq!(a.read_kept(blocks[0].0, &mut out).unwrap(), None, "{case}");
        assert_eq!(out, [7; 8], "{case}: nothing read of a tag awake");
        let freed_and_again = a.alloc_tagged(PAGE, s, "weights").unwrap();
        a.free(freed_and_again).unwrap();
        a.driver_mut().clear();
        a.driver_mut().inner_mut().clear_faults();
        a.sleep("weights", true).unwrap();
    } else {
        a.sleep("weights", true).unwrap();
        plan(&mut a);
        let err = a.wake("weights").unwrap_err();
        assert!(matches!(err, Error::Driver(_)), "{case}: {err:?}");
        a.check_invariants().unwrap();
        assert_eq!(a.asleep_tags().len(), 1, "{case}: the tag stays asleep");
        assert!(matches!(
            a.alloc_tagged(PAGE, s, "weights"),
            Err(Error::TagAsleep { .. })
        ));
        assert!(a.tag_infos()[0].bytes_kept, "{case}: its bytes kept");
        for (i, &(addr, size)) in blocks.iter().enumerate() {
            let mut out = vec![0u8; size as usize];
            let tag = a.read_kept(addr, &mut out).unwrap();
            assert_eq!(tag.as_deref(), Some("weights"), "{case}");
            assert_eq!(
                out,
                pattern(i as u64, size as usize),
                "{case}: kept, readable"
            );
        }
        a.driver_mut().clear();
        a.driver_mut().inner_mut().clear_faults();
    }
    a.wake("weights").unwrap();
    assert!(intact(&a), "{case}: every byte after the wake");
    a.check_invariants().unwrap();
    for (addr, _) in blocks {
        a.free(addr).unwrap();
    }
    a.empty_cache().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

/// Failures at a sleep (`false`): pinning the first or a later piece, the first or a later copy, the
/// event, the wait (the sleep's only synchronization: no stream is busy); at a wake (`true`): a copy back,
/// its event, its wait. The number is the call's among the sleep's (or the wake's) calls of that kind.
const FAILURES: [(bool, Op, u64); 10] = [
    (false, Op::HostAlloc, 1),
    (false, Op::HostAlloc, 3),
    (false, Op::CopyToHost, 1),
    (false, Op::CopyToHost, 4),
    (false, Op::RecordEvent, 1),
    (false, Op::Synchronize, 1),
    (true, Op::CopyFromHost, 1),
    (true, Op::CopyFromHost, 3),
    (true, Op::RecordEvent, 1),
    (true, Op::Synchronize, 1),
];

#[test]
fn a_failed_host_allocation_copy_event_or_wait_loses_nothing() {
    for failure in FAILURES {
        fails_and_recovers(failure, false);
    }
}

#[test]
fn a_copy_step_that_fails_after_its_effect_loses_nothing() {
    for failure in FAILURES {
        fails_and_recovers(failure, true);
    }
}

/// A graph captured inside a tag (its static input allocated before, its temporaries and output during
/// the capture, under the tag) sleeps with the tag: its memory is given back, and the replay finds every
/// page again after the wake, the freed temporaries' included.
#[test]
fn a_graph_captured_in_a_tag_sleeps_and_replays_after_the_wake() {
    let mut a = new_alloc(config());
    let (s, capture) = (StreamId(1), StreamId(3));
    let input = a.alloc_tagged(4 * PAGE, s, "graph").unwrap();
    write_pattern(&mut a, input, 1, 4 * PAGE);
    let pool = GraphPool(1, 0);
    let id = begin_capture(&mut a, capture, pool, CaptureMode::ThreadLocal);
    let tmp = a.alloc_tagged(6 * PAGE, capture, "graph").unwrap();
    let input_range = VaRange::new(input, 4 * PAGE);
    a.driver_mut()
        .launch(capture, &[input_range, VaRange::new(tmp, 6 * PAGE)])
        .unwrap();
    let out = a.alloc_tagged(2 * PAGE, capture, "graph").unwrap();
    let out_range = VaRange::new(out, 2 * PAGE);
    a.driver_mut()
        .launch(capture, &[VaRange::new(tmp, 6 * PAGE), out_range])
        .unwrap();
    a.free(tmp).unwrap();
    end_capture(&mut a, capture, pool);
    write_pattern(&mut a, out, 2, 2 * PAGE);
    a.driver_mut().replay_graph(id, s).unwrap();
    a.driver_mut().complete_stream(s);
    let pool_bytes = a.stats().graph_pool_bytes;
    assert!(pool_bytes >= 8 * PAGE, "{pool_bytes}");

    let used = a.driver().used_bytes();
    let given = a.sleep("graph", true).unwrap();
    assert!(given >= 12 * PAGE, "the graph's pages too: {given}");
    assert_eq!(a.driver().used_bytes(), used - given);
    assert!(matches!(
        a.driver_mut().replay_graph(id, s),
        Err(DriverError::NotMapped { .. })
    ));
    a.check_invariants().unwrap();
    another_job(&mut a);
    a.wake("graph").unwrap();
    a.driver_mut()
        .replay_graph(id, s)
        .expect("the replay finds its memory, the freed temporaries' included");
    a.driver_mut().complete_stream(s);
    assert!(holds_pattern(&a, input, 1, 4 * PAGE));
    assert!(holds_pattern(&a, out, 2, 2 * PAGE), "the output kept");
    assert_eq!(a.stats().graph_pool_bytes, pool_bytes);
    a.check_invariants().unwrap();
    a.release_pool(pool).unwrap();
    a.free(out).unwrap();
    a.free(input).unwrap();
    a.check_invariants().unwrap();
}

/// The driver refuses to unmap what a copy job copies until the job is over, as it refuses memory pending
/// work uses; a job whose range is not mapped is refused at its start.
#[test]
fn a_copy_jobs_ranges_are_not_unmapped_under_it() {
    let mut d = SimDriver::new(
        SimConfig::default()
            .with_capacity(8 * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let va = d.reserve(4 * PAGE).unwrap();
    let handle = d.create(2 * PAGE).unwrap();
    d.map(va.start, 2 * PAGE, handle).unwrap();
    d.set_access(va.start, 2 * PAGE).unwrap();
    d.write(va.start + 100, b"kept").unwrap();
    let plan = CopyPlan {
        direction: CopyDirection::ToHost,
        pieces: vec![PAGE],
        allocate: vec![true],
        copies: vec![HostCopy {
            va: va.start + 100,
            len: 4,
            piece: 0,
            offset: 8,
        }],
        pinning: HostPinning::default(),
    };
    let job = d.start_copies(plan.clone()).unwrap();
    assert_eq!(
        d.unmap(va.start, 2 * PAGE),
        Err(DriverError::UnmapWhileInUse {
            va: va.start + 100,
            stream: COPY_STREAM
        })
    );
    let outcome = job.run(vec![None]);
    outcome.result.unwrap();
    let piece = outcome.pieces.into_iter().next().flatten().unwrap();
    assert!(piece.is_pinned());
    assert_eq!(&piece.as_slice()[8..12], b"kept");
    d.unmap(va.start, 2 * PAGE).unwrap();
    let mut outside = plan;
    outside.copies[0].va = va.start + 2 * PAGE;
    assert!(matches!(
        d.start_copies(outside),
        Err(DriverError::NotMapped { .. })
    ));
    d.release(handle).unwrap();
    d.free_reservation(va).unwrap();
}

/// The rates the simulator's latency model gives a sleep and a wake of 256 MiB kept, under the H100 model:
/// an estimate of the link's speed (25 GB/s assumed for a pinned copy, 4 GB/s for pinning), printed with
/// `cargo test --test sleep_wake_copies estimated -- --nocapture`. The first sleep pins its pieces, later
/// ones reuse them, so a later sleep is estimated faster; so is a first sleep after `prepare_sleep`.
#[test]
fn estimated_rates_under_the_h100_model() {
    const MIB: u64 = 1 << 20;
    let sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(1024 * MIB)
            .with_backing_store(true)
            .with_latency(cuvmm::driver::sim::LatencyModel::h100()),
    );
    let mut a = Expandable::new(sim, Config::default()).unwrap();
    let size = 256 * MIB;
    let weights = a.alloc_tagged(size, StreamId(1), "weights").unwrap();
    a.driver_mut().memset_d8(weights, size, 3).unwrap();
    let ns = |a: &Expandable<SimDriver>| a.driver().counters().time_ns;
    let mut rates = Vec::new();
    for cycle in 0..3 {
        let t0 = ns(&a);
        a.sleep("weights", true).unwrap();
        let t1 = ns(&a);
        a.wake("weights").unwrap();
        let t2 = ns(&a);
        let gbps = |ns: u64| size as f64 / ns as f64;
        println!(
            "cycle {cycle}: sleep {:.1} ms ({:.1} GB/s), wake {:.1} ms ({:.1} GB/s) (H100 model, an estimate)",
            (t1 - t0) as f64 / 1e6,
            gbps(t1 - t0),
            (t2 - t1) as f64 / 1e6,
            gbps(t2 - t1)
        );
        rates.push((gbps(t1 - t0), gbps(t2 - t1)));
    }
    // Pinned ahead (`prepare_sleep`), a first sleep copies as fast as a later one.
    a.release_host_buffers(None).unwrap();
    drop(a.take_freed_host());
    let t0 = ns(&a);
    a.prepare_sleep("weights").unwrap();
    let t1 = ns(&a);
    a.sleep("weights", true).unwrap();
    let t2 = ns(&a);
    let prepared = size as f64 / (t2 - t1) as f64;
    println!(
        "prepared: pinning {:.1} ms, then the first sleep {:.1} ms ({prepared:.1} GB/s) (H100 model, an estimate)",
        (t1 - t0) as f64 / 1e6,
        (t2 - t1) as f64 / 1e6,
    );
    a.wake("weights").unwrap();
    let bytes = a.driver().read(weights, size as usize).unwrap();
    assert!(bytes.iter().all(|&b| b == 3));
    assert!(rates[1].0 > 2.0 * rates[0].0, "{rates:?}");
    assert!(rates[1].0 > 20.0 && rates[1].1 > 20.0, "{rates:?}");
    assert!(prepared > 2.0 * rates[0].0, "{prepared} {rates:?}");
}
