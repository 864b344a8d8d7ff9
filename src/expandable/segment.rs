//! One segment: a virtual reservation for one (stream, pool), tiled by blocks in address order.
//!
//! The segment knows its blocks and which pages they touch; it makes no driver call. Free blocks are indexed
//! by `(size, address)` for best fit; neighbours merge on free, so no two free blocks are adjacent.

use crate::driver::{StreamId, VaRange};
use crate::page_map::PageMap;
use std::collections::{BTreeMap, BTreeSet};
use std::ops::Range;

/// Which pool a request belongs to: small requests get segments of their own so that tiny long-lived
/// blocks do not pin pages that large blocks would free.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Pool {
    /// Requests of at most `Config::small_size` bytes.
    Small,
    /// Everything larger.
    Large,
}

/// A block of a segment. `requested` is `Some` while the block is live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub size: u64,
    pub requested: Option<u64>,
}

impl Block {
    pub fn is_live(&self) -> bool {
        self.requested.is_some()
    }
}

/// What a free of an address inside this segment found there.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FreeOutcome {
    /// A live block was freed: its size and requested size.
    Freed { size: u64, requested: u64 },
    /// The address lies in a free block.
    AlreadyFree,
    /// The address lies inside a live block but is not its start.
    NotABlockStart,
}

/// A virtual reservation and the blocks that tile it.
#[derive(Debug)]
pub(crate) struct Segment {
    pub va: VaRange,
    pub stream: StreamId,
    pub pool: Pool,
    pub pages: PageMap,
    blocks: BTreeMap<u64, Block>,
    free: BTreeSet<(u64, u64)>,
    live: usize,
}

impl Segment {
    /// A segment over `va`, one free block covering all of it.
    pub fn new(va: VaRange, stream: StreamId, pool: Pool, page_size: u64) -> Self {
        let pages = PageMap::new((va.size / page_size) as usize, page_size);
        let mut blocks = BTreeMap::new();
        blocks.insert(
            va.start,
            Block {
                size: va.size,
                requested: None,
            },
        );
        let mut free = BTreeSet::new();
        free.insert((va.size, va.start));
        Self {
            va,
            stream,
            pool,
            pages,
            blocks,
            free,
            live: 0,
        }
    }

    /// Number of live blocks.
    pub fn live_count(&self) -> usize {
        self.live
    }

    /// The smallest free block of at least `size` bytes: `(size, address)`.
    pub fn best_fit(&self, size: u64) -> Option<(u64, u64)> {
        self.free.range((size, 0)..).next().copied()
    }

    /// Among the `candidates` best-fitting free blocks for `size` bytes, the one whose first `size` bytes
    /// need the fewest pages mapped: `(missing pages, block size, address)`. Stops at the first that needs
    /// none.
    pub fn mapped_fit(&self, size: u64, candidates: usize) -> Option<(usize, u64, u64)> {
        let mut best: Option<(usize, u64, u64)> = None;
        for &(block_size, addr) in self.free.range((size, 0)..).take(candidates) {
            let missing = self.pages.unmapped_count(self.pages_of(addr, size));
            if best.is_none_or(|b| (missing, block_size) < (b.0, b.1)) {
                best = Some((missing, block_size, addr));
            }
            if missing == 0 {
                break;
            }
        }
        best
    }

    /// The pages that bytes `addr .. addr + size` touch.
    pub fn pages_of(&self, addr: u64, size: u64) -> Range<usize> {
        self.pages.pages_touched(addr - self.va.start, size)
    }

    /// Address of page `page`.
    pub fn page_addr(&self, page: usize) -> u64 {
        self.va.start + page as u64 * self.pages.page_size()
    }

    /// Turns the first `size` bytes of the free block at `addr` into a live block; the rest stays free.
    pub fn carve(&mut self, addr: u64, size: u64, requested: u64) {
        let block = self
            .blocks
            .get_mut(&addr)
            .expect("carve: no block at address");
        assert!(
            !block.is_live() && block.size >= size,
            "carve: block is live or too small"
        );
        let rest = block.size - size;
        self.free.remove(&(block.size, addr));
        *block = Block {
            size,
            requested: Some(requested),
        };
        if rest > 0 {
            self.blocks.insert(
                addr + size,
                Block {
                    size: rest,
                    requested: None,
                },
            );
            self.free.insert((rest, addr + size));
        }
        self.live += 1;
        let pages = self.pages_of(addr, size);
        self.pages.add_user(pages);
    }

    /// Frees the block that starts at `addr`, merging it with free neighbours.
    pub fn free(&mut self, addr: u64) -> FreeOutcome {
        let Some((&start, &block)) = self.blocks.range(..=addr).next_back() else {
            return FreeOutcome::NotABlockStart;
        };
        if !block.is_live() {
            return FreeOutcome::AlreadyFree;
        }
        if start != addr {
            return FreeOutcome::NotABlockStart;
        }
        let requested = block.requested.unwrap_or(0);
        let pages = self.pages_of(addr, block.size);
        self.pages.remove_user(pages);
        self.live -= 1;
        self.insert_free(addr, block.size);
        FreeOutcome::Freed {
            size: block.size,
            requested,
        }
    }

    /// Marks `addr .. addr + size` (currently one live block) free and merges it with its neighbours.
    fn insert_free(&mut self, mut addr: u64, mut size: u64) {
        if let Some((&prev, &block)) = self.blocks.range(..addr).next_back()
            && !block.is_live()
        {
            self.free.remove(&(block.size, prev));
            self.blocks.remove(&addr);
            addr = prev;
            size += block.size;
        }
        let next = addr + size;
        if let Some(&block) = self.blocks.get(&next)
            && !block.is_live()
        {
            self.free.remove(&(block.size, next));
            self.blocks.remove(&next);
            size += block.size;
        }
        self.blocks.insert(
            addr,
            Block {
                size,
                requested: None,
            },
        );
        self.free.insert((size, addr));
    }

    /// The block that starts at `addr`.
    pub fn block_at(&self, addr: u64) -> Option<Block> {
        self.blocks.get(&addr).copied()
    }

    /// All blocks in address order.
    pub fn blocks(&self) -> impl Iterator<Item = (u64, Block)> + '_ {
        self.blocks.iter().map(|(&a, &b)| (a, b))
    }

    /// The free index: `(size, address)` of every free block.
    pub fn free_index(&self) -> &BTreeSet<(u64, u64)> {
        &self.free
    }

    /// Free blocks as `(address, size)`.
    pub fn free_blocks(&self) -> impl Iterator<Item = (u64, u64)> + '_ {
        self.free.iter().map(|&(size, addr)| (addr, size))
    }

    /// Largest run of free bytes inside one free block whose pages are all mapped and accessible: the largest
    /// request this segment can serve without a driver call.
    pub fn largest_free_mapped(&self) -> u64 {
        let mut best = 0;
        for (addr, size) in self.free_blocks() {
            if size <= best {
                continue;
            }
            let pages = self.pages_of(addr, size);
            for run in self.pages.accessible_runs(pages) {
                let lo = self.page_addr(run.start).max(addr);
                let hi = self.page_addr(run.end).min(addr + size);
                best = best.max(hi.saturating_sub(lo));
            }
        }
        best
    }
}
