//! Writing a [`MemorySnapshot`] as the pickle `torch.cuda.memory._dump_snapshot` writes, for PyTorch's memory
//! viewer (`torch/utils/viz/MemoryViz.js`, <https://pytorch.org/memory_viz>) and for Python's `pickle.load`.
//!
//! The pickle is written by hand with the opcodes the viewer's own unpickler accepts, and no others:
//! protocol 2 (`PROTO`), `EMPTY_DICT`, `EMPTY_LIST`, `EMPTY_TUPLE`, `TUPLE2`, `MARK`, `SETITEMS`, `APPENDS`,
//! `BININT1`, `BININT2`, `BININT`, `LONG1`, `BINUNICODE`, `NONE`, `NEWTRUE`, `NEWFALSE`, `BINFLOAT` and
//! `STOP`. No memo (`BINPUT`/`MEMOIZE`): nothing is shared, so nothing needs it. Lists and dictionaries
//! are written in batches of 1,000 items, as Python's pickler does, so the viewer never spreads a huge
//! array into one call.

use crate::strategy::history::TraceEntry;
use crate::strategy::snapshot::{MemorySnapshot, SnapshotBlock, SnapshotSegment};
use std::io::{self, Write};
use std::path::{Path, PathBuf};

/// The opcodes this writer uses, all accepted by MemoryViz.js's unpickler.
pub mod op {
    /// `PROTO n`.
    pub const PROTO: u8 = 0x80;
    /// `EMPTY_DICT`.
    pub const EMPTY_DICT: u8 = b'}';
    /// `EMPTY_LIST`.
    pub const EMPTY_LIST: u8 = b']';
    /// `EMPTY_TUPLE`.
    pub const EMPTY_TUPLE: u8 = b')';
    /// `TUPLE2`: the top two items as a tuple.
    pub const TUPLE2: u8 = 0x86;
    /// `MARK`.
    pub const MARK: u8 = b'(';
    /// `SETITEMS`: key/value pairs since the mark into the dictionary below it.
    pub const SETITEMS: u8 = b'u';
    /// `APPENDS`: items since the mark onto the list below it.
    pub const APPENDS: u8 = b'e';
    /// `BININT1`: an unsigned byte.
    pub const BININT1: u8 = b'K';
    /// `BININT2`: an unsigned 16-bit little-endian integer.
    pub const BININT2: u8 = b'M';
    /// `BININT`: a signed 32-bit little-endian integer.
    pub const BININT: u8 = b'J';
    /// `LONG1`: a length byte, then a two's-complement little-endian integer of that many bytes.
    pub const LONG1: u8 = 0x8a;
    /// `BINUNICODE`: a 32-bit length, then UTF-8.
    pub const BINUNICODE: u8 = b'X';
    /// `NONE`.
    pub const NONE: u8 = b'N';
    /// `NEWTRUE`.
    pub const NEWTRUE: u8 = 0x88;
    /// `NEWFALSE`.
    pub const NEWFALSE: u8 = 0x89;
    /// `BINFLOAT`: a big-endian IEEE 754 double.
    pub const BINFLOAT: u8 = b'G';
    /// `STOP`.
    pub const STOP: u8 = b'.';

    /// Every opcode above.
    pub const ALL: [u8; 18] = [
        PROTO,
        EMPTY_DICT,
        EMPTY_LIST,
        EMPTY_TUPLE,
        TUPLE2,
        MARK,
        SETITEMS,
        APPENDS,
        BININT1,
        BININT2,
        BININT,
        LONG1,
        BINUNICODE,
        NONE,
        NEWTRUE,
        NEWFALSE,
        BINFLOAT,
        STOP,
    ];
}

/// Items per `APPENDS` or `SETITEMS`, as Python's pickler batches them.
const BATCH: usize = 1000;

/// A Python value, as much of the language as a snapshot needs.
#[derive(Clone, Debug, PartialEq)]
pub enum Value {
    /// `None`.
    None,
    /// `True` / `False`.
    Bool(bool),
    /// An `int`.
    Int(i128),
    /// A `float`.
    Float(f64),
    /// A `str`.
    Str(String),
    /// A `list`.
    List(Vec<Value>),
    /// A pair, as a `tuple`.
    Pair(Box<(Value, Value)>),
    /// A `dict` with string keys, in insertion order.
    Dict(Vec<(String, Value)>),
}

impl From<u64> for Value {
    fn from(v: u64) -> Self {
        Value::Int(i128::from(v))
    }
}

impl From<&str> for Value {
    fn from(v: &str) -> Self {
        Value::Str(v.to_string())
    }
}

/// Pickles `value` (protocol 2) into `out`.
pub fn write_value(value: &Value, out: &mut impl Write) -> io::Result<()> {
    out.write_all(&[op::PROTO, 2])?;
    emit(value, out)?;
    out.write_all(&[op::STOP])
}

fn emit(value: &Value, out: &mut impl Write) -> io::Result<()> {
    match value {
        Value::None => out.write_all(&[op::NONE]),
        Value::Bool(b) => out.write_all(&[if *b { op::NEWTRUE } else { op::NEWFALSE }]),
        Value::Int(i) => emit_int(*i, out),
        Value::Float(x) => {
            out.write_all(&[op::BINFLOAT])?;
            out.write_all(&x.to_be_bytes())
        }
        Value::Str(s) => {
            let len = u32::try_from(s.len())
                .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "string over 4 GiB"))?;
            out.write_all(&[op::BINUNICODE])?;
            out.write_all(&len.to_le_bytes())?;
            out.write_all(s.as_bytes())
        }
        Value::Pair(pair) => {
            emit(&pair.0, out)?;
            emit(&pair.1, out)?;
            out.write_all(&[op::TUPLE2])
        }
        Value::List(items) => {
            out.write_all(&[op::EMPTY_LIST])?;
            for batch in items.chunks(BATCH) {
                out.write_all(&[op::MARK])?;
                for item in batch {
                    emit(item, out)?;
                }
                out.write_all(&[op::APPENDS])?;
            }
            Ok(())
        }
        Value::Dict(entries) => {
            out.write_all(&[op::EMPTY_DICT])?;
            for batch in entries.chunks(BATCH) {
                out.write_all(&[op::MARK])?;
                for (key, item) in batch {
                    emit(&Value::Str(key.clone()), out)?;
                    emit(item, out)?;
                }
                out.write_all(&[op::SETITEMS])?;
            }
            Ok(())
        }
    }
}

/// The shortest integer opcode for `i`, as Python's pickler picks it.
fn emit_int(i: i128, out: &mut impl Write) -> io::Result<()> {
    if let Ok(b) = u8::try_from(i) {
        out.write_all(&[op::BININT1, b])
    } else if let Ok(w) = u16::try_from(i) {
        out.write_all(&[op::BININT2])?;
        out.write_all(&w.to_le_bytes())
    } else if let Ok(d) = i32::try_from(i) {
        out.write_all(&[op::BININT])?;
        out.write_all(&d.to_le_bytes())
    } else {
        // Minimal two's complement: drop high bytes that only repeat the sign.
        let bytes = i.to_le_bytes();
        let mut len = bytes.len();
        while len > 1 {
            let (top, next) = (bytes[len - 1], bytes[len - 2]);
            let redundant = (top == 0 && next < 0x80) || (top == 0xff && next >= 0x80);
            if !redundant {
                break;
            }
            len -= 1;
        }
        out.write_all(&[op::LONG1, len as u8])?;
        out.write_all(&bytes[..len])
    }
}

/// The snapshot as the dictionary PyTorch pickles: `segments` and `device_traces`.
pub fn snapshot_value(snapshot: &MemorySnapshot) -> Value {
    Value::Dict(vec![
        (
            "segments".into(),
            Value::List(snapshot.segments.iter().map(segment_value).collect()),
        ),
        (
            "device_traces".into(),
            Value::List(
                snapshot
                    .device_traces
                    .iter()
                    .map(|trace| Value::List(trace.iter().map(entry_value).collect()))
                    .collect(),
            ),
        ),
    ])
}

fn segment_value(seg: &SnapshotSegment) -> Value {
    let kind = match seg.pool {
        crate::strategy::pool::Pool::Small => "small",
        crate::strategy::pool::Pool::Large => "large",
    };
    let mut fields = segment_fields(seg, kind);
    if let Some(tag) = &seg.tag {
        // cuvmm's own keys, only for tagged segments (the memory viewer ignores keys it does not know).
        fields.push(("cuvmm_tag".into(), tag.as_str().into()));
        fields.push(("cuvmm_asleep".into(), Value::Bool(seg.asleep)));
    }
    Value::Dict(fields)
}

/// The keys PyTorch's snapshot has for a segment.
fn segment_fields(seg: &SnapshotSegment, kind: &'static str) -> Vec<(String, Value)> {
    vec![
        ("device".into(), (seg.device as u64).into()),
        ("address".into(), seg.address.into()),
        ("total_size".into(), seg.total_size.into()),
        ("allocated_size".into(), seg.allocated_size().into()),
        ("active_size".into(), seg.active_size().into()),
        ("requested_size".into(), seg.requested_size().into()),
        ("stream".into(), seg.stream.0.into()),
        ("segment_type".into(), kind.into()),
        (
            "segment_pool_id".into(),
            Value::Pair(Box::new((seg.graph_pool.0.into(), seg.graph_pool.1.into()))),
        ),
        ("is_expandable".into(), Value::Bool(seg.is_expandable)),
        ("frames".into(), Value::List(Vec::new())),
        (
            "blocks".into(),
            Value::List(seg.blocks.iter().map(block_value).collect()),
        ),
    ]
}

fn block_value(block: &SnapshotBlock) -> Value {
    Value::Dict(vec![
        ("address".into(), block.address.into()),
        ("size".into(), block.size.into()),
        ("requested_size".into(), block.requested_size.into()),
        ("state".into(), block.state.as_str().into()),
        ("frames".into(), Value::List(Vec::new())),
    ])
}

fn entry_value(entry: &TraceEntry) -> Value {
    let mut fields = vec![("action".to_string(), entry.action.as_str().into())];
    match entry.device_free {
        // PyTorch writes an OOM's free device memory where other entries have their address.
        Some(free) => fields.push(("device_free".into(), free.into())),
        None => fields.push(("addr".into(), entry.addr.into())),
    }
    fields.push(("size".into(), entry.size.into()));
    fields.push(("stream".into(), entry.stream.0.into()));
    fields.push(("time_us".into(), entry.time_us.into()));
    fields.push(("frames".into(), Value::List(Vec::new())));
    Value::Dict(fields)
}

/// The pickled snapshot.
pub fn to_pickle(snapshot: &MemorySnapshot) -> Vec<u8> {
    let mut out = Vec::new();
    write_value(&snapshot_value(snapshot), &mut out).expect("writing to a Vec cannot fail");
    out
}

/// A snapshot file that could not be written.
#[derive(Debug, thiserror::Error)]
#[error("{path}: cannot write the snapshot: {source}")]
pub struct WriteError {
    /// The file.
    pub path: PathBuf,
    /// Why.
    pub source: io::Error,
}

/// Writes the pickled snapshot to `path`.
///
/// # Errors
/// [`WriteError`], naming the file.
pub fn write_file(path: &Path, snapshot: &MemorySnapshot) -> Result<(), WriteError> {
    std::fs::write(path, to_pickle(snapshot)).map_err(|source| WriteError {
        path: path.to_path_buf(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pickled(value: &Value) -> Vec<u8> {
        let mut out = Vec::new();
        write_value(value, &mut out).unwrap();
        out
    }

    #[test]
    fn integers_take_the_shortest_opcode() {
        assert_eq!(
            pickled(&Value::Int(7)),
            [op::PROTO, 2, op::BININT1, 7, op::STOP]
        );
        assert_eq!(
            pickled(&Value::Int(0x1234)),
            [op::PROTO, 2, op::BININT2, 0x34, 0x12, op::STOP]
        );
        assert_eq!(
            pickled(&Value::Int(-2)),
            [op::PROTO, 2, op::BININT, 0xfe, 0xff, 0xff, 0xff, op::STOP]
        );
        // 2^40: six bytes, the top one below 0x80 so no sign byte is needed.
        let long = pickled(&Value::Int(1 << 40));
        assert_eq!(&long[2..4], &[op::LONG1, 6]);
        assert_eq!(&long[4..10], &[0, 0, 0, 0, 0, 1]);
        // u64::MAX needs a ninth byte so that it is not read as -1.
        let max = pickled(&Value::from(u64::MAX));
        assert_eq!(&max[2..4], &[op::LONG1, 9]);
        assert_eq!(max[12], 0);
    }

    #[test]
    fn lists_are_appended_in_batches_of_a_thousand() {
        let list = Value::List((0..2500).map(|_| Value::None).collect());
        let bytes = pickled(&list);
        let count = |b: u8| bytes.iter().filter(|&&x| x == b).count();
        assert_eq!(count(op::APPENDS), 3);
        assert_eq!(count(op::MARK), 3);
        assert_eq!(count(op::NONE), 2500);
    }
}
