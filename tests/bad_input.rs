//! A user's mistakes are typed errors, never panics, and leave the allocator usable.

mod common;

use cuvmm::history::TraceAction;
use cuvmm::strategy::Snapshots;
use cuvmm::{Error, Strategy, StreamId};

const PAGE: u64 = 1 << 16;
const S: StreamId = StreamId::DEFAULT;

#[test]
fn size_zero_is_refused() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    assert!(matches!(alloc.alloc(0, S), Err(Error::ZeroSize)));
    alloc.check_invariants().unwrap();
}

#[test]
fn sizes_beyond_the_device_can_never_fit() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    alloc.record_history(Some(8)).unwrap();
    let sizes = [16 * PAGE + 1, 1 << 40, u64::MAX - 100, u64::MAX];
    for size in sizes {
        match alloc.alloc(size, S) {
            Err(Error::TooLarge {
                requested,
                capacity,
            }) => {
                assert_eq!((requested, capacity), (size, 16 * PAGE));
            }
            other => panic!("alloc({size}) gave {other:?}"),
        }
    }
    // Each is an out-of-memory, counted and recorded as PyTorch does.
    assert_eq!(alloc.stats().num_ooms, 4);
    let traces = alloc.snapshot().unwrap().device_traces.concat();
    let ooms: Vec<u64> = (traces.iter())
        .filter(|t| t.action == TraceAction::Oom)
        .map(|t| t.size)
        .collect();
    assert_eq!(ooms, sizes);
    let a = alloc.alloc(16 * PAGE, S).expect("exactly the device fits");
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn free_of_unknown_addresses() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let a = alloc.alloc(3000, S).unwrap();
    for addr in [0, 1, a + 512, a - 512, u64::MAX] {
        assert!(
            matches!(
                alloc.free(addr),
                Err(Error::UnknownAddress { .. }) | Err(Error::DoubleFree { .. })
            ),
            "{addr:#x}"
        );
    }
    assert!(matches!(alloc.free(a + 512), Err(Error::UnknownAddress { addr }) if addr == a + 512));
    assert!(matches!(
        alloc.free(0),
        Err(Error::UnknownAddress { addr: 0 })
    ));
    alloc.free(a).unwrap();
    alloc.check_invariants().unwrap();
}

#[test]
fn double_free_is_reported() {
    let mut alloc = common::expandable(PAGE, 16, 1024, false);
    let a = alloc.alloc(3000, S).unwrap();
    let b = alloc.alloc(3000, S).unwrap();
    alloc.free(a).unwrap();
    assert!(matches!(alloc.free(a), Err(Error::DoubleFree { addr }) if addr == a));
    alloc.free(b).unwrap();
    assert!(matches!(alloc.free(b), Err(Error::DoubleFree { .. })));
    alloc.check_invariants().unwrap();
    assert_eq!(alloc.stats().allocated_bytes.current, 0);
}

#[test]
fn a_page_size_that_is_not_a_multiple_of_the_granularity_is_refused() {
    let sim = cuvmm::driver::sim::SimDriver::new(
        cuvmm::driver::sim::SimConfig::default()
            .with_capacity(16 * PAGE)
            .with_granularity(PAGE),
    );
    let err = cuvmm::expandable::Expandable::new(
        sim,
        cuvmm::Config::default().with_page_size(PAGE + 512),
    )
    .unwrap_err();
    // The key, the size given and the granularity it must be a multiple of: what the user needs to fix it.
    let message = err.to_string();
    assert!(message.contains("page_size_mb"), "{message}");
    assert!(
        message.contains(&format!("{} bytes", PAGE + 512)),
        "{message}"
    );
    assert!(
        message.contains(&format!("granularity is {PAGE} bytes")),
        "{message}"
    );
}
