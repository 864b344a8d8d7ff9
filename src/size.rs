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
