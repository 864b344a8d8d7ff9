//! `check_invariants()`: a full walk of the allocator's state against ARCHITECTURE.md's invariants.
//!
//! 1. Live blocks never overlap, lie inside one segment and are 512 B aligned.
//! 2. Every page a live block touches is mapped with access set; page user counts match the blocks.
//! 3. A handle is held once (a page handle mapped at one page, a chunk at every page of one aligned group of
//!    `chunk_pages` pages, or pooled); chunks are exactly the handles the chunk set holds, and exist only
//!    when `chunk_pages > 1`; pages held = pages created - pages released = reserved bytes / page size.
//!    A lent page (`lending.rs`) is a lent block of one page at home, in a chunk's group, and one second
//!    mapping of that page's piece of the chunk elsewhere; the lenders count exactly these. Only held
//!    handles have a kept export descriptor.
//! 4. Blocks tile each segment exactly; no two free blocks are adjacent; the free index matches.
//! 5. Statistics equal what the block list says (active = allocated + pending).
//! 6. Pending blocks are exactly those the pending-free list holds events for, each with at least one,
//!    those whose free during a capture deferred their events (`graphs.rs`), and those freed while their
//!    tag slept (`tags.rs`);
//!    recorded stream uses belong to live blocks and never name the block's own segment stream.
//! 7. Graph pools (`graphs.rs`) and sleeping tags (`sleep.rs`) agree with their segments; a sleeping tag's
//!    live blocks are those it fell asleep with, and once asleep none of its pages is mapped.

use super::blocks::{Block, BlockState};
use super::segment::Kind;
use super::{Expandable, ROUND};
use crate::driver::Driver;
use crate::strategy::error::InvariantViolation as V;
use crate::strategy::graph_pool::GraphPool;
use crate::strategy::pool::Pool;
use std::collections::{HashMap, HashSet};

/// What the block list says, per pool.
#[derive(Default)]
struct PoolTotals {
    allocated: u64,
    pending: u64,
    pending_blocks: u64,
    requested: u64,
    live: u64,
    touched: u64,
    mapped: u64,
    segments: u64,
    straddling: u64,
}

pub(super) fn check<D: Driver>(a: &Expandable<D>) -> Result<(), V> {
    let (physical, lending) = (a.supply.physical(), a.supply.lending());
    let mut totals = [PoolTotals::default(), PoolTotals::default()];
    let mut idle = 0;
    let mut held: HashSet<u64> = HashSet::new();
    let mut held_pages = 0u64;
    let mut chunks_seen = 0usize;
    // Lent blocks found, per chunk: (segment start, page).
    let mut lent_blocks: HashMap<u64, Vec<(usize, usize)>> = HashMap::new();
    let mut lent_per_pool = [0usize; 2];
    // Pages mapped in each private pool's segments, per pool, lent pages left out as in `mapped`.
    let mut graph_mapped: HashMap<GraphPool, [u64; 2]> = HashMap::new();
    for (slot, seg) in a.segments.slotted() {
        let t = &mut totals[seg.pool.index()];
        t.segments += 1;
        t.mapped += seg.pages.mapped_count() as u64;
        if let Some(graph) = seg.graph {
            graph_mapped.entry(graph).or_default()[seg.pool.index()] +=
                seg.pages.mapped_count() as u64;
        }
        let mut expected = seg.va.start;
        let mut prev_free: Option<u64> = None;
        let mut users = vec![0u32; seg.pages.len()];
        let mut free_count = 0;
        for (addr, block) in seg.blocks() {
            if addr != expected {
                return Err(V::Tiling {
                    segment: seg.va.start,
                    expected,
                    found: addr,
                });
            }
            // A segment of whole-page requests is tiled by whole pages: no block shares a page.
            let align = match seg.kind {
                Kind::WholePages => a.page_size,
                Kind::Mixed => ROUND,
            };
            if addr % align != 0 || block.size % align != 0 || block.size == 0 {
                return Err(V::Misaligned { addr, align });
            }
            expected = addr + block.size;
            match block.state {
                BlockState::Live { .. } | BlockState::Pending { .. } => {
                    prev_free = None;
                    if let BlockState::Live { requested: req } = block.state {
                        t.allocated += block.size;
                        t.requested += req;
                        t.live += 1;
                    } else if let BlockState::Pending { requested: req } = block.state {
                        t.requested += req;
                        t.pending += block.size;
                        t.pending_blocks += 1;
                        if !a.waits.is_parked(addr)
                            && !a.graphs.is_deferred(addr)
                            && !seg.tag.is_some_and(|id| a.tags.freed_at_wake(id, addr))
                        {
                            return Err(V::PendingFree { addr });
                        }
                    }
                    for page in seg.pages_of(addr, block.size) {
                        users[page] += 1;
                        // A sleeping tag's pages are unmapped under its live blocks (`check_sleep`).
                        if !seg.pages.is_accessible(page) && !a.tags.sleeps(a.segments.at(slot).tag)
                        {
                            return Err(V::LivePageUnmapped {
                                page_addr: seg.page_addr(page),
                                block: addr,
                            });
                        }
                    }
                }
                BlockState::Lent => {
                    prev_free = None;
                    let pages = seg.pages_of(addr, block.size);
                    let page = pages.start;
                    let handle = seg.pages.handle(page).filter(|&h| physical.is_chunk(h));
                    if block.size != a.page_size || seg.page_addr(page) != addr {
                        return Err(V::Misaligned {
                            addr,
                            align: a.page_size,
                        });
                    }
                    let Some(handle) = handle else {
                        return Err(V::LentPage { addr });
                    };
                    lent_blocks.entry(handle.0).or_default().push((slot, page));
                    lent_per_pool[seg.pool.index()] += 1;
                    users[page] += 1;
                }
                BlockState::Free => {
                    if let Some(first) = prev_free {
                        return Err(V::AdjacentFree {
                            first,
                            second: addr,
                        });
                    }
                    if !seg.free_index().contains(&(block.size, addr)) {
                        return Err(V::FreeIndex { addr });
                    }
                    prev_free = Some(addr);
                    free_count += 1;
                    t.straddling += u64::from(seg.is_straddling(addr, block.size));
                }
            }
        }
        if expected != seg.va.end() {
            return Err(V::Tiling {
                segment: seg.va.start,
                expected,
                found: seg.va.end(),
            });
        }
        if free_count != seg.free_index().len() {
            let stray = seg
                .free_blocks()
                .find(|&(addr, size)| seg.block_at(addr) != Some(Block::free(size)));
            return Err(V::FreeIndex {
                addr: stray.map_or(seg.va.start, |(addr, _)| addr),
            });
        }
        let mut inaccessible = 0;
        for (page, &actual) in users.iter().enumerate() {
            inaccessible +=
                usize::from(seg.pages.is_mapped(page) && !seg.pages.is_accessible(page));
            let counted = seg.pages.users(page);
            if counted != actual {
                return Err(V::PageUsers {
                    page_addr: seg.page_addr(page),
                    counted,
                    actual,
                });
            }
            let Some(handle) = seg.pages.handle(page) else {
                continue;
            };
            if let Some(piece) = lending.alias_at(seg.page_addr(page)) {
                // A second mapping: its memory is held at home.
                lending.check_alias(
                    &a.segments,
                    (a.page_size, physical.chunk_pages()),
                    (piece, handle, seg.page_addr(page)),
                )?;
                t.mapped -= 1;
                if let Some(graph) = seg.graph {
                    graph_mapped.entry(graph).or_default()[seg.pool.index()] -= 1;
                }
                continue;
            }
            held_pages += 1;
            if physical.is_chunk(handle) {
                // A chunk is inserted at the first page of its group, and every page of the group holds it.
                let k = physical.chunk_pages();
                let group = page - page % k;
                let whole = group + k <= seg.pages.len()
                    && (group..group + k).all(|p| seg.pages.handle(p) == Some(handle));
                if !whole || (page == group && !held.insert(handle.0)) {
                    return Err(V::HandleHeldTwice { handle: handle.0 });
                }
                if page == group {
                    chunks_seen += 1;
                }
            } else if !held.insert(handle.0) {
                return Err(V::HandleHeldTwice { handle: handle.0 });
            }
        }
        if inaccessible != seg.pages.inaccessible_count() {
            return Err(V::Stat {
                stat: "pages mapped without access",
                counted: seg.pages.inaccessible_count() as u64,
                actual: inaccessible as u64,
            });
        }
        t.touched += seg.pages.touched_count() as u64;
        idle += seg.pages.idle_count();
    }
    lending.check_lenders(
        &a.segments,
        physical.chunk_pages(),
        &lent_blocks,
        lent_per_pool,
        a.books.lent_pages(),
    )?;
    let mapped = held_pages;
    let (pooled, pooled_chunks) = physical.pooled();
    for handle in pooled {
        if physical.is_chunk(*handle) || !held.insert(handle.0) {
            return Err(V::HandleHeldTwice { handle: handle.0 });
        }
        held_pages += 1;
    }
    for handle in pooled_chunks {
        if !physical.is_chunk(*handle) || !held.insert(handle.0) {
            return Err(V::HandleHeldTwice { handle: handle.0 });
        }
        chunks_seen += 1;
        held_pages += physical.chunk_pages() as u64;
    }
    // A descriptor is kept for a handle held, and forgotten at its release (`supply/exports.rs`).
    if let Some(handle) = physical.exported().find(|handle| !held.contains(&handle.0)) {
        return Err(V::ExportOutlivesHandle { handle: handle.0 });
    }
    let chunks = physical.chunks();
    if chunks_seen != chunks.len() || (physical.chunk_pages() == 1 && !chunks.is_empty()) {
        return Err(V::HandleCount {
            mapped,
            pooled: physical.pooled_pages() as u64,
            created: chunks_seen as u64,
            released: chunks.len() as u64,
        });
    }
    let pending_blocks = totals.iter().map(|t| t.pending_blocks).sum::<u64>();
    // Every deferred free, and every free waiting for its tag's wake, is of a distinct pending block
    // (`check_graphs`, `check_tags`); the other pending blocks are parked.
    a.graphs.check_graphs(&a.segments, &a.waits)?;
    a.tags.check_tags(&a.segments)?;
    let parked = (pending_blocks as usize)
        .checked_sub(a.graphs.deferred_count() + a.tags.freed_count())
        .ok_or(V::PendingFree { addr: 0 })?;
    a.waits.check_waits(&a.segments, parked)?;
    let c = &a.books.counters;
    if held_pages != c.created - c.released {
        return Err(V::HandleCount {
            mapped,
            pooled: physical.pooled_pages() as u64,
            created: c.created,
            released: c.released,
        });
    }
    if let Some(limit) = physical
        .reserved_allowed()
        .filter(|&limit| c.reserved.current > limit)
    {
        return Err(V::OverLimit {
            reserved: c.reserved.current,
            limit,
        });
    }
    for (graph, array) in &c.mapped_by_graph {
        let pages = graph_mapped.remove(graph).unwrap_or_default();
        V::check_stats(&[
            (
                "reserved_bytes_by_private_pools (small)",
                array.pool[Pool::Small.index()].current,
                pages[Pool::Small.index()] * a.page_size,
            ),
            (
                "reserved_bytes_by_private_pools (large)",
                array.pool[Pool::Large.index()].current,
                pages[Pool::Large.index()] * a.page_size,
            ),
        ])?;
    }
    // A private pool whose mapped pages were never counted.
    if let Some(pages) = graph_mapped
        .values()
        .find(|pages| pages.iter().any(|&n| n > 0))
    {
        V::check_stats(&[(
            "reserved_bytes_by_private_pools (uncounted)",
            0,
            (pages[0] + pages[1]) * a.page_size,
        )])?;
    }
    V::check_stats(&[
        (
            "reserved_bytes",
            c.reserved.current,
            held_pages * a.page_size,
        ),
        ("idle_pages", a.books.idle_pages() as u64, idle as u64),
    ])?;
    for pool in [Pool::Small, Pool::Large] {
        let t = &totals[pool.index()];
        let i = pool.index();
        let stranded = ((t.touched - a.books.lent_pages()[i] as u64) * a.page_size)
            .saturating_sub(t.allocated + t.pending);
        V::check_stats(&[
            ("allocated_bytes", c.allocated.pool[i].current, t.allocated),
            (
                "active_bytes",
                c.active.pool[i].current,
                t.allocated + t.pending,
            ),
            ("requested_bytes", c.requested.pool[i].current, t.requested),
            ("allocation", c.allocation.pool[i].current, t.live),
            (
                "active",
                c.active_count.pool[i].current,
                t.live + t.pending_blocks,
            ),
            (
                "mapped_bytes",
                c.mapped.pool[i].current,
                t.mapped * a.page_size,
            ),
            ("segment", c.segment.pool[i].current, t.segments),
            (
                "touched_pages",
                a.books.touched_pages(pool) as u64,
                t.touched,
            ),
            (
                "inactive_split_bytes",
                c.inactive_split.pool[i].current,
                stranded,
            ),
            (
                "inactive_split",
                c.inactive_split_count.pool[i].current,
                t.straddling,
            ),
        ])?;
    }
    let sum = |f: &dyn Fn(&PoolTotals) -> u64| totals.iter().map(f).sum::<u64>();
    V::check_stats(&[
        (
            "allocated_bytes",
            c.allocated.current(),
            sum(&|t| t.allocated),
        ),
        ("allocation", c.allocation.current(), sum(&|t| t.live)),
        ("segment", c.segment.current(), sum(&|t| t.segments)),
        (
            "inactive_split_bytes",
            c.inactive_split.current(),
            (totals.iter().zip(a.books.lent_pages()))
                .map(|(t, lent)| {
                    ((t.touched - lent as u64) * a.page_size)
                        .saturating_sub(t.allocated + t.pending)
                })
                .sum(),
        ),
    ])
}
