//! One segment: a virtual reservation for one (stream, pool), tiled by blocks in address order.
//!
//! The segment knows its blocks and which pages they touch; it makes no driver call. Free blocks are indexed
//! by `(size, address)` for best fit; neighbours merge on free, so no two free blocks are adjacent.
//!
//! A block is free, live, or *pending*: freed by the program while work on other streams may still use it
//! (`record_stream`). A pending block is not allocatable and still counts as a user of its pages, so they
//! can be neither reused nor unmapped until the allocator releases it.

use super::blocks::{Block, BlockRef, BlockState, Blocks};
use super::free_index::FreeIndex;
use crate::driver::{StreamId, VaRange};
use crate::page_map::PageMap;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::pool::Pool;
use std::ops::Range;

/// Every request is rounded up to a multiple of this many bytes, as in PyTorch.
pub const ROUND: u64 = 512;

/// How many runs of mapped pages inside one free block [`Segment::placement`] considers, and how many idle
/// runs [`Segment::mapped_fit`] follows to larger free blocks.
const PLACEMENT_RUNS: usize = 16;

/// How many free blocks larger than the best fits [`Segment::mapped_fit`] lists, to find the idle runs that
/// lie in one without looking each run's block up; with more it looks them up.
const LARGER_BLOCKS: usize = 32;

/// A placement inside a free block must save this fraction (1 / n) of a request's pages ([`Segment::min_saving`]).
const INNER_PLACEMENT_DIVISOR: usize = 8;

/// The index of a tag (`tags.rs`) in the allocator's list of tags: a segment's key carries it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) struct TagId(pub u32);

/// Which large-pool requests a segment holds, as the policies place them apart (`compaction/`,
/// `handle_size/`): a request goes to the segments of its kind first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Any request that no other kind takes: every request, unless a policy places some apart.
    Mixed,
    /// Requests of whole pages, which start and end on page boundaries there, so that no two blocks share
    /// a page (`Segment::mapped_fit` with `whole_pages`).
    WholePages,
}

/// What a free of an address inside this segment found there.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FreeOutcome {
    /// A live block was freed (or parked): its size and requested size, and where it is kept (for
    /// [`Segment::free_live`], which then needs no lookup).
    Freed {
        size: u64,
        requested: u64,
        at: BlockRef,
    },
    /// The address lies in a free or pending block.
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
    /// The private pool (CUDA graph) this segment serves, if any: only its allocations are placed here.
    pub graph: Option<GraphPool>,
    /// The tag its allocations were made under, if any (`sleep.rs`): only they are placed here.
    pub tag: Option<TagId>,
    /// Which requests are placed here ([`Kind`]).
    pub kind: Kind,
    pub pages: PageMap,
    /// When a block of this segment was last freed (the allocator's free clock): reclaiming under pressure
    /// takes the idle pages of the segments freed longest ago first.
    pub last_free: u64,
    /// Whether memory of this segment was ever exported to another process (`sharing.rs`): its handles may
    /// be mapped there too, so none of them is ever re-created as single pages (`compaction:split`).
    pub shared: bool,
    blocks: Blocks,
    free: FreeIndex,
    occupied: usize,
    /// Free blocks with an end that is not on a page boundary: they share a page with an occupied
    /// neighbour (free blocks have no free neighbours), so part of them cannot be given back.
    straddling: usize,
}

impl Segment {
    /// A segment over `va`, one free block covering all of it.
    pub fn new(va: VaRange, stream: StreamId, pool: Pool, kind: Kind, page_size: u64) -> Self {
        let page_count = (va.size / page_size) as usize;
        let pages = PageMap::new(page_count, page_size);
        let blocks = Blocks::new(va.start, page_count, page_size, Block::free(va.size));
        let mut segment = Self {
            va,
            stream,
            pool,
            graph: None,
            tag: None,
            kind,
            pages,
            last_free: 0,
            shared: false,
            blocks,
            free: FreeIndex::default(),
            occupied: 0,
            straddling: 0,
        };
        segment.index_free(va.start, va.size);
        segment
    }

    /// Whether the free block `addr .. addr + size` shares a page with a neighbour.
    fn straddles(&self, addr: u64, size: u64) -> bool {
        let offset = addr - self.va.start;
        !self.pages.is_page_aligned(offset) || !self.pages.is_page_aligned(offset + size)
    }

    /// Adds a free block to the free index.
    fn index_free(&mut self, addr: u64, size: u64) {
        self.free.insert((size, addr));
        self.straddling += usize::from(self.straddles(addr, size));
    }

    /// Removes a free block from the free index.
    fn unindex_free(&mut self, addr: u64, size: u64) {
        if self.free.remove(&(size, addr)) {
            self.straddling -= usize::from(self.straddles(addr, size));
        }
    }

    /// Replaces the free block `old` (`(addr, size)`) in the free index by `new`: as
    /// [`unindex_free`](Self::unindex_free) then [`index_free`](Self::index_free), in one step when both lie
    /// in the same size class.
    fn reindex_free(&mut self, old: (u64, u64), new: (u64, u64)) {
        if self.free.replace(&(old.1, old.0), (new.1, new.0)) {
            self.straddling -= usize::from(self.straddles(old.0, old.1));
        }
        self.straddling += usize::from(self.straddles(new.0, new.1));
    }

    /// Number of free blocks that share a page with an occupied block (PyTorch's `inactive_split` count).
    pub fn straddling_count(&self) -> usize {
        self.straddling
    }

    /// Whether the free block `addr .. addr + size` would be counted by [`straddling_count`](Self::straddling_count)
    /// (for the invariant walk).
    pub fn is_straddling(&self, addr: u64, size: u64) -> bool {
        self.straddles(addr, size)
    }

    /// Number of live and pending blocks.
    pub fn occupied_count(&self) -> usize {
        self.occupied
    }

    /// The smallest free block of at least `size` bytes: `(size, address)`.
    pub fn best_fit(&self, size: u64) -> Option<(u64, u64)> {
        self.free.range_from((size, 0)).next().copied()
    }

    /// The placement of `size` bytes that needs the fewest pages mapped, among the `candidates` best-fitting
    /// free blocks and, if each of those needs pages, the free blocks around the [`PLACEMENT_RUNS`] longest
    /// idle runs: `(missing pages, block size, address)`, ties to the smaller block. The address may lie
    /// inside the block ([`Segment::placement`]). Stops at the first placement that needs no page. With
    /// `whole_pages`, only the whole pages of each free block are used (for a request of whole pages, which
    /// then shares no page).
    pub fn mapped_fit(
        &self,
        size: u64,
        candidates: usize,
        whole_pages: bool,
    ) -> Option<(usize, u64, u64)> {
        let mut best: Option<(usize, u64, u64)> = None;
        let mut consider = |start: u64, block_size: u64| {
            let (inner, inner_size) = match whole_pages {
                true => match self.whole_pages_of(start, block_size) {
                    Some((inner, inner_size)) if inner_size >= size => (inner, inner_size),
                    _ => return false,
                },
                false => (start, block_size),
            };
            let (missing, addr) = self.placement(inner, inner_size, size);
            if best.is_none_or(|b| (missing, block_size) < (b.0, b.1)) {
                best = Some((missing, block_size, addr));
            }
            missing == 0
        };
        let mut fits = self.free.range_from((size, 0));
        for &(block_size, start) in fits.by_ref().take(candidates) {
            if consider(start, block_size) {
                return best;
            }
        }
        if self.min_saving(size) == 0 || self.pages.idle_count() == 0 {
            return best;
        }
        // The free blocks large enough that were not compared yet: a run of idle pages elsewhere leads to a
        // block too small, or to one compared already, which would not change `best` (nor stop the search).
        let mut larger = [(0, 0); LARGER_BLOCKS];
        let mut found = 0;
        for &(block_size, start) in fits.by_ref().take(LARGER_BLOCKS) {
            larger[found] = (start, block_size);
            found += 1;
        }
        if found == 0 {
            return best;
        }
        let all_found = fits.next().is_none();
        // Every best fit by size needs pages: a larger free block may hold mapped pages the request can use
        // where they are. Idle pages lie in free blocks only, so the longest idle runs point at them.
        for run in self.longest_idle_runs() {
            let page_start = self.page_addr(run.start);
            let (start, block_size) = if all_found {
                // A run lies inside one free block (an idle page is touched by no occupied block).
                match larger[..found]
                    .iter()
                    .find(|&&(start, block_size)| (start..start + block_size).contains(&page_start))
                {
                    Some(&block) => block,
                    None => continue,
                }
            } else {
                match self.blocks.containing(page_start) {
                    Some((start, block)) if !block.is_occupied() && block.size >= size => {
                        (start, block.size)
                    }
                    _ => continue,
                }
            };
            if consider(start, block_size) {
                break;
            }
        }
        best
    }

    /// The whole pages of the free block `start .. start + block_size`: `(address, size)`, if it holds one.
    fn whole_pages_of(&self, start: u64, block_size: u64) -> Option<(u64, u64)> {
        let page = self.pages.page_size();
        let lo = self.va.start + (start - self.va.start).next_multiple_of(page);
        let hi = self.va.start + (start + block_size - self.va.start) / page * page;
        (hi > lo).then(|| (lo, hi - lo))
    }

    /// The [`PLACEMENT_RUNS`] longest runs of idle pages, longest first, ties to the lower address.
    fn longest_idle_runs(&self) -> impl Iterator<Item = Range<usize>> {
        // Kept sorted, longest first, as `(start, end)` (which is `Copy`, so making room is a memmove): a run
        // enters only if it beats the shortest kept, so the scan over every idle run allocates nothing.
        let mut longest = [(0, 0); PLACEMENT_RUNS];
        let mut kept = 0;
        for run in self.pages.idle_runs_lazy() {
            let len = run.len();
            if kept == PLACEMENT_RUNS && len <= longest[kept - 1].1 - longest[kept - 1].0 {
                continue;
            }
            let at = longest[..kept].partition_point(|&(start, end)| end - start >= len);
            kept = (kept + 1).min(PLACEMENT_RUNS);
            longest.copy_within(at..kept - 1, at + 1);
            longest[at] = (run.start, run.end);
        }
        longest
            .into_iter()
            .take(kept)
            .map(|(start, end)| start..end)
    }

    /// How many fewer pages a placement inside a free block must need than one at its start to be worth
    /// splitting the block for: an eighth of the request's pages; 0 (never) for requests under 8 pages.
    fn min_saving(&self, size: u64) -> usize {
        self.pages.pages_in(size) as usize / INNER_PLACEMENT_DIVISOR
    }

    /// Where in the free block `start .. start + block_size` to put `size` bytes: `(missing pages, address)`.
    ///
    /// At the block's start, unless a placement inside the block needs at least [`Segment::min_saving`]
    /// fewer pages mapped. The placements inside considered are, for each of the first [`PLACEMENT_RUNS`]
    /// runs of mapped pages of the block, the window that starts where the run starts and the one that ends
    /// where it ends (a window with the fewest unmapped pages can always be slid to start or end at a run
    /// boundary), aligned to [`ROUND`] inside the block; ties go to the lowest address.
    pub fn placement(&self, start: u64, block_size: u64, size: u64) -> (usize, u64) {
        let missing_at = |addr: u64| self.pages.unmapped_count(self.pages_of(addr, size));
        let at_start = (missing_at(start), start);
        let min_saving = self.min_saving(size);
        if min_saving == 0 || at_start.0 < min_saving || block_size == size {
            return at_start;
        }
        let end = start + block_size;
        let round = ROUND;
        let mut best = at_start;
        let pages = self.pages_of(start, block_size);
        let pages = if self.pages.idle_count() == 0 {
            // Inside a free block only idle pages are mapped, besides its first and last, which live
            // neighbours may share; and a window over the first is the block's start.
            pages.end - 1..pages.end
        } else {
            pages
        };
        for run in self.pages.mapped_runs_lazy(pages).take(PLACEMENT_RUNS) {
            let run_start = self.page_addr(run.start).max(start);
            let run_end = self.page_addr(run.end).min(end);
            let from_start = run_start.next_multiple_of(round).min(end - size);
            let to_end = (run_end.saturating_sub(size) / round * round).max(start);
            for addr in [from_start, to_end] {
                let candidate = (missing_at(addr), addr);
                best = best.min(candidate);
            }
            if best.0 == 0 {
                break;
            }
        }
        if at_start.0 - best.0 >= min_saving {
            best
        } else {
            at_start
        }
    }

    /// Among the `candidates` best-fitting free blocks for `size` bytes, the smallest that holds `size`
    /// *cached* bytes, memory this segment's stream gave back rather than the unmapped frontier of the
    /// reservation: either the whole block is mapped with access set, or `size` bytes of it lie on idle
    /// pages (mapped with access, touched by no live block). `(block size, address)`: the block's start, or
    /// the lowest such address in it.
    pub fn cached_fit(&self, size: u64, candidates: usize) -> Option<(u64, u64)> {
        // A free block's pages other than its first and last are touched by no other block, so they are
        // idle if mapped: a block of `size` bytes or more whose pages are all accessible has at least
        // `size / page_size - 2` idle pages, and `size` bytes on idle pages need `size / page_size`.
        let idle_bytes = self.pages.idle_count() as u64 * self.pages.page_size();
        if idle_bytes + 2 * self.pages.page_size() < size {
            return None;
        }
        self.free
            .range_from((size, 0))
            .take(candidates)
            .find_map(|&(block_size, start)| {
                Some((block_size, self.cached_window(start, block_size, size)?))
            })
    }

    /// Where `size` cached bytes lie in the free block `start .. start + block_size` (see
    /// [`Segment::cached_fit`]).
    fn cached_window(&self, start: u64, block_size: u64, size: u64) -> Option<u64> {
        let pages = self.pages_of(start, block_size);
        if self.pages.all_accessible(pages.clone()) {
            return Some(start);
        }
        if (self.pages.idle_count() as u64 * self.pages.page_size()) < size {
            return None;
        }
        let end = start + block_size;
        let mut pos = pages.start;
        while let Some(run) = self.pages.first_idle_run(pos..pages.end) {
            let from = self.page_addr(run.start).max(start).next_multiple_of(ROUND);
            let fits = from + size <= self.page_addr(run.end).min(end);
            if fits && self.pages.all_accessible(self.pages_of(from, size)) {
                return Some(from);
            }
            pos = run.end;
        }
        None
    }

    /// The pages that bytes `addr .. addr + size` touch.
    pub fn pages_of(&self, addr: u64, size: u64) -> Range<usize> {
        self.pages.pages_touched(addr - self.va.start, size)
    }

    /// Address of page `page`.
    pub fn page_addr(&self, page: usize) -> u64 {
        self.va.start + page as u64 * self.pages.page_size()
    }

    /// Turns `addr .. addr + size`, which lies inside one free block, into a live block; what is left of the
    /// free block before and after it stays free.
    pub fn carve(&mut self, addr: u64, size: u64, requested: u64) {
        self.carve_as(addr, size, BlockState::Live { requested });
    }

    /// Turns the idle page at `addr` (`size` bytes, page-aligned, inside one free block) into a lent block.
    pub fn lend(&mut self, addr: u64, size: u64) {
        self.carve_as(addr, size, BlockState::Lent);
    }

    /// Frees the lent block at `addr`, merging it with free neighbours.
    ///
    /// # Panics
    /// If there is no lent block at `addr`: the lending table lost track of it.
    pub fn unlend(&mut self, addr: u64) {
        let size = match self.blocks.get(addr) {
            Some(Block {
                size,
                state: BlockState::Lent,
            }) => size,
            _ => panic!("unlend: no lent block at {addr:#x}"),
        };
        self.release(None, addr, size);
    }

    /// [`carve`](Self::carve) into a block of state `state`.
    fn carve_as(&mut self, addr: u64, size: u64, state: BlockState) {
        // Found once: the splits below change the block where it is kept, without looking it up again.
        let (mut at, start, block) = self
            .blocks
            .locate(addr)
            .expect("carve: no block at address");
        assert!(
            !block.is_occupied() && addr + size <= start + block.size,
            "carve: block is occupied or too small"
        );
        // The free block leaves the index; what is left of it before and after enters it, the first of
        // those in its place (the same as removing it and inserting them).
        let mut vacated = Some((start, block.size));
        let mut left = block.size;
        if addr > start {
            let head = addr - start;
            at = self
                .blocks
                .split_at(at, Block::free(head), Block::free(left - head));
            self.refill_free(&mut vacated, (start, head));
            left -= head;
        }
        let live = Block { size, state };
        let rest = left - size;
        if rest > 0 {
            self.blocks.split_at(at, live, Block::free(rest));
            self.refill_free(&mut vacated, (addr + size, rest));
        } else {
            self.blocks.set(at, live);
        }
        if let Some((start, size)) = vacated {
            self.unindex_free(start, size);
        }
        self.occupied += 1;
        let pages = self.pages_of(addr, size);
        self.pages.add_user(pages);
    }

    /// What freeing `addr` would find: the live block that starts there (`Freed`), or why not.
    pub fn check_free(&self, addr: u64) -> FreeOutcome {
        let Some((at, start, block)) = self.blocks.locate(addr) else {
            return FreeOutcome::NotABlockStart;
        };
        let BlockState::Live { requested } = block.state else {
            return FreeOutcome::AlreadyFree;
        };
        if start != addr {
            return FreeOutcome::NotABlockStart;
        }
        FreeOutcome::Freed {
            size: block.size,
            requested,
            at,
        }
    }

    /// Frees the live block of `size` bytes at `addr`, kept at `at`, which [`Segment::check_free`] found (the
    /// blocks unchanged since), merging it with free neighbours.
    pub fn free_live(&mut self, at: BlockRef, addr: u64, size: u64) {
        self.release(Some(at), addr, size);
    }

    /// Frees the live block of `size` bytes at `addr`, as [`Segment::free_live`], looking it up.
    pub fn free_live_at_addr(&mut self, addr: u64, size: u64) {
        self.release(None, addr, size);
    }

    /// Turns the live block that starts at `addr` into a pending one: no longer live, not yet free, still a
    /// user of its pages.
    pub fn park(&mut self, addr: u64) -> FreeOutcome {
        let outcome = self.check_free(addr);
        if let (&FreeOutcome::Freed { requested, .. }, Some(block)) =
            (&outcome, self.blocks.get_mut(addr))
        {
            block.state = BlockState::Pending { requested };
        }
        outcome
    }

    /// Frees the pending block that starts at `addr`, merging it with free neighbours. Returns its size and
    /// requested size.
    ///
    /// # Panics
    /// If there is no pending block at `addr`: the allocator's pending list lost track of it.
    pub fn release_pending(&mut self, addr: u64) -> (u64, u64) {
        let block = self.blocks.get(addr);
        let (size, requested) = match block {
            Some(Block {
                size,
                state: BlockState::Pending { requested },
            }) => (size, requested),
            _ => panic!("release_pending: no pending block at {addr:#x}"),
        };
        self.release(None, addr, size);
        (size, requested)
    }

    /// Drops the occupied block at `addr` (kept at `at`, if known) as a user of its pages and makes it free.
    fn release(&mut self, at: Option<BlockRef>, addr: u64, size: u64) {
        let pages = self.pages_of(addr, size);
        self.pages.remove_user(pages);
        self.occupied -= 1;
        let at = at.unwrap_or_else(|| {
            self.blocks
                .locate(addr)
                .expect("release: no block at address")
                .0
        });
        self.insert_free(at);
    }

    /// Indexes the free block `new`, in the place of `vacated` (taken) if there is one to replace.
    fn refill_free(&mut self, vacated: &mut Option<(u64, u64)>, new: (u64, u64)) {
        match vacated.take() {
            Some(old) => self.reindex_free(old, new),
            None => self.index_free(new.0, new.1),
        }
    }

    /// Marks the occupied block at `addr` free and merges it with its free neighbours.
    fn insert_free(&mut self, at: BlockRef) {
        let merged = self.blocks.free_and_merge(at);
        // The merged block takes the place of a neighbour it absorbed, if any.
        let mut vacated = merged.before.or(merged.after);
        if let (Some(_), Some((start, size))) = (merged.before, merged.after) {
            self.unindex_free(start, size);
        }
        self.refill_free(&mut vacated, merged.block);
    }

    /// The block that starts at `addr`.
    pub fn block_at(&self, addr: u64) -> Option<Block> {
        self.blocks.get(addr)
    }

    /// The blocks that overlap `start .. end`, in address order.
    pub fn blocks_overlapping(
        &self,
        start: u64,
        end: u64,
    ) -> impl Iterator<Item = (u64, Block)> + '_ {
        std::iter::successors(self.blocks.containing(start), |&(addr, _)| {
            self.blocks.after(addr)
        })
        .take_while(move |&(addr, _)| addr < end)
    }

    /// All blocks in address order.
    pub fn blocks(&self) -> impl Iterator<Item = (u64, Block)> + '_ {
        self.blocks.iter()
    }

    /// The free index: `(size, address)` of every free block.
    pub fn free_index(&self) -> &FreeIndex {
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

#[cfg(test)]
mod tests;
