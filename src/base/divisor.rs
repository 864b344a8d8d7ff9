//! Division by a size fixed at construction (a page size, a granularity): a shift and a mask when it is a
//! power of two, as it always is on a GPU. A 64-bit division takes tens of cycles, and the allocator and the
//! simulated device divide by their page size several times per request.

#![deny(unsafe_code)]

/// `bytes`, ready to divide by.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Divisor {
    bytes: u64,
    /// Whether `bytes` is a power of two, so that `shift` and `mask` apply (a flag rather than an `Option`,
    /// so the fast path is one predictable branch).
    power_of_two: bool,
    /// `log2(bytes)` when it is a power of two.
    shift: u32,
    /// `bytes - 1`.
    mask: u64,
}

impl Divisor {
    /// A divisor of `bytes`.
    ///
    /// # Panics
    /// If `bytes` is zero.
    pub(crate) fn new(bytes: u64) -> Self {
        assert!(bytes > 0, "dividing by zero bytes");
        Self {
            bytes,
            power_of_two: bytes.is_power_of_two(),
            shift: bytes.trailing_zeros(),
            mask: bytes - 1,
        }
    }

    /// The divisor.
    pub(crate) fn bytes(self) -> u64 {
        self.bytes
    }

    /// `value / bytes`.
    #[inline]
    pub(crate) fn quotient(self, value: u64) -> u64 {
        if self.power_of_two {
            value >> self.shift
        } else {
            value / self.bytes
        }
    }

    /// `value % bytes`.
    #[inline]
    pub(crate) fn remainder(self, value: u64) -> u64 {
        if self.power_of_two {
            value & self.mask
        } else {
            value % self.bytes
        }
    }

    /// Whether `value` is a multiple of `bytes`.
    #[inline]
    pub(crate) fn divides(self, value: u64) -> bool {
        self.remainder(value) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Powers of two (shift and mask) and other sizes (division) give what `/` and `%` give.
    #[test]
    fn matches_division() {
        for bytes in [1, 2, 3, 100, 512, 4096, 6000, 2 << 20, 3 << 20, 1 << 40] {
            let d = Divisor::new(bytes);
            for value in [0, 1, bytes - 1, bytes, bytes + 1, 7 * bytes + 5, u64::MAX] {
                assert_eq!(d.quotient(value), value / bytes, "{value} / {bytes}");
                assert_eq!(d.remainder(value), value % bytes, "{value} % {bytes}");
                assert_eq!(d.divides(value), value % bytes == 0);
            }
        }
    }
}
