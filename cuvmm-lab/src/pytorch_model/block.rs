//! Blocks and the pools of cached blocks.
//!
//! PyTorch keeps each segment's blocks in a doubly linked list and the free ones in two ordered sets per
//! pool (`BlockPool::blocks` by `BlockComparatorSize`, `BlockPool::unmapped` by `BlockComparatorAddress`).
//! Here every block of every segment lives in one map ordered by address, so a block's `prev` and `next`
//! are its neighbours in the map when they belong to the same segment; the ordered sets hold keys, not
//! pointers.

use cuvmm::driver::StreamId;
use cuvmm::strategy::pool::Pool;
use std::collections::{BTreeMap, BTreeSet};

/// One block: a piece of a segment, live (allocated) or cached (free).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    /// Bytes, a multiple of 512.
    pub size: u64,
    /// Bytes the caller asked for while allocated; 0 while free.
    pub requested: u64,
    /// Whether a caller holds it.
    pub allocated: bool,
    /// The stream it was allocated for; only that stream reuses it.
    pub stream: StreamId,
    /// The pool it belongs to.
    pub pool: Pool,
    /// Start address of its segment.
    pub segment: u64,
    /// Whether physical memory backs it: always for `cudaMalloc`'d segments; in expandable segments the
    /// unmapped tail of the reservation is a block too.
    pub mapped: bool,
    /// The pool's `get_free_blocks_call_count` when the block was last cached (for garbage collection).
    pub gc_count_base: u64,
}

/// Key of a cached, mapped block in a pool: best fit is the first key at or after `(stream, size, 0)`.
pub(crate) type SizeKey = (StreamId, u64, u64);

/// One pool's cached blocks (PyTorch's `BlockPool`).
#[derive(Debug, Default, Clone)]
pub(crate) struct BlockPool {
    /// Free mapped blocks by (stream, size, address).
    pub blocks: BTreeSet<SizeKey>,
    /// Unmapped blocks of expandable segments by (stream, address).
    pub unmapped: BTreeSet<(StreamId, u64)>,
    /// How often a free block was looked for while garbage collection is on.
    pub get_free_blocks_call_count: u64,
}

/// Every block, by address.
#[derive(Debug, Default, Clone)]
pub(crate) struct Blocks {
    map: BTreeMap<u64, Block>,
}

impl Blocks {
    pub fn get(&self, addr: u64) -> Option<&Block> {
        self.map.get(&addr)
    }

    pub fn get_mut(&mut self, addr: u64) -> Option<&mut Block> {
        self.map.get_mut(&addr)
    }

    /// The block at `addr`, which the caller knows exists.
    pub fn at(&self, addr: u64) -> Block {
        self.map[&addr]
    }

    pub fn insert(&mut self, addr: u64, block: Block) {
        self.map.insert(addr, block);
    }

    pub fn remove(&mut self, addr: u64) -> Option<Block> {
        self.map.remove(&addr)
    }

    /// The block just before `addr` in the same segment.
    pub fn prev(&self, addr: u64) -> Option<(u64, Block)> {
        let segment = self.map.get(&addr)?.segment;
        let (&a, &b) = self.map.range(..addr).next_back()?;
        (b.segment == segment).then_some((a, b))
    }

    /// The block just after the one at `addr` in the same segment.
    pub fn next(&self, addr: u64) -> Option<(u64, Block)> {
        let segment = self.map.get(&addr)?.segment;
        let (&a, &b) = self.map.range(addr + 1..).next()?;
        (b.segment == segment).then_some((a, b))
    }

    /// Whether the block at `addr` shares its segment with another block (PyTorch's `is_split`).
    pub fn is_split(&self, addr: u64) -> bool {
        self.prev(addr).is_some() || self.next(addr).is_some()
    }

    /// The blocks of the segment starting at `segment`, in address order.
    pub fn of_segment(&self, segment: u64) -> impl Iterator<Item = (u64, &Block)> {
        self.map
            .range(segment..)
            .take_while(move |(_, b)| b.segment == segment)
            .map(|(&a, b)| (a, b))
    }

    pub fn iter(&self) -> impl Iterator<Item = (u64, &Block)> {
        self.map.iter().map(|(&a, b)| (a, b))
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }
}
