//! The allocator settings a snapshot records, as a [`Config`].

use super::snapshot::SnapshotError;
use cuvmm::strategy::config::{Config, RoundupDivisions};
use serde_pickle::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// The configuration PyTorch ran with, from a snapshot's `allocator_settings` (PyTorch's defaults where
/// the snapshot does not say). Keys cuvmm does not model are ignored.
pub fn config_from_settings(
    path: &Path,
    settings: Option<&BTreeMap<String, Value>>,
) -> Result<Config, SnapshotError> {
    let mut config = Config::default();
    let Some(settings) = settings else {
        return Ok(config);
    };
    let bad = |key: &str| SnapshotError::Setting {
        path: path.to_path_buf(),
        key: key.to_string(),
    };
    for (key, value) in settings {
        match key.as_str() {
            "max_split_size" => {
                config.max_split_size = match int(value).ok_or_else(|| bad(key))? {
                    n if n <= 0 || n >= i128::from(u64::MAX) => None,
                    n => Some(n as u64),
                }
            }
            "max_non_split_rounding_size" | "max_non_split_rounding" => {
                if let Some(n) = int(value).filter(|&n| n > 0 && n < i128::from(u64::MAX)) {
                    config.max_non_split_rounding = n as u64;
                }
            }
            "garbage_collection_threshold" => {
                let t = float(value).ok_or_else(|| bad(key))?;
                config.garbage_collection_threshold = (t > 0.0 && t < 1.0).then_some(t);
            }
            "expandable_segments" => {
                config.expandable_segments = matches!(value, Value::Bool(true));
            }
            "roundup_power2_divisions" => {
                config.roundup_power2_divisions = divisions(value).ok_or_else(|| bad(key))?;
            }
            _ => {}
        }
    }
    Ok(config)
}

fn int(v: &Value) -> Option<i128> {
    match v {
        Value::I64(n) => Some(i128::from(*n)),
        Value::Int(n) => n.to_string().parse().ok(),
        Value::Bool(b) => Some(i128::from(*b)),
        _ => None,
    }
}

fn float(v: &Value) -> Option<f64> {
    match v {
        Value::F64(x) => Some(*x),
        other => int(other).map(|n| n as f64),
    }
}

/// PyTorch records the divisions as a dict from each interval's start in MiB (`"1"` .. `"32768"`) to its
/// divisions; older versions as a list, or a single number.
fn divisions(v: &Value) -> Option<RoundupDivisions> {
    let per: Vec<u64> = match v {
        Value::Dict(map) => {
            let mut entries: Vec<(u64, u64)> = Vec::new();
            for (k, d) in map {
                let k = match k {
                    serde_pickle::HashableValue::String(s) => s.parse().ok()?,
                    serde_pickle::HashableValue::I64(n) => u64::try_from(*n).ok()?,
                    _ => return None,
                };
                entries.push((k, u64::try_from(int(d)?).ok()?));
            }
            entries.sort_unstable();
            entries.into_iter().map(|(_, d)| d).collect()
        }
        Value::List(items) | Value::Tuple(items) => items
            .iter()
            .map(|d| int(d).and_then(|n| u64::try_from(n).ok()))
            .collect::<Option<_>>()?,
        other => {
            let n = u64::try_from(int(other)?).ok()?;
            return Some(if n > 1 {
                RoundupDivisions::Uniform(n)
            } else {
                RoundupDivisions::None
            });
        }
    };
    Some(if per.iter().all(|&d| d <= 1) {
        RoundupDivisions::None
    } else {
        RoundupDivisions::PerInterval(per)
    })
}
