//! `compaction:split`: where memory is plentiful, exactly `compaction:pressure`'s driver calls; past the
//! budget, chunks that live blocks still touch are re-created as single pages at the same addresses, their
//! live bytes kept, after one device synchronization; and the out-of-memory diagnosis of the default names
//! the stranded bytes and the setting that would have made the request fit.

mod common;

use common::{begin_capture, expandable_with, pattern};
use cuvmm::config::Compaction;
use cuvmm::driver::CaptureMode;
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver, Op, StreamId};
use cuvmm::expandable::Expandable;
use cuvmm::oom::{StrandedRemedy, Suggestion};
use cuvmm::strategy::{Controls, DeviceBytes, GraphPools, Sharing};
use cuvmm::{Config, Error, Strategy};
use cuvmm::{GraphPool, StreamFilter};

const PAGE: u64 = 1 << 16;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

/// Chunks of 4 pages, `compaction` as given.
fn config(compaction: Compaction) -> Config {
    Config {
        large_handle: 4 * PAGE,
        small_size: 1024,
        ..Config::default()
    }
    .with_compaction(compaction)
}

/// A 32-page device with chunks of 4 pages, `compaction` as given.
fn allocator(compaction: Compaction) -> Expandable<SimDriver> {
    expandable_with(PAGE, 32, config(compaction), true)
}

/// Fills the device with 8 chunks, each kept by a one-page block written with a pattern; returns those
/// blocks.
fn strand(a: &mut Expandable<SimDriver>) -> Vec<u64> {
    let mut big = Vec::new();
    let mut kept = Vec::new();
    for i in 0..8 {
        big.push(a.alloc(3 * PAGE, S0).unwrap());
        let addr = a.alloc(PAGE, S0).unwrap();
        a.copy_from_host_for_test(addr, &pattern(i, PAGE as usize));
        kept.push(addr);
    }
    for addr in big {
        a.free(addr).unwrap();
    }
    a.check_invariants().unwrap();
    kept
}

/// After `strand`, a request of the 12 pages that only the 24 stranded ones would hold runs out of memory,
/// naming them and `remedy`; returns the message.
fn runs_out_naming_the_stranded_pages(
    a: &mut Expandable<SimDriver>,
    remedy: StrandedRemedy,
) -> String {
    let err = a.alloc(12 * PAGE, S1).unwrap_err();
    let Error::OutOfMemory(oom) = &err else {
        panic!("{err}");
    };
    assert_eq!(oom.stranded, 24 * PAGE);
    assert_eq!(
        oom.suggestion(),
        Suggestion::Stranded {
            stranded: 24 * PAGE,
            setting: remedy
        }
    );
    err.to_string()
}

/// Each block `strand` kept holds its pattern.
fn assert_kept(a: &mut Expandable<SimDriver>, kept: &[u64]) {
    for (i, &addr) in kept.iter().enumerate() {
        let mut out = vec![0; PAGE as usize];
        a.copy_to_host(addr, &mut out).unwrap();
        assert_eq!(
            out,
            pattern(i as u64, PAGE as usize),
            "block {i} kept its bytes"
        );
    }
}

/// Frees `blocks`, then the cache: nothing is left reserved.
fn free_all(a: &mut Expandable<SimDriver>, blocks: impl IntoIterator<Item = u64>) {
    for addr in blocks {
        a.free(addr).unwrap();
    }
    a.empty_cache().unwrap();
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, 0);
}

trait Write {
    fn copy_from_host_for_test(&mut self, addr: u64, bytes: &[u8]);
}

impl Write for Expandable<SimDriver> {
    fn copy_from_host_for_test(&mut self, addr: u64, bytes: &[u8]) {
        self.driver_mut().copy_from_host(addr, bytes).unwrap();
    }
}

#[test]
fn a_request_past_the_budget_splits_stranded_chunks_and_keeps_the_live_bytes() {
    let mut a = allocator(Compaction::Split);
    let kept = strand(&mut a);
    let syncs = a.driver().counters().get(Op::Synchronize);
    // 24 idle pages in chunks that live pages touch: only a split gives them back.
    let addr = a.alloc(12 * PAGE, S1).unwrap();
    a.check_invariants().unwrap();
    assert!(
        a.driver().counters().get(Op::Synchronize) > syncs,
        "the device synchronized"
    );
    assert_kept(&mut a, &kept);
    free_all(&mut a, [addr].into_iter().chain(kept));
}

/// A 64-page device shared with another process, an allocator made on it (its budget counts on the whole
/// device), then the other process taking 32 pages: the driver runs out of memory before the budget is
/// reached. Returns the allocator and the other process, which holds its pages while it lives.
fn half_taken_by_another_process(compaction: Compaction) -> (Expandable<SimDriver>, SimDriver) {
    let mut sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(64 * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(true),
    );
    let mut other = sim.another_process();
    let a = Expandable::new(sim, config(compaction)).unwrap();
    for _ in 0..32 {
        other.create(PAGE).unwrap();
    }
    (a, other)
}

#[test]
fn a_device_full_before_the_budget_splits_stranded_chunks_too() {
    // The budget is what was free when the allocator started. On a GPU the device fills up before it
    // where other processes took memory since, or the driver's own (an H200 behind `cuvmm capacity
    // --backend cuda`'s ballast ran out a page before the budget, and `compaction:split` never split): the
    // driver's out-of-memory, not the budget, says memory ran out, and the split must run then too.
    let (mut a, _other) = half_taken_by_another_process(Compaction::Split);
    let kept = strand(&mut a);
    let addr = a.alloc(12 * PAGE, S1).unwrap();
    a.check_invariants().unwrap();
    assert_kept(&mut a, &kept);
    free_all(&mut a, [addr].into_iter().chain(kept));
    // The default cannot: it runs out, naming the stranded pages and the setting.
    let (mut a, _other) = half_taken_by_another_process(Compaction::Pressure);
    strand(&mut a);
    runs_out_naming_the_stranded_pages(&mut a, StrandedRemedy::Split);
    a.check_invariants().unwrap();
}

#[test]
fn the_default_runs_out_of_memory_and_names_the_stranded_bytes_and_the_setting() {
    let mut a = allocator(Compaction::Pressure);
    strand(&mut a);
    let text = runs_out_naming_the_stranded_pages(&mut a, StrandedRemedy::Split);
    assert!(
        text.contains("1.50 MiB of idle pages lie in multi-page handles"),
        "{text}"
    );
    assert_eq!(
        text.matches("lie in multi-page handles").count(),
        1,
        "said once: {text}"
    );
    assert!(text.contains("or call release_stranded()"), "{text}");
    assert!(text.contains("set compaction:split"), "{text}");
    a.check_invariants().unwrap();
}

#[test]
fn plentiful_memory_makes_pressures_calls_exactly() {
    let run = |compaction| {
        let mut a = expandable_with(PAGE, 4096, config(compaction), false);
        let mut live = Vec::new();
        for i in 0..300u64 {
            let size = ((i * 7919) % 13 + 1) * 3 * PAGE / 2 + (i % 5) * 4096 + 512;
            live.push(a.alloc(size, StreamId(i % 2)).unwrap());
            if live.len() > 6 {
                let victim = live.remove(((i * 31) % live.len() as u64) as usize);
                a.free(victim).unwrap();
            }
            a.check_invariants().unwrap();
        }
        a.driver().counters()
    };
    let (pressure, split) = (run(Compaction::Pressure), run(Compaction::Split));
    assert_eq!(pressure, split);
    assert_eq!(split.get(Op::Synchronize), 0);
}

#[test]
fn memory_shared_with_another_process_is_never_split() {
    // The other process maps the same handles: re-created ones would no longer share the bytes.
    let mut a = allocator(Compaction::Split);
    let kept = strand(&mut a);
    let shared = a.share(kept[0]).unwrap();
    // All the blocks are in one segment, which has shared memory: nothing is split.
    let text =
        runs_out_naming_the_stranded_pages(&mut a, StrandedRemedy::SinglePages { page_size: PAGE });
    assert!(
        text.contains("set large_handle_mb of the page size"),
        "{text}"
    );
    drop(shared);
    a.check_invariants().unwrap();
}

#[test]
fn release_stranded_gives_back_the_stranded_pages_under_the_default_policy_and_keeps_the_live_bytes()
 {
    // The program's own call at a quiescent point: no `compaction:split` needed.
    let mut a = allocator(Compaction::Pressure);
    let kept = strand(&mut a);
    let reserved = a.stats().reserved_bytes.current;
    let syncs = a.driver().counters().get(Op::Synchronize);
    assert_eq!(a.release_stranded().unwrap(), 24 * PAGE);
    a.check_invariants().unwrap();
    assert_eq!(a.stats().reserved_bytes.current, reserved - 24 * PAGE);
    assert!(
        a.driver().counters().get(Op::Synchronize) > syncs,
        "the device synchronized before the live bytes moved"
    );
    assert_kept(&mut a, &kept);
    // Nothing is stranded any more: a second call gives nothing back, and the request that ran out of
    // memory before (the test above) now fits.
    assert_eq!(a.release_stranded().unwrap(), 0);
    let addr = a.alloc(12 * PAGE, S1).unwrap();
    a.check_invariants().unwrap();
    free_all(&mut a, [addr].into_iter().chain(kept));
}

#[test]
fn release_stranded_leaves_shared_memory_and_is_refused_during_a_capture() {
    let mut a = allocator(Compaction::Pressure);
    let kept = strand(&mut a);
    let shared = a.share(kept[0]).unwrap();
    assert_eq!(
        a.release_stranded().unwrap(),
        0,
        "the shared segment is not split"
    );
    drop(shared);
    begin_capture(&mut a, StreamId(2), GraphPool(3, 0), CaptureMode::Global);
    assert!(matches!(
        a.release_stranded(),
        Err(Error::CaptureUnderway {
            operation: "release_stranded"
        })
    ));
    a.check_invariants().unwrap();
}

#[test]
fn release_stranded_leaves_a_live_graph_pool_and_splits_it_once_released() {
    // A live pool's addresses are baked into its graphs, and its pages stay where they are (`pinned`).
    let mut a = allocator(Compaction::Pressure);
    let pool = GraphPool(5, 0);
    a.begin_allocate_to_pool(pool, StreamFilter::Streams(vec![S0]))
        .unwrap();
    let kept = strand(&mut a);
    a.end_allocate_to_pool(pool).unwrap();
    let reserved = a.stats().reserved_bytes.current;
    assert_eq!(a.release_stranded().unwrap(), 0, "the live pool is left");
    assert_eq!(a.stats().reserved_bytes.current, reserved);
    // Released with blocks still live, the pool is memory like any other.
    a.release_pool(pool).unwrap();
    assert_eq!(a.release_stranded().unwrap(), 24 * PAGE);
    a.check_invariants().unwrap();
    assert_kept(&mut a, &kept);
    free_all(&mut a, kept);
}
