//! `check_invariants()` for the split allocator: a full walk against ARCHITECTURE.md's invariants.
//!
//! 1. Blocks tile each segment exactly, 512 B aligned; live blocks never overlap.
//! 2. In expandable segments, every mapped block lies on mapped pages and every unmapped block on none.
//! 4. No two free neighbours are both mapped or both unmapped (they merge); the pools' free sets hold
//!    exactly the free blocks.
//! 5. Statistics equal what the block list says.

use super::Split;
use super::rules::MIN_BLOCK_SIZE;
use cuvmm::driver::Driver;
use cuvmm::strategy::error::InvariantViolation as V;
use cuvmm::strategy::pool::Pool;

/// What the block list says for one pool.
#[derive(Default)]
struct PoolTotals {
    allocated: u64,
    requested: u64,
    live: u64,
    reserved: u64,
    malloc_segments: u64,
    inactive_split_bytes: u64,
    inactive_split: u64,
}

pub(super) fn check<D: Driver>(a: &Split<D>) -> Result<(), V> {
    let mut totals = [PoolTotals::default(), PoolTotals::default()];
    let mut free_mapped = 0;
    let mut unmapped = 0;
    let mut blocks_seen = 0;
    for (&start, seg) in &a.segments {
        let PoolTotals {
            allocated,
            requested,
            live,
            reserved,
            malloc_segments,
            inactive_split_bytes,
            inactive_split,
        } = &mut totals[seg.pool.index()];
        let mut expected = start;
        let mut prev: Option<(u64, bool, bool)> = None;
        let blocks: Vec<_> = a.blocks.of_segment(start).collect();
        let split = blocks.len() > 1;
        for (addr, b) in blocks {
            blocks_seen += 1;
            if addr != expected {
                return Err(V::Tiling {
                    segment: start,
                    expected,
                    found: addr,
                });
            }
            if addr % MIN_BLOCK_SIZE != 0 || b.size % MIN_BLOCK_SIZE != 0 || b.size == 0 {
                return Err(V::Misaligned {
                    addr,
                    align: MIN_BLOCK_SIZE,
                });
            }
            expected = addr + b.size;
            if let Some((p, p_alloc, p_mapped)) = prev
                && !p_alloc
                && !b.allocated
                && p_mapped == b.mapped
            {
                return Err(V::AdjacentFree {
                    first: p,
                    second: addr,
                });
            }
            prev = Some((addr, b.allocated, b.mapped));
            let pool = a.pool(b.pool);
            if b.allocated {
                *allocated += b.size;
                *requested += b.requested;
                *live += 1;
                if pool.blocks.contains(&(b.stream, b.size, addr)) {
                    return Err(V::FreeIndex { addr });
                }
            } else if b.mapped {
                free_mapped += 1;
                if !pool.blocks.contains(&(b.stream, b.size, addr)) {
                    return Err(V::FreeIndex { addr });
                }
                if split && seg.expandable.is_none() {
                    *inactive_split += 1;
                    *inactive_split_bytes += b.size;
                }
            } else {
                unmapped += 1;
                if !pool.unmapped.contains(&(b.stream, addr)) {
                    return Err(V::FreeIndex { addr });
                }
            }
            if let Some(es) = &seg.expandable {
                let first = (addr - start) / es.page;
                let last = (addr - start + b.size).div_ceil(es.page);
                for page in first..last {
                    let is_mapped = es.handles.get(page as usize).is_some_and(Option::is_some);
                    let whole = (page * es.page >= addr - start)
                        && ((page + 1) * es.page <= addr - start + b.size);
                    if b.mapped && !is_mapped || !b.mapped && is_mapped && whole {
                        return Err(V::LivePageUnmapped {
                            page_addr: start + page * es.page,
                            block: addr,
                        });
                    }
                }
            }
        }
        if expected != start + seg.size {
            return Err(V::Tiling {
                segment: start,
                expected,
                found: start + seg.size,
            });
        }
        match &seg.expandable {
            None => {
                *reserved += seg.size;
                *malloc_segments += 1;
            }
            Some(es) => *reserved += es.held_bytes(),
        }
    }
    if blocks_seen != a.blocks.len() {
        let stray = a
            .blocks
            .iter()
            .find(|(_, b)| !a.segments.contains_key(&b.segment))
            .map_or(0, |(addr, _)| addr);
        return Err(V::LostAllocation { addr: stray });
    }
    let pooled: usize = a.pools.iter().map(|p| p.blocks.len()).sum();
    let pooled_unmapped: usize = a.pools.iter().map(|p| p.unmapped.len()).sum();
    let c = &a.counters;
    let sum = |f: &dyn Fn(&PoolTotals) -> u64| totals.iter().map(f).sum::<u64>();
    let reserved = sum(&|t| t.reserved);
    V::check_stats(&[
        ("total_allocated_memory", a.total_allocated_memory, reserved),
        ("cached_blocks", pooled as u64, free_mapped),
        ("unmapped_blocks", pooled_unmapped as u64, unmapped),
    ])?;
    for pool in [Pool::Small, Pool::Large] {
        let t = &totals[pool.index()];
        let i = pool.index();
        V::check_stats(&[
            ("allocated_bytes", c.allocated.pool[i].current, t.allocated),
            ("active_bytes", c.active.pool[i].current, t.allocated),
            ("requested_bytes", c.requested.pool[i].current, t.requested),
            ("allocation", c.allocation.pool[i].current, t.live),
            ("reserved_bytes", c.reserved.pool[i].current, t.reserved),
            ("segment", c.segment.pool[i].current, t.malloc_segments),
            (
                "inactive_split_bytes",
                c.inactive_split_bytes.pool[i].current,
                t.inactive_split_bytes,
            ),
            (
                "inactive_split",
                c.inactive_split.pool[i].current,
                t.inactive_split,
            ),
        ])?;
    }
    V::check_stats(&[
        (
            "allocated_bytes",
            c.allocated.current(),
            sum(&|t| t.allocated),
        ),
        ("reserved_bytes", c.reserved.current(), reserved),
        ("allocation", c.allocation.current(), sum(&|t| t.live)),
        ("segment", c.segment.current(), sum(&|t| t.malloc_segments)),
    ])
}
