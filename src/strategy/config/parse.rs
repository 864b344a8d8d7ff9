//! The parser of `key:value,key:value` strings, and the keys it knows.
//!
//! PyTorch's keys follow the rules of PyTorch's own parser (`c10/core/AllocatorConfig.cpp`, class
//! `AcceleratorAllocatorConfig`, for the keys every accelerator shares; `c10/cuda/CUDAAllocatorConfig.cpp`
//! for the CUDA ones), with one deliberate difference: numbers must be whole, unsigned and nothing else,
//! where C++'s `stoull` would take `"-5"` (wrapping it) or the `"64"` of `"64abc"`.

use super::{Budget, Compaction, Config, ConfigError, RoundupDivisions};
use crate::base::size::{KIB, MIB};

/// PyTorch's `kLargeBuffer` (20 MiB): the smallest `max_split_size_mb` and `max_non_split_rounding_mb`.
pub(super) const LARGE_BUFFER: u64 = 20 * MIB;
/// PyTorch's `pinned_max_register_threads()`.
const PINNED_MAX_REGISTER_THREADS: u64 = 128;

pub(super) const EXPECT_POSITIVE: &str =
    "a positive whole number that fits in 64 bits once in bytes";
pub(super) const EXPECT_VA_FACTOR: &str = "a whole number from 1 to 16";
pub(super) const EXPECT_AT_LEAST_20: &str = "a whole number of MiB >= 20 (PyTorch's kLargeBuffer)";
pub(super) const EXPECT_FRACTION: &str = "a number strictly between 0 and 1";
pub(super) const EXPECT_BUDGET_FRACTION: &str = "a number greater than 0 and at most 1";
pub(super) const EXPECT_HEADROOM: &str = "a number from 0 to 1";
const EXPECT_COMPACTION: &str = "`pressure`, `eager` or `split`";
pub(super) const EXPECT_ROUNDUP: &str = "a power of two, or a list like [256:1,512:2,>:8] whose keys are \
     powers of two (MiB) or `>` and whose values are powers of two or 0";
const EXPECT_BOOL: &str = "True or False (spelled as PyTorch spells them)";
const EXPECT_BACKEND: &str =
    "native (cuvmm does not model PyTorch's cudaMallocAsync backend; leave `backend` out)";
pub(super) const EXPECT_SLEEP_COPY: &str =
    "a whole number of MiB of at least 1 (a multiple of 4 KiB, set in code)";
const EXPECT_MARGIN: &str = "a whole number of MiB (0 keeps no margin)";
const EXPECT_STREAM_CACHE: &str = "a whole number of MiB (0 turns the stream caches off)";
const EXPECT_IDLE: &str =
    "a whole number of MiB that fits in 64 bits once in bytes, or `unlimited`";
const EXPECT_THREADS: &str = "a power of two <= 128";
const EXPECT_LARGE_SEGMENT: &str = "20 (cuvmm models PyTorch's fixed 20 MiB large segments)";

/// Parses `s` from the defaults; see [`Config::from_alloc_conf`].
pub(super) fn parse(s: &str) -> Result<Config, ConfigError> {
    // PyTorch's tokenizer drops every whitespace character, wherever it is.
    let s: String = s.chars().filter(|c| !c.is_whitespace()).collect();
    let mut config = Config::default();
    if s.is_empty() {
        return Ok(config);
    }
    let entries = split_top_level(&s);
    for (i, entry) in entries.iter().enumerate() {
        // A trailing comma is accepted, as PyTorch accepts it; no other empty entry is.
        if entry.is_empty() && i > 0 && i + 1 == entries.len() {
            continue;
        }
        let Some((key, value)) = entry.split_once(':') else {
            return Err(ConfigError::Syntax {
                entry: entry.to_string(),
            });
        };
        apply(&mut config, key, value)?;
    }
    config.validate()?;
    Ok(config)
}

/// Splits at the commas outside brackets, so a `[..]` list stays in its entry.
fn split_top_level(s: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut depth = 0usize;
    let mut start = 0;
    for (i, c) in s.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth = depth.saturating_sub(1),
            ',' if depth == 0 => {
                out.push(&s[start..i]);
                start = i + 1;
            }
            _ => {}
        }
    }
    out.push(&s[start..]);
    out
}

/// Sets the field that `key` names.
fn apply(config: &mut Config, key: &str, value: &str) -> Result<(), ConfigError> {
    let bad = |expected| bad_value(key, value, expected);
    match key {
        "max_split_size_mb" => config.max_split_size = Some(mib_at_least_20(key, value)?),
        "max_non_split_rounding_mb" => config.max_non_split_rounding = mib_at_least_20(key, value)?,
        "garbage_collection_threshold" => {
            let t: f64 = value.parse().map_err(|_| bad(EXPECT_FRACTION))?;
            if !(t > 0.0 && t < 1.0) {
                return Err(bad(EXPECT_FRACTION));
            }
            config.garbage_collection_threshold = Some(t);
        }
        "roundup_power2_divisions" => {
            config.roundup_power2_divisions =
                roundup(&config.roundup_power2_divisions, key, value)?;
        }
        "expandable_segments" => config.expandable_segments = boolean(key, value)?,
        "backend" if value == "native" => {}
        "backend" => return Err(bad(EXPECT_BACKEND)),
        "large_segment_size_mb" if value == "20" => {}
        "large_segment_size_mb" => return Err(bad(EXPECT_LARGE_SEGMENT)),
        "release_lock_on_cudamalloc" | "release_lock_on_hipmalloc" => {
            boolean(key, value)?;
            ignored(key, value, "cuvmm does its own locking");
        }
        "graph_capture_record_stream_reuse" => {
            boolean(key, value)?;
            ignored(key, value, "cuvmm does not model CUDA graph capture");
        }
        "pinned_use_cuda_host_register" => config.host_pinning.register = boolean(key, value)?,
        "pinned_num_register_threads" => {
            let n = uint(key, value, EXPECT_THREADS)?;
            if !n.is_power_of_two() || n > PINNED_MAX_REGISTER_THREADS {
                return Err(bad(EXPECT_THREADS));
            }
            config.host_pinning.threads = n as usize;
        }
        "pinned_use_hip_host_register" | "pinned_use_background_threads" => {
            boolean(key, value)?;
            ignored(
                key,
                value,
                "cuvmm has no pinned memory allocator for tensors",
            );
        }
        "pinned_reserve_segment_size_mb" => {
            if uint(key, value, EXPECT_POSITIVE)? == 0 {
                return Err(bad(EXPECT_POSITIVE));
            }
            ignored(
                key,
                value,
                "cuvmm has no pinned memory allocator for tensors",
            );
        }
        "page_size_mb" => config.page_size = Some(positive_bytes(key, value, MIB)?),
        "small_size_kb" => config.small_size = positive_bytes(key, value, KIB)?,
        "max_idle_mb" if value == "unlimited" => config.max_idle_bytes = u64::MAX,
        "max_idle_mb" => {
            let mib = uint(key, value, EXPECT_IDLE)?;
            config.max_idle_bytes = mib.checked_mul(MIB).ok_or_else(|| bad(EXPECT_IDLE))?;
        }
        "cross_stream_reuse" => config.cross_stream_reuse = boolean(key, value)?,
        "lend_chunk_pages" => config.lend_chunk_pages = boolean(key, value)?,
        "capture_detection" => config.capture_detection = boolean(key, value)?,
        "keep_host_buffers" => config.keep_host_buffers = boolean(key, value)?,
        "sleep_copy_mb" => {
            let mib = uint(key, value, EXPECT_SLEEP_COPY)?;
            config.sleep_copy = (mib.checked_mul(MIB))
                .filter(|&b| b > 0)
                .ok_or_else(|| bad(EXPECT_SLEEP_COPY))?;
        }
        "device_margin_mb" => {
            let mib = uint(key, value, EXPECT_MARGIN)?;
            config.device_margin = mib.checked_mul(MIB).ok_or_else(|| bad(EXPECT_MARGIN))?;
        }
        "stream_cache_eager" => config.stream_cache_eager = Some(boolean(key, value)?),
        "compaction" => {
            config.compaction = match value {
                "pressure" => Compaction::Pressure,
                "eager" => Compaction::Eager,
                "split" => Compaction::Split,
                _ => return Err(bad(EXPECT_COMPACTION)),
            }
        }
        "reserve_budget_mb" => {
            config.reserve_budget = Some(Budget::Bytes(positive_bytes(key, value, MIB)?));
        }
        "reserve_budget_fraction" | "per_process_memory_fraction" => {
            let f: f64 = value.parse().map_err(|_| bad(EXPECT_BUDGET_FRACTION))?;
            if !(f > 0.0 && f <= 1.0) {
                return Err(bad(EXPECT_BUDGET_FRACTION));
            }
            if key == "reserve_budget_fraction" {
                config.reserve_budget = Some(Budget::Fraction(f));
            } else {
                config.memory_limit = Some(Budget::Fraction(f));
            }
        }
        "large_handle_mb" => config.large_handle = positive_bytes(key, value, MIB)?,
        "stream_cache_mb" => {
            let mib = uint(key, value, EXPECT_STREAM_CACHE)?;
            config.stream_cache = mib
                .checked_mul(MIB)
                .ok_or_else(|| bad(EXPECT_STREAM_CACHE))?;
        }
        "large_handle_headroom" => {
            let f: f64 = value.parse().map_err(|_| bad(EXPECT_HEADROOM))?;
            if !(0.0..=1.0).contains(&f) {
                return Err(bad(EXPECT_HEADROOM));
            }
            config.large_handle_headroom = f;
        }
        "va_factor" => {
            config.va_factor = uint(key, value, EXPECT_VA_FACTOR)?;
            if config.va_factor == 0 || config.va_factor > super::MAX_VA_FACTOR {
                return Err(bad(EXPECT_VA_FACTOR));
            }
        }
        _ => {
            return Err(ConfigError::UnknownKey {
                key: key.to_string(),
            });
        }
    }
    Ok(())
}

fn bad_value(key: &str, value: &str, expected: &'static str) -> ConfigError {
    ConfigError::BadValue {
        key: key.to_string(),
        value: value.to_string(),
        expected,
    }
}

/// Reports a PyTorch key whose (valid) value changes nothing cuvmm models.
fn ignored(key: &str, value: &str, why: &str) {
    tracing::warn!(
        key,
        value,
        "ignoring PyTorch allocator option `{key}`: {why}"
    );
}

/// A whole unsigned number: ASCII digits only, fitting in 64 bits.
fn uint(key: &str, value: &str, expected: &'static str) -> Result<u64, ConfigError> {
    if value.is_empty() || !value.bytes().all(|b| b.is_ascii_digit()) {
        return Err(bad_value(key, value, expected));
    }
    value.parse().map_err(|_| bad_value(key, value, expected))
}

/// PyTorch's `toBool`: exactly `True` or `False`.
fn boolean(key: &str, value: &str) -> Result<bool, ConfigError> {
    match value {
        "True" => Ok(true),
        "False" => Ok(false),
        _ => Err(bad_value(key, value, EXPECT_BOOL)),
    }
}

/// A positive count of `unit`s, in bytes.
fn positive_bytes(key: &str, value: &str, unit: u64) -> Result<u64, ConfigError> {
    let n = uint(key, value, EXPECT_POSITIVE)?;
    n.checked_mul(unit)
        .filter(|&bytes| bytes > 0)
        .ok_or_else(|| bad_value(key, value, EXPECT_POSITIVE))
}

/// PyTorch's `max_split_size_mb` / `max_non_split_rounding_mb`: at least `kLargeBuffer / kMB` MiB,
/// larger values capped at `SIZE_MAX / kMB` MiB, stored in bytes.
fn mib_at_least_20(key: &str, value: &str) -> Result<u64, ConfigError> {
    let mib = uint(key, value, EXPECT_AT_LEAST_20)?;
    if mib < LARGE_BUFFER / MIB {
        return Err(bad_value(key, value, EXPECT_AT_LEAST_20));
    }
    Ok(mib.min(u64::MAX / MIB) * MIB)
}

/// PyTorch's `parseRoundUpPower2Divisions`. A single number sets every interval. A list updates the
/// intervals `current` has (a repeated key does not start again from zero, as in PyTorch): `b:d` sets
/// interval `log2(b)` (clamped to the last), the first such entry also every interval below it, and
/// `>:d` every interval above the last one set; intervals between two entries keep their value.
fn roundup(
    current: &RoundupDivisions,
    key: &str,
    value: &str,
) -> Result<RoundupDivisions, ConfigError> {
    let bad = || bad_value(key, value, EXPECT_ROUNDUP);
    let Some(inner) = value.strip_prefix('[') else {
        let n = uint(key, value, EXPECT_ROUNDUP)?;
        return if n.is_power_of_two() {
            Ok(RoundupDivisions::Uniform(n))
        } else {
            Err(bad())
        };
    };
    let inner = inner.strip_suffix(']').ok_or_else(bad)?;
    if inner.contains(['[', ']']) {
        return Err(bad());
    }
    let mut divisions = current.per_interval();
    let items: Vec<&str> = inner.split(',').collect();
    let mut first = true;
    let mut last_index = 0;
    for (i, item) in items.iter().enumerate() {
        if item.is_empty() && i + 1 == items.len() {
            break; // `[]` or a trailing comma, as PyTorch accepts them
        }
        let (bound, d) = item.split_once(':').ok_or_else(bad)?;
        let d = uint(key, d, EXPECT_ROUNDUP).map_err(|_| bad())?;
        if d != 0 && !d.is_power_of_two() {
            return Err(bad());
        }
        if bound == ">" {
            divisions
                .iter_mut()
                .skip(last_index + 1)
                .for_each(|x| *x = d);
            continue;
        }
        let bound = uint(key, bound, EXPECT_ROUNDUP).map_err(|_| bad())?;
        if !bound.is_power_of_two() {
            return Err(bad());
        }
        let index = (bound.ilog2() as usize).min(RoundupDivisions::INTERVALS - 1);
        if first {
            divisions[..index].fill(d);
            first = false;
        }
        divisions[index] = d;
        last_index = index;
    }
    Ok(RoundupDivisions::PerInterval(divisions))
}
