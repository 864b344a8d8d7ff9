//! The allocator on the driver under test: random allocations and frees with every byte checked.

use super::*;
use cuvmm::strategy::DeviceBytes;

#[derive(Debug, Clone)]
enum Action {
    Alloc { size: u64, stream: u64 },
    Free { pick: usize },
    EmptyCache,
    Trim { pages: u64 },
}

fn action(max_size: u64) -> impl Strategy<Value = Action> {
    prop_oneof![
        6 => (0u32..=16, 1u64..=1 << 16, 0u64..3).prop_map(move |(shift, frac, stream)| {
            // Log-uniform sizes from 1 byte to `max_size`.
            let size = (((max_size >> shift).max(1) * frac) >> 16).max(1);
            Action::Alloc { size, stream }
        }),
        5 => any::<usize>().prop_map(|pick| Action::Free { pick }),
        1 => Just(Action::EmptyCache),
        1 => (0u64..4).prop_map(|pages| Action::Trim { pages }),
    ]
}

/// The byte written into allocation number `n`.
fn pattern(n: u64) -> u8 {
    (n % 251) as u8 + 1
}

/// The allocator's property test on drivers from `make`: `cases` random sequences of up to 120 actions
/// with requests of up to four pages. Checks, after every step: allocations are 512 B aligned and do not
/// overlap, `check_invariants()` holds, and each allocation's first and last bytes are still the pattern
/// written into it when it is freed; at the end, after freeing everything and `empty_cache()`, the driver
/// holds nothing. Out-of-memory is allowed (the bound on it is `tests/expandable_model.rs`'s business).
pub fn allocator_properties<D: Subject>(make: impl Fn() -> D, cases: u32) {
    let mut runner = TestRunner::new(RunnerConfig {
        cases,
        failure_persistence: None,
        ..RunnerConfig::default()
    });
    let g = make().granularity();
    let outcome = runner.run(&prop::collection::vec(action(4 * g), 1..120), |actions| {
        run_actions(make(), actions);
        Ok(())
    });
    if let Err(e) = outcome {
        panic!("allocator property failed: {e}");
    }
}

fn run_actions<D: Subject>(driver: D, actions: Vec<Action>) {
    // 4-page chunks under a 16-page budget: past it, idle pages are unmapped, stranded chunk pages are
    // lent (mapped again from their offset), and then new pages created while the device has room.
    let g = driver.granularity();
    let config = Config {
        small_size: 4096,
        large_handle: 4 * g,
        reserve_budget: Some(Budget::Bytes(16 * g)),
        ..Config::default()
    };
    let mut alloc = Expandable::new(driver, config).expect("allocator");
    // addr -> (size, pattern)
    let mut live: BTreeMap<u64, (u64, u8)> = BTreeMap::new();
    let mut n = 0;
    for action in actions {
        match action {
            Action::Alloc { size, stream } => match alloc.alloc(size, StreamId(stream)) {
                Ok(addr) => {
                    assert_eq!(addr % 512, 0, "misaligned {addr:#x}");
                    let rounded = size.next_multiple_of(512);
                    if let Some((&prev, &(psize, _))) = live.range(..addr).next_back() {
                        assert!(prev + psize <= addr, "{prev:#x}+{psize} overlaps {addr:#x}");
                    }
                    if let Some((&next, _)) = live.range(addr..).next() {
                        assert!(
                            addr + rounded <= next,
                            "{addr:#x}+{size} overlaps {next:#x}"
                        );
                    }
                    n += 1;
                    let byte = pattern(n);
                    alloc
                        .memset(addr, size, byte)
                        .expect("memset a new allocation");
                    live.insert(addr, (size, byte));
                }
                Err(Error::OutOfMemory(_)) => {}
                Err(e) => panic!("alloc({size}) failed: {e}"),
            },
            Action::Free { pick } => {
                if live.is_empty() {
                    continue;
                }
                let addr = *live
                    .keys()
                    .nth(pick % live.len())
                    .expect("a live allocation");
                let (size, byte) = live.remove(&addr).expect("live");
                check_pattern(&mut alloc, addr, size, byte);
                alloc.free(addr).expect("free");
            }
            Action::EmptyCache => alloc.empty_cache().expect("empty_cache"),
            Action::Trim { pages } => {
                alloc.trim(pages * alloc.page_size()).expect("trim");
            }
        }
        alloc
            .check_invariants()
            .unwrap_or_else(|v| panic!("invariant broken: {v}"));
    }
    for (addr, (size, byte)) in std::mem::take(&mut live) {
        check_pattern(&mut alloc, addr, size, byte);
        alloc.free(addr).expect("free at the end");
    }
    alloc.empty_cache().expect("final empty_cache");
    alloc.check_invariants().expect("invariants at the end");
    let held = alloc.driver().held();
    assert!(held.is_empty(), "the driver still holds {held}");
}

/// Checks the first and last (up to) 64 bytes of an allocation.
fn check_pattern<S: DeviceBytes>(alloc: &mut S, addr: u64, size: u64, byte: u8) {
    let len = size.min(64);
    for at in [addr, addr + size - len] {
        let mut out = vec![0; len as usize];
        alloc.copy_to_host(at, &mut out).expect("copy_to_host");
        assert!(
            out.iter().all(|&b| b == byte),
            "allocation {addr:#x} ({size} B): bytes at {at:#x} changed: {out:?}, expected {byte}"
        );
    }
}
