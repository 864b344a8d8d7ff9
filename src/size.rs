//! Byte sizes: constants, parsing ("80GiB", "2MiB", "512") and formatting for people.

/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// Formats a byte count as PyTorch's memory_summary does: "0 B", "512 B", "1.50 MiB", "80.00 GiB".
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut value = bytes as f64;
    let mut unit = 0;
    while value >= 1024.0 && unit + 1 < UNITS.len() {
        value /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{value:.2} {}", UNITS[unit])
    }
}

/// Rounds `value` up to a multiple of `align`, or `None` on overflow. `align` must be non-zero.
pub fn round_up(value: u64, align: u64) -> Option<u64> {
    value.checked_next_multiple_of(align)
}

// TEMP: replaced by the wt-cfg branch
/// A size string that does not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid size `{0}`: expected a number with an optional B, KiB, MiB, GiB, K, M or G suffix"
)]
pub struct SizeError(pub String);

// TEMP: replaced by the wt-cfg branch
/// Parses "512", "4KiB", "2MiB", "80GiB", "64K", "8M", "1G" into bytes.
pub fn parse_size(text: &str) -> Result<u64, SizeError> {
    let error = || SizeError(text.to_string());
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, suffix) = text.split_at(split);
    let unit = match suffix.trim() {
        "" | "B" => 1,
        "KiB" | "K" => KIB,
        "MiB" | "M" => MIB,
        "GiB" | "G" => GIB,
        _ => return Err(error()),
    };
    let value: u64 = digits.parse().map_err(|_| error())?;
    value.checked_mul(unit).ok_or_else(error)
}
