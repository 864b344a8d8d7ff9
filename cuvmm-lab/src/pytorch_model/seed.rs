//! Adopting memory that PyTorch already held: a trace recorded mid-run starts with segments, some of
//! their blocks live, whose layout the replay must reproduce before the first event.

use super::Split;
use super::block::Block;
use super::rules::MIN_BLOCK_SIZE;
use cuvmm::driver::{Driver, StreamId};
use cuvmm::strategy::error::Error;
use cuvmm::strategy::pool::Pool;

/// A live block of a [`SeedSegment`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeedBlock {
    /// Offset from the segment's start.
    pub offset: u64,
    /// The block's (rounded) size.
    pub size: u64,
    /// The bytes its owner asked for.
    pub requested: u64,
}

/// A `cudaMalloc`'d segment that existed before the allocator: its size, stream, pool and live blocks.
/// Everything between the live blocks is cached (free), as PyTorch leaves it: free neighbours always merge.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeedSegment {
    /// Bytes of the segment.
    pub size: u64,
    /// Its stream.
    pub stream: StreamId,
    /// Its pool.
    pub pool: Pool,
    /// Its live blocks, in address order.
    pub live: Vec<SeedBlock>,
}

/// A seed that cannot be adopted.
#[derive(Debug, thiserror::Error)]
pub enum SeedError {
    /// A block or segment size or offset is not a multiple of 512 B, or is 0.
    #[error(
        "seed block at offset {offset:#x}: sizes and offsets must be non-zero multiples of 512 B"
    )]
    Misaligned {
        /// The block's offset.
        offset: u64,
    },
    /// A block overlaps the one before it or runs past the segment's end.
    #[error("seed block at offset {offset:#x} overlaps its neighbour or the segment's end")]
    Overlap {
        /// The block's offset.
        offset: u64,
    },
    /// Adoption is only for `cudaMalloc`'d segments (the classic model).
    #[error("seeding segments is only supported by the classic model")]
    Expandable,
    /// The driver could not provide the segment.
    #[error("allocating the seed segment failed: {0}")]
    Alloc(#[from] Error),
}

impl<D: Driver> Split<D> {
    /// `cudaMalloc`s a segment laid out as `seed` says and returns its address: the live blocks are
    /// allocated (counted as allocations), the gaps between them cached. On a
    /// [`SimDriver`](cuvmm::driver::sim::SimDriver) with planned addresses, the segment lands where
    /// PyTorch had it.
    ///
    /// # Errors
    /// [`SeedError`] for a malformed layout (nothing is allocated then), or the driver's failure.
    pub fn adopt_segment(&mut self, seed: &SeedSegment) -> Result<u64, SeedError> {
        if self.expandable {
            return Err(SeedError::Expandable);
        }
        if seed.size == 0 || seed.size % MIN_BLOCK_SIZE != 0 {
            return Err(SeedError::Misaligned { offset: 0 });
        }
        let mut end = 0;
        for b in &seed.live {
            if b.size == 0 || b.size % MIN_BLOCK_SIZE != 0 || b.offset % MIN_BLOCK_SIZE != 0 {
                return Err(SeedError::Misaligned { offset: b.offset });
            }
            if b.offset < end || b.offset.checked_add(b.size).is_none_or(|e| e > seed.size) {
                return Err(SeedError::Overlap { offset: b.offset });
            }
            end = b.offset + b.size;
        }
        let base = self.driver.malloc(seed.size).map_err(Error::from)?;
        self.add_malloc_segment(base, seed.size, seed.stream, seed.pool);
        self.blocks.remove(base);
        let template = Block {
            size: 0,
            requested: 0,
            allocated: false,
            stream: seed.stream,
            pool: seed.pool,
            segment: base,
            mapped: true,
            gc_count_base: 0,
        };
        let mut cursor = 0;
        let mut free = Vec::new();
        for b in &seed.live {
            if b.offset > cursor {
                free.push((cursor, b.offset - cursor));
            }
            self.blocks.insert(
                base + b.offset,
                Block {
                    size: b.size,
                    requested: b.requested,
                    allocated: true,
                    ..template
                },
            );
            let c = &mut self.counters;
            c.allocation.add(seed.pool, 1);
            c.allocated.add(seed.pool, b.size);
            c.active.add(seed.pool, b.size);
            c.requested.add(seed.pool, b.requested);
            if b.size >= self.config.max_split_size.unwrap_or(u64::MAX) {
                c.oversize_allocations.add(1);
            }
            cursor = b.offset + b.size;
        }
        if cursor < seed.size {
            free.push((cursor, seed.size - cursor));
        }
        let split = seed.live.len() + free.len() > 1;
        for (offset, size) in free {
            self.blocks
                .insert(base + offset, Block { size, ..template });
            self.insert_into_blocks(base + offset);
            if split {
                self.counters.inactive_split.add(seed.pool, 1);
                self.counters.inactive_split_bytes.add(seed.pool, size);
            }
        }
        Ok(base)
    }
}
