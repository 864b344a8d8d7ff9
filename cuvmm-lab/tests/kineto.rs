//! The PyTorch profiler trace in `../shared/traces` (ResNet-50 on a V100, `profile_memory=True`) loads as a
//! valid trace whose counts match what the traces' README says of the file, and replays through cuvmm.

use cuvmm_lab::replay::ReplayOptions;
use cuvmm_lab::replay::allocators;
use cuvmm_lab::replay::replay;
use cuvmm_lab::trace::Event;
use cuvmm_lab::trace::load::{self, LoadError};
use std::path::{Path, PathBuf};

const FILE: &str = "kineto_resnet50_v100_memory_events.pt.trace.json.gz";

fn kineto_trace() -> Option<PathBuf> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/traces")
        .join(FILE);
    if !path.exists() {
        println!("skipped: {} is absent", path.display());
        return None;
    }
    Some(path)
}

#[test]
fn the_profiler_trace_loads_with_every_memory_event_and_replays_through_cuvmm() {
    let Some(path) = kineto_trace() else { return };
    let traces = load::load(&path, None).unwrap();
    assert_eq!(traces.len(), 1, "one CUDA device");
    let trace = &traces[0];
    assert_eq!(trace.name, FILE);
    assert_eq!(trace.validate(), Ok(()));
    // The README counts 8,220 CUDA memory events, 4,110 allocations and 4,110 frees; frees of memory
    // allocated before profiling are seeded as allocations, so there are at least 4,110 of those.
    let frees = trace
        .events
        .iter()
        .filter(|e| matches!(e, Event::Free { .. }))
        .count();
    assert_eq!(frees, 4110);
    let seeded = trace.alloc_count() - 4110;
    assert!(seeded < 4110, "{seeded} seeded allocations");

    let mut cuvmm = allocators::build("cuvmm", 32 << 30, 2 << 20).unwrap();
    let result = replay(cuvmm.as_mut(), trace, &ReplayOptions::default()).unwrap();
    assert_eq!(result.ooms, 0);
    assert_eq!(result.peak_live_bytes, trace.peak_live_bytes());
    assert!(result.peak_allocated_bytes >= result.peak_live_bytes);
}

#[test]
fn a_device_without_memory_events_is_named_in_the_error() {
    let Some(path) = kineto_trace() else { return };
    let err = load::load(&path, Some(3)).unwrap_err();
    assert!(matches!(err, LoadError::Kineto(_)), "{err}");
    let message = err.to_string();
    assert!(
        message.contains(FILE) && message.contains("device 3"),
        "{message}"
    );
}
