//! The virtual-memory calls' state and CUDA's rules for them: reservations, physical handles, mappings.
//!
//! Every method checks all of its rules before it changes anything, so a failed call has no effect.
//!
//! Handles are numbered from 1 in creation order and kept in a vector indexed by number ([`Handles`]);
//! each mapping is recorded once ([`Mappings`]) and a page table of granules ([`Granules`]) holds the number
//! of the mapping covering each granule. Both make a call cost a few array reads instead of ordered-map or
//! SipHash lookups, which dominated replays. Checking that a range is made of whole mappings walks from
//! mapping to mapping, one lookup each, and `set_access` changes one record per mapping.

use super::granules::Granules;
use super::handles::Handles;
use super::mappings::{Mappings, Record};
use super::va::VaRegion;
use crate::base::divisor::Divisor;
use crate::driver::{DriverError, Op, PhysHandle, PhysPage, VaRange};
use std::collections::BTreeMap;
use std::ops::Range;

/// Where reservations start: a realistic device address.
const RESERVATION_BASE: u64 = 0x7f00_0000_0000;
/// The top of the 48-bit virtual address space.
const VA_TOP: u64 = 1 << 48;

/// One mapping: a handle, or part of it.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mapping {
    /// Bytes mapped.
    pub(super) size: u64,
    /// Where in the handle the mapping starts, in bytes.
    pub(super) offset: u64,
    /// The handle's number.
    pub(super) handle: u64,
    /// Whether `set_access` made it readable and writable.
    pub(super) accessible: bool,
    /// The peers that `set_access` granted access to, one bit per device ordinal.
    pub(super) peers: u32,
}

/// Reservations, handles and mappings.
#[derive(Debug, Clone)]
pub(super) struct Vmm {
    granularity: u64,
    /// The granularity, to divide by (a shift and a mask when it is a power of two, as on a GPU).
    granule: Divisor,
    va: VaRegion,
    reservations: BTreeMap<u64, u64>,
    /// The reservation `map` found last, `(start, end)`: maps come in runs into one reservation.
    last_reservation: Option<(u64, u64)>,
    /// The page table: which mapping covers each granule of address space.
    granules: Granules,
    /// Mappings alive, by the number the page table holds.
    mappings: Mappings,
    /// Physical allocations whose memory is not freed yet.
    handles: Handles,
    /// Whether part of a handle may be mapped (`cuMemMap` from an offset): see
    /// [`SimConfig::partial_mappings`](super::SimConfig::partial_mappings).
    partial_mappings: bool,
}

impl Vmm {
    /// Empty state for a device with this granularity (non-zero).
    pub(super) fn new(granularity: u64, capacity: u64, partial_mappings: bool) -> Self {
        Self {
            granularity,
            granule: Divisor::new(granularity),
            va: VaRegion::new(RESERVATION_BASE, VA_TOP, granularity),
            reservations: BTreeMap::new(),
            last_reservation: None,
            granules: Granules::default(),
            // Room for as many handles (and as many mappings of them) as fit on the device at once, up to a
            // million: a replay creates tens of thousands, and growing a table copied it each time it doubled.
            mappings: Mappings::with_capacity((capacity / granularity).min(1 << 20) as usize),
            handles: Handles::with_capacity((capacity / granularity).min(1 << 20) as usize),
            partial_mappings,
        }
    }

    /// `cuMemAddressReserve`.
    pub(super) fn reserve(&mut self, size: u64) -> Result<VaRange, DriverError> {
        self.check_size(Op::Reserve, size)?;
        let g = self.granularity;
        let start = self
            .va
            .place(size, g, &self.reservations)
            .ok_or(DriverError::VaExhausted {
                op: Op::Reserve,
                requested: size,
            })?;
        self.reservations.insert(start, size);
        Ok(VaRange::new(start, size))
    }

    /// `cuMemAddressFree`: `range` must be exactly a reservation, with nothing mapped in it.
    pub(super) fn free_reservation(&mut self, range: VaRange) -> Result<(), DriverError> {
        if self.reservations.get(&range.start) != Some(&range.size) {
            return Err(DriverError::UnknownReservation {
                op: Op::FreeReservation,
                start: range.start,
            });
        }
        let mapped = self.granules.starts_in(
            self.granule.quotient(range.start),
            self.granule.quotient(range.end()),
        );
        if mapped > 0 {
            return Err(DriverError::ReservationInUse {
                start: range.start,
                mapped,
            });
        }
        self.reservations.remove(&range.start);
        self.last_reservation = None;
        Ok(())
    }

    /// `cuMemCreate`, with `free` bytes of physical memory left on the device.
    pub(super) fn create(&mut self, size: u64, free: u64) -> Result<PhysHandle, DriverError> {
        self.check_size(Op::Create, size)?;
        if size > free {
            return Err(DriverError::OutOfMemory {
                op: Op::Create,
                requested: size,
                free,
            });
        }
        Ok(self.handles.create(size))
    }

    /// `cuMemRelease`. Returns the handle's allocation if its memory was freed now (the handle was not
    /// mapped, and was the allocation's last handle).
    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<Option<u64>, DriverError> {
        self.handles.release(handle)
    }

    /// What `cuMemExportToShareableHandle` exports: the allocation behind live `handle`, and its size.
    pub(super) fn exportable(&mut self, handle: PhysHandle) -> Result<(u64, u64), DriverError> {
        let h = self.handles.live(Op::Export, handle)?;
        Ok((h.alloc, h.size))
    }

    /// `cuMemImportFromShareableHandle`: a new handle to allocation `alloc` of `size` bytes (alive, see
    /// [`allocation_alive`](Self::allocation_alive)).
    pub(super) fn import(&mut self, alloc: u64, size: u64) -> PhysHandle {
        self.handles.import(alloc, size)
    }

    /// Whether the memory of allocation `alloc` is not freed yet.
    pub(super) fn allocation_alive(&self, alloc: u64) -> bool {
        self.handles.allocation_alive(alloc)
    }

    /// The allocation behind handle number `id` (mapped or live), which owns its bytes.
    pub(super) fn allocation_of(&self, id: u64) -> u64 {
        self.handles.allocation_of(id).unwrap_or(id)
    }

    /// `cuMemMap` at `va`: of the whole of `handle` (`offset` None), or of `size` bytes of it from byte
    /// `offset`.
    pub(super) fn map(
        &mut self,
        va: u64,
        size: u64,
        handle: PhysHandle,
        offset: Option<u64>,
    ) -> Result<(), DriverError> {
        self.check_size(Op::Map, size)?;
        self.check_address(Op::Map, va)?;
        let handle_size = self.handles.live(Op::Map, handle)?.size;
        let base = match offset {
            None if handle_size != size => {
                return Err(DriverError::SizeMismatch {
                    handle,
                    handle_size,
                    size,
                });
            }
            None => 0,
            Some(offset) => {
                self.check_multiple(Op::Map, "offset", offset)?;
                DriverError::check_inside_handle(handle, handle_size, offset, size)?;
                if !self.partial_mappings && (offset != 0 || size != handle_size) {
                    // CUDA's answer (CUDA_ERROR_NOT_SUPPORTED on an H100, driver 580: docs/gpu-results.md).
                    return Err(DriverError::Unsupported { op: Op::Map });
                }
                self.granule.quotient(offset)
            }
        };
        let outside = || DriverError::OutsideReservation {
            op: Op::Map,
            start: va,
            size,
        };
        let Some(end) = va.checked_add(size) else {
            return Err(outside());
        };
        if !self.in_one_reservation(va, end) {
            return Err(outside());
        }
        let g = self.granularity;
        let (first, count) = (self.granule.quotient(va), self.granule.quotient(size));
        let record = Record {
            first,
            granules: count,
            handle: handle.0,
            base,
            accessible: false,
            peers: 0,
        };
        let mappings = &mut self.mappings;
        if let Err(index) = self
            .granules
            .claim(first..first + count, || mappings.insert(record))
        {
            // The mapping covering the highest granule of the range is the one starting last before its end.
            return Err(DriverError::AlreadyMapped {
                start: va,
                size,
                existing: self.mapping_start(index) * g,
            });
        }
        self.handles.mapped(handle);
        Ok(())
    }

    /// Whether `va .. end` lies inside one reservation. Remembers the reservation: maps come in runs.
    fn in_one_reservation(&mut self, va: u64, end: u64) -> bool {
        let inside = |(start, r_end): (u64, u64)| va >= start && end <= r_end;
        if self.last_reservation.is_some_and(inside) {
            return true;
        }
        let Some((&r_start, &r_size)) = self.reservations.range(..=va).next_back() else {
            return false;
        };
        let reservation = (r_start, VaRange::new(r_start, r_size).end());
        if !inside(reservation) {
            return false;
        }
        self.last_reservation = Some(reservation);
        true
    }

    /// `count` calls of `create(size, free)` in one pass, if every one of them would succeed: appends the
    /// handles to `out` and returns `true`. Otherwise changes nothing and returns `false`, and the caller
    /// makes the calls one by one, so a failure is exactly the failure of that call.
    pub(super) fn create_all(
        &mut self,
        size: u64,
        count: usize,
        free: u64,
        out: &mut Vec<PhysHandle>,
    ) -> bool {
        // Each call takes `size` bytes of what is free, so all succeed when their total fits.
        let fits = (size as u128) * (count as u128) <= free as u128;
        if self.check_size(Op::Create, size).is_err() || !fits {
            return false;
        }
        self.handles.create_many(size, count, out);
        true
    }

    /// One `map` call per piece of `pages` (`size` bytes of its handle from its offset), at consecutive
    /// addresses `size` bytes apart from `va`, in one pass, if every one of them would succeed: returns
    /// `true`. Otherwise changes nothing and returns `false` (see [`create_all`](Self::create_all)).
    pub(super) fn map_all(&mut self, va: u64, size: u64, pages: &[PhysPage]) -> bool {
        let Some(end) = size
            .checked_mul(pages.len() as u64)
            .and_then(|bytes| va.checked_add(bytes))
        else {
            return false;
        };
        let valid = self.check_size(Op::Map, size).is_ok()
            && self.check_address(Op::Map, va).is_ok()
            && pages.iter().all(|page| {
                self.granule.divides(page.offset)
                    && self.handles.is_live_with(page.handle, page.offset, size)
                    && (self.partial_mappings
                        || (page.offset == 0 && self.handles.is_whole(page.handle, size)))
            })
            && self.in_one_reservation(va, end);
        let granules = self.granule.quotient(va)..self.granule.quotient(end);
        // The calls map disjoint granules, so each finds its own unmapped when all of them are.
        if !valid || self.granules.last_mapped(granules.clone()).is_some() {
            return false;
        }
        let per_page = self.granule.quotient(size);
        let mut first = granules.start;
        for page in pages {
            let id = self.mappings.insert(Record {
                first,
                granules: per_page,
                handle: page.handle.0,
                base: self.granule.quotient(page.offset),
                accessible: false,
                peers: 0,
            });
            self.granules.insert(first..first + per_page, id);
            self.handles.mapped(page.handle);
            first += per_page;
        }
        true
    }

    /// `cuMemSetAccess` on whole mappings, for the device and for `peers` (one bit per device ordinal).
    /// Returns how many mappings the range covered.
    pub(super) fn set_access(
        &mut self,
        va: u64,
        size: u64,
        peers: u32,
    ) -> Result<u64, DriverError> {
        let range = self.check_whole_mappings(Op::SetAccess, va, size)?;
        let mut index = range.start;
        let mut covered = 0;
        while index < range.end {
            let mapping = self.mappings.get_mut(self.granules.starting_at(index));
            mapping.accessible = true;
            mapping.peers |= peers;
            index = mapping.end();
            covered += 1;
        }
        Ok(covered)
    }

    /// `cuMemUnmap` of whole mappings. Returns the allocations whose memory was freed now (their last
    /// handle was released and is now unmapped), and how many mappings the range covered.
    pub(super) fn unmap(&mut self, va: u64, size: u64) -> Result<(Vec<u64>, u64), DriverError> {
        let range = self.check_whole_mappings(Op::Unmap, va, size)?;
        let mut freed = Vec::new();
        let mut covered = 0;
        // The range is whole, back-to-back mappings (checked above).
        let mut index = range.start;
        while index < range.end {
            let mapping = self.mappings.remove(self.granules.starting_at(index));
            self.granules.remove(index..mapping.end());
            if let Some(id) = self.handles.unmapped(mapping.handle) {
                freed.push(id);
            }
            index = mapping.end();
            covered += 1;
        }
        Ok((freed, covered))
    }

    /// The size of a handle the device still knows (released but mapped ones included).
    pub(super) fn handle_size(&self, handle: PhysHandle) -> Option<u64> {
        self.handles.size(handle.0)
    }

    /// The mapping that contains `addr`, with its start.
    pub(super) fn mapping_at(&self, addr: u64) -> Option<(u64, Mapping)> {
        let (_, id) = self.granules.mapping_at(self.granule.quotient(addr))?;
        let record = self.mappings.get(id);
        let g = self.granularity;
        let mapping = Mapping {
            size: record.granules * g,
            offset: record.base * g,
            handle: record.handle,
            accessible: record.accessible,
            peers: record.peers,
        };
        Some((record.first * g, mapping))
    }

    /// Bytes of physical memory held by handles.
    pub(super) fn physical_bytes(&self) -> u64 {
        self.handles.bytes()
    }

    /// Handles created and not released.
    pub(super) fn handle_count(&self) -> usize {
        self.handles.live_count()
    }

    /// Live mappings.
    pub(super) fn mapping_count(&self) -> usize {
        self.mappings.len()
    }

    /// Live reservations.
    pub(super) fn reservation_count(&self) -> usize {
        self.reservations.len()
    }

    /// Handles not released, with their sizes, in creation order.
    pub(super) fn unreleased_handles(&self) -> Vec<(PhysHandle, u64)> {
        self.handles.unreleased()
    }

    /// Live mappings, in address order.
    pub(super) fn mapped_ranges(&self) -> Vec<VaRange> {
        let g = self.granularity;
        let mut ranges: Vec<VaRange> = self
            .mappings
            .iter()
            .map(|record| VaRange::new(record.first * g, record.granules * g))
            .collect();
        ranges.sort_unstable_by_key(|range| range.start);
        ranges
    }

    /// Live reservations, in address order.
    /// Whether `start .. end` overlaps a reservation.
    pub(super) fn overlaps_reservation(&self, start: u64, end: u64) -> bool {
        self.reservations
            .range(..end)
            .next_back()
            .is_some_and(|(&s, &size)| s.saturating_add(size) > start)
    }

    pub(super) fn reserved_ranges(&self) -> Vec<VaRange> {
        self.reservations
            .iter()
            .map(|(&s, &size)| VaRange::new(s, size))
            .collect()
    }

    /// Size non-zero and a multiple of the granularity.
    fn check_size(&self, op: Op, size: u64) -> Result<(), DriverError> {
        if size == 0 {
            return Err(DriverError::ZeroSize { op });
        }
        self.check_multiple(op, "size", size)
    }

    /// Address a multiple of the granularity.
    fn check_address(&self, op: Op, va: u64) -> Result<(), DriverError> {
        self.check_multiple(op, "address", va)
    }

    fn check_multiple(&self, op: Op, what: &'static str, value: u64) -> Result<(), DriverError> {
        if self.granule.divides(value) {
            Ok(())
        } else {
            Err(DriverError::NotAligned {
                op,
                what,
                value,
                granularity: self.granularity,
            })
        }
    }

    /// Checks that `va .. va + size` consists of whole, back-to-back mappings. Returns its granules.
    ///
    /// A walk from mapping to mapping: each granule reached must be mapped, by a mapping that starts there
    /// (mappings never overlap, so only the first can start before it) and ends inside the range. The
    /// first unmapped granule it meets is the range's first hole.
    fn check_whole_mappings(&self, op: Op, va: u64, size: u64) -> Result<Range<u64>, DriverError> {
        self.check_size(op, size)?;
        self.check_address(op, va)?;
        let end = va
            .checked_add(size)
            .ok_or(DriverError::OutsideReservation {
                op,
                start: va,
                size,
            })?;
        let g = self.granularity;
        let range = self.granule.quotient(va)..self.granule.quotient(end);
        let mut index = range.start;
        let partial = |mapping: &Record| DriverError::PartialMapping {
            op,
            start: va,
            size,
            mapping: mapping.first * g,
            mapping_size: mapping.granules * g,
        };
        while index < range.end {
            let id = self.granules.starting_at(index);
            if id == 0 {
                // No mapping starts here: the granule is in the middle of one (only the range's first can
                // be), or unmapped.
                return Err(match self.granules.mapping_at(index) {
                    Some((_, id)) => partial(self.mappings.get(id)),
                    None => DriverError::NotMapped {
                        op,
                        addr: index * g,
                    },
                });
            }
            let mapping = self.mappings.get(id);
            if mapping.end() > range.end {
                return Err(partial(mapping));
            }
            index = mapping.end();
        }
        Ok(range)
    }

    /// The first granule of the mapping that covers granule `index` (mapped).
    fn mapping_start(&self, index: u64) -> u64 {
        self.granules
            .mapping_at(index)
            .map_or(index, |(first, _)| first)
    }
}
