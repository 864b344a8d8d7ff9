//! PyTorch profiler (Kineto) traces: the `[memory]` events of `torch.profiler.profile(profile_memory=True)`,
//! as written by `export_chrome_trace` (`*.pt.trace.json`, often gzipped).
//!
//! Each `[memory]` instant event carries `Bytes` (positive: an allocation, negative: a free of that many
//! bytes), `Device Type` (1 = CUDA) and `Device Id`, but no address, so a free cannot name its allocation.
//! It is matched to the most recent live allocation of the same size on the device. Which of several
//! same-sized allocations a free releases is then a guess, but the bytes live at every moment, and so the
//! peak live bytes, are exact. A free that matches no live allocation released memory allocated before
//! profiling began: it is seeded as an allocation at the start, as snapshots' live blocks are.

use super::event::{Event, Trace};
use cuvmm::driver::StreamId;
use serde::Deserialize;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Kineto's `Device Type` of a CUDA device.
const CUDA: i64 = 1;
/// No single allocation reaches 2^50 bytes (1 PiB).
const MAX_SIZE: u64 = 1 << 50;

/// Why a profiler trace cannot be replayed. Every message names the file.
#[derive(Debug, thiserror::Error)]
pub enum KinetoError {
    /// The file cannot be decompressed.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a Chrome-trace JSON object with a `traceEvents` list.
    #[error("{path}: not a PyTorch profiler trace: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// Why.
        source: serde_json::Error,
    },
    /// A `[memory]` event of a CUDA device has no usable `Bytes`.
    #[error("{path}: memory event {index}: `Bytes` is missing, 0 or beyond any device")]
    BadBytes {
        /// The file.
        path: PathBuf,
        /// Position of the event among the file's events.
        index: usize,
    },
    /// No CUDA device has memory events (the profiler ran without `profile_memory=True`, or on no GPU).
    #[error(
        "{path}: no CUDA memory events (record with torch.profiler.profile(profile_memory=True))"
    )]
    NoMemoryEvents {
        /// The file.
        path: PathBuf,
    },
    /// The device asked for has no memory events.
    #[error("{path}: no memory events on CUDA device {device} (devices with events: {devices})")]
    NoSuchDevice {
        /// The file.
        path: PathBuf,
        /// The device asked for.
        device: usize,
        /// The devices that have events, comma-separated (empty when none has).
        devices: String,
    },
}

#[derive(Deserialize)]
struct File {
    #[serde(rename = "traceEvents")]
    trace_events: Vec<RawEvent>,
}

#[derive(Deserialize)]
struct RawEvent {
    #[serde(default)]
    name: String,
    #[serde(default)]
    ts: f64,
    #[serde(default)]
    args: Option<Args>,
}

#[derive(Deserialize)]
struct Args {
    #[serde(rename = "Device Type")]
    device_type: Option<i64>,
    #[serde(rename = "Device Id")]
    device_id: Option<i64>,
    #[serde(rename = "Bytes")]
    bytes: Option<i64>,
}

/// One CUDA memory event: when, which device, and signed bytes.
struct MemoryEvent {
    ts: f64,
    device: usize,
    bytes: i64,
}

/// Reads the profiler trace in `bytes` (gzipped or not; `path` names the file in errors) and returns the trace of CUDA device `device`, or
/// of each CUDA device with memory events when `device` is `None`, in device order. Traces are named
/// `name`, with `:N` appended for a device N other than 0.
///
/// # Errors
/// [`KinetoError`], naming the file.
pub fn parse(
    path: &Path,
    bytes: &[u8],
    device: Option<usize>,
    name: &str,
) -> Result<Vec<Trace>, KinetoError> {
    let json = super::gzip::decompressed(bytes).map_err(|source| KinetoError::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let file: File = serde_json::from_slice(&json).map_err(|source| KinetoError::Json {
        path: path.to_path_buf(),
        source,
    })?;
    let events = memory_events(path, &file)?;
    let devices: BTreeSet<usize> = events.iter().map(|e| e.device).collect();
    let chosen: Vec<usize> = match device {
        Some(d) if devices.contains(&d) => vec![d],
        Some(d) => {
            let devices = devices
                .iter()
                .map(usize::to_string)
                .collect::<Vec<_>>()
                .join(", ");
            return Err(KinetoError::NoSuchDevice {
                path: path.to_path_buf(),
                device: d,
                devices,
            });
        }
        None if devices.is_empty() => {
            return Err(KinetoError::NoMemoryEvents {
                path: path.to_path_buf(),
            });
        }
        None => devices.into_iter().collect(),
    };
    Ok(chosen
        .into_iter()
        .map(|d| {
            let name = match d {
                0 => name.to_string(),
                d => format!("{name}:{d}"),
            };
            device_trace(name, events.iter().filter(|e| e.device == d))
        })
        .collect())
}

/// The CUDA `[memory]` events, in time order (the file's order among equal times).
fn memory_events(path: &Path, file: &File) -> Result<Vec<MemoryEvent>, KinetoError> {
    let mut events = Vec::new();
    for (index, raw) in file.trace_events.iter().enumerate() {
        let Some(args) = raw.args.as_ref().filter(|_| raw.name == "[memory]") else {
            continue;
        };
        if args.device_type != Some(CUDA) {
            continue;
        }
        let bad = || KinetoError::BadBytes {
            path: path.to_path_buf(),
            index,
        };
        let bytes = args.bytes.ok_or_else(bad)?;
        if bytes == 0 || bytes.unsigned_abs() >= MAX_SIZE {
            return Err(bad());
        }
        let device = usize::try_from(args.device_id.unwrap_or(0)).unwrap_or(0);
        events.push(MemoryEvent {
            ts: raw.ts,
            device,
            bytes,
        });
    }
    events.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    Ok(events)
}

/// One device's events as a trace: frees matched to the newest live allocation of their size; frees with
/// no match seeded as allocations at the start.
fn device_trace<'a>(name: String, events: impl Iterator<Item = &'a MemoryEvent>) -> Trace {
    let mut seeded = Vec::new();
    let mut body = Vec::new();
    let mut live: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut next_id = 0u64;
    for event in events {
        let size = event.bytes.unsigned_abs();
        next_id += 1;
        if event.bytes > 0 {
            live.entry(size).or_default().push(next_id);
            body.push(Event::Alloc {
                id: next_id,
                size,
                stream: StreamId::DEFAULT,
            });
        } else {
            let id = match live.get_mut(&size).and_then(Vec::pop) {
                Some(id) => id,
                None => {
                    seeded.push(Event::Alloc {
                        id: next_id,
                        size,
                        stream: StreamId::DEFAULT,
                    });
                    next_id
                }
            };
            body.push(Event::Free { id });
        }
    }
    seeded.extend(body);
    Trace {
        name,
        events: seeded,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(ts: f64, bytes: i64) -> MemoryEvent {
        MemoryEvent {
            ts,
            device: 0,
            bytes,
        }
    }

    #[test]
    fn frees_match_the_newest_live_allocation_of_their_size_and_unmatched_frees_are_seeded() {
        let events = [
            event(1.0, 512),
            event(2.0, 512),
            event(3.0, 1024),
            event(4.0, -512),
            event(5.0, -2048),
            event(6.0, -512),
        ];
        let trace = device_trace("t".into(), events.iter());
        assert_eq!(trace.validate(), Ok(()));
        // The 2048-byte free had no allocation: it comes first, as live memory.
        assert_eq!(
            trace.events[0],
            Event::Alloc {
                id: 5,
                size: 2048,
                stream: StreamId::DEFAULT
            }
        );
        // The first 512-byte free releases the second 512-byte allocation (id 2), the next one id 1.
        let frees: Vec<u64> = trace
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Free { id } => Some(*id),
                _ => None,
            })
            .collect();
        assert_eq!(frees, [2, 5, 1]);
        assert_eq!(trace.peak_live_bytes(), 2048 + 512 + 512 + 1024);
    }
}
