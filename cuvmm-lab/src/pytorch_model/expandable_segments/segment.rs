//! The pages of one PyTorch expandable segment: its reservation, the handle mapped at each page, and the
//! pages a failed driver call left held. Mapping and unmapping pages is here; which blocks they serve is
//! `expandable_segments.rs`'s.

use cuvmm::driver::{Driver, PhysHandle, StreamId, VaRange};
use cuvmm::strategy::error::Error;

/// The pages of one reservation (PyTorch's `ExpandableSegment`).
#[derive(Debug)]
pub(crate) struct ExpandableSegment {
    /// The reservation.
    pub va: VaRange,
    /// Bytes per page (and per handle).
    pub page: u64,
    /// The handle mapped at each page, up to the last mapped one.
    pub handles: Vec<Option<PhysHandle>>,
    /// Pages that a failed driver call left held: a handle whose release failed, or a page whose unmap
    /// failed while a failed growth was rolled back. Counted as reserved, and given back on the release
    /// paths (see [`Split::release_stranded`](super::Split::release_stranded)).
    pub stranded: Vec<Stranded>,
}

/// A page of physical memory the allocator could not give back yet (a driver call failed), and where it
/// is still mapped, if anywhere. No block uses it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Stranded {
    /// The page's handle.
    pub handle: PhysHandle,
    /// The address it is still mapped at, if its unmap failed.
    pub mapped_at: Option<u64>,
}

impl ExpandableSegment {
    /// Pages `begin..end` covering `offset .. offset + size`, widened to whole pages.
    fn pages_covering(&self, offset: u64, size: u64) -> (usize, usize) {
        let begin = offset / self.page;
        let end = (offset + size).div_ceil(self.page);
        (begin as usize, end as usize)
    }

    /// Physical bytes this segment holds: its mapped pages and its stranded ones.
    pub fn held_bytes(&self) -> u64 {
        (self.mapped_pages() + self.stranded.len()) as u64 * self.page
    }

    /// PyTorch's `ExpandableSegment::map`: creates one handle per page of the pages covering
    /// `offset .. offset + size` (`offset` page aligned), maps them and sets access on the whole range.
    /// Returns the bytes mapped, or 0 if the device ran out of memory. On any failure nothing stays
    /// mapped: what was created or mapped is given back (PyTorch gives back only the handles of a failed
    /// `cuMemCreate`; its other failures throw), and what cannot be is kept as stranded. Stranded pages are
    /// retried first, since one may still be mapped in the range.
    pub(super) fn map<D: Driver>(
        &mut self,
        driver: &mut D,
        offset: u64,
        size: u64,
    ) -> Result<u64, Error> {
        self.retry_stranded(driver)?;
        let (begin, end) = self.pages_covering(offset, size);
        let mut created = Vec::with_capacity(end - begin);
        for _ in begin..end {
            match driver.create(self.page) {
                Ok(h) => created.push((h, None)),
                Err(e) => {
                    self.give_back(driver, created);
                    return if e.is_out_of_memory() {
                        Ok(0)
                    } else {
                        Err(e.into())
                    };
                }
            }
        }
        for entry in 0..created.len() {
            let addr = self.page_addr(begin + entry);
            if let Err(e) = driver.map(addr, self.page, created[entry].0) {
                self.give_back(driver, created);
                return Err(e.into());
            }
            created[entry].1 = Some(addr);
        }
        let bytes = (end - begin) as u64 * self.page;
        if let Err(e) = driver.set_access(self.page_addr(begin), bytes) {
            self.give_back(driver, created);
            return Err(e.into());
        }
        if self.handles.len() < end {
            self.handles.resize(end, None);
        }
        for (i, (handle, _)) in (begin..end).zip(created) {
            self.handles[i] = Some(handle);
        }
        Ok(bytes)
    }

    /// Unmaps (where mapped) and releases pages that a failed growth had obtained; whatever fails is kept
    /// in [`stranded`](Self::stranded).
    fn give_back<D: Driver>(&mut self, driver: &mut D, pages: Vec<(PhysHandle, Option<u64>)>) {
        for (handle, mapped_at) in pages {
            self.stranded.push(Stranded { handle, mapped_at });
        }
        if let Err(err) = self.retry_stranded(driver) {
            tracing::warn!(%err, "pytorch model: giving back the pages of a failed growth failed; kept for later");
        }
    }

    /// Tries again to unmap and release every stranded page. Returns the first failure; the pages that
    /// failed stay stranded.
    pub fn retry_stranded<D: Driver>(&mut self, driver: &mut D) -> Result<(), Error> {
        let mut first_err = None;
        for mut s in std::mem::take(&mut self.stranded) {
            if let Some(addr) = s.mapped_at {
                if let Err(e) = driver.unmap(addr, self.page) {
                    first_err.get_or_insert(e);
                    self.stranded.push(s);
                    continue;
                }
                s.mapped_at = None;
            }
            if let Err(e) = driver.release(s.handle) {
                first_err.get_or_insert(e);
                self.stranded.push(s);
            }
        }
        first_err.map_or(Ok(()), |e| Err(e.into()))
    }

    /// PyTorch's `ExpandableSegment::unmap`: unmaps and releases the whole pages inside
    /// `offset .. offset + size`, after synchronizing `stream`. Returns the offset and size unmapped (size 0
    /// if no whole page lies inside) and the first failure. A failed unmap stops there: the range returned
    /// is then the pages before it, which were unmapped.
    pub(super) fn unmap<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        offset: u64,
        size: u64,
    ) -> (u64, u64, Result<(), Error>) {
        let begin = offset.div_ceil(self.page) as usize;
        let end = ((offset + size) / self.page) as usize;
        if begin >= end {
            return (offset, 0, Ok(()));
        }
        let (done, result) = self.unmap_handles(driver, stream, begin, end);
        (
            begin as u64 * self.page,
            (done - begin) as u64 * self.page,
            result,
        )
    }

    /// PyTorch's `unmapHandles`: synchronize the stream (unmapping does not wait for it), then unmap and
    /// release each page. Returns the page up to which everything was unmapped (`begin` if the
    /// synchronization failed, `end` unless an unmap failed) and the first failure. A handle whose
    /// release fails after its unmap is kept as stranded.
    fn unmap_handles<D: Driver>(
        &mut self,
        driver: &mut D,
        stream: StreamId,
        begin: usize,
        end: usize,
    ) -> (usize, Result<(), Error>) {
        if let Err(e) = driver.synchronize(stream) {
            return (begin, Err(e.into()));
        }
        let mut first_err = None;
        for i in begin..end {
            let Some(handle) = self.handles.get(i).copied().flatten() else {
                continue;
            };
            if let Err(e) = driver.unmap(self.page_addr(i), self.page) {
                self.trim_handles();
                return (i, Err(e.into()));
            }
            self.handles[i] = None;
            if let Err(e) = driver.release(handle) {
                self.stranded.push(Stranded {
                    handle,
                    mapped_at: None,
                });
                first_err.get_or_insert(e);
            }
        }
        self.trim_handles();
        (end, first_err.map_or(Ok(()), |e| Err(e.into())))
    }

    fn trim_handles(&mut self) {
        while self.handles.last().is_some_and(Option::is_none) {
            self.handles.pop();
        }
    }

    fn page_addr(&self, i: usize) -> u64 {
        self.va.start + i as u64 * self.page
    }

    /// Pages mapped now.
    pub fn mapped_pages(&self) -> usize {
        self.handles.iter().flatten().count()
    }

    /// Unmaps everything, gives back stranded pages and frees the reservation (PyTorch's destructor).
    /// On failure the segment keeps what it could not give back, and the call may be repeated.
    pub fn teardown<D: Driver>(&mut self, driver: &mut D, stream: StreamId) -> Result<(), Error> {
        self.retry_stranded(driver)?;
        if self.mapped_pages() > 0 {
            let end = self.handles.len();
            self.unmap_handles(driver, stream, 0, end).1?;
        }
        driver.free_reservation(self.va)?;
        Ok(())
    }
}
