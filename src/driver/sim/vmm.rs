//! The virtual-memory calls' state and CUDA's rules for them: reservations, physical handles, mappings.
//!
//! Every method checks all of its rules before it changes anything, so a failed call has no effect.

use super::va::VaRegion;
use crate::driver::{DriverError, Op, PhysHandle, VaRange};
use std::collections::{BTreeMap, HashMap};

/// Where reservations start: a realistic device address.
const RESERVATION_BASE: u64 = 0x7f00_0000_0000;
/// The top of the 48-bit virtual address space.
const VA_TOP: u64 = 1 << 48;

/// A physical allocation from `create`.
#[derive(Debug, Clone, Copy)]
struct Handle {
    size: u64,
    /// Released by the caller; freed once `maps` reaches 0.
    released: bool,
    /// Mappings of this handle.
    maps: u32,
}

/// One mapping of a whole handle.
#[derive(Debug, Clone, Copy)]
pub(super) struct Mapping {
    /// Bytes mapped (the handle's size).
    pub(super) size: u64,
    /// The handle's number.
    pub(super) handle: u64,
    /// Whether `set_access` made it readable and writable.
    pub(super) accessible: bool,
}

/// Reservations, handles and mappings.
#[derive(Debug, Clone)]
pub(super) struct Vmm {
    granularity: u64,
    va: VaRegion,
    reservations: BTreeMap<u64, u64>,
    mappings: BTreeMap<u64, Mapping>,
    handles: HashMap<u64, Handle>,
    next_handle: u64,
    live_handles: usize,
    /// Bytes of handles whose memory is not yet freed (released but still mapped ones included).
    physical: u64,
}

impl Vmm {
    /// Empty state for a device with this granularity (non-zero).
    pub(super) fn new(granularity: u64) -> Self {
        Self {
            granularity,
            va: VaRegion::new(RESERVATION_BASE, VA_TOP, granularity),
            reservations: BTreeMap::new(),
            mappings: BTreeMap::new(),
            handles: HashMap::new(),
            next_handle: 0,
            live_handles: 0,
            physical: 0,
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
        let inside = self.mappings.range(range.start..range.end());
        if inside.clone().next().is_some() {
            return Err(DriverError::ReservationInUse {
                start: range.start,
                mapped: inside.count(),
            });
        }
        self.reservations.remove(&range.start);
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
        self.next_handle += 1;
        let id = self.next_handle;
        self.handles.insert(
            id,
            Handle {
                size,
                released: false,
                maps: 0,
            },
        );
        self.live_handles += 1;
        self.physical += size;
        Ok(PhysHandle(id))
    }

    /// `cuMemRelease`. Returns the handle's number if its memory was freed now (it was not mapped).
    pub(super) fn release(&mut self, handle: PhysHandle) -> Result<Option<u64>, DriverError> {
        let h = self.live_handle(Op::Release, handle)?;
        h.released = true;
        let unmapped = h.maps == 0;
        self.live_handles -= 1;
        Ok(unmapped.then(|| self.drop_handle(handle.0)))
    }

    /// `cuMemMap` of the whole of `handle` at `va`.
    pub(super) fn map(
        &mut self,
        va: u64,
        size: u64,
        handle: PhysHandle,
    ) -> Result<(), DriverError> {
        self.check_size(Op::Map, size)?;
        self.check_address(Op::Map, va)?;
        let handle_size = self.live_handle(Op::Map, handle)?.size;
        if handle_size != size {
            return Err(DriverError::SizeMismatch {
                handle,
                handle_size,
                size,
            });
        }
        let outside = DriverError::OutsideReservation {
            op: Op::Map,
            start: va,
            size,
        };
        let end = va.checked_add(size).ok_or(outside.clone())?;
        let (&r_start, &r_size) = self
            .reservations
            .range(..=va)
            .next_back()
            .ok_or(outside.clone())?;
        if !VaRange::new(r_start, r_size).contains_range(va, size) {
            return Err(outside);
        }
        if let Some((&existing, m)) = self.mappings.range(..end).next_back() {
            if existing + m.size > va {
                return Err(DriverError::AlreadyMapped {
                    start: va,
                    size,
                    existing,
                });
            }
        }
        if let Some(h) = self.handles.get_mut(&handle.0) {
            h.maps += 1;
        }
        self.mappings.insert(
            va,
            Mapping {
                size,
                handle: handle.0,
                accessible: false,
            },
        );
        Ok(())
    }

    /// `cuMemSetAccess` on whole mappings.
    pub(super) fn set_access(&mut self, va: u64, size: u64) -> Result<(), DriverError> {
        let end = self.check_whole_mappings(Op::SetAccess, va, size)?;
        for (_, m) in self.mappings.range_mut(va..end) {
            m.accessible = true;
        }
        Ok(())
    }

    /// `cuMemUnmap` of whole mappings. Returns the numbers of released handles whose memory was freed now.
    pub(super) fn unmap(&mut self, va: u64, size: u64) -> Result<Vec<u64>, DriverError> {
        let end = self.check_whole_mappings(Op::Unmap, va, size)?;
        let mut freed = Vec::new();
        while let Some((&start, &m)) = self.mappings.range(va..end).next() {
            self.mappings.remove(&start);
            let Some(h) = self.handles.get_mut(&m.handle) else {
                continue;
            };
            h.maps -= 1;
            if h.released && h.maps == 0 {
                freed.push(self.drop_handle(m.handle));
            }
        }
        Ok(freed)
    }

    /// The size of a handle the device still knows (released but mapped ones included).
    pub(super) fn handle_size(&self, handle: PhysHandle) -> Option<u64> {
        self.handles.get(&handle.0).map(|h| h.size)
    }

    /// The mapping that contains `addr`, with its start.
    pub(super) fn mapping_at(&self, addr: u64) -> Option<(u64, Mapping)> {
        let (&start, &m) = self.mappings.range(..=addr).next_back()?;
        (addr - start < m.size).then_some((start, m))
    }

    /// Bytes of physical memory held by handles.
    pub(super) fn physical_bytes(&self) -> u64 {
        self.physical
    }

    /// Handles created and not released.
    pub(super) fn handle_count(&self) -> usize {
        self.live_handles
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
        let mut out: Vec<_> = self
            .handles
            .iter()
            .filter(|(_, h)| !h.released)
            .map(|(&id, h)| (PhysHandle(id), h.size))
            .collect();
        out.sort_unstable();
        out
    }

    /// Live mappings, in address order.
    pub(super) fn mapped_ranges(&self) -> Vec<VaRange> {
        self.mappings
            .iter()
            .map(|(&s, m)| VaRange::new(s, m.size))
            .collect()
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

    /// A handle that is known and not released.
    fn live_handle(&mut self, op: Op, handle: PhysHandle) -> Result<&mut Handle, DriverError> {
        self.handles
            .get_mut(&handle.0)
            .filter(|h| !h.released)
            .ok_or(DriverError::UnknownHandle { op, handle })
    }

    /// Frees a released, unmapped handle's memory. Returns its number.
    fn drop_handle(&mut self, id: u64) -> u64 {
        if let Some(h) = self.handles.remove(&id) {
            self.physical -= h.size;
        }
        id
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
        if value % self.granularity == 0 {
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

    /// Checks that `va .. va + size` consists of whole, back-to-back mappings. Returns its end.
    fn check_whole_mappings(&self, op: Op, va: u64, size: u64) -> Result<u64, DriverError> {
        self.check_size(op, size)?;
        self.check_address(op, va)?;
        let end = va
            .checked_add(size)
            .ok_or(DriverError::OutsideReservation {
                op,
                start: va,
                size,
            })?;
        let partial = |mapping: u64, m: &Mapping| DriverError::PartialMapping {
            op,
            start: va,
            size,
            mapping,
            mapping_size: m.size,
        };
        if let Some((&s, m)) = self.mappings.range(..va).next_back() {
            if s + m.size > va {
                return Err(partial(s, m));
            }
        }
        let mut cursor = va;
        for (&s, m) in self.mappings.range(va..end) {
            if s != cursor {
                return Err(DriverError::NotMapped { op, addr: cursor });
            }
            if s + m.size > end {
                return Err(partial(s, m));
            }
            cursor = s + m.size;
        }
        if cursor != end {
            return Err(DriverError::NotMapped { op, addr: cursor });
        }
        Ok(end)
    }
}
