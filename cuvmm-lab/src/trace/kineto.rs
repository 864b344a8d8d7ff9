//! PyTorch profiler (Kineto) traces: the `[memory]` events of `torch.profiler.profile(profile_memory=True)`,
//! as written by `export_chrome_trace` (`*.pt.trace.json`, often gzipped).
//!
//! Each `[memory]` instant event carries `Bytes` (positive: an allocation, negative: a free of that many
//! bytes), `Device Type` (1 = CUDA) and `Device Id`; later profilers (every PyTorch 2 release) also write
//! the block's address (`Addr`), the device's allocated bytes after the event (`Total Allocated`) and its
//! reserved bytes (`Total Reserved`, not read).
//! - Where every memory event of a device has an address, a free releases the live allocation at its
//!   address, exactly as the program did. An allocation at an address that is still live means the free
//!   before it was not recorded (the profiler records only the threads it follows): the earlier allocation
//!   is freed there, as it must have been by then.
//! - Otherwise (early profiler traces have no `Addr`), a free releases the most recent live allocation of
//!   its size on the device. Which of several same-sized allocations a free releases is then a guess, and
//!   the live bytes are a lower bound: a free of a block allocated before profiling can end a later one of
//!   its size instead.
//!
//! Either way, a free that matches no live allocation released memory allocated before profiling began: it
//! is seeded as an allocation at the start, as snapshots' live blocks are. Where the first event has
//! `Total Allocated`, the bytes allocated before it that no free names (never freed while profiling: a
//! model's weights, say) are seeded too, as one allocation.

use super::event::{Event, MAX_SIZE, Trace};
use cuvmm::driver::StreamId;
use serde::Deserialize;
use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};

/// Kineto's `Device Type` of a CUDA device.
const CUDA: i64 = 1;

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
    #[error(
        "{path}: memory event {index}: `Bytes` is missing, not an integer, 0 or beyond any device"
    )]
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

/// The arguments a `[memory]` event has. Every event's are read into this, so each field is any JSON value:
/// what another kind of event holds under these names cannot make the file unreadable. For a memory event, a
/// `Bytes` that is no integer is refused ([`KinetoError::BadBytes`]); an `Addr` or `Total Allocated` that is
/// none only costs the event that figure.
#[derive(Deserialize)]
struct Args {
    #[serde(rename = "Device Type")]
    device_type: Option<serde_json::Value>,
    #[serde(rename = "Device Id")]
    device_id: Option<serde_json::Value>,
    #[serde(rename = "Bytes")]
    bytes: Option<serde_json::Value>,
    /// The block's address, in later profilers' traces.
    #[serde(rename = "Addr")]
    addr: Option<serde_json::Value>,
    /// The device's allocated bytes right after the event (PyTorch's `memory_allocated()`), written with
    /// `Addr`.
    #[serde(rename = "Total Allocated")]
    total_allocated: Option<serde_json::Value>,
}

/// A non-negative integer below [`MAX_SIZE`], if `value` is one.
fn bytes_in(value: Option<&serde_json::Value>) -> Option<u64> {
    value
        .and_then(serde_json::Value::as_u64)
        .filter(|&n| n < MAX_SIZE)
}

/// One CUDA memory event: when, which device, signed bytes, and the block's address and the device's
/// allocated bytes after it when it has them.
struct MemoryEvent {
    ts: f64,
    device: usize,
    bytes: i64,
    addr: Option<u64>,
    total_allocated: Option<u64>,
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
        if args
            .device_type
            .as_ref()
            .and_then(serde_json::Value::as_i64)
            != Some(CUDA)
        {
            continue;
        }
        let bad = || KinetoError::BadBytes {
            path: path.to_path_buf(),
            index,
        };
        let bytes = (args.bytes.as_ref())
            .and_then(serde_json::Value::as_i64)
            .ok_or_else(bad)?;
        if bytes == 0 || bytes.unsigned_abs() >= MAX_SIZE {
            return Err(bad());
        }
        let device = (args.device_id.as_ref())
            .and_then(serde_json::Value::as_u64)
            .and_then(|d| usize::try_from(d).ok())
            .unwrap_or(0);
        events.push(MemoryEvent {
            ts: raw.ts,
            device,
            bytes,
            addr: args.addr.as_ref().and_then(serde_json::Value::as_u64),
            total_allocated: bytes_in(args.total_allocated.as_ref()),
        });
    }
    events.sort_by(|a, b| a.ts.total_cmp(&b.ts));
    Ok(events)
}

/// One device's events as a trace: frees matched to their allocation by address where every event has one,
/// else to the newest live allocation of their size; frees with no match seeded as allocations at the start,
/// and so are the bytes allocated before the first event that no free names, as one allocation, where that
/// event says how many bytes were allocated after it.
fn device_trace<'a>(name: String, events: impl Iterator<Item = &'a MemoryEvent> + Clone) -> Trace {
    let by_address = events.clone().all(|e| e.addr.is_some());
    // The bytes allocated when profiling began: after the first event, less what it did.
    let before = events.clone().next().and_then(|first| {
        first
            .total_allocated
            .and_then(|total| total.checked_add_signed(-first.bytes))
    });
    let mut seeded = Vec::new();
    let mut body = Vec::new();
    // The live allocations' ids under their key: the address, or the size (newest last).
    let mut live: HashMap<u64, Vec<u64>> = HashMap::new();
    let mut next_id = 0u64;
    for event in events {
        let size = event.bytes.unsigned_abs();
        let key = match event.addr {
            Some(addr) if by_address => addr,
            _ => size,
        };
        next_id += 1;
        if event.bytes > 0 {
            let ids = live.entry(key).or_default();
            if by_address {
                // A free not recorded: the allocation there ended before this one began.
                body.extend(ids.drain(..).map(|id| Event::Free { id }));
            }
            ids.push(next_id);
            body.push(Event::Alloc {
                id: next_id,
                size,
                stream: StreamId::DEFAULT,
            });
        } else {
            let id = match live.get_mut(&key).and_then(Vec::pop) {
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
    let seeded_bytes = seeded.iter().fold(0u64, |sum, e| match e {
        Event::Alloc { size, .. } => sum.saturating_add(*size),
        _ => sum,
    });
    if let Some(unseen) = before
        .and_then(|before| before.checked_sub(seeded_bytes))
        .filter(|&unseen| unseen > 0 && unseen < MAX_SIZE)
    {
        // Never freed while profiling (a model's weights, say): live throughout, of unknown block sizes.
        seeded.push(Event::Alloc {
            id: next_id + 1,
            size: unseen,
            stream: StreamId::DEFAULT,
        });
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
            addr: None,
            total_allocated: None,
        }
    }

    fn at(addr: u64, bytes: i64) -> MemoryEvent {
        MemoryEvent {
            ts: 0.0,
            device: 0,
            bytes,
            addr: Some(addr),
            total_allocated: None,
        }
    }

    fn frees(trace: &Trace) -> Vec<u64> {
        trace
            .events
            .iter()
            .filter_map(|e| match e {
                Event::Free { id } => Some(*id),
                _ => None,
            })
            .collect()
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
        assert_eq!(frees(&trace), [2, 5, 1]);
        assert_eq!(trace.peak_live_bytes(), 2048 + 512 + 512 + 1024);
    }

    #[test]
    fn with_addresses_frees_release_the_allocation_at_their_address() {
        let events = [
            at(0x1000, 512),
            at(0x2000, 512),
            at(0x1000, -512), // by size, the newest (0x2000) would go
            at(0x9000, -2048),
            at(0x3000, 512),
            at(0x3000, 512), // the free of the first was not recorded
            at(0x2000, -512),
        ];
        let trace = device_trace("t".into(), events.iter());
        assert_eq!(trace.validate(), Ok(()));
        assert_eq!(
            trace.events[0],
            Event::Alloc {
                id: 4,
                size: 2048,
                stream: StreamId::DEFAULT
            }
        );
        assert_eq!(frees(&trace), [1, 4, 5, 2]);
        assert_eq!(trace.peak_live_bytes(), 2048 + 512 + 512);
    }

    #[test]
    fn one_event_without_an_address_pairs_the_device_by_size() {
        let mut events = vec![at(0x1000, 512), at(0x2000, 512), at(0x1000, -512)];
        events.push(event(0.0, -512));
        let trace = device_trace("t".into(), events.iter());
        assert_eq!(frees(&trace), [2, 1]);
    }

    #[test]
    fn bytes_allocated_before_profiling_and_never_freed_are_seeded_as_one_allocation() {
        // 10,000 bytes allocated when profiling began: 2,048 of them freed while profiling, 7,952 never.
        let mut first = at(0x1000, 512);
        first.total_allocated = Some(10_512);
        let events = [first, at(0x9000, -2048), at(0x1000, -512)];
        let trace = device_trace("t".into(), events.iter());
        assert_eq!(trace.validate(), Ok(()));
        assert_eq!(trace.peak_live_bytes(), 10_512);
        let seeded: Vec<u64> = trace.events[..2]
            .iter()
            .filter_map(|e| match e {
                Event::Alloc { size, .. } => Some(*size),
                _ => None,
            })
            .collect();
        assert_eq!(seeded, [2048, 7952]);
        // Without the figure, only what the trace frees is known.
        let events = [at(0x1000, 512), at(0x9000, -2048), at(0x1000, -512)];
        let trace = device_trace("t".into(), events.iter());
        assert_eq!(trace.peak_live_bytes(), 512 + 2048);
    }

    #[test]
    fn a_total_below_what_the_frees_show_seeds_nothing_more() {
        let mut first = at(0x9000, -2048);
        first.total_allocated = Some(0);
        let trace = device_trace("t".into(), [first].iter());
        assert_eq!(trace.alloc_count(), 1);
        assert_eq!(trace.peak_live_bytes(), 2048);
    }

    #[test]
    fn other_events_arguments_are_not_read_and_a_memory_events_bytes_must_be_an_integer() {
        let path = Path::new("p.json");
        let memory = r#"{"name": "[memory]", "ts": 2, "args": {"Device Type": 1, "Device Id": 0, "Bytes": 512, "Addr": "0x1000", "Total Allocated": -1}}"#;
        let other = r#"{"name": "kernel", "ts": 1, "args": {"Device Type": "gpu", "Device Id": "0", "Bytes": 1.5}}"#;
        let file = format!(r#"{{"traceEvents": [{other}, {memory}]}}"#);
        let traces = parse(path, file.as_bytes(), None, "p").unwrap();
        // The address and the total that are not integers are only not used.
        assert_eq!(traces[0].events.len(), 1);
        assert_eq!(traces[0].peak_live_bytes(), 512);

        let memory = memory.replace("\"Bytes\": 512", "\"Bytes\": \"512\"");
        let file = format!(r#"{{"traceEvents": [{other}, {memory}]}}"#);
        let err = parse(path, file.as_bytes(), None, "p").unwrap_err();
        assert!(
            matches!(err, KinetoError::BadBytes { index: 1, .. }),
            "{err}"
        );
    }
}
