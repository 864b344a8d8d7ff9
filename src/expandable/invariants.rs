//! `check_invariants()`: a full walk of the allocator's state against ARCHITECTURE.md's invariants.
//!
//! 1. Live blocks never overlap, lie inside one segment and are 512 B aligned.
//! 2. Every page a live block touches is mapped with access set; page user counts match the blocks.
//! 3. A handle is held once (mapped at one page, or pooled); held handles = created - released.
//! 4. Blocks tile each segment exactly; no two free blocks are adjacent; the free index matches.
//! 5. Statistics equal what the block list says (active = allocated + pending).
//! 6. Pending blocks are exactly those the pending-free list holds events for, each with at least one;
//!    recorded stream uses belong to live blocks and never name the block's own segment stream.

use super::segment::{Block, BlockState};
use super::{Expandable, ROUND};
use crate::driver::Driver;
use crate::error::InvariantViolation as V;
use std::collections::{HashMap, HashSet};

pub(super) fn check<D: Driver>(a: &Expandable<D>) -> Result<(), V> {
    let mut allocated = 0;
    let mut pending = 0;
    let mut pending_blocks = 0;
    let mut requested = 0;
    let mut live = 0;
    let mut touched = 0;
    let mut idle = 0;
    let mut held: HashSet<u64> = HashSet::new();
    for seg in a.live_segments() {
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
            if addr % ROUND != 0 || block.size % ROUND != 0 || block.size == 0 {
                return Err(V::Misaligned { addr, align: ROUND });
            }
            expected = addr + block.size;
            match block.state {
                BlockState::Live { .. } | BlockState::Pending => {
                    prev_free = None;
                    if let BlockState::Live { requested: req } = block.state {
                        allocated += block.size;
                        requested += req;
                        live += 1;
                        check_stream_uses(a, addr, seg.stream)?;
                    } else {
                        pending += block.size;
                        pending_blocks += 1;
                        if a.pending.outstanding.get(&addr).is_none_or(|&n| n == 0) {
                            return Err(V::PendingFree { addr });
                        }
                    }
                    for page in seg.pages_of(addr, block.size) {
                        users[page] += 1;
                        if !seg.pages.is_accessible(page) {
                            return Err(V::LivePageUnmapped {
                                page_addr: seg.page_addr(page),
                                block: addr,
                            });
                        }
                    }
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
        for (page, &actual) in users.iter().enumerate() {
            let counted = seg.pages.users(page);
            if counted != actual {
                return Err(V::PageUsers {
                    page_addr: seg.page_addr(page),
                    counted,
                    actual,
                });
            }
            if let Some(handle) = seg.pages.handle(page)
                && !held.insert(handle.0)
            {
                return Err(V::HandleHeldTwice { handle: handle.0 });
            }
        }
        touched += seg.pages.touched_count();
        idle += seg.pages.idle_count();
    }
    let mapped = held.len() as u64;
    for handle in &a.pooled {
        if !held.insert(handle.0) {
            return Err(V::HandleHeldTwice { handle: handle.0 });
        }
    }
    check_pending_list(a, pending_blocks)?;
    let c = &a.counters;
    if held.len() as u64 != c.created - c.released {
        return Err(V::HandleCount {
            mapped,
            pooled: a.pooled.len() as u64,
            created: c.created,
            released: c.released,
        });
    }
    let checks = [
        ("allocated_bytes", c.allocated.current, allocated),
        ("active_bytes", c.active.current, allocated + pending),
        ("requested_bytes", c.requested.current, requested),
        ("allocation", c.allocation.current, live),
        (
            "reserved_bytes",
            c.reserved.current,
            held.len() as u64 * a.page_size,
        ),
        (
            "segment",
            c.segment.current,
            a.live_segments().count() as u64,
        ),
        ("touched_pages", a.touched_pages as u64, touched as u64),
        ("idle_pages", a.idle_pages as u64, idle as u64),
        (
            "inactive_split_bytes",
            c.inactive_split.current,
            (touched as u64 * a.page_size).saturating_sub(allocated + pending),
        ),
    ];
    V::check_stats(&checks)
}

/// The streams recorded for the live block at `addr` (if any): not empty, no duplicate, not `own`.
fn check_stream_uses<D: Driver>(
    a: &Expandable<D>,
    addr: u64,
    own: crate::driver::StreamId,
) -> Result<(), V> {
    let Some(streams) = a.stream_uses.get(&addr) else {
        return Ok(());
    };
    let distinct: HashSet<_> = streams.iter().collect();
    if streams.is_empty() || distinct.len() != streams.len() || distinct.contains(&own) {
        return Err(V::StreamUse { addr });
    }
    Ok(())
}

/// The pending list against the blocks: every recorded stream use is of a live block, every event is
/// counted once for its block, and there are as many parked blocks as pending blocks.
fn check_pending_list<D: Driver>(a: &Expandable<D>, pending_blocks: usize) -> Result<(), V> {
    for &addr in a.stream_uses.keys() {
        let live = a.slot_of(addr).is_some_and(|slot| {
            a.segment(slot)
                .block_at(addr)
                .is_some_and(|block| block.is_live())
        });
        if !live {
            return Err(V::StreamUse { addr });
        }
    }
    let mut events: HashMap<u64, usize> = HashMap::new();
    for &(_, addr) in a.pending.events.values().flatten() {
        *events.entry(addr).or_default() += 1;
    }
    for (&addr, &outstanding) in &a.pending.outstanding {
        if events.get(&addr) != Some(&outstanding) {
            return Err(V::PendingFree { addr });
        }
    }
    if let Some(&addr) = events
        .keys()
        .find(|addr| !a.pending.outstanding.contains_key(addr))
    {
        return Err(V::PendingFree { addr });
    }
    if a.pending.outstanding.len() != pending_blocks {
        let addr = a.pending.outstanding.keys().min().copied().unwrap_or(0);
        return Err(V::PendingFree { addr });
    }
    Ok(())
}
