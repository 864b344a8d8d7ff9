//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`) as replayable traces.
//!
//! [`load`] reads a pickled snapshot and returns, for one device, the requests in order ([`TraceOp`]),
//! the allocator's segment events (the ground truth a model must reproduce), the allocator's state when
//! recording began ([`InitialSegment`]s, reconstructed from the final `segments` and the events), and the
//! configuration PyTorch ran with. `../shared/traces/README.md` describes the format.

pub mod guard;
mod reconstruct;
pub mod releases;
mod requests;
mod settings;
pub mod snapshot;
/// The snapshot pickle writer, at its old path: it lives with the facade's snapshot (`cuvmm::strategy::snapshot::pickle`).
pub use cuvmm::strategy::snapshot::pickle as writer;

pub use snapshot::SnapshotError;

use crate::pytorch_model::{SeedBlock, SeedSegment, SegmentEvent};
use cuvmm::driver::StreamId;
use cuvmm::strategy::config::Config;
use cuvmm::strategy::pool::Pool;
use std::path::Path;

/// One request of a recorded trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TraceOp {
    /// `alloc`: PyTorch handed out `addr` for `size` requested bytes on `stream`.
    Alloc {
        /// The address PyTorch returned (the allocation's name in later events).
        addr: u64,
        /// Bytes requested.
        size: u64,
        /// The stream.
        stream: StreamId,
    },
    /// The block at `addr` returned to the cache (`free_completed`).
    Free {
        /// The address.
        addr: u64,
    },
    /// `torch.cuda.empty_cache()` was called.
    EmptyCache,
}

/// A segment held when recording began, with its live blocks (their offsets from `addr`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct InitialSegment {
    /// Where PyTorch had it.
    pub addr: u64,
    /// Bytes.
    pub size: u64,
    /// Its stream.
    pub stream: StreamId,
    /// Its pool.
    pub pool: Pool,
    /// Blocks live at the start, in address order.
    pub live: Vec<SeedBlock>,
}

impl InitialSegment {
    /// The segment as a seed for [`Split::adopt_segment`](crate::pytorch_model::Split::adopt_segment).
    pub fn seed(&self) -> SeedSegment {
        SeedSegment {
            size: self.size,
            stream: self.stream,
            pool: self.pool,
            live: self.live.clone(),
        }
    }
}

/// One device's trace, ready to replay.
#[derive(Clone, Debug)]
pub struct PytorchTrace {
    /// The device ordinal.
    pub device: usize,
    /// Whether PyTorch ran with expandable segments (its settings, `segment_map` events or expandable
    /// segments say so).
    pub expandable: bool,
    /// The configuration PyTorch ran with.
    pub config: Config,
    /// The requests, in order.
    pub ops: Vec<TraceOp>,
    /// Segments held when recording began, in address order.
    pub initial: Vec<InitialSegment>,
    /// PyTorch's segment events, in order.
    pub segment_events: Vec<SegmentEvent>,
    /// Bytes reserved when recording began.
    pub initial_reserved: u64,
    /// The most bytes reserved at once during the trace.
    pub peak_reserved: u64,
    /// Whether some memory was released because a device allocation failed (rather than by
    /// `empty_cache`): replaying that needs the device's capacity.
    pub oom_releases: bool,
}

/// Reads the snapshot at `path` and builds the trace of `device`, or of the busiest device (the one with
/// the most trace entries) when `device` is `None`.
///
/// # Errors
/// [`SnapshotError`], naming the file, for a file that cannot be read, is not a snapshot, lacks the device,
/// or contradicts itself.
pub fn load(path: &Path, device: Option<usize>) -> Result<PytorchTrace, SnapshotError> {
    let raw = snapshot::read(path)?;
    let device = reconstruct::pick_device(path, &raw, device)?;
    let config = settings::config_from_settings(path, raw.allocator_settings.as_ref())?;
    reconstruct::build(path, &raw, device, config)
}

/// Reads the snapshot at `path` and builds the trace of `device`, or, when `device` is `None`, of every
/// device that has trace entries (the busiest one if none has), in device order.
///
/// # Errors
/// As [`load`].
pub fn load_devices(
    path: &Path,
    device: Option<usize>,
) -> Result<Vec<PytorchTrace>, SnapshotError> {
    devices_from_raw(path, &snapshot::read(path)?, device)
}

/// As [`load_devices`], from the pickle's bytes; `path` names the snapshot in errors.
///
/// # Errors
/// As [`load`].
pub fn parse_devices(
    path: &Path,
    bytes: &[u8],
    device: Option<usize>,
) -> Result<Vec<PytorchTrace>, SnapshotError> {
    devices_from_raw(path, &snapshot::parse(path, bytes)?, device)
}

fn devices_from_raw(
    path: &Path,
    raw: &snapshot::RawSnapshot,
    device: Option<usize>,
) -> Result<Vec<PytorchTrace>, SnapshotError> {
    let config = settings::config_from_settings(path, raw.allocator_settings.as_ref())?;
    let devices: Vec<usize> = match device {
        Some(_) => vec![reconstruct::pick_device(path, raw, device)?],
        None => {
            let busy: Vec<usize> = (0..raw.device_traces.len())
                .filter(|&d| raw.device_traces[d].as_ref().is_some_and(|e| !e.is_empty()))
                .collect();
            if busy.is_empty() {
                vec![reconstruct::pick_device(path, raw, None)?]
            } else {
                busy
            }
        }
    };
    devices
        .into_iter()
        .map(|d| reconstruct::build(path, raw, d, config.clone()))
        .collect()
}
