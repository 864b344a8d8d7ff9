//! Replaying a trace through an allocator, and the result a replay reports.
//!
//! [`replay`] runs a [`Trace`] through a [`Strategy`]; [`allocators`] builds every allocator by name (with
//! `cuda_async`, CUDA's own, on a GPU); [`observe`] watches a replay while it runs; [`peak`] finds the
//! allocator's state at its peak.

pub mod allocators;
#[cfg(feature = "cuda")]
pub mod cuda_async;
mod id_table;
pub mod observe;
pub mod peak;

use crate::trace::event::{Event, Trace};
use cuvmm::driver::sim::{Calibration, LatencyModel};
use cuvmm::driver::{DriverCounters, Op};
use cuvmm::strategy::error::{Error, InvariantViolation, OutOfMemory};
use cuvmm::strategy::{DeviceBytes, Strategy};
use id_table::{IdTable, Slot};
use observe::{NoObserver, ReplayObserver};
use serde::Serialize;
use std::time::Instant;

/// How to replay.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ReplayOptions {
    /// Call [`Strategy::check_invariants`] after every N events (and after the last one); `None` never does.
    pub check_invariants_every: Option<usize>,
    /// Write a byte pattern into each allocation ([`DeviceBytes::memset`]) and check a sample of it
    /// ([`DeviceBytes::copy_to_host`]: its first, middle and last [`TOUCH_SAMPLE`] bytes) before it is
    /// freed. Needs a strategy with [`DeviceBytes`].
    /// Proves on a real device that live allocations do not overlap and that their memory is really there.
    pub touch: bool,
}

/// Bytes read back from each end and from the middle of an allocation by a touching replay.
pub const TOUCH_SAMPLE: u64 = 64;

/// The byte a touching replay writes into allocation `id`: never 0 (fresh memory often is), and different
/// for neighbouring ids.
pub fn touch_byte(id: u64) -> u8 {
    (id % 255) as u8 + 1
}

/// Driver calls a replay made, per operation (the JSON object `driver_calls`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct DriverCalls {
    /// `cuMemCreate` calls.
    pub create: u64,
    /// `cuMemRelease` calls.
    pub release: u64,
    /// `cuMemMap` calls.
    pub map: u64,
    /// `cuMemUnmap` calls.
    pub unmap: u64,
    /// `cuMemSetAccess` calls.
    pub set_access: u64,
    /// `cuMemAlloc` calls.
    pub malloc: u64,
    /// `cuMemFree` calls.
    pub free: u64,
}

impl DriverCalls {
    /// The operations counted here: memory management, without events and synchronizations.
    pub const OPS: [Op; 7] = [
        Op::Create,
        Op::Release,
        Op::Map,
        Op::Unmap,
        Op::SetAccess,
        Op::Malloc,
        Op::Free,
    ];

    /// The calls counted in `counters`.
    pub fn from_counters(counters: &DriverCounters) -> Self {
        Self {
            create: counters.get(Op::Create),
            release: counters.get(Op::Release),
            map: counters.get(Op::Map),
            unmap: counters.get(Op::Unmap),
            set_access: counters.get(Op::SetAccess),
            malloc: counters.get(Op::Malloc),
            free: counters.get(Op::Free),
        }
    }

    /// All of these calls together.
    pub fn total(&self) -> u64 {
        self.create
            + self.release
            + self.map
            + self.unmap
            + self.set_access
            + self.malloc
            + self.free
    }
}

/// An estimate of the memory-management calls' time under each latency model: the A100 figures under both
/// extreme calibrations, and the H100's and H200's measured models.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct ByModel {
    /// A100: each figure a fixed cost per call.
    pub per_call: f64,
    /// A100: each figure a cost per 2 MiB covered.
    pub per_byte: f64,
    /// H100, measured (`LatencyModel::h100`): a fixed cost per call (per mapping for set_access and
    /// unmap) and a cost per 2 MiB covered.
    pub h100: f64,
    /// H200, measured (`LatencyModel::h200`), as `h100`.
    pub h200: f64,
}

impl ByModel {
    /// The estimates for the memory-management calls in `counters`.
    pub fn of(counters: &DriverCounters) -> Self {
        let model = LatencyModel::a100();
        let us = |c| model.estimate_us(counters, &DriverCalls::OPS, c);
        Self {
            per_call: us(Calibration::PerCall),
            per_byte: us(Calibration::PerByte),
            h100: LatencyModel::h100().estimate_us(
                counters,
                &DriverCalls::OPS,
                Calibration::PerByte,
            ),
            h200: LatencyModel::h200().estimate_us(
                counters,
                &DriverCalls::OPS,
                Calibration::PerByte,
            ),
        }
    }
}

/// What replaying one workload through one allocator measured. Its JSON field names are stable: later
/// versions only add fields.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ReplayResult {
    /// The trace's name.
    pub workload: String,
    /// The allocator's [`Strategy::name`].
    pub allocator: String,
    /// Events replayed.
    pub events: usize,
    /// The trace's own peak of live requested bytes (what a perfect allocator would need).
    pub peak_live_bytes: u64,
    /// Peak of the allocator's allocated bytes.
    pub peak_allocated_bytes: u64,
    /// Peak of the allocator's reserved bytes.
    pub peak_reserved_bytes: u64,
    /// Peak allocated over peak reserved (1.0 if nothing was reserved).
    pub utilization: f64,
    /// Allocations that failed with out-of-memory (their frees were skipped).
    pub ooms: u64,
    /// Driver calls made.
    pub driver_calls: DriverCalls,
    /// Driver time the calls cost (estimated on the simulated device), in microseconds.
    pub estimated_driver_us: f64,
    /// The estimated time of the calls in `driver_calls` (events and synchronizations left out) under both
    /// extreme calibrations of the latency model, in microseconds (`sim::LatencyModel`,
    /// [`cuvmm::driver::sim::LATENCY_SOURCES`]). 0 on a backend that records no units.
    pub estimated_driver_us_by_model: ByModel,
    /// Event calls (record, query, destroy): for streams that use other streams' blocks.
    pub event_calls: u64,
    /// Stream synchronizations the allocator made (before unmapping pages, or to drain pending frees).
    pub synchronizations: u64,
    /// Wall time of the replay loop, in seconds.
    pub replay_seconds: f64,
    /// The first out-of-memory error, with its diagnosis (not in the JSON: its message is for people).
    #[serde(skip)]
    pub first_oom: Option<Box<OutOfMemory>>,
}

/// Why a replay stopped.
#[derive(Debug, thiserror::Error)]
pub enum ReplayError {
    /// An allocation failed with an error other than out-of-memory.
    #[error("event {index}: allocation {id} of {size} bytes failed: {source}")]
    Alloc {
        /// Position of the event in the trace.
        index: usize,
        /// The allocation's id.
        id: u64,
        /// Bytes requested.
        size: u64,
        /// What the allocator said.
        source: Error,
    },
    /// A free failed.
    #[error("event {index}: free of allocation {id} failed: {source}")]
    Free {
        /// Position of the event in the trace.
        index: usize,
        /// The allocation's id.
        id: u64,
        /// What the allocator said.
        source: Error,
    },
    /// An allocation reuses the id of a live allocation.
    #[error("event {index}: allocation {id} is already live")]
    DuplicateId {
        /// Position of the event in the trace.
        index: usize,
        /// The id.
        id: u64,
    },
    /// A free names no live allocation (and no allocation that failed with out-of-memory).
    #[error("event {index}: free of {id}, which is not live")]
    UnknownFree {
        /// Position of the event in the trace.
        index: usize,
        /// The id.
        id: u64,
    },
    /// Writing or reading an allocation's bytes failed ([`ReplayOptions::touch`]).
    #[error("event {index}: touching allocation {id} failed: {source}")]
    Touch {
        /// Position of the event in the trace.
        index: usize,
        /// The allocation's id.
        id: u64,
        /// What the allocator (its driver) said.
        source: Error,
    },
    /// An allocation's bytes changed between its allocation and its free ([`ReplayOptions::touch`]).
    #[error(
        "event {index}: allocation {id} at {addr:#x}: byte {offset} is {found:#04x}, expected {expected:#04x}"
    )]
    Corrupted {
        /// Position of the event in the trace (the free).
        index: usize,
        /// The allocation's id.
        id: u64,
        /// The allocation's address.
        addr: u64,
        /// Offset of the first wrong byte found.
        offset: u64,
        /// The byte written.
        expected: u8,
        /// The byte read back.
        found: u8,
    },
    /// A record_stream names no live allocation (and no allocation that failed with out-of-memory).
    #[error("event {index}: record_stream of {id}, which is not live")]
    RecordStreamNotLive {
        /// Position of the event in the trace.
        index: usize,
        /// The id.
        id: u64,
    },
    /// A record_stream failed (other than by being unsupported).
    #[error("event {index}: record_stream of allocation {id} failed: {source}")]
    RecordStream {
        /// Position of the event in the trace.
        index: usize,
        /// The allocation's id.
        id: u64,
        /// What the allocator said.
        source: Error,
    },
    /// Releasing the cache ([`Event::EmptyCache`]) failed.
    #[error("event {index}: empty_cache failed: {source}")]
    EmptyCache {
        /// Position of the event in the trace.
        index: usize,
        /// What the allocator said.
        source: Error,
    },
    /// The allocator broke an invariant.
    #[error("after event {index}: invariant broken: {source}")]
    Invariant {
        /// Position of the last event applied.
        index: usize,
        /// The violation.
        source: InvariantViolation,
    },
}

/// Replays `trace` through `strategy`: allocations in the trace map to the addresses the strategy returns.
/// An allocation that fails with out-of-memory is counted in [`ReplayResult::ooms`] and its free (and
/// record_streams) skipped; any other failure stops the replay with the index of the event.
///
/// A [`Event::RecordStream`] calls [`StreamUses::record_stream`](cuvmm::strategy::StreamUses::record_stream). An allocator that does not track streams
/// (no [`Strategy::stream_uses`]) replays it as nothing: no kernel runs during a replay, so the only effect
/// of a cross-stream use is when the memory may be reused, and such an allocator reuses it at once.
///
/// An [`Event::EmptyCache`] calls [`Strategy::empty_cache`]: every allocator gives back what it caches,
/// and pays for growing again afterwards.
pub fn replay(
    strategy: &mut dyn Strategy,
    trace: &Trace,
    options: &ReplayOptions,
) -> Result<ReplayResult, ReplayError> {
    replay_observed(strategy, trace, options, &mut NoObserver)
}

/// As [`replay`], telling `observer` when the replay starts and after each event (see
/// [`ReplayObserver`]). [`replay`] passes [`NoObserver`], for which the calls compile to nothing.
pub fn replay_observed<O: ReplayObserver + ?Sized>(
    strategy: &mut dyn Strategy,
    trace: &Trace,
    options: &ReplayOptions,
    observer: &mut O,
) -> Result<ReplayResult, ReplayError> {
    // Laid out before the clock starts: the table is the replay's bookkeeping, not the allocator's work.
    let mut ids = IdTable::new(
        trace.events.len(),
        trace.events.iter().filter_map(|event| match *event {
            Event::Alloc { id, .. } => Some(id),
            _ => None,
        }),
    );
    let mut ooms = 0;
    let mut first_oom = None;
    observer.start(trace, strategy);
    let start = Instant::now();
    for (index, event) in trace.events.iter().enumerate() {
        match *event {
            Event::Alloc { id, size, stream } => {
                if let Slot::Live { .. } = ids.get(id) {
                    return Err(ReplayError::DuplicateId { index, id });
                }
                match strategy.alloc(size, stream) {
                    Ok(addr) => {
                        ids.set(id, Slot::Live { addr, size });
                        if options.touch {
                            device_bytes(strategy)
                                .and_then(|bytes| bytes.memset(addr, size, touch_byte(id)))
                                .map_err(|source| ReplayError::Touch { index, id, source })?;
                        }
                    }
                    Err(e) if e.is_out_of_memory() => {
                        ooms += 1;
                        ids.set(id, Slot::Failed);
                        if let (None, Error::OutOfMemory(oom)) = (&first_oom, e) {
                            first_oom = Some(oom);
                        }
                    }
                    Err(source) => {
                        return Err(ReplayError::Alloc {
                            index,
                            id,
                            size,
                            source,
                        });
                    }
                }
            }
            Event::Free { id } => match ids.get(id) {
                Slot::Live { addr, size } => {
                    ids.set(id, Slot::Unknown);
                    if options.touch {
                        check_touched(strategy, index, id, addr, size)?;
                    }
                    strategy
                        .free(addr)
                        .map_err(|source| ReplayError::Free { index, id, source })?
                }
                Slot::Failed => ids.set(id, Slot::Unknown),
                Slot::Unknown => return Err(ReplayError::UnknownFree { index, id }),
            },
            Event::RecordStream { id, stream } => match ids.get(id) {
                // A strategy that does not track streams replays it as nothing.
                Slot::Live { addr, .. } => {
                    if let Some(uses) = strategy.stream_uses() {
                        uses.record_stream(addr, stream)
                            .map_err(|source| ReplayError::RecordStream { index, id, source })?;
                    }
                }
                Slot::Failed => {}
                Slot::Unknown => return Err(ReplayError::RecordStreamNotLive { index, id }),
            },
            Event::EmptyCache => strategy
                .empty_cache()
                .map_err(|source| ReplayError::EmptyCache { index, source })?,
        }
        let last = index + 1 == trace.events.len();
        let due = |every: usize| last || (every > 0 && (index + 1) % every == 0);
        if options.check_invariants_every.is_some_and(due) {
            strategy
                .check_invariants()
                .map_err(|source| ReplayError::Invariant { index, source })?;
        }
        observer.after_event(index, strategy);
    }
    let replay_seconds = start.elapsed().as_secs_f64();
    let stats = strategy.stats();
    let counters = strategy.driver_counters();
    Ok(ReplayResult {
        workload: trace.name.clone(),
        allocator: strategy.name().to_string(),
        events: trace.events.len(),
        peak_live_bytes: trace.peak_live_bytes(),
        peak_allocated_bytes: stats.allocated_bytes.peak,
        peak_reserved_bytes: stats.reserved_bytes.peak,
        utilization: stats.utilization(),
        ooms,
        driver_calls: DriverCalls::from_counters(&counters),
        estimated_driver_us: counters.time_us(),
        estimated_driver_us_by_model: ByModel::of(&counters),
        event_calls: [Op::RecordEvent, Op::QueryEvent, Op::DestroyEvent]
            .iter()
            .map(|&op| counters.get(op))
            .sum(),
        synchronizations: stats.num_synchronizations,
        replay_seconds,
        first_oom,
    })
}

/// Reads back the first, middle and last [`TOUCH_SAMPLE`] bytes of allocation `id` and checks that each is
/// its [`touch_byte`].
fn check_touched(
    strategy: &mut dyn Strategy,
    index: usize,
    id: u64,
    addr: u64,
    size: u64,
) -> Result<(), ReplayError> {
    let expected = touch_byte(id);
    let len = size.min(TOUCH_SAMPLE);
    let mut sample = vec![0; len as usize];
    for offset in [0, (size - len) / 2, size - len] {
        device_bytes(strategy)
            .and_then(|bytes| bytes.copy_to_host(addr + offset, &mut sample))
            .map_err(|source| ReplayError::Touch { index, id, source })?;
        if let Some(at) = sample.iter().position(|&b| b != expected) {
            return Err(ReplayError::Corrupted {
                index,
                id,
                addr,
                offset: offset + at as u64,
                expected,
                found: sample[at],
            });
        }
    }
    Ok(())
}

/// The strategy's [`DeviceBytes`], which a `--touch` replay needs; [`Error::Unsupported`] without them.
fn device_bytes(strategy: &mut dyn Strategy) -> Result<&mut dyn DeviceBytes, Error> {
    let unsupported = strategy.unsupported("memset and copy_to_host (--touch)");
    strategy.device_bytes().ok_or(unsupported)
}
