//! Fidelity of the PyTorch models against real PyTorch: replay a recorded snapshot through the model that
//! matches its allocator, started from the reconstructed state, and compare the segment events.
//!
//! The model runs on a [`SimDriver`] that hands each `cudaMalloc` the address PyTorch recorded (so ties
//! in best fit break by the same addresses) and whose capacity is generous, unless the trace shows memory
//! released because a device allocation failed: then the capacity is the most PyTorch ever held, the one
//! value consistent with every recorded `cudaMalloc` succeeding and the failed one failing.

use crate::pytorch_model::{SeedError, SegmentAction, SegmentEvent, Split};
use crate::trace::load::{self, LoadError, TraceFormat};
use crate::trace::pytorch::{self, PytorchTrace, SnapshotError, TraceOp};
use cuvmm::driver::sim::{SimConfig, SimDriver};
use cuvmm::size::{GIB, MIB};
use cuvmm::strategy::Strategy;
use cuvmm::strategy::error::Error;
use serde::Serialize;
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

/// One side of the comparison.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct Side {
    /// Segment events (`segment_alloc`/`segment_free`, or `segment_map`/`segment_unmap`).
    pub segment_events: usize,
    /// The most bytes reserved at once, the starting state included.
    pub peak_reserved_bytes: u64,
}

/// What `cuvmm fidelity` reports (its JSON is exactly these fields).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct FidelityReport {
    /// The snapshot file, as given.
    pub trace: String,
    /// The device replayed.
    pub device: usize,
    /// The model: "classic" or "pytorch-expandable".
    pub mode: String,
    /// What PyTorch did.
    pub ground_truth: Side,
    /// What the model did.
    pub model: Side,
    /// The longest common subsequence of the two lists of segment events, compared by action and size,
    /// over the longer list (so extra model events count against it too); 1 when both are empty.
    pub segment_event_match: f64,
    /// |model - truth| / truth of the peak reserved bytes.
    pub peak_reserved_error: f64,
    /// Diagnostics that are not part of the JSON.
    #[serde(skip)]
    pub details: FidelityDetails,
}

/// How the replay went, for diagnosis.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct FidelityDetails {
    /// Allocations replayed.
    pub allocs: usize,
    /// Allocations that the model placed at the address PyTorch used.
    pub same_address: usize,
    /// Allocations the model could not serve.
    pub ooms: usize,
    /// The model's segment events.
    pub model_events: Vec<SegmentEvent>,
    /// The device capacity the model ran with.
    pub capacity: u64,
}

/// Why a fidelity run failed.
#[derive(Debug, thiserror::Error)]
pub enum FidelityError {
    /// The file cannot be read, or is in no format a trace has.
    #[error(transparent)]
    Load(#[from] LoadError),
    /// The file is a trace of another kind: only a snapshot records PyTorch's own decisions.
    #[error(
        "{path}: {format}, not a PyTorch memory snapshot: fidelity compares with PyTorch's own decisions, which only a snapshot records (torch.cuda.memory._dump_snapshot)"
    )]
    NotASnapshot {
        /// The file.
        path: PathBuf,
        /// What it is.
        format: TraceFormat,
    },
    /// The snapshot cannot be used.
    #[error(transparent)]
    Snapshot(#[from] SnapshotError),
    /// The model rejected the configuration or the device.
    #[error("building the model: {0}")]
    Build(Error),
    /// A reconstructed starting segment could not be adopted.
    #[error("seeding the segment PyTorch had at {addr:#x}: {source}")]
    Seed {
        /// Where PyTorch had it.
        addr: u64,
        /// Why.
        source: SeedError,
    },
    /// The model failed a request for a reason other than out-of-memory.
    #[error("request {index} of the trace: {source}")]
    Replay {
        /// Position among the requests.
        index: usize,
        /// What the model said.
        source: Error,
    },
}

impl FidelityError {
    /// Whether the input is at fault (a file that is not a usable snapshot) rather than the model.
    pub fn is_bad_input(&self) -> bool {
        matches!(
            self,
            FidelityError::Load(_)
                | FidelityError::NotASnapshot { .. }
                | FidelityError::Snapshot(_)
        )
    }
}

/// Reads the snapshot at `path` and measures the model against `device` (the busiest when `None`).
pub fn fidelity(path: &Path, device: Option<usize>) -> Result<FidelityReport, FidelityError> {
    let format = load::detect(path)?;
    if format != TraceFormat::PytorchSnapshot {
        return Err(FidelityError::NotASnapshot {
            path: path.to_path_buf(),
            format,
        });
    }
    let trace = pytorch::load(path, device)?;
    run(&trace, &path.display().to_string())
}

/// Replays `trace` through the matching model and compares; `name` labels the report.
pub fn run(trace: &PytorchTrace, name: &str) -> Result<FidelityReport, FidelityError> {
    let capacity = if trace.oom_releases {
        trace.peak_reserved
    } else {
        (80 * GIB).max(trace.peak_reserved.saturating_mul(2))
    };
    let mut sim = SimDriver::new(
        SimConfig::default()
            .with_capacity(capacity)
            .with_granularity(2 * MIB),
    );
    let plan = trace.initial.iter().map(|s| (s.size, s.addr)).chain(
        trace
            .segment_events
            .iter()
            .filter(|e| e.action == SegmentAction::SegmentAlloc)
            .map(|e| (e.size, e.addr)),
    );
    sim.plan_malloc_addresses(plan);
    let mut config = trace.config.clone();
    config.expandable_segments = trace.expandable;
    let mut model = Split::new(sim, config).map_err(FidelityError::Build)?;
    // Trace address -> model address of every live allocation.
    let mut addrs: HashMap<u64, u64> = HashMap::new();
    if !trace.expandable {
        for seg in &trace.initial {
            let base = model
                .adopt_segment(&seg.seed())
                .map_err(|source| FidelityError::Seed {
                    addr: seg.addr,
                    source,
                })?;
            for b in &seg.live {
                addrs.insert(seg.addr + b.offset, base + b.offset);
            }
        }
    }
    model.record_segment_events(true);
    let mut details = FidelityDetails {
        capacity,
        ..FidelityDetails::default()
    };
    let mut failed: HashSet<u64> = HashSet::new();
    for (index, op) in trace.ops.iter().enumerate() {
        match *op {
            TraceOp::Alloc { addr, size, stream } => {
                details.allocs += 1;
                match model.alloc(size, stream) {
                    Ok(got) => {
                        details.same_address += usize::from(got == addr);
                        addrs.insert(addr, got);
                        failed.remove(&addr);
                    }
                    Err(e) if e.is_out_of_memory() => {
                        details.ooms += 1;
                        failed.insert(addr);
                    }
                    Err(source) => return Err(FidelityError::Replay { index, source }),
                }
            }
            TraceOp::Free { addr } => {
                if let Some(got) = addrs.remove(&addr) {
                    model
                        .free(got)
                        .map_err(|source| FidelityError::Replay { index, source })?;
                } else {
                    failed.remove(&addr);
                }
            }
            TraceOp::EmptyCache => model
                .empty_cache()
                .map_err(|source| FidelityError::Replay { index, source })?,
        }
    }
    details.model_events = model.take_segment_events();
    let truth = Side {
        segment_events: trace.segment_events.len(),
        peak_reserved_bytes: trace.peak_reserved,
    };
    let ours = Side {
        segment_events: details.model_events.len(),
        peak_reserved_bytes: model.stats().reserved_bytes.peak,
    };
    let peak_reserved_error = if truth.peak_reserved_bytes == 0 {
        if ours.peak_reserved_bytes == 0 {
            0.0
        } else {
            1.0
        }
    } else {
        ours.peak_reserved_bytes.abs_diff(truth.peak_reserved_bytes) as f64
            / truth.peak_reserved_bytes as f64
    };
    Ok(FidelityReport {
        trace: name.to_string(),
        device: trace.device,
        mode: if trace.expandable {
            "pytorch-expandable"
        } else {
            "classic"
        }
        .to_string(),
        ground_truth: truth,
        model: ours,
        segment_event_match: event_match(&trace.segment_events, &details.model_events),
        peak_reserved_error,
        details,
    })
}

/// Length of the longest common subsequence of the two event lists (same action and size) over the
/// longer list's length; 1 when both are empty.
pub fn event_match(truth: &[SegmentEvent], model: &[SegmentEvent]) -> f64 {
    let longest = truth.len().max(model.len());
    if longest == 0 {
        return 1.0;
    }
    let key = |e: &SegmentEvent| (e.action, e.size);
    // Two rows of the dynamic programme: O(truth x model) time, O(model) memory.
    let mut prev = vec![0u32; model.len() + 1];
    let mut row = vec![0u32; model.len() + 1];
    for t in truth {
        for (j, m) in model.iter().enumerate() {
            row[j + 1] = if key(t) == key(m) {
                prev[j] + 1
            } else {
                row[j].max(prev[j + 1])
            };
        }
        std::mem::swap(&mut prev, &mut row);
    }
    f64::from(prev[model.len()]) / longest as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use cuvmm::driver::StreamId;

    fn ev(action: SegmentAction, size: u64) -> SegmentEvent {
        SegmentEvent {
            action,
            addr: 0,
            size,
            stream: StreamId::DEFAULT,
        }
    }

    #[test]
    fn event_match_is_the_common_subsequence_over_the_longer_list() {
        use SegmentAction::{SegmentAlloc as A, SegmentFree as F};
        assert_eq!(event_match(&[], &[]), 1.0);
        let truth = [ev(A, 2), ev(A, 20), ev(F, 2), ev(A, 4)];
        assert_eq!(event_match(&truth, &truth), 1.0);
        // One event missing: 3 of 4.
        assert_eq!(event_match(&truth, &truth[..3]), 0.75);
        // Same sizes, other action: no match.
        assert_eq!(event_match(&[ev(A, 2)], &[ev(F, 2)]), 0.0);
        // Extra model events count against the match too.
        assert_eq!(event_match(&[], &[ev(A, 2)]), 0.0);
        let swapped = [ev(A, 20), ev(A, 2), ev(F, 2), ev(A, 4)];
        assert_eq!(event_match(&truth, &swapped), 0.75);
    }
}
