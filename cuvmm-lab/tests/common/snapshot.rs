//! PyTorch memory snapshots built in tests: the dictionaries `torch.cuda.memory._snapshot()` pickles, as
//! serde-pickle values, and a writer to a temporary file.

use serde_pickle::{HashableValue as K, SerOptions, Value as V};
use std::collections::BTreeMap;
use std::path::PathBuf;

/// A text value.
pub fn s(x: &str) -> V {
    V::String(x.to_string())
}

/// A dictionary with text keys.
pub fn dict(entries: Vec<(&str, V)>) -> V {
    V::Dict(
        entries
            .into_iter()
            .map(|(k, v)| (K::String(k.to_string()), v))
            .collect::<BTreeMap<_, _>>(),
    )
}

/// A trace entry of `action` on stream 0, with no frames.
pub fn entry(action: &str, addr: i64, size: i64) -> V {
    dict(vec![
        ("action", s(action)),
        ("addr", V::I64(addr)),
        ("size", V::I64(size)),
        ("stream", V::I64(0)),
        ("frames", V::List(vec![])),
    ])
}

/// A block of a segment.
pub fn block(addr: i64, size: i64, requested: i64, state: &str) -> V {
    dict(vec![
        ("address", V::I64(addr)),
        ("size", V::I64(size)),
        ("requested_size", V::I64(requested)),
        ("state", s(state)),
    ])
}

/// A segment on device 0, stream 0, of `kind` ("large" or "small").
pub fn segment(addr: i64, size: i64, kind: &str, expandable: bool, blocks: Vec<V>) -> V {
    dict(vec![
        ("device", V::I64(0)),
        ("address", V::I64(addr)),
        ("total_size", V::I64(size)),
        ("stream", V::I64(0)),
        ("segment_type", s(kind)),
        ("is_expandable", V::Bool(expandable)),
        ("blocks", V::List(blocks)),
    ])
}

/// The pickle of `value`, as Python's pickler would write it for serde-pickle's reader.
pub fn pickle(value: &V) -> Vec<u8> {
    let mut bytes = Vec::new();
    serde_pickle::value_to_writer(&mut bytes, value, SerOptions::new()).unwrap();
    bytes
}

/// Writes `snapshot` as `name` in a temporary folder of this test process (`prefix` names the test file).
pub fn write(prefix: &str, name: &str, snapshot: &V) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("cuvmm-{prefix}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, pickle(snapshot)).unwrap();
    path
}
