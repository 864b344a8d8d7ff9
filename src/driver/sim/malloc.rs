//! `cuMemAlloc` / `cuMemFree`: mapped, accessible memory in one call, from its own address region.

use super::va::VaRegion;
use crate::base::size::MIB;
use crate::driver::{DriverError, Op, VaRange};
use std::collections::BTreeMap;

/// Where `malloc` addresses start (below the reservations, which start at `0x7f00_0000_0000`).
const MALLOC_BASE: u64 = 0x7e00_0000_0000;
/// Where `malloc` addresses end: 1 TiB of address space.
const MALLOC_LIMIT: u64 = 0x7f00_0000_0000;
/// Every allocation is aligned to, and accounted in multiples of, this many bytes (like `cudaMalloc`).
pub(super) const MALLOC_ALIGN: u64 = 512;
/// Allocations of at least this size are aligned to it (`cudaMalloc` hands out 2 MiB-aligned pointers).
const LARGE: u64 = 2 * MIB;

/// Live allocations from `malloc`.
#[derive(Debug, Clone)]
pub(super) struct Mallocs {
    va: VaRegion,
    /// Start -> size asked for.
    live: BTreeMap<u64, u64>,
    /// Physical bytes held: each size rounded up to [`MALLOC_ALIGN`].
    bytes: u64,
}

impl Default for Mallocs {
    fn default() -> Self {
        Self {
            va: VaRegion::new(MALLOC_BASE, MALLOC_LIMIT, MALLOC_ALIGN),
            live: BTreeMap::new(),
            bytes: 0,
        }
    }
}

impl Mallocs {
    /// Allocates `size` bytes with `free` bytes of physical memory left on the device, at `at` if given
    /// (the caller checked that the range is clear), else at the next free place.
    pub(super) fn malloc(
        &mut self,
        size: u64,
        free: u64,
        at: Option<u64>,
    ) -> Result<u64, DriverError> {
        if size == 0 {
            return Err(DriverError::ZeroSize { op: Op::Malloc });
        }
        let exhausted = DriverError::VaExhausted {
            op: Op::Malloc,
            requested: size,
        };
        let held = accounted(size).ok_or(exhausted.clone())?;
        if held > free {
            return Err(DriverError::OutOfMemory {
                op: Op::Malloc,
                requested: size,
                free,
            });
        }
        let align = if size >= LARGE { LARGE } else { MALLOC_ALIGN };
        let ptr = match at {
            Some(ptr) => ptr,
            None => self.va.place(held, align, &self.live).ok_or(exhausted)?,
        };
        self.live.insert(ptr, size);
        self.bytes += held;
        Ok(ptr)
    }

    /// Frees the allocation at `ptr`.
    pub(super) fn free(&mut self, ptr: u64) -> Result<(), DriverError> {
        let size = self.live.remove(&ptr).ok_or(DriverError::UnknownPointer {
            op: Op::Free,
            addr: ptr,
        })?;
        self.bytes -= accounted(size).unwrap_or(0);
        Ok(())
    }

    /// The size of the live allocation at `ptr`.
    pub(super) fn size(&self, ptr: u64) -> Option<u64> {
        self.live.get(&ptr).copied()
    }

    /// Whether `start .. start + size` (rounded up to [`MALLOC_ALIGN`]) overlaps no live allocation.
    pub(super) fn is_clear(&self, start: u64, size: u64) -> bool {
        let Some(end) = accounted(size).and_then(|held| start.checked_add(held)) else {
            return false;
        };
        self.live
            .range(..end)
            .next_back()
            .is_none_or(|(&s, &len)| s.saturating_add(accounted(len).unwrap_or(len)) <= start)
    }

    /// The allocation that contains `addr`, as (start, size).
    pub(super) fn containing(&self, addr: u64) -> Option<(u64, u64)> {
        let (&start, &size) = self.live.range(..=addr).next_back()?;
        (addr - start < size).then_some((start, size))
    }

    /// Physical bytes held by allocations.
    pub(super) fn bytes(&self) -> u64 {
        self.bytes
    }

    /// Live allocations, in address order.
    pub(super) fn ranges(&self) -> Vec<VaRange> {
        self.live
            .iter()
            .map(|(&s, &size)| VaRange::new(s, size))
            .collect()
    }
}

/// Physical bytes an allocation of `size` holds.
fn accounted(size: u64) -> Option<u64> {
    size.checked_next_multiple_of(MALLOC_ALIGN)
}
