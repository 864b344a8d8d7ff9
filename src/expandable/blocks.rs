//! The blocks that tile one segment, in address order: a doubly linked list in a slab, with a hash map from
//! each block's start address and, per page, the last block starting in it.
//!
//! Freeing merges a block with its neighbours, which the links give at once; finding a block by its start is
//! one hash lookup; finding the block that holds any address (the rarer question) goes to the page's last
//! block start, or back to the last page where one starts. An ordered map answered all three with tree
//! searches, several per allocation and free, which was most of a replay's time.

#![deny(unsafe_code)]

use crate::base::bits::Bits;
use crate::base::divisor::Divisor;
use rustc_hash::FxHashMap;

/// No node.
const NIL: u32 = u32::MAX;

/// Blocks a segment has room for before its tables grow.
const INITIAL_BLOCKS: usize = 1024;

/// What [`Blocks::free_and_merge`] did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Merged {
    /// The free block before, merged: `(start, size)` before the merge.
    pub before: Option<(u64, u64)>,
    /// The free block after, merged: `(start, size)` before the merge.
    pub after: Option<(u64, u64)>,
    /// The free block that results: `(start, size)`.
    pub block: (u64, u64),
}

/// Where a block is kept, from [`Blocks::locate`]: valid until the blocks change otherwise than through it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct BlockRef(u32);

#[derive(Debug, Clone, Copy)]
struct Node {
    addr: u64,
    block: Block,
    prev: u32,
    next: u32,
}

/// What a block of a segment is used for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockState {
    /// Allocatable.
    Free,
    /// Handed out, for a request of `requested` bytes.
    Live { requested: u64 },
    /// Freed by the program, waiting for events on other streams before it becomes free; its requested
    /// bytes count until then, as PyTorch's `requested_bytes`.
    Pending { requested: u64 },
    /// One idle page of a chunk, lent: its memory is mapped a second time elsewhere (`lending.rs`), so its
    /// addresses here are not allocatable until it comes back.
    Lent,
}

/// A block of a segment.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Block {
    pub size: u64,
    pub state: BlockState,
}

impl Block {
    /// A free block of `size` bytes.
    pub fn free(size: u64) -> Self {
        Self {
            size,
            state: BlockState::Free,
        }
    }

    /// Whether the block is live, pending or lent: not allocatable, and a user of its pages.
    pub fn is_occupied(&self) -> bool {
        self.state != BlockState::Free
    }

    /// Whether the block is handed out.
    pub fn is_live(&self) -> bool {
        matches!(self.state, BlockState::Live { .. })
    }

    /// Whether the block is freed but its memory waits: for the work of other streams, for a capture's end,
    /// or for its tag's wake.
    pub fn is_pending(&self) -> bool {
        matches!(self.state, BlockState::Pending { .. })
    }
}

/// The blocks of one segment.
#[derive(Debug)]
pub(crate) struct Blocks {
    nodes: Vec<Node>,
    /// Unused slots of `nodes`.
    spare: Vec<u32>,
    by_start: FxHashMap<u64, u32>,
    /// Per page, the last (highest) block starting in it, or `NIL`; as far as the highest page where a
    /// block ever started (it grows on demand, as most of a reservation never holds a block start).
    last_start: Vec<u32>,
    pages: usize,
    /// Pages in which some block starts.
    starts: Bits,
    head: u32,
    base: u64,
    page_size: Divisor,
}

impl Blocks {
    /// One block, `block`, covering `pages` pages of `page_size` bytes from `base`.
    pub(crate) fn new(base: u64, pages: usize, page_size: u64, block: Block) -> Self {
        // Room reserved up front (host address space, touched only as it is used), so a replay does not
        // copy these each time they double: nodes and starts for the blocks of a busy segment, and
        // `last_start` for every page.
        let mut blocks = Self {
            nodes: Vec::with_capacity(INITIAL_BLOCKS),
            spare: Vec::new(),
            by_start: FxHashMap::with_capacity_and_hasher(INITIAL_BLOCKS, Default::default()),
            last_start: Vec::with_capacity(pages.max(1)),
            pages: pages.max(1),
            starts: Bits::new(pages.max(1)),
            head: NIL,
            base,
            page_size: Divisor::new(page_size),
        };
        blocks.head = blocks.link(base, block, NIL, NIL);
        blocks
    }

    /// The block that starts at `addr`.
    pub(crate) fn get(&self, addr: u64) -> Option<Block> {
        self.by_start
            .get(&addr)
            .map(|&n| self.nodes[n as usize].block)
    }

    /// The block that starts at `addr`, to change it in place (its size only where the tiling stays whole).
    pub(crate) fn get_mut(&mut self, addr: u64) -> Option<&mut Block> {
        let n = *self.by_start.get(&addr)?;
        Some(&mut self.nodes[n as usize].block)
    }

    /// The block that holds `addr`, with its start.
    pub(crate) fn containing(&self, addr: u64) -> Option<(u64, Block)> {
        self.locate(addr).map(|(_, start, block)| (start, block))
    }

    /// The block that holds `addr`: where it is kept (to change it without looking it up again), its start,
    /// and the block.
    pub(crate) fn locate(&self, addr: u64) -> Option<(BlockRef, u64, Block)> {
        if let Some(&n) = self.by_start.get(&addr) {
            return Some((BlockRef(n), addr, self.nodes[n as usize].block));
        }
        let page = self.page(addr.checked_sub(self.base)?)?;
        let mut n = self.last_start[self.starts.find_last_set(page)?];
        // (A page with a start bit is below `last_start.len()`.)
        while n != NIL && self.nodes[n as usize].addr > addr {
            n = self.nodes[n as usize].prev;
        }
        let node = self.nodes.get(n as usize)?;
        (addr < node.addr + node.block.size).then_some((BlockRef(n), node.addr, node.block))
    }

    /// The block before the one that starts at `addr`, with its start.
    #[cfg(test)]
    pub(crate) fn before(&self, addr: u64) -> Option<(u64, Block)> {
        self.neighbour(addr, |node| node.prev)
    }

    /// The block after the one that starts at `addr`, with its start.
    pub(crate) fn after(&self, addr: u64) -> Option<(u64, Block)> {
        self.neighbour(addr, |node| node.next)
    }

    /// Replaces the block at `addr` by `first` there and `second` right after it (`first.size` bytes on).
    #[cfg(test)]
    pub(crate) fn split(&mut self, addr: u64, first: Block, second: Block) {
        self.split_at(BlockRef(self.by_start[&addr]), first, second);
    }

    /// Replaces block `at` ([`Blocks::locate`]) by `first` there and `second` right after it (`first.size`
    /// bytes on). Returns where `second` is kept.
    pub(crate) fn split_at(&mut self, at: BlockRef, first: Block, second: Block) -> BlockRef {
        let n = at.0;
        let addr = self.nodes[n as usize].addr;
        self.nodes[n as usize].block = first;
        let next = self.nodes[n as usize].next;
        let m = self.link(addr + first.size, second, n, next);
        self.nodes[n as usize].next = m;
        if next != NIL {
            self.nodes[next as usize].prev = m;
        }
        BlockRef(m)
    }

    /// Replaces block `at` ([`Blocks::locate`]) by `block` of the same size.
    pub(crate) fn set(&mut self, at: BlockRef, block: Block) {
        debug_assert_eq!(self.nodes[at.0 as usize].block.size, block.size);
        self.nodes[at.0 as usize].block = block;
    }

    /// Merges the block at `addr` into the block before it, which grows by its size. Returns the merged
    /// block's start.
    #[cfg(test)]
    pub(crate) fn merge_into_previous(&mut self, addr: u64) -> u64 {
        let prev = self.nodes[self.by_start[&addr] as usize].prev;
        self.absorb_next(prev);
        self.nodes[prev as usize].addr
    }

    /// Makes the occupied block `at` ([`Blocks::locate`]) free and merges it with free neighbours, following
    /// the links (no lookup). Returns the free neighbours merged, as `(start, size)` before the merge, and the merged
    /// block's `(start, size)`.
    pub(crate) fn free_and_merge(&mut self, at: BlockRef) -> Merged {
        let mut n = at.0;
        self.nodes[n as usize].block.state = BlockState::Free;
        let mut merged = Merged::default();
        let prev = self.nodes[n as usize].prev;
        if prev != NIL && !self.nodes[prev as usize].block.is_occupied() {
            let p = self.nodes[prev as usize];
            merged.before = Some((p.addr, p.block.size));
            self.absorb_next(prev);
            n = prev;
        }
        let next = self.nodes[n as usize].next;
        if next != NIL && !self.nodes[next as usize].block.is_occupied() {
            let x = self.nodes[next as usize];
            merged.after = Some((x.addr, x.block.size));
            self.absorb_next(n);
        }
        let node = self.nodes[n as usize];
        merged.block = (node.addr, node.block.size);
        merged
    }

    /// Merges node `n`'s next block into it.
    fn absorb_next(&mut self, n: u32) {
        let next = self.nodes[n as usize].next;
        let Node {
            block, next: after, ..
        } = self.nodes[next as usize];
        let node = &mut self.nodes[n as usize];
        node.block.size += block.size;
        node.next = after;
        if after != NIL {
            self.nodes[after as usize].prev = n;
        }
        self.unlink(next);
    }

    /// All blocks in address order, with their starts.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, Block)> + '_ {
        let mut n = self.head;
        std::iter::from_fn(move || {
            let node = self.nodes.get(n as usize)?;
            n = node.next;
            Some((node.addr, node.block))
        })
    }

    fn neighbour(&self, addr: u64, pick: impl Fn(&Node) -> u32) -> Option<(u64, Block)> {
        let n = *self.by_start.get(&addr)?;
        let node = self.nodes.get(pick(&self.nodes[n as usize]) as usize)?;
        Some((node.addr, node.block))
    }

    fn page(&self, offset: u64) -> Option<usize> {
        let page = usize::try_from(self.page_size.quotient(offset)).ok()?;
        (page < self.pages).then_some(page)
    }

    /// Stores a node for `block` at `addr` between `prev` and `next` (the caller sets their links).
    fn link(&mut self, addr: u64, block: Block, prev: u32, next: u32) -> u32 {
        let node = Node {
            addr,
            block,
            prev,
            next,
        };
        let n = match self.spare.pop() {
            Some(n) => {
                self.nodes[n as usize] = node;
                n
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 blocks")
            }
        };
        self.by_start.insert(addr, n);
        let page = self.page_size.quotient(addr - self.base) as usize;
        if page >= self.last_start.len() {
            // (Within the capacity reserved up front: 256 pages at a time, each written once.)
            let len = (page + 1).next_multiple_of(256).min(self.pages);
            self.last_start.resize(len, NIL);
        }
        let last = self.last_start[page];
        if last == NIL {
            self.last_start[page] = n;
            self.starts.set(page, true);
        } else if self.nodes[last as usize].addr < addr {
            // The page's bit is set already.
            self.last_start[page] = n;
        }
        n
    }

    /// Forgets node `n`, already taken out of the list.
    fn unlink(&mut self, n: u32) {
        let Node { addr, prev, .. } = self.nodes[n as usize];
        self.by_start.remove(&addr);
        let page = self.page_size.quotient(addr - self.base) as usize;
        if self.last_start[page] == n {
            let same_page = prev != NIL
                && self
                    .page_size
                    .quotient(self.nodes[prev as usize].addr - self.base)
                    == page as u64;
            if same_page {
                self.last_start[page] = prev;
            } else {
                self.last_start[page] = NIL;
                self.starts.set(page, false);
            }
        }
        self.spare.push(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const PAGE: u64 = 4096;
    const BASE: u64 = 1 << 20;

    fn live(size: u64) -> Block {
        Block {
            size,
            state: BlockState::Live { requested: size },
        }
    }

    #[test]
    fn splits_merges_and_lookups_agree_with_the_tiling() {
        let mut b = Blocks::new(BASE, 16, PAGE, Block::free(16 * PAGE));
        // [live 512][live 512][free ...] inside page 0, then a live block from page 3 on.
        b.split(BASE, live(512), Block::free(16 * PAGE - 512));
        b.split(BASE + 512, live(512), Block::free(16 * PAGE - 1024));
        b.split(
            BASE + 1024,
            Block::free(3 * PAGE - 1024),
            Block::free(13 * PAGE),
        );
        b.get_mut(BASE + 3 * PAGE).unwrap().state = BlockState::Live { requested: 1 };
        let starts: Vec<u64> = b.iter().map(|(a, _)| a - BASE).collect();
        assert_eq!(starts, [0, 512, 1024, 3 * PAGE]);
        assert_eq!(b.containing(BASE + 700).map(|(a, _)| a), Some(BASE + 512));
        assert_eq!(
            b.containing(BASE + 2 * PAGE + 5).map(|(a, _)| a),
            Some(BASE + 1024)
        );
        assert_eq!(
            b.containing(BASE + 15 * PAGE).map(|(a, _)| a),
            Some(BASE + 3 * PAGE)
        );
        assert_eq!(b.containing(BASE + 16 * PAGE), None);
        assert_eq!(b.containing(BASE - 1), None);
        assert_eq!(b.before(BASE + 1024).map(|(a, _)| a), Some(BASE + 512));
        assert_eq!(b.after(BASE + 1024).map(|(a, _)| a), Some(BASE + 3 * PAGE));
        assert_eq!(b.before(BASE).map(|(a, _)| a), None);
        // Merging the second block into the first leaves page 0 with one start, at BASE.
        assert_eq!(b.merge_into_previous(BASE + 512), BASE);
        assert_eq!(b.get(BASE).unwrap().size, 1024);
        assert_eq!(b.get(BASE + 512), None);
        assert_eq!(b.containing(BASE + 700).map(|(a, _)| a), Some(BASE));
        // Merging the block of page 3 away clears its page: lookups there go back to page 0's last block.
        assert_eq!(b.merge_into_previous(BASE + 3 * PAGE), BASE + 1024);
        assert_eq!(
            b.containing(BASE + 10 * PAGE).map(|(a, _)| a),
            Some(BASE + 1024)
        );
        let total: u64 = b.iter().map(|(_, block)| block.size).sum();
        assert_eq!(total, 16 * PAGE);
        // Slots are reused.
        b.split(BASE, Block::free(512), live(512));
        assert_eq!(b.nodes.len(), 4);
    }

    #[test]
    fn freeing_merges_with_free_neighbours_only() {
        let mut b = Blocks::new(BASE, 16, PAGE, Block::free(16 * PAGE));
        // [free 512][live 512][live 512][free rest]
        b.split(BASE, Block::free(512), Block::free(16 * PAGE - 512));
        b.split(BASE + 512, live(512), Block::free(16 * PAGE - 1024));
        b.split(BASE + 1024, live(512), Block::free(16 * PAGE - 1536));
        let merged = b.free_and_merge(b.locate(BASE + 512).unwrap().0);
        assert_eq!(merged.before, Some((BASE, 512)));
        assert_eq!(merged.after, None);
        assert_eq!(merged.block, (BASE, 1024));
        let merged = b.free_and_merge(b.locate(BASE + 1024).unwrap().0);
        assert_eq!(merged.before, Some((BASE, 1024)));
        assert_eq!(merged.after, Some((BASE + 1536, 16 * PAGE - 1536)));
        assert_eq!(merged.block, (BASE, 16 * PAGE));
        assert_eq!(b.iter().count(), 1);
        assert_eq!(b.containing(BASE + 5 * PAGE).map(|(a, _)| a), Some(BASE));
    }
}
