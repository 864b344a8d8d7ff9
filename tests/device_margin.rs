//! The device margin (`device_margin_mb`, `Allocator::set_device_margin`, torch_memory_saver's
//! `memory_margin_bytes`): a request's growth leaves that much of the device free, counting what other
//! processes use. Past it a request is served from idle memory (the cache released and retried, as on a full
//! device) or fails with an out-of-memory that names the margin; a wake, which maps what its tag had, is
//! exempt; with chunks, single pages are tried where a chunk would cross it.

mod common;

use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::driver::{Driver as _, PhysHandle};
use cuvmm::expandable::Expandable;
use cuvmm::oom::Suggestion;
use cuvmm::strategy::Controls as _;
use cuvmm::{Config, Error, Strategy as _, StreamId};

const PAGE: u64 = 2 << 20;
/// A 128 MiB device.
const PAGES: u64 = 64;
const S0: StreamId = StreamId(0);
const S1: StreamId = StreamId(1);

/// An allocator configured by `conf` on a device shared with another process, which then takes `taken`
/// pages (held while the returned process and its handles live).
fn shared(conf: &str, taken: u64) -> (Expandable<SimDriver>, SimDriver, Vec<PhysHandle>) {
    let mut sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(PAGES * PAGE)
            .with_granularity(PAGE)
            .with_backing_store(false),
    );
    let mut other = sim.another_process();
    let config = Config::from_alloc_conf(conf).expect("valid configuration");
    let a = Expandable::new(sim, config).unwrap();
    let handles = (0..taken).map(|_| other.create(PAGE).unwrap()).collect();
    (a, other, handles)
}

fn device_free(a: &mut Expandable<SimDriver>) -> u64 {
    a.driver_mut().mem_info().unwrap().free
}

#[test]
fn the_key_sets_the_margin_and_bad_values_are_refused() {
    assert_eq!(Config::default().device_margin, 0);
    let config = Config::from_alloc_conf("device_margin_mb:1024").unwrap();
    assert_eq!(config.device_margin, 1 << 30);
    assert_eq!(Config::default().with_device_margin(5).device_margin, 5);
    for bad in ["x", "-1", "1.5", "", "99999999999999999"] {
        let conf = format!("device_margin_mb:{bad}");
        let err = Config::from_alloc_conf(&conf).expect_err(&conf);
        assert!(
            err.to_string().contains("device_margin_mb"),
            "{conf}: {err}"
        );
    }
}

#[test]
fn growth_leaves_the_margin_free_and_a_request_past_it_names_it() {
    // With 20 MiB chunks the last one fills the 40 pages (8 left free); single pages leave 9.
    for (conf, free) in [
        ("device_margin_mb:16", 8),
        ("device_margin_mb:16,large_handle_mb:2", 9),
    ] {
        // Another process holds 16 of the 64 pages; 8 pages are to stay free: 40 pages may be created.
        let (mut a, _other, _held) = shared(conf, 16);
        let mut live = Vec::new();
        while let Ok(addr) = a.alloc(3 * PAGE, S0) {
            a.check_invariants().unwrap();
            assert!(
                device_free(&mut a) >= 8 * PAGE,
                "{conf}: {}",
                device_free(&mut a)
            );
            live.push(addr);
        }
        assert_eq!(live.len(), 13, "{conf}: 39 of the 40 pages, 3 at a time");
        let err = a.alloc(3 * PAGE, S0).unwrap_err();
        let Error::OutOfMemory(oom) = &err else {
            panic!("{conf}: {err:?}");
        };
        assert_eq!(oom.margin, 8 * PAGE, "{conf}");
        assert_eq!(oom.device_free, free * PAGE, "{conf}");
        assert_eq!(
            oom.suggestion(),
            Suggestion::LowerMargin {
                margin: 8 * PAGE,
                need: (3 + 8 - free) * PAGE
            },
            "{conf}"
        );
        assert!(err.to_string().contains("device margin"), "{conf}: {err}");
        a.check_invariants().unwrap();
        // Lowered at run time, the same request is served.
        a.set_device_margin(4 * PAGE);
        live.push(a.alloc(3 * PAGE, S0).unwrap());
        a.set_device_margin(0);
        live.push(a.alloc(6 * PAGE, S0).unwrap());
        a.check_invariants().unwrap();
        for addr in live {
            a.free(addr).unwrap();
        }
        a.check_invariants().unwrap();
    }
}

#[test]
fn past_the_margin_idle_memory_serves_the_request() {
    let (mut a, _other, _held) = shared("device_margin_mb:16,large_handle_mb:2", 16);
    // 30 pages idle in stream 1's cache: a request of 20 on stream 0 would cross the margin with new pages,
    // so the cache is released and the request served as on a full device.
    let cached = a.alloc(30 * PAGE, S1).unwrap();
    a.free(cached).unwrap();
    let mine = a.alloc(20 * PAGE, S0).unwrap();
    a.check_invariants().unwrap();
    assert!(device_free(&mut a) >= 8 * PAGE);
    let stats = a.stats();
    assert_eq!(stats.num_ooms, 0);
    assert!(stats.reserved_bytes.peak <= 40 * PAGE);
    a.free(mine).unwrap();
    a.check_invariants().unwrap();
}

#[test]
fn a_wake_maps_its_tags_memory_whatever_the_margin() {
    let (mut a, mut other, mut held) = shared("large_handle_mb:2", 0);
    let weights = a.alloc_tagged(20 * PAGE, S0, "weights").unwrap();
    a.sleep("weights", false).unwrap();
    // Another process takes all but 24 pages; 8 are to stay free.
    held.extend((0..40).map(|_| other.create(PAGE).unwrap()));
    a.set_device_margin(8 * PAGE);
    a.wake("weights").unwrap();
    a.check_invariants().unwrap();
    assert_eq!(device_free(&mut a), 4 * PAGE, "the wake took its 20 pages");
    assert!(a.alloc(PAGE, S0).unwrap_err().is_out_of_memory());
    a.free(weights).unwrap();
    a.check_invariants().unwrap();
}
