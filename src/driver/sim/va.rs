//! Placement of virtual address ranges inside a region of the simulated address space.
//!
//! Ranges are handed out upward from the region's base, with a guard gap after each, so addresses look
//! like a real device's and a stray access past the end of one range never lands in the next. When the
//! region's top is reached, freed gaps are reused first fit.

use std::collections::BTreeMap;

/// A region `base .. limit` of the virtual address space.
#[derive(Debug, Clone)]
pub(super) struct VaRegion {
    base: u64,
    limit: u64,
    next: u64,
    guard: u64,
}

impl VaRegion {
    /// A region from `base` to `limit`, with `guard` bytes left free after each range.
    pub(super) fn new(base: u64, limit: u64, guard: u64) -> Self {
        Self {
            base,
            limit,
            next: base,
            guard,
        }
    }

    /// A start for `size` bytes aligned to `align`, clear of every range in `live` (start -> size, all
    /// inside this region) by at least the guard; `None` if none is left. Does not record the range: the
    /// caller adds it to `live`.
    pub(super) fn place(
        &mut self,
        size: u64,
        align: u64,
        live: &BTreeMap<u64, u64>,
    ) -> Option<u64> {
        if let Some(start) = self.fit_at(self.next, size, align) {
            self.next = self.after(start, size);
            return Some(start);
        }
        let start = self.first_gap(size, align, live)?;
        self.next = self.next.max(self.after(start, size));
        Some(start)
    }

    /// `cursor` aligned up, if `size` bytes from there end at or below the limit.
    fn fit_at(&self, cursor: u64, size: u64, align: u64) -> Option<u64> {
        let start = cursor.checked_next_multiple_of(align)?;
        let end = start.checked_add(size)?;
        (end <= self.limit).then_some(start)
    }

    /// The first address a range may start at after a range `start .. start + size`.
    fn after(&self, start: u64, size: u64) -> u64 {
        start.saturating_add(size).saturating_add(self.guard)
    }

    /// First fit among the gaps between live ranges (the slow path, once the bump pointer hit the top).
    fn first_gap(&self, size: u64, align: u64, live: &BTreeMap<u64, u64>) -> Option<u64> {
        let mut cursor = self.base;
        for (&start, &len) in live {
            if let Some(candidate) = self.fit_at(cursor, size, align) {
                let clear = candidate
                    .checked_add(size)
                    .and_then(|e| e.checked_add(self.guard));
                if clear.is_some_and(|c| c <= start) {
                    return Some(candidate);
                }
            }
            cursor = self.after(start, len);
        }
        self.fit_at(cursor, size, align)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bumps_with_guard_then_reuses_gaps() {
        let mut region = VaRegion::new(0x1000, 0x1000 + 10 * 0x100, 0x100);
        let mut live = BTreeMap::new();
        let a = region.place(0x200, 0x100, &live).unwrap();
        live.insert(a, 0x200);
        let b = region.place(0x200, 0x100, &live).unwrap();
        live.insert(b, 0x200);
        assert_eq!((a, b), (0x1000, 0x1300));
        let c = region.place(0x300, 0x100, &live).unwrap();
        live.insert(c, 0x300);
        assert_eq!(c, 0x1600);
        // Full: nothing left until a range is freed.
        assert_eq!(region.place(0x100, 0x100, &live), None);
        live.remove(&a);
        assert_eq!(region.place(0x200, 0x100, &live), Some(0x1000));
        assert_eq!(region.place(0x300, 0x100, &live), None);
    }
}
