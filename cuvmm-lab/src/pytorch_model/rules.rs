//! PyTorch's sizing rules, as pure functions: rounding, pool choice, segment size, and when to split.
//!
//! Each function mirrors one of `c10/cuda/CUDACachingAllocator.cpp` (`round_size`,
//! `roundup_power2_next_division`, `get_pool`, `get_allocation_size`, `should_split`) and carries its name.

use cuvmm::size::MIB;
use cuvmm::strategy::config::RoundupDivisions;
use cuvmm::strategy::pool::Pool;

/// Every block is a multiple of this many bytes (PyTorch's `kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Requests of at most this many bytes (after rounding) use the small pool (`kSmallSize`).
pub const SMALL_SIZE: u64 = MIB;
/// Segment size of the small pool (`kSmallBuffer`), and its page size in expandable mode.
pub const SMALL_BUFFER: u64 = 2 * MIB;
/// Segment size for large requests below [`MIN_LARGE_ALLOC`] (`kLargeBuffer`), and the large pool's page
/// size in expandable mode.
pub const LARGE_BUFFER: u64 = 20 * MIB;
/// Large requests below this size share a [`LARGE_BUFFER`] segment (`kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 * MIB;
/// Larger requests get a segment of their own size rounded up to this (`kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 * MIB;

/// PyTorch's `roundup_power2_next_division`: `size` rounded up to the next of `divisions` equal steps
/// between the powers of two around it. A power of two is returned as is. `None` on overflow.
///
/// PyTorch's example: 1200 with 4 divisions lies between 1024 and 2048, whose steps are 1024, 1280, 1536
/// and 1792, so it rounds to 1280.
pub fn roundup_power2_next_division(size: u64, divisions: u64) -> Option<u64> {
    if size.is_power_of_two() || size == 0 {
        return Some(size);
    }
    let floor = 1u64 << size.ilog2();
    // `power2_floor >> log2(divisions)`; `divisions` is a power of two >= 2 when this is called.
    let step = floor >> divisions.max(1).ilog2();
    if step == 0 {
        return floor.checked_mul(2);
    }
    let down = size & !(step - 1);
    if down == size {
        Some(size)
    } else {
        down.checked_add(step)
    }
}

/// PyTorch's `round_size`: below 512 B, 512 B; else, if the size's interval has more than one division and
/// the size exceeds `512 x divisions`, the next power-of-two division; else the next multiple of 512 B.
/// `None` on overflow.
pub fn round_size(size: u64, divisions: &RoundupDivisions) -> Option<u64> {
    if size < MIN_BLOCK_SIZE {
        return Some(MIN_BLOCK_SIZE);
    }
    let d = divisions.divisions(size);
    if d > 1 && size > MIN_BLOCK_SIZE.saturating_mul(d) {
        roundup_power2_next_division(size, d)
    } else {
        size.checked_next_multiple_of(MIN_BLOCK_SIZE)
    }
}

/// PyTorch's `get_pool`: the small pool for rounded sizes of at most 1 MiB, the large pool above.
pub fn pool_for(rounded: u64) -> Pool {
    if rounded <= SMALL_SIZE {
        Pool::Small
    } else {
        Pool::Large
    }
}

/// PyTorch's `get_allocation_size`: the size of the segment `cudaMalloc`'d for a rounded request that no
/// cached block serves: 2 MiB for the small pool, 20 MiB below 10 MiB, else the request rounded up to
/// 2 MiB. `None` on overflow.
pub fn allocation_size(rounded: u64) -> Option<u64> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_BUFFER)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_BUFFER)
    } else {
        rounded.checked_next_multiple_of(ROUND_LARGE)
    }
}

/// PyTorch's `should_split`: whether a free block of `block_size` bytes that serves a request of `size`
/// bytes is split, leaving the remainder free. In the small pool, and for every block when expandable
/// segments are on, a remainder of at least 512 B is split off; in the large pool, only a remainder of more
/// than 1 MiB, and only for requests below `max_split_size`.
pub fn should_split(
    pool: Pool,
    expandable: bool,
    block_size: u64,
    size: u64,
    max_split_size: u64,
) -> bool {
    let remaining = block_size - size;
    if pool == Pool::Small || expandable {
        remaining >= MIN_BLOCK_SIZE
    } else {
        size < max_split_size && remaining > SMALL_SIZE
    }
}

/// The oversize rules of PyTorch's `get_free_block`: whether the best-fitting cached block of `block_size`
/// bytes may serve a request of `size` bytes. A request below `max_split_size` never takes a block of
/// `max_split_size` or more (it would have to split it); a request of `max_split_size` or more takes a
/// block only if it is less than `max_non_split_rounding` larger than the request.
pub fn oversize_allows(
    size: u64,
    block_size: u64,
    max_split_size: u64,
    max_non_split_rounding: u64,
) -> bool {
    if size < max_split_size {
        block_size < max_split_size
    } else {
        block_size < size.saturating_add(max_non_split_rounding)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn power2_division_pytorch_example_1200_with_4_divisions_is_1280() {
        assert_eq!(roundup_power2_next_division(1200, 4), Some(1280));
        // The steps between 1024 and 2048 with 4 divisions: 1024, 1280, 1536, 1792.
        assert_eq!(roundup_power2_next_division(1281, 4), Some(1536));
        assert_eq!(roundup_power2_next_division(1536, 4), Some(1536));
        assert_eq!(roundup_power2_next_division(1793, 4), Some(2048));
        // Powers of two stay.
        assert_eq!(roundup_power2_next_division(4096, 8), Some(4096));
    }

    #[test]
    fn round_size_is_512_below_512_then_multiples_of_512() {
        let none = RoundupDivisions::None;
        assert_eq!(round_size(1, &none), Some(512));
        assert_eq!(round_size(511, &none), Some(512));
        assert_eq!(round_size(512, &none), Some(512));
        assert_eq!(round_size(513, &none), Some(1024));
        assert_eq!(round_size(1200, &none), Some(1536));
        assert_eq!(round_size(u64::MAX, &none), None);
    }

    #[test]
    fn round_size_uses_divisions_only_above_512_times_divisions() {
        let four = RoundupDivisions::Uniform(4);
        // 1200 <= 512 * 4: plain 512 B rounding.
        assert_eq!(round_size(1200, &four), Some(1536));
        // 3000 > 2048: between 2048 and 4096 the steps are 512 apart.
        assert_eq!(round_size(3000, &four), Some(3072));
        // 5 MiB + 1 rounds to the next quarter between 4 MiB and 8 MiB: 6 MiB.
        assert_eq!(round_size(5 * MIB + 1, &four), Some(6 * MIB));
        // One division means no power-of-two rounding.
        assert_eq!(
            round_size(5 * MIB + 1, &RoundupDivisions::Uniform(1)),
            Some(5 * MIB + 512)
        );
    }

    #[test]
    fn round_size_follows_the_interval_of_a_per_interval_setting() {
        // [256:1,512:2,1024:4,>:8] as PyTorch parses it: intervals below 256 MiB get 1, 512 MiB 2, ...
        let mut v = vec![1u64; 16];
        v[9] = 2;
        v[10] = 4;
        for d in v.iter_mut().skip(11) {
            *d = 8;
        }
        let per = RoundupDivisions::PerInterval(v);
        // 300 MiB (interval 256 MiB..512 MiB, index 8): one division, 512 B rounding.
        assert_eq!(round_size(300 * MIB + 1, &per), Some(300 * MIB + 512));
        // 600 MiB (index 9): 2 divisions between 512 MiB and 1 GiB -> 768 MiB.
        assert_eq!(round_size(600 * MIB, &per), Some(768 * MIB));
        // 1100 MiB (index 10): 4 divisions between 1 GiB and 2 GiB -> 1280 MiB.
        assert_eq!(round_size(1100 * MIB, &per), Some(1280 * MIB));
        // 3 GiB + 1 (index 11): 8 divisions between 2 GiB and 4 GiB -> 3 GiB + 256 MiB.
        assert_eq!(round_size(3072 * MIB + 1, &per), Some(3328 * MIB));
    }

    #[test]
    fn small_pool_holds_requests_up_to_1_mib() {
        assert_eq!(pool_for(512), Pool::Small);
        assert_eq!(pool_for(MIB), Pool::Small);
        assert_eq!(pool_for(MIB + 512), Pool::Large);
    }

    #[test]
    fn segment_sizes_2_mib_small_20_mib_below_10_mib_then_2_mib_multiples() {
        assert_eq!(allocation_size(512), Some(2 * MIB));
        assert_eq!(allocation_size(MIB), Some(2 * MIB));
        assert_eq!(allocation_size(MIB + 512), Some(20 * MIB));
        assert_eq!(allocation_size(10 * MIB - 512), Some(20 * MIB));
        assert_eq!(allocation_size(10 * MIB), Some(10 * MIB));
        assert_eq!(allocation_size(10 * MIB + 512), Some(12 * MIB));
        assert_eq!(allocation_size(100 * MIB + 1), Some(102 * MIB));
    }

    #[test]
    fn small_blocks_split_any_remainder_of_512_bytes() {
        let max = u64::MAX;
        assert!(should_split(
            Pool::Small,
            false,
            2 * MIB,
            2 * MIB - 512,
            max
        ));
        assert!(!should_split(Pool::Small, false, 2 * MIB, 2 * MIB, max));
    }

    #[test]
    fn large_blocks_split_only_remainders_above_1_mib_below_max_split_size() {
        let max = u64::MAX;
        assert!(!should_split(Pool::Large, false, 20 * MIB, 19 * MIB, max));
        assert!(should_split(
            Pool::Large,
            false,
            20 * MIB,
            19 * MIB - 512,
            max
        ));
        // A request of max_split_size or more never splits its block.
        assert!(!should_split(
            Pool::Large,
            false,
            100 * MIB,
            40 * MIB,
            40 * MIB
        ));
        assert!(should_split(
            Pool::Large,
            false,
            100 * MIB,
            39 * MIB,
            40 * MIB
        ));
    }

    #[test]
    fn expandable_segments_split_every_remainder_of_512_bytes() {
        assert!(should_split(
            Pool::Large,
            true,
            20 * MIB,
            20 * MIB - 512,
            u64::MAX
        ));
        assert!(!should_split(
            Pool::Large,
            true,
            20 * MIB,
            20 * MIB,
            u64::MAX
        ));
    }

    #[test]
    fn oversize_requests_only_take_blocks_below_size_plus_max_non_split_rounding() {
        let (max_split, rounding) = (40 * MIB, 20 * MIB);
        // A request below max_split_size never takes an oversize block.
        assert!(!oversize_allows(30 * MIB, 40 * MIB, max_split, rounding));
        assert!(oversize_allows(30 * MIB, 39 * MIB, max_split, rounding));
        // An oversize request takes a block less than 20 MiB larger than itself.
        assert!(oversize_allows(
            50 * MIB,
            70 * MIB - 512,
            max_split,
            rounding
        ));
        assert!(!oversize_allows(50 * MIB, 70 * MIB, max_split, rounding));
    }
}
