//! Properties of the built-in workloads: deterministic, valid, of the intended scale and size mix.

use cuvmm::driver::StreamId;
use cuvmm::size::{GIB, KIB};
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::Trace;
use cuvmm_lab::workload::{self, BUILTIN, DEFAULT_SEED};
use std::collections::HashMap;

fn all(seed: u64) -> Vec<Trace> {
    BUILTIN
        .iter()
        .map(|name| workload::generate(name, seed).expect("built-in workload"))
        .collect()
}

fn sizes(trace: &Trace) -> impl Iterator<Item = u64> + '_ {
    trace.events.iter().filter_map(|e| match e {
        Event::Alloc { size, .. } => Some(*size),
        Event::Free { .. } | Event::RecordStream { .. } | Event::EmptyCache => None,
    })
}

#[test]
fn same_seed_same_trace_and_different_seeds_differ() {
    for name in BUILTIN {
        let a = workload::generate(name, 7).unwrap();
        assert_eq!(a, workload::generate(name, 7).unwrap(), "{name}");
        assert_ne!(a, workload::generate(name, 8).unwrap(), "{name}");
        assert_eq!(a.name, *name);
    }
}

#[test]
fn traces_are_valid_and_of_the_intended_scale() {
    for seed in [DEFAULT_SEED, 1, 2] {
        for trace in all(seed) {
            let name = &trace.name;
            assert_eq!(trace.validate(), Ok(()), "{name} seed {seed}");
            let events = trace.events.len();
            assert!(
                (10_000..=100_000).contains(&events),
                "{name} seed {seed}: {events} events"
            );
            let peak = trace.peak_live_bytes();
            assert!(
                (8 * GIB..80 * GIB).contains(&peak),
                "{name} seed {seed}: peak live {peak}"
            );
        }
    }
}

#[test]
fn sizes_span_bytes_to_gibibytes() {
    let traces = all(DEFAULT_SEED);
    let min = traces.iter().flat_map(sizes).min().unwrap();
    let max = traces.iter().flat_map(sizes).max().unwrap();
    assert!(min < KIB, "smallest size {min}");
    assert!(max >= GIB, "largest size {max}");
    for trace in &traces {
        let distinct: std::collections::HashSet<u64> = sizes(trace).collect();
        assert!(
            distinct.len() >= 20,
            "{}: only {} distinct sizes",
            trace.name,
            distinct.len()
        );
    }
}

#[test]
fn multi_stream_workload_frees_on_the_allocating_stream_and_uses_side_streams() {
    let trace = workload::generate("stream-producer-consumer", DEFAULT_SEED).unwrap();
    let mut stream_of: HashMap<u64, StreamId> = HashMap::new();
    for event in &trace.events {
        if let Event::Alloc { id, stream, .. } = *event {
            stream_of.insert(id, stream);
        }
    }
    let streams: std::collections::BTreeSet<StreamId> = stream_of.values().copied().collect();
    assert!(streams.len() >= 3, "{streams:?}");
    assert!(!streams.contains(&StreamId::DEFAULT), "{streams:?}");
}

#[test]
fn multi_stream_workloads_hand_buffers_across_streams() {
    let names: Vec<&str> = BUILTIN
        .iter()
        .copied()
        .filter(|n| n.contains("stream"))
        .collect();
    assert!(names.contains(&"stream-prefetch-offload"), "{names:?}");
    for name in names {
        let trace = workload::generate(name, DEFAULT_SEED).unwrap();
        let mut stream_of: HashMap<u64, StreamId> = HashMap::new();
        let mut handed = 0;
        for event in &trace.events {
            match *event {
                Event::Alloc { id, stream, .. } => {
                    stream_of.insert(id, stream);
                }
                Event::RecordStream { id, stream } => {
                    assert_ne!(
                        stream_of[&id], stream,
                        "{name}: record_stream on the own stream"
                    );
                    handed += 1;
                }
                Event::Free { .. } | Event::EmptyCache => {}
            }
        }
        assert!(handed >= 1_000, "{name}: only {handed} record_streams");
    }
}

#[test]
fn prefetched_weights_are_allocated_on_the_side_stream_and_freed_after_use() {
    let trace = workload::generate("stream-prefetch-offload", DEFAULT_SEED).unwrap();
    let mut alloc_stream: HashMap<u64, StreamId> = HashMap::new();
    let mut used_on: HashMap<u64, StreamId> = HashMap::new();
    for event in &trace.events {
        match *event {
            Event::Alloc { id, stream, .. } => {
                alloc_stream.insert(id, stream);
            }
            Event::RecordStream { id, stream } => {
                used_on.insert(id, stream);
            }
            Event::Free { id } => {
                if let Some(user) = used_on.remove(&id) {
                    assert_ne!(alloc_stream[&id], user);
                }
            }
            Event::EmptyCache => {}
        }
    }
    assert!(used_on.is_empty(), "every prefetched buffer is freed");
    let streams: std::collections::BTreeSet<StreamId> = alloc_stream.values().copied().collect();
    assert_eq!(streams.len(), 2, "{streams:?}");
}

#[test]
fn unknown_workload_is_none_and_every_builtin_is_described() {
    assert!(workload::generate("no-such", 1).is_none());
    assert!(workload::description("no-such").is_none());
    for name in BUILTIN {
        assert!(!workload::description(name).unwrap().is_empty());
    }
}
