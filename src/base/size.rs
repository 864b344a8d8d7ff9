//! Byte sizes: constants, parsing ("80GiB", "2MiB", "512") and formatting for people.

/// One kibibyte.
pub const KIB: u64 = 1 << 10;
/// One mebibyte.
pub const MIB: u64 = 1 << 20;
/// One gibibyte.
pub const GIB: u64 = 1 << 30;

/// A size string that [`parse_size`] cannot read. Each names the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SizeError {
    /// Nothing but whitespace.
    #[error("empty size")]
    Empty,
    /// A leading minus sign.
    #[error("size `{input}` is negative")]
    Negative {
        /// The input.
        input: String,
    },
    /// No number where one must start, or a malformed one ("NaN", "1.2.3", ".GiB").
    #[error("size `{input}` does not start with a number")]
    BadNumber {
        /// The input.
        input: String,
    },
    /// A unit other than B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB, P/PB/PiB.
    #[error("size `{input}` has unknown unit `{unit}`; expected B, KiB, MiB, GiB, TiB or PiB")]
    UnknownUnit {
        /// The input.
        input: String,
        /// The unit as written.
        unit: String,
    },
    /// More bytes than a `u64` holds.
    #[error("size `{input}` does not fit in 64 bits")]
    Overflow {
        /// The input.
        input: String,
    },
}

/// Parses a size as people write it on a command line: a number, an optional space, an optional unit.
///
/// Accepted: "512", "512B", "64KiB", "2M", "2 MiB", "80G", "80GB", "80GiB", "1.5GiB". Units are
/// case-insensitive and all **binary**: K/KB/KiB = 2^10, M/MB/MiB = 2^20, G/GB/GiB = 2^30, T/TB/TiB = 2^40,
/// P/PB/PiB = 2^50 (so "80GB" is 80 GiB, as GPU memory is sized). A fraction is allowed and the result is
/// truncated to whole bytes, exactly (no floating point): "1.5KiB" is 1536, "0.3B" is 0.
///
/// # Errors
/// A [`SizeError`] naming the input: empty, negative, not a number (including "NaN" and "inf"),
/// an unknown unit, or more than `u64::MAX` bytes.
pub fn parse_size(s: &str) -> Result<u64, SizeError> {
    let input = s.trim();
    let owned = || input.to_string();
    if input.is_empty() {
        return Err(SizeError::Empty);
    }
    if input.starts_with('-') {
        return Err(SizeError::Negative { input: owned() });
    }
    let number_len = input
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(input.len());
    let (number, unit) = input.split_at(number_len);
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    if whole.is_empty() && fraction.is_empty() || fraction.contains('.') {
        return Err(SizeError::BadNumber { input: owned() });
    }
    let unit = unit.trim_start();
    let shift = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        "p" | "pb" | "pib" => 50,
        _ => {
            return Err(SizeError::UnknownUnit {
                input: owned(),
                unit: unit.to_string(),
            });
        }
    };
    let overflow = || SizeError::Overflow { input: owned() };
    let whole = whole
        .bytes()
        .try_fold(0u64, |acc, d| {
            acc.checked_mul(10)?.checked_add(u64::from(d - b'0'))
        })
        .ok_or_else(overflow)?;
    whole
        .checked_mul(1 << shift)
        .and_then(|bytes| bytes.checked_add(fraction_times_pow2(fraction, shift)))
        .ok_or_else(overflow)
}

/// `floor(0.<digits> * 2^shift)`, exactly: doubling the decimal fraction `shift` times, each carry out of
/// the units digit is the next binary digit of the result.
fn fraction_times_pow2(digits: &str, shift: u32) -> u64 {
    let mut digits: Vec<u8> = digits.bytes().map(|d| d - b'0').collect();
    let mut out = 0u64;
    for _ in 0..shift {
        let mut carry = 0;
        for d in digits.iter_mut().rev() {
            let doubled = *d * 2 + carry;
            *d = doubled % 10;
            carry = doubled / 10;
        }
        out = out * 2 + u64::from(carry);
    }
    out
}

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

#[cfg(test)]
mod tests;
