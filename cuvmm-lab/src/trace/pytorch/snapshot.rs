//! The memory snapshot as PyTorch pickles it (`torch.cuda.memory._dump_snapshot`): only the fields cuvmm
//! reads, each tolerant of what older and newer PyTorch versions leave out.

use serde::Deserialize;
use serde_pickle::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The top-level dictionary.
#[derive(Debug, Clone, Deserialize)]
pub struct RawSnapshot {
    /// Segments held when the snapshot was taken, all devices.
    #[serde(default)]
    pub segments: Vec<RawSegment>,
    /// Per device ordinal, the recorded trace entries in time order.
    #[serde(default)]
    pub device_traces: Vec<Option<Vec<RawEntry>>>,
    /// The allocator's settings (newer PyTorch versions).
    #[serde(default)]
    pub allocator_settings: Option<BTreeMap<String, Value>>,
}

/// One segment of the final state.
#[derive(Debug, Clone, Deserialize)]
pub struct RawSegment {
    /// Device ordinal.
    pub device: u64,
    /// Start address.
    pub address: u64,
    /// Bytes (for an expandable segment, the contiguous mapped range).
    pub total_size: u64,
    /// Stream (`cudaStream_t` as an integer).
    #[serde(default)]
    pub stream: u64,
    /// `"small"` or `"large"`.
    #[serde(default)]
    pub segment_type: Option<String>,
    /// Whether the segment is an expandable one (absent in older versions).
    #[serde(default)]
    pub is_expandable: Option<bool>,
    /// Its blocks, in address order.
    #[serde(default)]
    pub blocks: Vec<RawBlock>,
}

/// One block of a final segment.
#[derive(Debug, Clone, Deserialize)]
pub struct RawBlock {
    /// Start address (absent in some versions: then blocks follow each other from the segment's start).
    #[serde(default)]
    pub address: Option<u64>,
    /// The block's size.
    pub size: u64,
    /// Bytes requested by its owner.
    #[serde(default)]
    pub requested_size: u64,
    /// `"active_allocated"`, `"active_awaiting_free"` or `"inactive"`.
    pub state: String,
}

/// One trace entry as pickled: its fields are checked by [`RawEntry::check`], so that a missing or
/// mistyped one is named with the entry's index.
#[derive(Debug, Clone, Deserialize)]
pub struct RawEntry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, ...
    #[serde(default)]
    pub action: Option<Value>,
    /// Address concerned.
    #[serde(default)]
    pub addr: Option<Value>,
    /// Bytes (requested bytes for alloc and free; segment bytes for segment events).
    #[serde(default)]
    pub size: Option<Value>,
    /// Stream.
    #[serde(default)]
    pub stream: Option<Value>,
    /// What the Python and C++ stack recorded with the entry says of `empty_cache` (the frames themselves
    /// are not kept: shared between entries in the pickle, they would be copied into each).
    #[serde(default)]
    pub frames: Option<StackMark>,
}

/// One trace entry with its fields checked.
#[derive(Debug, Clone, PartialEq)]
pub struct Entry {
    /// `alloc`, `free_requested`, `free_completed`, `segment_alloc`, ...
    pub action: String,
    /// Address concerned (0 if the action does not need it and the entry lacks it).
    pub addr: u64,
    /// Bytes (requested bytes for alloc and free; segment bytes for segment events).
    pub size: u64,
    /// Stream.
    pub stream: u64,
    /// Whether the recorded stack passes through `empty_cache` ([`RawEntry::from_empty_cache`]).
    pub from_empty_cache: Option<bool>,
}

/// The fields each action needs: requests need their address, size and stream; segment events their
/// address and size. Other actions (`oom`, `snapshot`, ...) need none.
pub fn required_fields(action: &str) -> &'static [&'static str] {
    match action {
        "alloc" | "free_requested" | "free_completed" | "free" => &["addr", "size", "stream"],
        "segment_alloc" | "segment_free" | "segment_map" | "segment_unmap" => &["addr", "size"],
        _ => &[],
    }
}

impl RawEntry {
    /// The entry with its fields checked: `action` must be text, and every field the action needs (see
    /// [`required_fields`]) a non-negative integer below 2^64. Fields the action does not need are read
    /// when they are such integers and taken as 0 otherwise.
    ///
    /// # Errors
    /// The field that is missing or mistyped, and why.
    pub fn check(&self) -> Result<Entry, (&'static str, FieldProblem)> {
        let action = match &self.action {
            Some(Value::String(a)) => a.clone(),
            Some(_) => return Err(("action", FieldProblem::NotText)),
            None => return Err(("action", FieldProblem::Missing)),
        };
        let required = required_fields(&action);
        let field = |name: &'static str, value: &Option<Value>| -> Result<u64, _> {
            let needed = required.contains(&name);
            match value.as_ref().map(unsigned) {
                Some(Some(n)) => Ok(n),
                Some(None) if needed => Err((name, FieldProblem::NotAnInteger)),
                None if needed => Err((name, FieldProblem::Missing)),
                _ => Ok(0),
            }
        };
        Ok(Entry {
            addr: field("addr", &self.addr)?,
            size: field("size", &self.size)?,
            stream: field("stream", &self.stream)?,
            from_empty_cache: self.from_empty_cache(),
            action,
        })
    }

    /// Whether the recorded stack passes through `empty_cache` (PyTorch's `emptyCache`): a
    /// `segment_free` made by `torch.cuda.empty_cache()` rather than by an out-of-memory retry.
    /// `None` when the entry has no frames.
    pub fn from_empty_cache(&self) -> Option<bool> {
        let mark = self.frames?;
        mark.any_text.then_some(mark.empty_cache)
    }
}

/// A recorded stack read for what cuvmm needs of it, as it is decoded: whether any of its text (the values,
/// at any depth, of its lists, tuples and dictionaries) names `empty_cache` (PyTorch's `emptyCache`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StackMark {
    /// Whether the stack holds any text at all.
    pub any_text: bool,
    /// Whether some of it names `empty_cache`.
    pub empty_cache: bool,
}

impl StackMark {
    fn text(s: &str) -> Self {
        StackMark {
            any_text: true,
            empty_cache: s.contains("emptyCache") || s.contains("empty_cache"),
        }
    }

    fn merge(self, other: Self) -> Self {
        StackMark {
            any_text: self.any_text || other.any_text,
            empty_cache: self.empty_cache || other.empty_cache,
        }
    }
}

impl<'de> Deserialize<'de> for StackMark {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct Visit;
        impl<'de> serde::de::Visitor<'de> for Visit {
            type Value = StackMark;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("a recorded stack")
            }
            fn visit_str<E>(self, s: &str) -> Result<StackMark, E> {
                Ok(StackMark::text(s))
            }
            fn visit_bool<E>(self, _: bool) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_i64<E>(self, _: i64) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_u64<E>(self, _: u64) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_f64<E>(self, _: f64) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_bytes<E>(self, _: &[u8]) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_unit<E>(self) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_none<E>(self) -> Result<StackMark, E> {
                Ok(StackMark::default())
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut items: A,
            ) -> Result<StackMark, A::Error> {
                let mut mark = StackMark::default();
                while let Some(item) = items.next_element::<StackMark>()? {
                    mark = mark.merge(item);
                }
                Ok(mark)
            }
            fn visit_map<A: serde::de::MapAccess<'de>>(
                self,
                mut entries: A,
            ) -> Result<StackMark, A::Error> {
                let mut mark = StackMark::default();
                while let Some((_, value)) =
                    entries.next_entry::<serde::de::IgnoredAny, StackMark>()?
                {
                    mark = mark.merge(value);
                }
                Ok(mark)
            }
        }
        deserializer.deserialize_any(Visit)
    }
}

/// What is wrong with a field of a trace entry.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FieldProblem {
    /// The entry lacks it.
    #[error("is missing")]
    Missing,
    /// It is not a non-negative integer below 2^64.
    #[error("is not a non-negative integer")]
    NotAnInteger,
    /// It is not text.
    #[error("is not text")]
    NotText,
}

fn unsigned(v: &Value) -> Option<u64> {
    match v {
        Value::I64(n) => u64::try_from(*n).ok(),
        Value::Int(n) => n.to_string().parse().ok(),
        _ => None,
    }
}

/// A snapshot file that cannot be used. Each names the file.
#[derive(Debug, thiserror::Error)]
pub enum SnapshotError {
    /// The file cannot be read.
    #[error("{path}: cannot read: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not a pickled PyTorch memory snapshot.
    #[error("{path}: not a PyTorch memory snapshot: {source}")]
    Decode {
        /// The file.
        path: PathBuf,
        /// What the pickle decoder said.
        source: serde_pickle::Error,
    },
    /// A pickle whose decoding would exhaust memory, time or the stack (it copies values, nests too deep,
    /// or shares values too often), which no memory snapshot does.
    #[error("{path}: not a PyTorch memory snapshot: {what} (pickle byte {offset})")]
    Refused {
        /// The file.
        path: PathBuf,
        /// Offset of the opcode refused.
        offset: usize,
        /// What it would do.
        what: &'static str,
    },
    /// A pickled list of segments, as `torch.cuda.memory_snapshot()` returns: the memory held at one
    /// moment, with no allocation history to replay.
    #[error(
        "{path}: a list, not a memory snapshot's dictionary (torch.cuda.memory_snapshot() gives a list of the segments held at one moment, with no allocation history to replay): record with torch.cuda.memory._record_memory_history() and save with torch.cuda.memory._dump_snapshot(FILE)"
    )]
    SegmentsOnly {
        /// The file.
        path: PathBuf,
    },
    /// The device has no trace entries: the snapshot holds the memory of one moment, no history to replay.
    #[error(
        "{path}: device {device} has no allocation history (no trace entries): call torch.cuda.memory._record_memory_history() before the code to measure, then torch.cuda.memory._dump_snapshot(FILE)"
    )]
    NoHistory {
        /// The file.
        path: PathBuf,
        /// The device.
        device: usize,
    },
    /// The snapshot has no device with that ordinal.
    #[error("{path}: no device {device} in the snapshot (it has {devices})")]
    NoSuchDevice {
        /// The file.
        path: PathBuf,
        /// The device asked for.
        device: usize,
        /// How many devices it has.
        devices: usize,
    },
    /// The snapshot contradicts itself (an event that cannot follow the state before it).
    #[error("{path}: inconsistent snapshot: {what} at {addr:#x}")]
    Inconsistent {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: &'static str,
        /// The address concerned.
        addr: u64,
    },
    /// A trace entry lacks a field its action needs, or holds one of the wrong type.
    #[error("{path}: device {device} trace entry {index} ({action}): `{field}` {problem}")]
    Field {
        /// The file.
        path: PathBuf,
        /// The device whose trace holds the entry.
        device: usize,
        /// Position of the entry in that device's trace.
        index: usize,
        /// The entry's action (`?` when it has none).
        action: String,
        /// The field.
        field: &'static str,
        /// What is wrong with it.
        problem: FieldProblem,
    },
    /// A setting in `allocator_settings` has a value cuvmm cannot read.
    #[error("{path}: allocator setting `{key}` has an unreadable value")]
    Setting {
        /// The file.
        path: PathBuf,
        /// The setting.
        key: String,
    },
}

/// Reads a pickled snapshot, gzipped or not, from the file at `path`.
pub fn read(path: &Path) -> Result<RawSnapshot, SnapshotError> {
    let io = |source| SnapshotError::Io {
        path: path.to_path_buf(),
        source,
    };
    let bytes = std::fs::read(path).map_err(io)?;
    parse(path, &crate::trace::gzip::decompressed(&bytes).map_err(io)?)
}

/// Reads a pickled snapshot from `bytes`; `path` names it in errors. A pickle that would make the decoder
/// exhaust memory, time or the stack is refused first (`guard.rs`). serde-pickle needs
/// `replace_recursive_structures` for these files: PyTorch shares frame dictionaries between entries
/// through the pickle memo.
pub fn parse(path: &Path, bytes: &[u8]) -> Result<RawSnapshot, SnapshotError> {
    super::guard::check(bytes).map_err(|refusal| SnapshotError::Refused {
        path: path.to_path_buf(),
        offset: refusal.offset,
        what: refusal.what,
    })?;
    if top_level_is_list(bytes) {
        return Err(SnapshotError::SegmentsOnly {
            path: path.to_path_buf(),
        });
    }
    let options = serde_pickle::DeOptions::new().replace_recursive_structures();
    serde_pickle::from_slice(bytes, options).map_err(|source| SnapshotError::Decode {
        path: path.to_path_buf(),
        source,
    })
}

/// Whether the pickle in `bytes` (protocol 2 or later, its guard passed) holds a list at the top: its first
/// opcode after `PROTO` and an optional `FRAME` is `EMPTY_LIST`, where a snapshot's is `EMPTY_DICT`.
fn top_level_is_list(bytes: &[u8]) -> bool {
    const PROTO: u8 = 0x80;
    const FRAME: u8 = 0x95;
    const EMPTY_LIST: u8 = b']';
    let mut at = if bytes.first() == Some(&PROTO) { 2 } else { 0 };
    if bytes.get(at) == Some(&FRAME) {
        at += 9;
    }
    bytes.get(at) == Some(&EMPTY_LIST)
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_pickle::{HashableValue as K, SerOptions};

    fn frame(name: &str) -> Value {
        Value::Dict(BTreeMap::from([
            (K::String("filename".into()), Value::String("a.py".into())),
            (K::String("line".into()), Value::I64(3)),
            (K::String("name".into()), Value::String(name.into())),
        ]))
    }

    fn entry(frames: Option<Value>) -> RawEntry {
        let mut fields = BTreeMap::from([(
            K::String("action".into()),
            Value::String("segment_free".into()),
        )]);
        if let Some(frames) = frames {
            fields.insert(K::String("frames".into()), frames);
        }
        let bytes = serde_pickle::value_to_vec(&Value::Dict(fields), SerOptions::new()).unwrap();
        serde_pickle::from_slice(&bytes, serde_pickle::DeOptions::new()).unwrap()
    }

    #[test]
    fn a_stack_is_read_for_whether_it_passes_through_empty_cache() {
        let stack = |names: &[&str]| Some(Value::List(names.iter().map(|n| frame(n)).collect()));
        assert_eq!(entry(None).from_empty_cache(), None);
        assert_eq!(entry(stack(&[])).from_empty_cache(), None);
        assert_eq!(
            entry(stack(&["forward", "malloc"])).from_empty_cache(),
            Some(false)
        );
        assert_eq!(
            entry(stack(&[
                "forward",
                "c10::cuda::CUDACachingAllocator::emptyCache()"
            ]))
            .from_empty_cache(),
            Some(true)
        );
        // At any depth, in tuples too; keys are not read.
        let nested = Value::Tuple(vec![
            Value::I64(1),
            Value::List(vec![stack(&["torch.cuda.empty_cache"]).unwrap()]),
        ]);
        assert_eq!(entry(Some(nested)).from_empty_cache(), Some(true));
        let key_only = Value::Dict(BTreeMap::from([(
            K::String("empty_cache".into()),
            Value::String("x".into()),
        )]));
        assert_eq!(entry(Some(key_only)).from_empty_cache(), Some(false));
    }
}
